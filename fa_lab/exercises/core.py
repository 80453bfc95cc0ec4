"""The machinery behind graded exercises: an exercise, its cases, and ``check``.

An exercise is a function the learner writes (``softmax_rows``, ``online_attention``,
...), a solution with the same signature, and a generator of test cases.  ``check``
calls both on fresh random cases — lengths that are not multiples of the tile, N = 1,
Nq != Nk, every mask the exercise claims, several seeds — and turns whatever the
learner's code does (wrong numbers, wrong shape/dtype/device, an exception, a hang, an
Nq×Nk buffer in a tiled function) into a row of a readable table.  It never raises
into the notebook (only a KeyboardInterrupt from the user goes through).

Scoring: one point per case for the values, plus one point per structure check that
applies to the case.  The rows are planned before anything runs, so ``max_score`` is
the same for a stub, a wrong answer and the solution (a gradebook can rely on it).

Optional ``Exercise`` fields (all defaulted; chapters that do not need them ignore them):

``tile``          ``(BLOCK_M, BLOCK_N)`` or ``case -> (BLOCK_M, BLOCK_N)`` (None = not tiled along
                  that axis); ``case.meta['block_m'/'block_n']`` override it.  Used to say which
                  tile / program id the worst element belongs to.
``structure``     ``StructureCheck`` objects (see ``structure.py``): each is an extra row on the
                  cases it applies to (by default those with ``meta['structure']=True``).
``mistakes``      known wrong answers (``Mistake``): when the learner's output matches one,
                  the feedback names it.
``out_args``      kernel style: indices of positional arguments the function writes into.
                  They are poisoned (NaN) before the call and judged after it.
``outputs``       names of the results for messages, e.g. ``("o", "lse")``.
``judge_dtype``   e.g. ``torch.float64``: values are judged against the solution run on
                  inputs upcast to this dtype (the float64 reference is the judge), at the
                  tolerance of ``case.dtype``; the learner must still return the solution's dtypes.
``strict_dtype``  a float result in another float dtype is wrong (default True).
``poison_empty``  ``torch.empty``-style buffers come back filled with NaN (default True).

``Case.meta`` carries facts the feedback uses: ``n_q``, ``n_k``, ``causal``, ``window``,
``block_m``, ``block_n``, ``structure`` (and anything a chapter wants to label cases with).
"""
from __future__ import annotations

import ctypes
import html
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from fa_lab.core.testing import tolerance
from fa_lab.exercises.feedback import Mismatch, check_like, compare_tensor, heatmap_png
from fa_lab.exercises.structure import PoisonEmpty, Watch, poison_

DEFAULT_SEEDS = (0, 1, 2)
DEFAULT_TIMEOUT = 60.0  # seconds for a whole check


@dataclass
class Case:
    """One call: ``fn(*args, **kwargs)``, judged at ``dtype``'s tolerance."""

    label: str
    args: tuple
    kwargs: dict = field(default_factory=dict)
    dtype: torch.dtype = torch.float32
    meta: dict = field(default_factory=dict)


@dataclass
class Mistake:
    """A typical wrong answer: ``fn`` has the solution's signature and makes exactly this mistake."""

    name: str
    fn: Callable
    message: str


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
    # optional, see the module docstring
    tile: Any = None
    structure: tuple = ()
    mistakes: tuple = ()
    out_args: tuple = ()
    outputs: tuple = ()
    judge_dtype: torch.dtype | None = None
    strict_dtype: bool = True
    poison_empty: bool = True

    def tile_for(self, case: Case) -> tuple:
        tile = self.tile(case) if callable(self.tile) else self.tile
        block_m, block_n = tile if tile else (None, None)
        return case.meta.get("block_m", block_m), case.meta.get("block_n", block_n)


_EXERCISES: dict[str, Exercise] = {}


def register_exercise(ex: Exercise) -> Exercise:
    if ex.name in _EXERCISES:
        raise ValueError(f"exercise {ex.name!r} is registered twice")
    _EXERCISES[ex.name] = ex
    return ex


# --------------------------------------------------------------------------- inputs

def _clone(x):
    """Fresh copies of tensor arguments, so the learner's code cannot alter the solution's inputs."""
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(_clone(i) for i in x)
    return x


def _upcast(x, dtype):
    if isinstance(x, torch.Tensor):
        return x.detach().to(dtype) if x.is_floating_point() else x.detach().clone()
    if isinstance(x, dict):
        return {k: _upcast(v, dtype) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(_upcast(i, dtype) for i in x)
    return x


def _outputs_of(ex: Exercise, value, args):
    """What is judged: the return value, or (kernel style) the output arguments after the call."""
    if not ex.out_args:
        return value
    outs = tuple(args[i] for i in ex.out_args)
    return outs[0] if len(outs) == 1 else outs


def _prepare(ex: Exercise, case: Case):
    args, kwargs = _clone(case.args), _clone(case.kwargs)
    args = list(args)
    for i in ex.out_args:
        poison_(args[i])
    return tuple(args), kwargs


# --------------------------------------------------------------------------- judging

def _name(ex: Exercise | None, i: int | None) -> str:
    names = ex.outputs if ex is not None else ()
    if i is None:
        return names[0] if len(names) == 1 else "result"
    return names[i] if i < len(names) else f"result[{i}]"


def _compare_tree(got, expected, native, case: Case, ex: Exercise | None, values: bool = True) -> None:
    """Same structure, then each tensor within the case dtype's tolerance (dtypes from ``native``).

    ``values=False`` checks only the structure, types, shapes, devices and dtypes (before a custom compare).
    """
    tile = ex.tile_for(case) if ex is not None else (None, None)
    strict = ex.strict_dtype if ex is not None else True

    def one(g, e, n, what):
        if not values:
            if isinstance(e, torch.Tensor):
                check_like(g, e, what=what, strict_dtype=strict)
            return
        if isinstance(e, torch.Tensor):
            compare_tensor(g, e, what=what, tol_dtype=case.dtype,
                           expected_dtype=n.dtype if isinstance(n, torch.Tensor) else None,
                           strict_dtype=strict, tile=tile, meta=case.meta)
        elif isinstance(e, float) and isinstance(g, (int, float)) and not isinstance(g, bool):
            atol, rtol = tolerance(case.dtype)
            if not (g == e or abs(g - e) <= atol + rtol * abs(e)):
                raise AssertionError(f"{what}: got {g!r}, expected {e!r}")
        elif isinstance(g, torch.Tensor) and g.numel() == 1 and not isinstance(e, torch.Tensor):
            raise AssertionError(f"{what}: got a tensor, expected a plain Python {type(e).__name__} (use .item())")
        elif g != e:
            raise AssertionError(f"{what}: got {g!r}, expected {e!r}")

    if isinstance(expected, (tuple, list)):
        if not isinstance(got, (tuple, list)) or len(got) != len(expected):
            names = ", ".join(_name(ex, i) for i in range(len(expected)))
            raise AssertionError(f"expected a tuple of {len(expected)} results ({names}), got {type(got).__name__}"
                                 + (f" of length {len(got)}" if isinstance(got, (tuple, list)) else ""))
        for i, (g, e) in enumerate(zip(got, expected)):
            one(g, e, native[i] if isinstance(native, (tuple, list)) else None, _name(ex, i))
    else:
        one(got, expected, native, _name(ex, None))


def compare_outputs(got, expected, case: Case) -> None:
    """Default judge: same structure, then each tensor within the dtype's tolerance (and the same dtype)."""
    _compare_tree(got, expected, expected, case, None)


# --------------------------------------------------------------------------- running learner code

class _StopLearnerCode(BaseException):
    """Injected into the learner's thread when it runs past the time limit (not an Exception: not caught by
    an ``except Exception`` in the learner's code)."""


def _stop(thread: threading.Thread) -> None:
    if thread.ident is not None and thread.is_alive():
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(_StopLearnerCode))


def _call_with_timeout(fn, args, kwargs, timeout: float, hooks=()):
    """Run learner code in a daemon thread, under the structure watchers; a hang becomes a TimeoutError.

    On timeout the thread is stopped (an exception is raised inside it at the next Python
    bytecode); code stuck inside one long C call finishes that call first.
    """
    box: dict[str, Any] = {}

    def target():
        try:
            if hooks:
                with Watch(hooks):
                    box["value"] = fn(*args, **kwargs)
            else:
                box["value"] = fn(*args, **kwargs)
        except _StopLearnerCode:
            box["stopped"] = True
        except BaseException as exc:  # noqa: BLE001 — anything the learner's code throws is reported
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True, name="fa_lab-check")
    t.start()
    try:
        t.join(max(timeout, 0.0))
    except KeyboardInterrupt:      # the user pressed stop: stop the learner's code too, and let it through
        _stop(t)
        raise
    if t.is_alive():
        _stop(t)
        t.join(2.0)
        tail = (" (it is still busy in the background; restart the kernel if the notebook gets slow)"
                if t.is_alive() else "")
        raise TimeoutError(f"no answer within the time limit ({timeout:.3g} s left of the check's budget): "
                           f"an infinite loop? a Python loop over far too many elements?{tail}")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def _describe_exception(exc: BaseException) -> str:
    if isinstance(exc, NotImplementedError):
        return "not implemented yet: replace the `raise NotImplementedError` with your code"
    if isinstance(exc, TimeoutError):
        return str(exc)
    tb = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in tb if "/fa_lab/" not in f.filename.replace("\\", "/")
            and "threading.py" not in f.filename]
    where = ""
    if mine:
        f = mine[-1]
        where = f" (in {f.name}, line {f.lineno}" + (f": {f.line.strip()}" if f.line else "") + ")"
    return f"your code raised {type(exc).__name__}: {exc}{where}"


# --------------------------------------------------------------------------- the result

_MARK = {True: "✓", False: "✗", None: "·"}   # passed, failed, not run


@dataclass
class CheckResult:
    """What ``check`` returns: ``.passed``, ``.score``, ``.max_score`` and a row per case (and structure check).

    A row is a dict: ``case`` (label with the seed), ``group`` (the label without it), ``seed``,
    ``kind`` ('values', 'structure' or 'skipped'), ``passed``, ``message`` (and for a wrong answer
    ``details``, a ``Mismatch``, and ``diagnosis``).  It shows as a table with one line per case
    and one column per seed; the first failing case is spelled out above it, with a heatmap.
    """

    name: str
    title: str
    rows: list = field(default_factory=list)
    hint: str = ""
    seconds: float = 0.0

    @property
    def score(self) -> int:
        return sum(bool(r["passed"]) for r in self.rows)

    @property
    def max_score(self) -> int:
        return len(self.rows)

    @property
    def passed(self) -> bool:
        return self.max_score > 0 and self.score == self.max_score

    @property
    def first_failure(self):
        return next((r for r in self.rows if not r["passed"]), None)

    def summary(self) -> str:
        return f"{self.name}: {self.score}/{self.max_score} {'PASSED' if self.passed else 'not yet'}"

    def to_dict(self) -> dict:
        first = self.first_failure
        return dict(name=self.name, title=self.title, score=self.score, max_score=self.max_score,
                    passed=self.passed, seconds=round(self.seconds, 3),
                    first_failure=None if first is None else dict(case=first["case"], message=first["message"],
                                                                  diagnosis=first.get("diagnosis", "")),
                    rows=[dict(case=r["case"], kind=r["kind"], passed=bool(r["passed"]), message=r["message"])
                          for r in self.rows])

    def _feedback_lines(self, r) -> list[str]:
        lines = [r["message"]]
        if r.get("diagnosis"):
            lines.append(f"Diagnosis: {r['diagnosis']}")
        if self.hint:
            lines.append(f"Hint: {self.hint}")
        return lines

    def _table(self):
        """(seeds, [(group, {seed: row}, first failing row or None)]) in the order the cases ran."""
        seeds, groups = [], {}
        for r in self.rows:
            seed = r.get("seed")
            if seed not in seeds:
                seeds.append(seed)
            groups.setdefault(r.get("group", r["case"]), {})[seed] = r
        table = []
        for by_seed in groups.values():
            failing = next((r for r in by_seed.values() if not r["passed"] and r["kind"] != "skipped"), None)
            shown = failing or next(iter(by_seed.values()))      # its label (shapes may differ by seed)
            table.append((shown.get("label", shown["case"]), by_seed, failing))
        return seeds, table

    @staticmethod
    def _state(row):
        return None if row is None or row["kind"] == "skipped" else bool(row["passed"])

    def __repr__(self) -> str:
        lines = [f"{self.summary()} — {self.title}"]
        first = self.first_failure
        if first is not None:
            lines.append(f"First failing case: {first['case']}")
            lines += [f"  {line}" for line in self._feedback_lines(first)]
        seeds, table = self._table()
        head = " ".join(f"s{s}" if s is not None else "  " for s in seeds)
        lines.append(f"  {head}  case")
        for group, by_seed, failing in table:
            marks = " ".join(f"{_MARK[self._state(by_seed.get(s))]:>2}" for s in seeds)
            lines.append(f"  {marks}  {group}" + (f" — {_brief(failing)}" if failing else ""))
        skipped = [r for r in self.rows if r["kind"] == "skipped"]
        if skipped:
            lines.append(f"  ({len(skipped)} row(s) {skipped[0]['message']})")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        esc = html.escape
        color = "#1a7f37" if self.passed else "#cf222e"
        out = [f"<div class='fa-lab-check'><p><b style='color:{color}'>{esc(self.title)}: "
               f"{self.score}/{self.max_score} {'passed' if self.passed else 'not yet'}</b> "
               f"<code style='color:#57606a'>{esc(self.name)}</code></p>"]
        first = self.first_failure
        if first is not None:
            out.append("<div style='border-left:3px solid #cf222e;padding-left:8px;margin-bottom:6px'>"
                       f"<b>First failing case:</b> <code>{esc(first['case'])}</code><br>")
            out.append("<br>".join(esc(line) for line in self._feedback_lines(first)))
            png = self._heatmap(first)
            if png:
                out.append(f"<br><img alt='expected vs got' src='data:image/png;base64,{png}'/>")
            out.append("</div>")
        seeds, table = self._table()
        cell = {True: "<td style='color:#1a7f37;text-align:center' title='passed'>✓</td>",
                None: "<td style='color:#8c959f;text-align:center' title='not run'>·</td>"}
        out.append("<table><tr>" + "".join(f"<th>seed&nbsp;{s}</th>" if s is not None else "<th></th>" for s in seeds)
                   + "<th style='text-align:left'>case</th><th style='text-align:left'>feedback</th></tr>")
        for group, by_seed, failing in table:
            tds = []
            for s in seeds:
                r = by_seed.get(s)
                state = self._state(r)
                tds.append(cell[state] if state is not False else
                           f"<td style='color:#cf222e;text-align:center' title='{esc(r['message'])}'>✗</td>")
            out.append("<tr>" + "".join(tds) + f"<td style='text-align:left'><code>{esc(group)}</code></td>"
                       f"<td style='text-align:left'>{esc(_brief(failing)) if failing else ''}</td></tr>")
        out.append("</table>")
        skipped = [r for r in self.rows if r["kind"] == "skipped"]
        if skipped:
            out.append(f"<p style='color:#57606a'>{len(skipped)} row(s) {esc(skipped[0]['message'])}</p>")
        out.append("</div>")
        return "".join(out)

    @staticmethod
    def _heatmap(row) -> str | None:
        details = row.get("details")
        if not isinstance(details, Mismatch):
            return None
        if "png" not in row:
            try:
                row["png"] = heatmap_png(details, title=f"{details.what} — {row['case']}")
            except Exception:  # a picture must never break the feedback
                row["png"] = None
        return row["png"]


def _brief(row, n: int = 140) -> str:
    """One line for the table: a wrong answer's summary, else the message, shortened."""
    details = row.get("details")
    msg = f"wrong answer: {details.summary}" if isinstance(details, Mismatch) and details.summary else row["message"]
    return msg if len(msg) <= n else msg[: n - 1] + "…"


# --------------------------------------------------------------------------- check

def plan(ex: Exercise, seeds=DEFAULT_SEEDS) -> list:
    """``[(seed, case, structure_checks)]``: every row ``check`` will score, known before anything runs."""
    return [(seed, case, [c for c in ex.structure if c.applies(case)])
            for seed in seeds for case in ex.make_cases(seed)]


def max_score(ex: Exercise, seeds=DEFAULT_SEEDS) -> int:
    return sum(1 + len(checks) for _, _, checks in plan(ex, seeds))


def _expected(ex: Exercise, case: Case):
    """(judge, native): the values to compare against, and the solution's output in the case's own dtypes."""
    args, kwargs = _prepare(ex, case)
    native = _outputs_of(ex, ex.solution(*args, **kwargs), args)
    if ex.judge_dtype is None:
        return native, native
    args, kwargs = _upcast(_prepare(ex, case), ex.judge_dtype)
    return _outputs_of(ex, ex.solution(*args, **kwargs), args), native


def _judge(ex: Exercise, got, judge, native, case: Case) -> None:
    if ex.compare is not None:
        _compare_tree(got, native, native, case, ex, values=False)  # shapes, dtypes, devices: for every exercise
        ex.compare(got, judge, case)
    else:
        _compare_tree(got, judge, native, case, ex)


def _match_mistake(ex: Exercise, got, case: Case, budget: float) -> str:
    """The known mistake the learner's output reproduces on this case, in words ('' if none)."""
    for m in ex.mistakes:
        try:
            args, kwargs = _prepare(ex, case)
            hooks = [PoisonEmpty()] if ex.poison_empty else []
            value = _call_with_timeout(m.fn, args, kwargs, min(budget, 10.0), hooks)
            _compare_tree(got, _outputs_of(ex, value, args), None, case, ex)
        except BaseException:  # noqa: BLE001 — no match (or the mistake itself failed): try the next one
            continue
        return f"your result matches a known mistake — {m.name}: {m.message}"
    return ""


def run_check(ex: Exercise, fn, *, seeds=DEFAULT_SEEDS, timeout: float = DEFAULT_TIMEOUT) -> CheckResult:
    t0 = time.monotonic()
    result = CheckResult(ex.name, f"Chapter {ex.chapter} · {ex.title}", hint=ex.hint)
    try:
        planned = plan(ex, seeds)
    except Exception as exc:  # noqa: BLE001 — the exercise's own case generator failed: say so, do not raise
        result.rows.append(dict(case="making the test cases", kind="values", passed=False,
                                message=f"internal error in exercise {ex.name!r} (not your code): {exc!r}"))
        return result
    stop = None if callable(fn) else (f"check needs the function you wrote, got {type(fn).__name__}: "
                                      f"check({ex.name!r}, my_function)")
    deadline = t0 + timeout
    diagnosed = 0
    position: dict = {}
    for seed, case, checks in planned:
        index = position[seed] = position.get(seed, -1) + 1   # the same case of another seed: same table line

        def add(kind, passed, message, check=None, **extra):
            suffix = f" · structure: {check.label}" if check is not None else ""
            result.rows.append(dict(case=f"{case.label} seed={seed}{suffix}", label=case.label + suffix,
                                    group=(index, suffix), seed=seed, kind=kind, passed=passed,
                                    message=message, **extra))

        if stop is not None:
            for c in [None] + checks:
                if result.rows:
                    add("skipped", False, f"not run: {stop}", c)
                else:
                    add("values", False, stop, c)
            continue
        try:
            judge, native = _expected(ex, case)
        except Exception as exc:  # noqa: BLE001
            for c in [None] + checks:
                add("values", False, f"internal error in exercise {ex.name!r} (not your code): {exc!r}", c)
            continue
        args, kwargs = _prepare(ex, case)
        monitors = [c.monitor(case, args, kwargs) for c in checks]
        hooks = ([PoisonEmpty()] if ex.poison_empty else []) + monitors
        returned = values_ok = False
        try:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"time limit of {timeout:.3g} s for the whole check used up")
            value = _call_with_timeout(fn, args, kwargs, remaining, hooks)
            returned = True
        except BaseException as exc:  # noqa: BLE001 — reported, never propagated into the notebook
            if isinstance(exc, KeyboardInterrupt):
                raise
            add("values", False, _describe_exception(exc))
            if isinstance(exc, (NotImplementedError, TimeoutError)):
                stop = "not implemented yet" if isinstance(exc, NotImplementedError) else "the time limit was reached"
        finally:
            for monitor in monitors:
                monitor.finish()
        if returned:
            got = _outputs_of(ex, value, args)
            try:
                _judge(ex, got, judge, native, case)
                values_ok = True
                add("values", True, "")
            except Exception as exc:  # noqa: BLE001 — AssertionError, or a custom compare choking on odd output
                text = str(exc) if isinstance(exc, AssertionError) else f"could not compare your result: {exc!r}"
                diagnosis = ""
                if ex.mistakes and diagnosed < 3 and deadline - time.monotonic() > 0:
                    diagnosed += 1
                    diagnosis = _match_mistake(ex, got, case, deadline - time.monotonic())
                add("values", False, f"wrong answer: {text}", details=exc if isinstance(exc, Mismatch) else None,
                    diagnosis=diagnosis)
        for c, monitor in zip(checks, monitors):
            if not returned:
                add("structure", False, "not judged: your function did not return", c)
                continue
            try:
                verdict = monitor.verdict()
            except Exception as exc:  # noqa: BLE001
                verdict = f"internal error in the structure check (not your code): {exc!r}"
            if verdict is None and not values_ok:  # structure only counts for a right answer
                verdict = "not judged: the values on this case are wrong (see the row above)"
            add("structure", verdict is None, verdict or "", c)
    result.seconds = time.monotonic() - t0
    return result
