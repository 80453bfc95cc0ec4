"""The machinery behind graded exercises: an exercise, its cases, and ``check``.

An exercise is a function the learner writes (``softmax_rows``, ``online_attention``,
...), a solution with the same signature, and a generator of test cases.  ``check``
calls both on fresh random cases — lengths that are not multiples of 16, N = 1,
Nq != Nk, every mask the exercise claims, several seeds — and turns whatever the
learner's code does (wrong numbers, wrong shape, an exception, a hang) into a row of a
readable table.  It never raises into the notebook.
"""
from __future__ import annotations

import html
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..testing import assert_close


@dataclass
class Case:
    """One call: ``fn(*args, **kwargs)``, judged at ``dtype``'s tolerance."""

    label: str
    args: tuple
    kwargs: dict = field(default_factory=dict)
    dtype: torch.dtype = torch.float32


@dataclass
class Exercise:
    name: str
    chapter: int
    title: str
    signature: str                           # what the learner writes, e.g. "softmax_rows(s) -> Tensor"
    solution: Callable
    make_cases: Callable[[int], list]        # seed -> [Case, ...]
    compare: Callable | None = None          # (got, expected, case) -> None, raises AssertionError
    hint: str = ""


_EXERCISES: dict[str, Exercise] = {}


def register_exercise(ex: Exercise) -> Exercise:
    if ex.name in _EXERCISES:
        raise ValueError(f"exercise {ex.name!r} is registered twice")
    _EXERCISES[ex.name] = ex
    return ex


def _clone(x):
    """Fresh copies of tensor arguments, so the learner's code cannot alter the solution's inputs."""
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, (tuple, list)):
        return type(x)(_clone(i) for i in x)
    return x


def compare_outputs(got, expected, case: Case) -> None:
    """Default judge: same structure, then each tensor within the dtype's tolerance."""
    if isinstance(expected, (tuple, list)):
        if not isinstance(got, (tuple, list)) or len(got) != len(expected):
            raise AssertionError(f"expected a tuple of {len(expected)} results, got {type(got).__name__}"
                                 + (f" of length {len(got)}" if isinstance(got, (tuple, list)) else ""))
        for i, (g, e) in enumerate(zip(got, expected)):
            _compare_one(g, e, case, f"result[{i}]")
    else:
        _compare_one(got, expected, case, "result")


def _compare_one(got, expected, case, what):
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            raise AssertionError(f"{what}: expected a torch.Tensor, got {type(got).__name__}")
        if got.shape != expected.shape:
            raise AssertionError(f"{what}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}")
        if got.device != expected.device:
            raise AssertionError(f"{what}: on {got.device}, expected {expected.device}")
        if got.dtype != expected.dtype and not (got.is_floating_point() and expected.is_floating_point()):
            raise AssertionError(f"{what}: dtype {got.dtype}, expected {expected.dtype}")
        if expected.dtype == torch.bool:
            if not torch.equal(got.bool(), expected):
                bad = torch.nonzero(got.bool() != expected)[0].tolist()
                raise AssertionError(f"{what}: differs first at {tuple(bad)}: got {bool(got[tuple(bad)])}, "
                                     f"expected {bool(expected[tuple(bad)])}")
            return
        assert_close(got, expected, case.dtype, what=what)
    elif got != expected:
        raise AssertionError(f"{what}: got {got!r}, expected {expected!r}")


def _call_with_timeout(fn, args, kwargs, timeout: float):
    """Run learner code in a daemon thread; a hang becomes a TimeoutError, not a stuck notebook."""
    box: dict[str, Any] = {}

    def target():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 — anything the learner's code throws is reported
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise TimeoutError(f"no answer after {timeout:.0f} s (an infinite loop? a loop over far too many elements?)")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _describe_exception(exc: BaseException) -> str:
    if isinstance(exc, NotImplementedError):
        return "not implemented yet: replace the `raise NotImplementedError` with your code"
    if isinstance(exc, TimeoutError):
        return str(exc)
    tb = traceback.extract_tb(exc.__traceback__)
    where = next((f" (line {f.lineno}: {f.line})" for f in reversed(tb) if "fa_lab" not in f.filename), "")
    return f"raised {type(exc).__name__}: {exc}{where}"


@dataclass
class CheckResult:
    """What ``check`` returns: ``.passed``, ``.score``, ``.max_score`` and a row per case."""

    name: str
    title: str
    rows: list = field(default_factory=list)   # dicts: case, passed, message

    @property
    def score(self) -> int:
        return sum(r["passed"] for r in self.rows)

    @property
    def max_score(self) -> int:
        return len(self.rows)

    @property
    def passed(self) -> bool:
        return self.max_score > 0 and self.score == self.max_score

    @property
    def first_failure(self):
        return next((r for r in self.rows if not r["passed"]), None)

    def __repr__(self) -> str:
        head = f"{self.name}: {self.score}/{self.max_score} {'PASSED' if self.passed else 'not yet'}"
        lines = [head]
        for r in self.rows:
            lines.append(f"  [{'ok' if r['passed'] else 'FAIL'}] {r['case']}" + ("" if r["passed"] else f" — {r['message']}"))
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        color = "#1a7f37" if self.passed else "#cf222e"
        out = [f"<div><b style='color:{color}'>{html.escape(self.title)}: {self.score}/{self.max_score} "
               f"{'passed' if self.passed else 'not yet'}</b>",
               "<table><tr><th></th><th style='text-align:left'>case</th><th style='text-align:left'>feedback</th></tr>"]
        for r in self.rows:
            mark = "✅" if r["passed"] else "❌"
            out.append(f"<tr><td>{mark}</td><td style='text-align:left'><code>{html.escape(r['case'])}</code></td>"
                       f"<td style='text-align:left'>{html.escape(r['message'])}</td></tr>")
        out.append("</table></div>")
        return "".join(out)


def run_check(ex: Exercise, fn, *, seeds=(0, 1, 2), timeout: float = 60.0) -> CheckResult:
    result = CheckResult(ex.name, f"Chapter {ex.chapter} · {ex.title}")
    if not callable(fn):
        result.rows.append(dict(case="your function", passed=False,
                                message=f"check needs the function you wrote, got {type(fn).__name__}"))
        return result
    compare = ex.compare or compare_outputs
    deadline = time.monotonic() + timeout
    for seed in seeds:
        for case in ex.make_cases(seed):
            label = f"{case.label} seed={seed}"
            expected = ex.solution(*_clone(case.args), **_clone(case.kwargs))
            remaining = deadline - time.monotonic()
            try:
                if remaining <= 0:
                    raise TimeoutError(f"time limit of {timeout:.0f} s for the whole check used up")
                got = _call_with_timeout(fn, _clone(case.args), _clone(case.kwargs), remaining)
                compare(got, expected, case)
                result.rows.append(dict(case=label, passed=True, message=""))
            except AssertionError as exc:
                result.rows.append(dict(case=label, passed=False, message=f"wrong answer: {exc}"))
            except BaseException as exc:  # noqa: BLE001 — reported, never propagated into the notebook
                result.rows.append(dict(case=label, passed=False, message=_describe_exception(exc)))
                if isinstance(exc, (NotImplementedError, TimeoutError)):
                    return result  # the rest would say the same thing
    return result
