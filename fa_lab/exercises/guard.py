"""Calling the learner's code without letting it take the notebook down.

The learner's function runs in a daemon thread, under the structure watchers, with a time
limit.  Whatever it throws (any ``BaseException``: a ``SystemExit``, a ``KeyboardInterrupt``
it raises itself, an exception whose ``__str__`` fails) comes back as a ``LearnerError``
holding the exception and its text, rendered in that thread under the same time limit, so
that nothing the learner's objects do runs unguarded in the grader's thread.  A hang becomes
``TimeLimitReached``; the user pressing stop is the only ``KeyboardInterrupt`` that leaves
``call_with_timeout``, after the learner's thread has been told to stop.
"""
from __future__ import annotations

import contextlib
import ctypes
import sys
import threading
import traceback
from typing import Any

from fa_lab.exercises.structure import Watch

THREAD_NAME = "fa_lab-check"


class _StopLearnerCode(BaseException):
    """Injected into the learner's thread when it runs past the time limit (not an Exception: not caught by
    an ``except Exception`` in the learner's code)."""


class TimeLimitReached(TimeoutError):
    """The grader's own time limit (a ``TimeoutError`` the learner's code raises is a ``LearnerError``)."""


class LearnerError(Exception):
    """The learner's code raised ``error``; ``text`` is its message, or a stand-in when it has none."""

    def __init__(self, error: BaseException, text: str):
        super().__init__(text)
        self.error = error
        self.text = text


def safe_text(obj, render=str, limit: int = 10_000) -> str:
    """``render(obj)`` shortened to ``limit`` characters; a stand-in when rendering fails (learner objects)."""
    for how in (render, repr):
        try:
            text = how(obj)
        except _StopLearnerCode:
            raise
        except KeyboardInterrupt:
            if threading.current_thread() is threading.main_thread():   # the user's stop button
                raise
            continue
        except BaseException:  # noqa: BLE001 — a broken __str__/__repr__ is the learner's, never the grader's
            continue
        if isinstance(text, str):
            return text if len(text) <= limit else text[: limit - 1] + "…"
    try:
        kind = type(obj).__name__
    except BaseException:  # noqa: BLE001
        kind = "object"
    return f"<{kind} that cannot be printed>"


def _stop(thread: threading.Thread) -> None:
    if thread.ident is not None and thread.is_alive():
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(_StopLearnerCode))


def call_with_timeout(fn, args, kwargs, timeout: float, hooks=()):
    """``fn(*args, **kwargs)`` in a daemon thread, under the structure watchers ``hooks``.

    Raises ``LearnerError`` for anything the call throws and ``TimeLimitReached`` when it
    does not return within ``timeout`` seconds: the thread is then stopped (an exception is
    raised inside it at the next Python bytecode); code stuck inside one long C call
    finishes that call first.
    """
    box: dict[str, Any] = {}

    tracer = next((h.trace for h in hooks if getattr(h, "profiled", False)), None)

    def target():
        try:
            if tracer is not None:     # sees every Python call this thread makes (callwatch.CallWatch)
                sys.setprofile(tracer)
            try:
                with contextlib.ExitStack() as stack:
                    for hook in hooks:
                        if hasattr(hook, "context"):
                            stack.enter_context(hook.context())
                    if hooks:
                        stack.enter_context(Watch(hooks))
                    box["value"] = fn(*args, **kwargs)
            finally:
                sys.setprofile(None)
        except _StopLearnerCode:
            box["stopped"] = True
        except BaseException as exc:  # noqa: BLE001 — anything the learner's code throws is reported
            box["error"] = exc
            try:
                box["text"] = safe_text(exc)     # here, under the time limit: a __str__ may hang
            except _StopLearnerCode:
                box["stopped"] = True

    t = threading.Thread(target=target, daemon=True, name=THREAD_NAME)
    try:
        t.start()
        t.join(min(max(timeout, 0.0), threading.TIMEOUT_MAX))
    except KeyboardInterrupt:      # the user pressed stop: stop the learner's code too, and let it through
        _stop(t)
        raise
    if t.is_alive():
        _stop(t)
        t.join(2.0)
        tail = (" (it is still busy in the background; restart the kernel if the notebook gets slow)"
                if t.is_alive() else "")
        raise TimeLimitReached(f"no answer within the time limit ({timeout:.3g} s left of the check's budget): "
                               f"an infinite loop? a Python loop over far too many elements?{tail}")
    if "error" in box:
        if "text" not in box:      # the time limit struck while the message was being written
            raise TimeLimitReached("no answer within the time limit: printing the exception your code raised "
                                   "did not finish")
        raise LearnerError(box["error"], box["text"])
    return box.get("value")


_WHAT_IT_MEANS = {
    SystemExit: "SystemExit (sys.exit() or exit() in a function ends nothing here: return a result instead)",
    KeyboardInterrupt: "KeyboardInterrupt (raised by your code itself, not by the stop button)",
}


def describe_exception(exc: BaseException) -> str:
    """One line for the learner: what went wrong, and where in their code."""
    if isinstance(exc, TimeLimitReached):
        return str(exc)
    error, text = (exc.error, exc.text) if isinstance(exc, LearnerError) else (exc, safe_text(exc))
    if isinstance(error, NotImplementedError):
        return "not implemented yet: replace the `raise NotImplementedError` with your code"
    try:
        tb = traceback.extract_tb(error.__traceback__)
        mine = [f for f in tb if "/fa_lab/" not in f.filename.replace("\\", "/")
                and "threading.py" not in f.filename]
    except Exception:  # noqa: BLE001 — a mangled traceback: say what was raised, without the place
        mine = []
    where = ""
    if mine:
        f = mine[-1]
        where = f" (in {f.name}, line {f.lineno}" + (f": {f.line.strip()}" if f.line else "") + ")"
    kind = next((words for cls, words in _WHAT_IT_MEANS.items() if type(error) is cls), type(error).__name__)
    return f"your code raised {kind}: {text}{where}" if text else f"your code raised {kind}{where}"
