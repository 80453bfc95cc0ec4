"""Grade exercise notebooks: run each from a fresh kernel and print a score table per exercise.

    fa-lab grade exercises/                    # every exercises/*.ipynb, as the learner left them
    fa-lab grade exercises/01_naive_attention.ipynb --json > gradebook.json
    fa-lab grade exercises/ --solutions --require-full   # CI: the shipped notebooks + the solutions = full marks

Each notebook is executed top to bottom by nbclient in a new kernel (so nothing from an
earlier session leaks in); every ``check("name", fn)`` it runs records its result, with the
default seeds and time limit whatever the notebook asked for.  An exercise whose check
never ran (an earlier cell failed, the cell was deleted) scores 0 out of its usual maximum.
``--solutions`` inserts ``fn = reference("name")`` before each check cell: the notebook as
shipped, with the TODOs filled in by the solutions that live in ``fa_lab/exercises``.
"""
from __future__ import annotations

import json
import os
import re
import sys
import tempfile
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
    """A copy of ``nb`` with ``fn = reference("name")`` inserted before every check cell."""
    import copy

    import nbformat

    nb = copy.deepcopy(nb)
    by_cell: dict[int, list[tuple[str, str]]] = {}
    for i, name, fn in check_calls(nb):
        if fn:
            by_cell.setdefault(i, []).append((name, fn))
    for i in sorted(by_cell, reverse=True):
        lines = ["from fa_lab.exercises import reference as fa_lab_reference"]
        lines += [f'{fn} = fa_lab_reference("{name}")' for name, fn in by_cell[i]]
        nb.cells.insert(i, nbformat.v4.new_code_cell("\n".join(lines)))
    return nb


def _package_root() -> str:
    """The folder holding the fa_lab this command runs from (the kernel must grade with the same one)."""
    import fa_lab

    return str(Path(fa_lab.__file__).resolve().parent.parent)


def _planned_max(name: str) -> int:
    from fa_lab.exercises import get, max_score

    try:
        return max_score(get(name))
    except Exception:  # unknown name or broken exercise: the check itself says so
        return 0


def grade_notebook(path: Path, *, solutions=False, cell_timeout=600.0, kernel=None) -> dict:
    """Execute one notebook in a fresh kernel; return its gradebook entry."""
    import nbformat
    from nbclient import NotebookClient

    from fa_lab.exercises import GRADE_LOG_ENV, get

    nb = nbformat.read(path, as_version=4)
    calls = check_calls(nb)
    if solutions:
        nb = fill_solutions(nb)
    kernel = kernel or nb.metadata.get("kernelspec", {}).get("name") or "python3"
    errors = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "checks.jsonl"
        # the kernel inherits these when it starts: where to record checks, and the same fa_lab as ours
        env = {GRADE_LOG_ENV: str(log),
               "PYTHONPATH": os.pathsep.join(p for p in (_package_root(), os.environ.get("PYTHONPATH")) if p)}
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            # 'immediate': the kernel is thrown away anyway; a graceful shutdown costs ~3 s a notebook
            client = NotebookClient(nb, timeout=cell_timeout, kernel_name=kernel, allow_errors=True,
                                    shutdown_kernel="immediate",
                                    resources={"metadata": {"path": str(path.parent.resolve())}})
            client.execute()
        except Exception as exc:  # noqa: BLE001 — a dead kernel or a cell timeout: grade what ran
            first = (str(exc).strip().splitlines() or [""])[0]
            errors.append(f"notebook stopped: {type(exc).__name__}: {first}")
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        records = {}
        if log.exists():
            for line in log.read_text(encoding="utf-8").splitlines():
                if line.strip():
                    rec = json.loads(line)
                    records[rec["name"]] = rec             # the last check of an exercise counts
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                errors.append(f"cell {i}: {out.get('ename')}: {out.get('evalue')}")
    exercises, seen = [], set()
    for _, name, _ in calls:
        if name in seen:
            continue
        seen.add(name)
        rec = records.get(name)
        try:
            ex = get(name)
            chapter, title = ex.chapter, ex.title
        except ValueError:
            chapter, title = None, "unknown exercise"
        if rec is None:
            entry = dict(name=name, chapter=chapter, title=title, score=0, max_score=_planned_max(name),
                         passed=False, feedback="check() did not run (an earlier cell failed, or the check cell "
                                                "was removed)")
        else:
            first = rec.get("first_failure") or {}
            feedback = "" if rec["passed"] else f"{first.get('case', '')}: {first.get('message', '')}"
            entry = dict(name=name, chapter=chapter, title=title, score=rec["score"], max_score=rec["max_score"],
                         passed=rec["passed"], feedback=feedback)
        exercises.append(entry)
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
                                        kernel=args.kernel))
    book = dict(notebooks=notebooks, solutions=bool(args.solutions),
                score=sum(n["score"] for n in notebooks), max_score=sum(n["max_score"] for n in notebooks))
    print(json.dumps(book, indent=2) if args.json else _table(book))
    if args.require_full:
        full = all(e["passed"] for n in notebooks for e in n["exercises"]) and all(n["exercises"] for n in notebooks)
        return 0 if full else 1
    return 0
