"""Grade exercise notebooks: run each from a fresh kernel and print a score table per exercise.

    fa-lab grade exercises/                    # every exercises/*.ipynb, as the learner left them
    fa-lab grade exercises/01_naive_attention.ipynb --json > gradebook.json
    fa-lab grade exercises/ --solutions --require-full   # CI: the shipped notebooks + the solutions = full marks

Each notebook is executed top to bottom by nbclient in a new kernel (its failing cells are
listed; its own ``check(...)`` calls are skipped).  Then every exercise the notebook checks
(``check("name", fn)``) is graded by this process: the notebook's definitions (imports,
``def``/``class``, ``NAME = ...``; see ``program``) are loaded in a fresh process, ``fn`` is
called there on the default cases and time limit, and what it returns is judged here.  So
nothing the notebook writes, prints or patches while it runs can change the score, and a
function that hangs or crashes costs only its own exercise.
``--solutions`` grades the exercises' model answers instead (and executes the notebook with
them filled in before each check cell): the shipped notebooks + the model answers must give
full marks.
"""
from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

#: check("ch1_causal_mask", causal_mask) — the exercise name and the learner's function
CHECK_CALL = re.compile(r"""\bcheck\(\s*["']([A-Za-z_][\w]*)["']\s*,\s*([A-Za-z_][\w.]*)?""")


def configure(parser) -> None:
    parser.add_argument("paths", nargs="*", default=["exercises"],
                        help="exercise notebooks or folders of them (default: exercises/)")
    parser.add_argument("--json", action="store_true", help="print the gradebook as JSON on stdout")
    parser.add_argument("--solutions", action="store_true",
                        help="fill in the reference solutions before each check (CI: must give full marks)")
    parser.add_argument("--require-full", action="store_true",
                        help="exit with status 1 unless every exercise gets full marks")
    parser.add_argument("--cell-timeout", type=float, default=600.0,
                        help="seconds a single notebook cell may run (default 600)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds each exercise's check may take, the same for every learner "
                             "(default: check()'s own limit)")
    parser.add_argument("--kernel", default=None, help="Jupyter kernel name (default: the notebook's, else python3)")


def find_notebooks(paths) -> list[Path]:
    found = []
    for p in map(Path, paths):
        if p.is_dir():
            found += sorted(q for q in p.glob("*.ipynb") if ".ipynb_checkpoints" not in q.parts)
        elif p.suffix == ".ipynb" and p.exists():
            found.append(p)
        else:
            raise FileNotFoundError(f"{p}: not a notebook or a folder of notebooks")
    return found


def check_calls(nb) -> list[tuple[int, str, str | None]]:
    """(cell index, exercise name, name of the learner's function) for each check(...) call, in order."""
    calls = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        for name, fn in CHECK_CALL.findall(cell.source):
            calls.append((i, name, fn or None))
    return calls


def fill_solutions(nb):
    """A copy of ``nb`` with ``fn = model_answer("name")`` inserted before every check cell."""
    import copy

    import nbformat

    nb = copy.deepcopy(nb)
    by_cell: dict[int, list[tuple[str, str]]] = {}
    for i, name, fn in check_calls(nb):
        if fn:
            by_cell.setdefault(i, []).append((name, fn))
    for i in sorted(by_cell, reverse=True):
        lines = ["from fa_lab.exercises.registry import model_answer as fa_lab_model_answer"]
        lines += [f'{fn} = fa_lab_model_answer("{name}")' for name, fn in by_cell[i]]
        nb.cells.insert(i, nbformat.v4.new_code_cell("\n".join(lines)))
    return nb


def _package_root() -> str:
    """The folder holding the fa_lab this command runs from (the kernel must grade with the same one)."""
    import fa_lab

    return str(Path(fa_lab.__file__).resolve().parent.parent)


def _isolated_check(ex, nb_program: str, fn_name: str | None, solutions: bool, timeout: float | None = None):
    """The grade of one exercise: the learner's function (or the model answer) checked in a fresh process."""
    from fa_lab.exercises import DEFAULT_SEEDS, DEFAULT_TIMEOUT
    from fa_lab.exercises.isolate import Isolated
    from fa_lab.exercises.runner import run_check

    if solutions:
        answer = ex.model_answer
        caller = Isolated(ex, ref=(answer.__module__, answer.__qualname__), trusted=True)
    else:
        caller = Isolated(ex, program=nb_program, fn_name=fn_name or "")
    return run_check(ex, ex.model_answer if solutions else fn_name, seeds=DEFAULT_SEEDS,
                     timeout=DEFAULT_TIMEOUT if timeout is None else timeout,
                     trusted=solutions, caller=caller)


def grade_notebook(path: Path, *, solutions=False, cell_timeout=600.0, kernel=None, timeout=None) -> dict:
    """Execute one notebook in a fresh kernel, then grade each exercise it checks in a fresh process."""
    import nbformat
    from nbclient import NotebookClient

    from fa_lab.exercises import DEFERRED_ENV, get
    from fa_lab.exercises.program import extract, notebook_cells

    nb = nbformat.read(path, as_version=4)
    calls = check_calls(nb)
    program = extract(notebook_cells(nb))      # the notebook as the learner left it: their definitions only
    if solutions:
        nb = fill_solutions(nb)
    kernel = kernel or nb.metadata.get("kernelspec", {}).get("name") or "python3"
    errors = []
    t0 = time.monotonic()
    # the kernel inherits these when it starts: the same fa_lab as ours, and no checks of its own (they would
    # only cost time: what the notebook's checks say does not count)
    env = {DEFERRED_ENV: "1",
           "PYTHONPATH": os.pathsep.join(p for p in (_package_root(), os.environ.get("PYTHONPATH")) if p)}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        # 'immediate': the kernel is thrown away anyway; a graceful shutdown costs ~3 s a notebook
        client = NotebookClient(nb, timeout=cell_timeout, kernel_name=kernel, allow_errors=True,
                                shutdown_kernel="immediate",
                                resources={"metadata": {"path": str(path.parent.resolve())}})
        client.execute()
    except Exception as exc:  # noqa: BLE001 — a dead kernel or a cell timeout: grade what is defined
        first = (str(exc).strip().splitlines() or [""])[0]
        errors.append(f"notebook stopped: {type(exc).__name__}: {first}")
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                errors.append(f"cell {i}: {out.get('ename')}: {out.get('evalue')}")
    exercises, seen = [], set()
    for _, name, fn_name in calls:
        if name in seen:
            continue
        seen.add(name)
        try:
            ex = get(name)
        except ValueError:
            exercises.append(dict(name=name, chapter=None, title="unknown exercise", score=0, max_score=0,
                                  passed=False, feedback=f"no exercise is called {name!r}"))
            continue
        result = _isolated_check(ex, program, fn_name, solutions, timeout)
        first = result.first_failure or {}
        feedback = "" if result.passed else f"{first.get('case', '')}: {first.get('message', '')}"
        exercises.append(dict(name=name, chapter=ex.chapter, title=ex.title, score=result.score,
                              max_score=result.max_score, passed=result.passed, feedback=feedback))
    return dict(notebook=str(path), seconds=round(time.monotonic() - t0, 2), errors=errors, exercises=exercises,
                score=sum(e["score"] for e in exercises), max_score=sum(e["max_score"] for e in exercises))


def _table(book: dict) -> str:
    lines = []
    for nb in book["notebooks"]:
        lines.append(f"{nb['notebook']}  ({nb['score']}/{nb['max_score']}, executed in {nb['seconds']:.1f} s)")
        width = max([len(e["name"]) for e in nb["exercises"]] + [8])
        for e in nb["exercises"]:
            status = "passed" if e["passed"] else "not yet"
            fb = e["feedback"].replace("\n", " ")
            fb = fb if len(fb) <= 110 else fb[:109] + "…"
            lines.append(f"  {e['name']:<{width}}  {e['score']:>4}/{e['max_score']:<4} {status:<8} {fb}")
        if not nb["exercises"]:
            lines.append("  (no check(...) calls in this notebook)")
        for err in nb["errors"]:
            lines.append(f"  ! {err}")
    total, most = book["score"], book["max_score"]
    pct = 100.0 * total / most if most else 0.0
    lines.append(f"TOTAL {total}/{most} ({pct:.1f}%)" + ("  [solutions filled in]" if book["solutions"] else ""))
    return "\n".join(lines)


def run(args) -> int:
    try:
        paths = find_notebooks(args.paths)
    except FileNotFoundError as exc:
        print(f"fa-lab grade: {exc}", file=sys.stderr)
        return 2
    if not paths:
        print(f"fa-lab grade: no notebooks in {' '.join(args.paths)}", file=sys.stderr)
        return 2
    notebooks = []
    for path in paths:
        print(f"grading {path} …", file=sys.stderr, flush=True)
        notebooks.append(grade_notebook(path, solutions=args.solutions, cell_timeout=args.cell_timeout,
                                        kernel=args.kernel, timeout=args.timeout))
    book = dict(notebooks=notebooks, solutions=bool(args.solutions),
                score=sum(n["score"] for n in notebooks), max_score=sum(n["max_score"] for n in notebooks))
    print(json.dumps(book, indent=2) if args.json else _table(book))
    if args.require_full:
        full = all(e["passed"] for n in notebooks for e in n["exercises"]) and all(n["exercises"] for n in notebooks)
        return 0 if full else 1
    return 0
