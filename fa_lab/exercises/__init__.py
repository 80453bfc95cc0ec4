"""Graded exercises: ``names()``, ``check(name, fn)``, ``describe(name)``, ``hint(name, level)``.

In a notebook::

    from fa_lab.exercises import check
    def softmax_rows(s): ...
    check("ch1_safe_softmax", softmax_rows)      # a pass/fail table, never an exception

Each chapter's exercises live in ``fa_lab/exercises/chN.py`` (warm-ups) and
``chN_kernels.py`` (kernels); the learner's notebooks are in ``exercises/`` and the
solutions stay here, out of the learner's notebook.  ``fa-lab grade exercises/`` grades
the notebooks (see ``grade``: the learner's definitions are checked in a fresh process).

The machinery, one idea per module: ``registry`` (what an exercise is, and where they are
kept), ``runner`` (``run_check``: every planned case, scored), ``isolate`` (running the
learner's function in a fresh process), ``program`` (the notebook's definitions),
``callwatch`` (whose code computed the answer), ``guard`` (calling the learner's code in a
thread, with a time limit, catching everything it throws), ``judge`` (fresh inputs,
expected outputs, comparing, diagnoses), ``feedback`` (what a wrong tensor teaches),
``structure`` (how the result was computed), ``result`` (the table a check shows).
"""
from __future__ import annotations

import os

from fa_lab.exercises.guard import safe_text
from fa_lab.exercises.isolate import Isolated, resolve
from fa_lab.exercises.program import defines, extract
from fa_lab.exercises.registry import (
    CHAPTER_MODULES,
    Case,
    Exercise,
    Mistake,
    describe,
    get,
    hint,
    names,
    reference,
    register_exercise,
)
from fa_lab.exercises.result import CheckResult
from fa_lab.exercises.runner import DEFAULT_SEEDS, DEFAULT_TIMEOUT, InProcess, max_score, plan, run_check
from fa_lab.exercises.structure import NoQuadraticBuffer, ReadBudget, SimLoadBudget, StructureCheck

#: set by ``fa-lab grade`` while it executes a notebook: the notebook's own checks are skipped (the grade
#: is decided afterwards, by checks the grader runs itself)
DEFERRED_ENV = "FA_LAB_CHECKS_DEFERRED"

__all__ = ["names", "reference", "check", "describe", "hint", "get", "max_score", "plan", "Case", "CheckResult",
           "Exercise", "Mistake", "register_exercise", "NoQuadraticBuffer", "ReadBudget", "SimLoadBudget",
           "StructureCheck", "CHAPTER_MODULES", "DEFAULT_SEEDS", "DEFAULT_TIMEOUT"]


def _notebook_source(fn):
    """``(program, name)`` when ``fn`` is bound by name in this IPython session (None otherwise)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    ip = get_ipython()
    if ip is None:
        return None
    ns = ip.user_ns
    name = getattr(fn, "__name__", None)
    if not (isinstance(name, str) and ns.get(name) is fn):
        name = next((k for k, v in list(ns.items()) if v is fn and not k.startswith("_")), None)
    if name is None:
        return None
    program = extract([c for c in ns.get("In", []) if isinstance(c, str)])
    return (program, name) if defines(program, name) else None


def _importable(fn):
    """``(module, qualname)`` when ``fn`` can be imported by name in another process (None otherwise)."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not (isinstance(module, str) and isinstance(qualname, str)) or module == "__main__" or "<" in qualname:
        return None
    try:
        obj = resolve(module, qualname)
    except Exception:  # noqa: BLE001
        return None
    return (module, qualname) if obj is fn else None


def check(name: str, fn, *, seeds=DEFAULT_SEEDS, timeout: float = DEFAULT_TIMEOUT) -> CheckResult:
    """Run ``fn`` against the solution on fresh random cases; returns a displayable result, never raises.

    A function defined at the top level of a notebook cell (or importable by name) runs in a
    fresh process (``isolate``): an endless compiled loop or a crash there ends that process,
    not the notebook.  Anything else (a lambda, a closure) runs in a thread of this process.
    """
    try:
        ex = get(name)
    except (TypeError, ValueError) as exc:
        result = CheckResult(safe_text(name, str, 80), "unknown exercise")
        result.rows.append(dict(case="exercise name", kind="values", passed=False, message=str(exc)))
        return result
    if os.environ.get(DEFERRED_ENV):
        result = CheckResult(ex.name, f"Chapter {ex.chapter} · {ex.title}")
        result.rows.append(dict(case="grading", kind="skipped", passed=None,
                                message="fa-lab grade checks this exercise itself, after the notebook has run"))
        return result
    caller = None
    try:
        source = _notebook_source(fn) if callable(fn) else None
        ref = None if source is not None or not callable(fn) else _importable(fn)
        if source is not None:
            caller = Isolated(ex, program=source[0], fn_name=source[1])
        elif ref is not None:
            caller = Isolated(ex, ref=ref)
    except Exception:  # noqa: BLE001 — no process to run it in: the thread of this process will do
        caller = None
    if caller is None and callable(fn):   # a lambda or closure: a thread of this process, not profiled
        caller = InProcess(ex, fn, trusted=False, profile=False)
    return run_check(ex, fn, seeds=seeds, timeout=timeout, trusted=False, caller=caller)
