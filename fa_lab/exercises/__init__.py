"""Graded exercises: ``names()``, ``reference(name)``, ``check(name, fn)``, ``describe(name)``.

In a notebook::

    from fa_lab.exercises import check
    def softmax_rows(s): ...
    check("ch1_safe_softmax", softmax_rows)      # a pass/fail table, never an exception

Each chapter's exercises live in ``fa_lab/exercises/chN.py``; the learner's notebooks
are in ``exercises/`` and the solutions stay here, out of the learner's notebook.
``fa-lab grade exercises/`` executes the notebooks from a fresh kernel and prints a
score table (``--json`` for a gradebook, ``--solutions`` to fill in the solutions).
"""
from __future__ import annotations

import importlib
import json
import os

from fa_lab.exercises.core import DEFAULT_SEEDS, DEFAULT_TIMEOUT, Case, CheckResult, Exercise, Mistake, _EXERCISES, register_exercise, run_check
from fa_lab.exercises.structure import NoQuadraticBuffer, ReadBudget, SimLoadBudget, StructureCheck

#: set by ``fa-lab grade``: every check() appends its result here (one JSON object per line),
#: with the default seeds and time limit whatever the notebook asked for
GRADE_LOG_ENV = "FA_LAB_GRADE_LOG"

#: one module per chapter; each registers its exercises on import
CHAPTER_MODULES = [
    "fa_lab.exercises.ch1",
    "fa_lab.exercises.ch2",
    "fa_lab.exercises.ch3",
    "fa_lab.exercises.ch4",
    "fa_lab.exercises.ch5",
    "fa_lab.exercises.ch6",
]

__all__ = ["names", "reference", "check", "describe", "get", "Case", "CheckResult", "Exercise", "Mistake",
           "register_exercise", "NoQuadraticBuffer", "ReadBudget", "SimLoadBudget", "StructureCheck"]


def _load():
    for mod in CHAPTER_MODULES:
        importlib.import_module(mod)
    return _EXERCISES


def names(chapter: int | None = None) -> list[str]:
    """Registered exercise names (optionally one chapter's)."""
    return [n for n, ex in _load().items() if chapter is None or ex.chapter == chapter]


def get(name: str) -> Exercise:
    exercises = _load()
    if name not in exercises:
        raise ValueError(f"unknown exercise {name!r}; known exercises: {', '.join(exercises)}")
    return exercises[name]


def reference(name: str):
    """The solution, a callable with the signature the exercise asks for."""
    return get(name).solution


def describe(name: str) -> str:
    ex = get(name)
    return f"{ex.title}\n  write: {ex.signature}\n  {ex.hint}".rstrip()


def check(name: str, fn, *, seeds=DEFAULT_SEEDS, timeout: float = DEFAULT_TIMEOUT) -> CheckResult:
    """Run ``fn`` against the solution on fresh random cases; returns a displayable result, never raises."""
    log = os.environ.get(GRADE_LOG_ENV)
    if log:  # grading: everyone gets the same cases and the same time limit
        seeds, timeout = DEFAULT_SEEDS, DEFAULT_TIMEOUT
    try:
        ex = get(name)
    except ValueError as exc:
        result = CheckResult(str(name), "unknown exercise")
        result.rows.append(dict(case="exercise name", kind="values", passed=False, message=str(exc)))
    else:
        result = run_check(ex, fn, seeds=seeds, timeout=timeout)
    if log:
        with open(log, "a", encoding="utf-8") as f:
            f.write(json.dumps(result.to_dict()) + "\n")
    return result
