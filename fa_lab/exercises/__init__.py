"""Graded exercises: ``names()``, ``reference(name)``, ``check(name, fn)``, ``describe(name)``.

In a notebook::

    from fa_lab.exercises import check
    def softmax_rows(s): ...
    check("ch1_safe_softmax", softmax_rows)      # a pass/fail table, never an exception

Each chapter's exercises live in ``fa_lab/exercises/chN.py``; the learner's notebooks
are in ``exercises/`` and the solutions stay here, out of the learner's notebook.
``fa-lab grade exercises/`` executes the notebooks from a fresh kernel and prints a
score table (``--json`` for a gradebook, ``--solutions`` to fill in the solutions).

The machinery, one idea per module: ``registry`` (what an exercise is, and where they are
kept), ``runner`` (``run_check``: every planned case, scored), ``guard`` (calling the
learner's code in a thread, with a time limit, catching everything it throws), ``judge``
(fresh inputs, expected outputs, comparing, diagnoses), ``feedback`` (what a wrong tensor
teaches), ``structure`` (how the result was computed), ``result`` (the table a check shows).
"""
from __future__ import annotations

import json
import os

from fa_lab.exercises.guard import safe_text
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
from fa_lab.exercises.runner import DEFAULT_SEEDS, DEFAULT_TIMEOUT, max_score, plan, run_check
from fa_lab.exercises.structure import NoQuadraticBuffer, ReadBudget, SimLoadBudget, StructureCheck

#: set by ``fa-lab grade``: every check() appends its result here (one JSON object per line),
#: with the default seeds and time limit whatever the notebook asked for
GRADE_LOG_ENV = "FA_LAB_GRADE_LOG"

__all__ = ["names", "reference", "check", "describe", "hint", "get", "max_score", "plan", "Case", "CheckResult", "Exercise",
           "Mistake", "register_exercise", "NoQuadraticBuffer", "ReadBudget", "SimLoadBudget", "StructureCheck",
           "CHAPTER_MODULES", "DEFAULT_SEEDS", "DEFAULT_TIMEOUT", "GRADE_LOG_ENV"]


def check(name: str, fn, *, seeds=DEFAULT_SEEDS, timeout: float = DEFAULT_TIMEOUT) -> CheckResult:
    """Run ``fn`` against the solution on fresh random cases; returns a displayable result, never raises."""
    log = os.environ.get(GRADE_LOG_ENV)
    if log:  # grading: everyone gets the same cases and the same time limit
        seeds, timeout = DEFAULT_SEEDS, DEFAULT_TIMEOUT
    try:
        ex = get(name)
    except (TypeError, ValueError) as exc:
        result = CheckResult(safe_text(name, str, 80), "unknown exercise")
        result.rows.append(dict(case="exercise name", kind="values", passed=False, message=str(exc)))
    else:
        result = run_check(ex, fn, seeds=seeds, timeout=timeout)
    if log:
        with open(log, "a", encoding="utf-8") as f:
            f.write(json.dumps(result.to_dict()) + "\n")
    return result
