"""The grader as a boundary: nothing the learner's code throws or returns reaches the notebook.

Exceptions whose ``__str__`` fails or hangs, ``SystemExit``, a ``KeyboardInterrupt`` raised by
the learner's code, the user pressing stop in the middle of a check, odd arguments to
``check``: each becomes a clear failing row, with the usual ``max_score``.  Right values in
the wrong type or dtype are named as such, never as a known mistake.
"""
import math
import signal
import threading
import time

import numpy as np
import pytest
import torch

import fa_lab  # noqa: F401  (chooses the world before anything imports numba/triton)
from fa_lab.exercises import check, get, max_score, reference, runner
from fa_lab.exercises.guard import THREAD_NAME, safe_text
from fa_lab.exercises.runner import run_check

SOFTMAX = "ch1_safe_softmax"   # one output tensor, known mistakes, quick
SEEDS = (0,)


def _no_check_thread_left(wait: float = 5.0) -> bool:
    deadline = time.monotonic() + wait
    while any(t.name == THREAD_NAME for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(t.name == THREAD_NAME for t in threading.enumerate())


class UnprintableError(Exception):
    def __str__(self):
        raise RuntimeError("no words")

    def __repr__(self):
        raise RuntimeError("no words either")


class ExitingStrError(Exception):
    def __str__(self):
        raise SystemExit(3)


class HangingStrError(Exception):
    def __str__(self):
        while True:
            pass


# --------------------------------------------------------------------------- what the learner's code throws

@pytest.mark.parametrize("error,shown", [(UnprintableError, "<UnprintableError that cannot be printed>"),
                                         (ExitingStrError, "ExitingStrError()")])
def test_exception_that_cannot_be_printed_is_reported(error, shown):
    def fn(s):
        raise error()
    result = check(SOFTMAX, fn, seeds=SEEDS)
    assert not result.passed and result.max_score == max_score(get(SOFTMAX), SEEDS)
    message = result.first_failure["message"]
    assert f"your code raised {error.__name__}: {shown}" in message, message
    repr(result), result._repr_html_()


def test_exception_whose_str_hangs_is_stopped():
    def fn(s):
        raise HangingStrError()
    t0 = time.monotonic()
    result = check(SOFTMAX, fn, seeds=SEEDS, timeout=0.5)
    assert time.monotonic() - t0 < 10
    assert not result.passed and "time limit" in result.first_failure["message"]
    assert _no_check_thread_left(), "the learner's thread was not stopped"


@pytest.mark.parametrize("raise_it,words", [
    (lambda: exec("import sys; sys.exit(3)"), "SystemExit"),
    (lambda: exec("raise SystemExit"), "SystemExit"),
    (lambda: exec("raise KeyboardInterrupt"), "KeyboardInterrupt (raised by your code itself"),
    (lambda: exec("raise GeneratorExit"), "GeneratorExit"),
])
def test_base_exceptions_from_learner_code_are_failures_not_exits(raise_it, words):
    def fn(s):
        raise_it()
    result = check(SOFTMAX, fn, seeds=(0, 1))
    assert not result.passed and not result.interrupted
    assert result.score == 0 and result.max_score == max_score(get(SOFTMAX), (0, 1))
    assert f"your code raised {words}" in result.first_failure["message"], result.first_failure["message"]
    assert all(r["kind"] == "values" for r in result.rows), "every case still runs"


def test_a_learner_timeout_error_is_the_learners():
    def fn(s):
        raise TimeoutError("my own")
    result = check(SOFTMAX, fn, seeds=(0, 1))
    assert "your code raised TimeoutError: my own" in result.first_failure["message"]
    assert not any(r["kind"] == "skipped" for r in result.rows), "not the grader's time limit"


# --------------------------------------------------------------------------- the user pressing stop

def test_keyboard_interrupt_during_a_check_marks_it_interrupted(monkeypatch):
    """The stop button while the second case runs: the first keeps its verdict, the rest are not run."""
    calls = []
    real = runner.call_with_timeout

    def interrupted_on_second(fn, args, kwargs, timeout, hooks=()):
        calls.append(fn)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(fn, args, kwargs, timeout, hooks)
    monkeypatch.setattr(runner, "call_with_timeout", interrupted_on_second)
    result = run_check(get(SOFTMAX), reference(SOFTMAX), seeds=(0, 1))
    assert result.interrupted and not result.passed
    assert result.max_score == max_score(get(SOFTMAX), (0, 1))
    assert result.rows[0]["passed"] and result.score == 1
    assert "interrupted" in result.rows[1]["message"] and result.rows[1]["kind"] == "values"
    assert all(r["kind"] == "skipped" and "interrupted" in r["message"] for r in result.rows[2:])
    assert len(calls) == 2, "nothing runs after the interrupt"
    assert "(interrupted)" in repr(result) and "(interrupted)" in result._repr_html_()
    assert result.to_dict()["interrupted"] is True


@pytest.fixture
def python_ctrl_c():
    """Python's own Ctrl-C handler, as a notebook's kernel has it (a test run started in the background, as in
    ``make test &``, ignores SIGINT), and the handler before it back afterwards."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs POSIX signals")
def test_sigint_to_the_notebook_stops_the_learners_thread_too(python_ctrl_c):
    """A real SIGINT to the main thread while it waits for the learner's code (as the stop button sends)."""
    main = threading.main_thread().ident

    def fn(s):
        signal.pthread_kill(main, signal.SIGINT)
        while True:
            pass
    t0 = time.monotonic()
    result = check(SOFTMAX, fn, seeds=(0, 1), timeout=30)
    assert time.monotonic() - t0 < 10
    assert result.interrupted and result.score == 0
    assert result.max_score == max_score(get(SOFTMAX), (0, 1))
    assert "interrupted" in result.first_failure["message"]
    assert _no_check_thread_left(), "the learner's thread was not stopped"


# --------------------------------------------------------------------------- odd results and arguments

class Hostile:
    """A result that breaks everything it is asked: equality, printing, truth."""

    def __eq__(self, other):
        raise UnprintableError()

    __ne__ = __eq__

    def __repr__(self):
        raise RuntimeError("no")

    def __bool__(self):
        raise RuntimeError("no")


def test_hostile_result_is_a_wrong_answer():
    result = check("ch6_tiled_forward_bytes", lambda *a, **kw: Hostile(), seeds=SEEDS)
    assert not result.passed and result.score == 0
    assert result.first_failure["message"].startswith("wrong answer")
    repr(result), result._repr_html_()


@pytest.mark.parametrize("name,kwargs,words", [
    (123, {}, "exercise name"),
    (["ch1_safe_softmax"], {}, "exercise name"),
    ("ch1_safe_softmax", dict(seeds=5), "seeds"),
    ("ch1_safe_softmax", dict(seeds=()), "seeds"),
    ("ch1_safe_softmax", dict(seeds=(0.5,)), "seeds"),
    ("ch1_safe_softmax", dict(timeout="soon"), "timeout"),
    ("ch1_safe_softmax", dict(timeout=-1), "timeout"),
    ("ch1_safe_softmax", dict(timeout=math.nan), "timeout"),
])
def test_odd_arguments_to_check_are_reported(name, kwargs, words):
    result = check(name, reference(SOFTMAX), **kwargs)
    assert not result.passed
    assert words in result.first_failure["message"] + result.first_failure["case"]


def test_unbounded_timeout_is_accepted():
    assert run_check(get(SOFTMAX), reference(SOFTMAX), seeds=SEEDS, timeout=math.inf).passed


def test_safe_text_never_raises():
    assert safe_text(UnprintableError()) == "<UnprintableError that cannot be printed>"
    assert safe_text("x" * 5000, limit=10) == "x" * 9 + "…"


# --------------------------------------------------------------------------- right values, wrong type

def _mapped(fn, f):
    def wrapped(*args, **kwargs):
        out = fn(*args, **kwargs)
        return type(out)(f(t) for t in out) if isinstance(out, (tuple, list)) else f(out)
    return wrapped


@pytest.mark.parametrize("name,how,words", [
    (SOFTMAX, "numpy", "result is a NumPy array of float32 where a torch.Tensor of torch.float32 on cpu is expected"),
    (SOFTMAX, "float64", "result has dtype torch.float64 where torch.float32 is expected"),
    ("ch1_causal_mask", "float32", "mask has dtype torch.float32 where torch.bool is expected"),
    ("ch2_merge_states", "float64", "l has dtype torch.float64 where torch.float32 is expected"),
    ("ch4_key_block_ranges", "float", "lo is a float where an int is expected"),
    ("ch4_key_block_ranges", "numpy", "hi is a NumPy int64 where an int is expected"),
    ("ch6_tiled_forward_bytes", "tensor", "bytes is a torch.Tensor of torch.int64 on cpu where an int is expected"),
])
def test_right_values_in_the_wrong_type_are_named(name, how, words):
    convert = {"numpy": lambda t: t.numpy() if isinstance(t, torch.Tensor) else np.int64(t),
               "float64": lambda t: t.double(), "float32": lambda t: t.float(), "float": float,
               "tensor": torch.tensor}[how]
    result = run_check(get(name), _mapped(reference(name), convert), seeds=(0, 1), trusted=True)
    assert result.score == 0 and result.max_score == max_score(get(name), (0, 1))
    diagnoses = [r.get("diagnosis", "") for r in result.rows if r["kind"] == "values"]
    assert all(d.startswith("the values are right, but") for d in diagnoses), diagnoses
    assert words in diagnoses[0], diagnoses[0]
    assert not any("known mistake" in d for d in diagnoses)


def test_wrong_values_in_the_wrong_type_get_no_such_diagnosis():
    result = check(SOFTMAX, lambda s: (2 * torch.softmax(s, dim=-1)).numpy(), seeds=SEEDS)
    assert not result.passed
    assert not any("values are right" in r.get("diagnosis", "") for r in result.rows)
