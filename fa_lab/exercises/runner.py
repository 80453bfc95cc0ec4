"""``run_check``: the learner's function against the solution on every planned case.

``check`` calls both on fresh random cases — lengths that are not multiples of the tile,
N = 1, Nq != Nk, every mask the exercise claims, several seeds — and turns whatever the
learner's code does (wrong numbers, wrong shape/dtype/device, an exception, a hang, an
Nq×Nk buffer in a tiled function) into a row of a readable table.  It never raises into
the notebook: when the user presses stop, the case under way and the cases after it are
marked as not run and the result says the check was interrupted.

The rows are planned before anything runs (``plan``), so ``max_score`` is the same for a
stub, a wrong answer and the solution.
"""
from __future__ import annotations

import inspect
import numbers
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from fa_lab.exercises.callwatch import CallWatch, OwnKernel, own_file
from fa_lab.exercises.feedback import Mismatch
from fa_lab.exercises.guard import LearnerError, TimeLimitReached, call_with_timeout, describe_exception, safe_text
from fa_lab.exercises.judge import expected_outputs, judge, match_mistake, outputs_of, prepare_args, type_diagnosis
from fa_lab.exercises.registry import Case, Exercise
from fa_lab.exercises.result import CheckResult
from fa_lab.exercises.structure import PoisonEmpty

DEFAULT_SEEDS = (0, 1, 2)
DEFAULT_TIMEOUT = 60.0  # seconds for a whole check
MAX_DIAGNOSED = 3       # wrong cases per check that the known mistakes are tried on (each costs their runs)

INTERRUPTED = "the check was interrupted (the stop button, or a KeyboardInterrupt)"


def plan(ex: Exercise, seeds=DEFAULT_SEEDS) -> list:
    """``[(seed, case, structure_checks)]``: every row ``check`` will score, known before anything runs."""
    own = [OwnKernel(ex.kind)] if ex.kind != "python" else []
    return [(seed, case, [c for c in ex.structure if c.applies(case)] + own)
            for seed in seeds for case in ex.make_cases(seed)]


def max_score(ex: Exercise, seeds=DEFAULT_SEEDS) -> int:
    return sum(1 + len(checks) for _, _, checks in plan(ex, seeds))


@dataclass
class _Run:
    """What carries from one case to the next: the deadline, why the rest is not run, mistakes tried."""

    deadline: float
    timeout: float
    stop: str | None = None
    diagnosed: int = 0
    output: list = field(default_factory=list)   # what the learner's code printed, case by case


def _bad_arguments(seeds, timeout) -> str | None:
    """What is wrong with ``check``'s seeds or time limit (None if nothing), in words for the learner."""
    try:
        seeds_ok = len(seeds) > 0 and all(isinstance(s, numbers.Integral) and not isinstance(s, bool)
                                          for s in seeds)
    except TypeError:
        seeds_ok = False
    if not seeds_ok:
        return f"seeds must be a non-empty tuple of integers such as (0, 1, 2), got {safe_text(seeds, repr, 80)}"
    if not isinstance(timeout, numbers.Real) or isinstance(timeout, bool) or not timeout > 0:
        return f"timeout must be a positive number of seconds, got {safe_text(timeout, repr, 80)}"
    return None


def run_check(ex: Exercise, fn, *, seeds=DEFAULT_SEEDS, timeout: float = DEFAULT_TIMEOUT,
              trusted: bool | None = None, caller=None) -> CheckResult:
    """Every planned case of ``ex``: ``fn`` called by ``caller`` (default: in this process), judged here.

    ``trusted`` lets the function use fa_lab's finished implementations (the exercise's own
    solution and model answer; by default only those are trusted).  ``caller`` runs the
    learner's code somewhere else (``isolate.Isolated``: a fresh process); the values are
    always judged in this process.
    """
    t0 = time.monotonic()
    first_hint = ex.hints[0] if ex.hints else ""
    if len(ex.hints) > 1:
        first_hint += f"  (more: hint({ex.name!r}, 2))"
    result = CheckResult(ex.name, f"Chapter {ex.chapter} · {ex.title}", hint=first_hint)
    bad = _bad_arguments(seeds, timeout)
    if bad is not None:      # no plan to score against: say so in one row
        result.rows.append(dict(case="check(...) arguments", kind="values", passed=False, message=bad))
        return result
    try:
        planned = plan(ex, seeds)
    except KeyboardInterrupt:
        result.interrupted = True
        result.rows.append(dict(case="making the test cases", kind="values", passed=False, message=INTERRUPTED))
        return result
    except Exception as exc:  # noqa: BLE001 — the exercise's own case generator failed: say so, do not raise
        result.rows.append(dict(case="making the test cases", kind="values", passed=False,
                                message=f"internal error in exercise {ex.name!r} (not your code): "
                                        f"{safe_text(exc, repr)}"))
        return result
    stop = None if callable(fn) or caller is not None else (
        f"check needs the function you wrote, got {type(fn).__name__}: check({ex.name!r}, my_function)")
    run = _Run(deadline=t0 + timeout, timeout=timeout, stop=stop)
    if trusted is None:
        trusted = fn is ex.model_answer or fn is ex.solution
    if caller is None and stop is None:
        caller = InProcess(ex, fn, trusted=trusted)
    position: dict = {}
    for seed, case, checks in planned:
        index = position[seed] = position.get(seed, -1) + 1   # the same case of another seed: same table line
        if run.stop is not None:
            rows = [("skipped", False, f"not run: {run.stop}", c, {}) if result.rows or c is not None
                    else ("values", False, run.stop, c, {}) for c in [None] + checks]
        else:
            try:
                rows = _run_case(ex, caller, case, checks, run)
            except KeyboardInterrupt:     # the user pressed stop: report what ran, never kill the notebook
                result.interrupted, run.stop = True, INTERRUPTED
                rows = [("values" if c is None else "structure", False, f"not finished: {INTERRUPTED}", c, {})
                        for c in [None] + checks]
        for kind, passed, message, check, extra in rows:
            suffix = f" · structure: {check.label}" if check is not None else ""
            result.rows.append(dict(case=f"{case.label} seed={seed}{suffix}", label=case.label + suffix,
                                    group=(index, suffix), seed=seed, kind=kind, passed=passed,
                                    message=message, **extra))
    if caller is not None:
        caller.close()
    result.output = "".join(run.output)
    result.seconds = time.monotonic() - t0
    return result


@dataclass
class CallReport:
    """What one call of the learner's function did, told by the process that ran it (judged elsewhere)."""

    returned: bool = False
    value: Any = None            # what is judged: the return value, or (kernel style) the output arguments
    error: str | None = None     # the exception or the time limit, in words for the learner
    stop: str | None = None      # why the cases after this one are not run
    verdicts: list = field(default_factory=list)   # per structure check: None (right) or what is wrong
    forbidden: str | None = None  # a finished implementation was called (in words)
    mutated: list = field(default_factory=list)    # inputs the function changed in place
    output: str = ""             # what the learner's code printed (isolated runs)


def _argument_names(ex: Exercise, n: int) -> list[str]:
    try:
        params = [p.name for p in inspect.signature(ex.solution).parameters.values()]
    except (TypeError, ValueError):
        params = []
    return [params[i] if i < len(params) else f"argument {i}" for i in range(n)]


def _same(a, b) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
    return bool(torch.equal(a, b))


def call_case(ex: Exercise, fn, case: Case, checks: list, remaining: float, *, own_files=(),
              trusted: bool = False, profile: bool = True) -> CallReport:
    """Call the learner's ``fn`` on one case, under the structure watchers, in this process."""
    report = CallReport()
    args, kwargs = prepare_args(ex, case)
    before = {i: a.detach().clone() for i, a in enumerate(args)
              if isinstance(a, torch.Tensor) and i not in ex.out_args}
    watch = CallWatch(own_files, trusted=trusted, profile=profile)
    monitors = [None if isinstance(c, OwnKernel) else c.monitor(case, args, kwargs) for c in checks]
    hooks = ([PoisonEmpty()] if ex.poison_empty else []) + [m for m in monitors if m is not None] + [watch]
    try:
        if remaining <= 0:
            raise TimeLimitReached("time limit for the whole check used up")
        value = call_with_timeout(fn, args, kwargs, remaining, hooks)
        report.returned = True
    except (LearnerError, TimeLimitReached) as exc:
        report.error = describe_exception(exc)
        if isinstance(exc, TimeLimitReached):
            report.stop = "the time limit was reached"
        elif isinstance(exc.error, NotImplementedError):
            report.stop = "not implemented yet"
    except Exception as exc:  # noqa: BLE001 — the call could not be made (no thread to run it in, ...)
        report.error = f"could not run your code: {safe_text(exc, repr)}"
    finally:
        for m in monitors:
            if m is not None:
                m.finish()
    report.forbidden = watch.message()
    names = _argument_names(ex, len(args))
    report.mutated = [names[i] for i, a in before.items() if not _same(a, args[i])]
    if report.returned:
        report.value = outputs_of(ex, value, args)
    for c, m in zip(checks, monitors):
        if isinstance(c, OwnKernel):
            report.verdicts.append(watch.kernel_verdict(c.kind))
            continue
        try:
            report.verdicts.append(m.verdict())
        except Exception as exc:  # noqa: BLE001
            report.verdicts.append(f"internal error in the structure check (not your code): {safe_text(exc, repr)}")
    return report


class InProcess:
    """Runs the learner's function in this process (a thread with a time limit): the trusted path and the
    fallback for functions that cannot be loaded elsewhere."""

    def __init__(self, ex: Exercise, fn, trusted: bool = False, profile: bool = True):
        self.ex, self.fn, self.trusted, self.profile = ex, fn, trusted, profile
        self.own_files = [f for f in (own_file(fn),) if f]

    def call(self, case: Case, checks: list, remaining: float) -> CallReport:
        return call_case(self.ex, self.fn, case, checks, remaining, own_files=self.own_files, trusted=self.trusted,
                         profile=self.profile)

    def close(self) -> None:
        pass


def _run_case(ex: Exercise, caller, case: Case, checks: list, run: _Run) -> list:
    """The rows of one case, ``(kind, passed, message, structure check or None, extra fields)``."""
    try:
        expected, native = expected_outputs(ex, case)
    except Exception as exc:  # noqa: BLE001 — the solution failed on its own case
        return [("values" if c is None else "structure", False,
                 f"internal error in exercise {ex.name!r} (not your code): {safe_text(exc, repr)}", c, {})
                for c in [None] + checks]
    report = caller.call(case, checks, run.deadline - time.monotonic())
    if report.stop and run.stop is None:
        run.stop = report.stop
    if report.output:
        run.output.append(report.output)
    if not report.returned:
        rows = [("values", False, report.error or "your function did not return", None, {})]
    elif report.forbidden:
        rows = [("values", False, f"not accepted: {report.forbidden}", None, {})]
    elif report.mutated:
        what = ", ".join(report.mutated)
        rows = [("values", False, f"your function changed its input{'s' if len(report.mutated) > 1 else ''} {what} "
                                  "in place: leave the inputs as they are and write results into new tensors "
                                  "(or into the output arguments)", None, {})]
    else:
        rows = [_values_row(ex, report.value, expected, native, case, run)]
    values_ok = rows[0][1]
    for c, verdict in zip(checks, report.verdicts or [None] * len(checks)):
        if not report.returned:
            rows.append(("structure", False, "not judged: your function did not return", c, {}))
            continue
        if verdict is None and not values_ok:  # structure only counts for a right answer
            verdict = "not judged: the values on this case are wrong (see the row above)"
        rows.append(("structure", verdict is None, verdict or "", c, {}))
    return rows


def _values_row(ex: Exercise, got, expected, native, case: Case, run: _Run) -> tuple:
    try:
        judge(ex, got, expected, native, case)
        return ("values", True, "", None, {})
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 — AssertionError, or a compare choking on odd output
        error = exc
    text = safe_text(error) if isinstance(error, AssertionError) else \
        f"could not compare your result: {safe_text(error, repr)}"
    diagnosis = type_diagnosis(ex, got, expected, native, case)
    if not diagnosis and ex.mistakes and run.diagnosed < MAX_DIAGNOSED and run.deadline - time.monotonic() > 0:
        run.diagnosed += 1
        diagnosis = match_mistake(ex, got, case, run.deadline - time.monotonic())
    return ("values", False, f"wrong answer: {text}", None,
            dict(details=error if isinstance(error, Mismatch) else None, diagnosis=diagnosis))
