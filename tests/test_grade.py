"""``fa-lab grade``: every exercise notebook executes from a fresh kernel, as shipped (the TODO
stubs score 0 with clear feedback, nothing crashes) and with the solutions filled in (full marks).

Chapters 1 and 2's notebooks always run; other chapters' exercise notebooks are found in
``exercises/`` and run too, marked slow.
"""
import argparse
import ast
import json
import re
from pathlib import Path

import nbformat
import pytest

import fa_lab  # noqa: F401
from fa_lab import cli
from fa_lab.exercises import get, max_score, names
from fa_lab.exercises import grade as cli_grade

ROOT = Path(__file__).resolve().parents[1]
EXERCISES = ROOT / "exercises"
CORE = ["01_naive_attention.ipynb", "02_online_softmax.ipynb"]
NOTEBOOKS = sorted(p.name for p in EXERCISES.glob("*.ipynb"))


def _grade(capsys, *argv):
    parser = argparse.ArgumentParser()
    cli_grade.configure(parser)
    rc = cli_grade.run(parser.parse_args([*argv, "--json"]))
    return rc, json.loads(capsys.readouterr().out)


def _param(nb):
    return pytest.param(nb, marks=() if nb in CORE else pytest.mark.slow)


def test_grade_is_a_subcommand():
    assert cli.SUBCOMMANDS["grade"] == "fa_lab.exercises.grade"


def test_core_notebooks_exist():
    assert set(CORE) <= set(NOTEBOOKS)


@pytest.mark.parametrize("nb", NOTEBOOKS)
def test_notebook_is_a_clean_learner_notebook(nb):
    """Outputs stripped, first cell shows the world, links to its chapter, a stub + check per exercise,
    no solution inside, and every exercise of its chapter is checked."""
    book = nbformat.read(EXERCISES / nb, as_version=4)
    code = [c for c in book.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), "strip the outputs"
    assert "fa_lab.banner()" in code[0].source and "from fa_lab.exercises import" in code[0].source
    text = "\n".join(c.source for c in book.cells if c.cell_type == "markdown")
    assert re.search(r"\]\(\.\./book/[^)]+\)", text), "link back to the chapter"
    calls = cli_grade.check_calls(book)
    assert calls, "no check(...) cells"
    known = set(names())
    for _, name, fn in calls:
        assert name in known, f"{nb} checks an unregistered exercise {name!r}"
        assert fn, f"check({name!r}, ...) must name the learner's function"
        assert re.search(rf"def {re.escape(fn)}\(", "\n".join(c.source for c in code)), f"no stub for {fn}"
    assert "NotImplementedError" in "\n".join(c.source for c in code)
    assert "reference(" not in "\n".join(c.source for c in code), "solutions stay out of the learner's notebook"
    chapter = int(nb.split("_")[0])
    assert {n for n in names(chapter)} <= {name for _, name, _ in calls}, "every exercise of the chapter"


def private_fa_lab_names(source: str) -> list[str]:
    """Names starting with ``_`` that ``source`` takes from fa_lab (imports, and attributes of what it imported)."""
    lines = ["pass" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines()]
    tree = ast.parse("\n".join(lines))
    bound, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "fa_lab":
            found += [p for p in node.module.split(".") if p.startswith("_")]
            found += [a.name for a in node.names if a.name.startswith("_")]
            bound |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "fa_lab":
                    found += [p for p in a.name.split(".") if p.startswith("_")]
                    bound.add(a.asname or "fa_lab")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in bound:
                found.append(node.attr)
    return found


def test_private_name_finder_finds_them():
    assert private_fa_lab_names("from fa_lab.core.masks import _window, visible") == ["_window"]
    assert private_fa_lab_names("import fa_lab\nx = fa_lab.kernels._launch(1)") == ["_launch"]
    assert private_fa_lab_names("from fa_lab import exercises as ex\nex._load()") == ["_load"]
    assert private_fa_lab_names("import fa_lab\n%time fa_lab.banner()\nx._y = 1") == []


@pytest.mark.parametrize("nb", NOTEBOOKS)
def test_notebook_uses_only_public_fa_lab_names(nb):
    book = nbformat.read(EXERCISES / nb, as_version=4)
    for filled in (book, cli_grade.fill_solutions(book)):
        for i, cell in enumerate(filled.cells):
            if cell.cell_type == "code":
                assert private_fa_lab_names(cell.source) == [], f"{nb} cell {i} uses private fa_lab names"


def test_fill_solutions_inserts_reference_before_each_check():
    book = nbformat.read(EXERCISES / CORE[0], as_version=4)
    filled = cli_grade.fill_solutions(book)
    assert len(filled.cells) == len(book.cells) + len(cli_grade.check_calls(book))
    for i, name, fn in cli_grade.check_calls(filled):
        assert f'{fn} = fa_lab_model_answer("{name}")' in filled.cells[i - 1].source


@pytest.mark.parametrize("nb", [_param(n) for n in NOTEBOOKS])
def test_grade_as_shipped_then_with_solutions(nb, capsys):
    rc, book = _grade(capsys, str(EXERCISES / nb))
    assert rc == 0
    (entry,) = book["notebooks"]
    assert entry["errors"] == [], entry["errors"]
    assert entry["exercises"] and entry["score"] == 0
    for ex in entry["exercises"]:
        assert ex["max_score"] == max_score(get(ex["name"])) > 0
        assert "not implemented yet" in ex["feedback"]

    rc, book = _grade(capsys, str(EXERCISES / nb), "--solutions", "--require-full")
    (entry,) = book["notebooks"]
    assert rc == 0 and entry["errors"] == [], entry
    assert all(ex["passed"] for ex in entry["exercises"]) and entry["score"] == entry["max_score"] > 0


def test_grade_survives_a_broken_notebook(tmp_path, capsys):
    """A learner cell with a syntax error: that exercise scores 0 of its usual maximum, the rest still runs."""
    book = nbformat.read(EXERCISES / CORE[0], as_version=4)
    first_stub = next(i for i, c in enumerate(book.cells) if c.cell_type == "code" and "def causal_mask" in c.source)
    book.cells[first_stub].source = "def causal_mask(n_q, n_k:\n    pass"
    path = tmp_path / "broken.ipynb"
    nbformat.write(book, path)
    rc = cli.main(["grade", str(path), "--require-full"])           # the real entry point, table output
    out = capsys.readouterr().out
    assert rc == 1 and "TOTAL 0/" in out and "SyntaxError" in out
    rc, graded = _grade(capsys, str(path))
    (entry,) = graded["notebooks"]
    mask = next(e for e in entry["exercises"] if e["name"] == "ch1_causal_mask")
    assert mask["score"] == 0 and mask["max_score"] == max_score(get("ch1_causal_mask"))
    assert "defines no top-level function named 'causal_mask'" in mask["feedback"]
    assert any("NameError" in e for e in entry["errors"])


def test_grade_rejects_a_missing_path(capsys):
    parser = argparse.ArgumentParser()
    cli_grade.configure(parser)
    assert cli_grade.run(parser.parse_args([str(EXERCISES / "nope.ipynb")])) == 2
