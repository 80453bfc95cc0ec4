"""Graded exercises: ``names()``, ``reference(name)``, ``check(name, fn)``, ``describe(name)``.

In a notebook::

    from fa_lab.exercises import check
    def softmax_rows(s): ...
    check("ch1_safe_softmax", softmax_rows)      # a pass/fail table, never an exception

Each chapter's exercises live in ``fa_lab/exercises/chN.py``; the learner's notebooks
are in ``exercises/`` and the solutions stay here, out of the learner's notebook.
"""
from __future__ import annotations

import importlib

from .core import Case, CheckResult, Exercise, _EXERCISES, register_exercise, run_check

#: one module per chapter; each registers its exercises on import
CHAPTER_MODULES = [
    "fa_lab.exercises.ch1",
    "fa_lab.exercises.ch2",
]

__all__ = ["names", "reference", "check", "describe", "Case", "CheckResult", "Exercise", "register_exercise"]


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


def check(name: str, fn, *, seeds=(0, 1, 2), timeout: float = 60.0) -> CheckResult:
    """Run ``fn`` against the solution on fresh random cases; returns a displayable result."""
    return run_check(get(name), fn, seeds=seeds, timeout=timeout)
