"""Running the learner's code in a fresh process: what it prints, raises or patches stays there.

``Isolated`` is a caller for ``runner.run_check``: it starts one process per check, loads the
learner's program there (``program.load``: the notebook's definitions only) or imports a
function by name, and sends it the cases one at a time.  The child calls the function under
the structure watchers (``runner.call_case``) and sends back what it returned — tensors,
NumPy arrays, numbers, tuples; any other object only as its type and text — which this
process unpacks with ``torch.load(weights_only=True)`` (nothing the learner built is
unpickled here) and judges.  So a patched judge, a patched result class or a forged log in
the learner's process changes nothing, and a hang that holds the GIL (an ``@njit`` infinite
loop) or a crash in compiled code ends that process, not the notebook or the grader.

Processes come from a fork server that has imported torch, NumPy, Numba and Triton once, so
a check starts in a fraction of a second; it never imports fa_lab (which asks CUDA about its
devices), so a child may use the GPU.
"""
from __future__ import annotations

import importlib
import io
import multiprocessing
import sys
import time

import torch

from fa_lab.exercises import program as learner_program
from fa_lab.exercises.guard import TimeLimitReached, describe_exception, safe_text
from fa_lab.exercises.registry import Case, Exercise, get, load
from fa_lab.exercises.runner import CallReport, OwnKernel, call_case

#: seconds a fresh process may take to import and load the learner's program (not the check's budget)
STARTUP_TIMEOUT = 120.0
#: seconds past the check's own deadline before the child is stopped (it reports its own time limit first)
MARGIN = 3.0
#: largest answer a child may send back
MAX_MESSAGE = 1 << 31

_PRELOAD = ["torch", "numpy", "numba", "numba.cuda", "triton", "triton.language"]
_context = None


def context():
    """The multiprocessing context children start from (a fork server where the platform has one)."""
    global _context
    if _context is None:
        if "forkserver" in multiprocessing.get_all_start_methods():
            _context = multiprocessing.get_context("forkserver")
            _context.set_forkserver_preload(_PRELOAD)
        else:
            _context = multiprocessing.get_context("spawn")
    return _context


# --------------------------------------------------------------------------- what crosses the boundary

def _pack(x, depth: int = 0):
    """The learner's value as tensors and plain data only (see the module docstring)."""
    if depth > 8:
        return ("obj", "object", "nested too deeply")
    if isinstance(x, torch.Tensor):
        t = torch.Tensor.detach(x)
        return ("tensor", t.to("cpu", copy=True) if t.device.type != "meta" else torch.empty(0), str(t.device),
                type(x).__name__)
    kind = type(x)
    if kind.__module__.split(".")[0] == "numpy":
        import numpy as np

        if isinstance(x, np.ndarray) and x.dtype.kind in "biuf":
            return ("ndarray", torch.from_numpy(np.ascontiguousarray(x).copy()))
        if isinstance(x, np.generic) and x.dtype.kind in "biuf":
            return ("npscalar", x.item(), str(x.dtype))
    if kind in (bool, int, float, str, type(None)):
        return ("py", x)
    if kind in (tuple, list):
        return (kind.__name__, [_pack(i, depth + 1) for i in x])
    if kind is range:
        return ("range", x.start, x.stop, x.step)
    return ("obj", safe_text(kind.__name__, str, 60), safe_text(x, repr, 300))


class StandIn:
    """Something the learner's function returned that is neither a tensor nor plain data."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _unpack(x):
    tag = x[0]
    if tag == "tensor":
        t, device = x[1], x[2]
        try:
            return t.to(device) if device != "cpu" else t
        except (RuntimeError, AssertionError):   # a device this process does not have
            return t
    if tag == "ndarray":
        return x[1].numpy()
    if tag == "npscalar":
        import numpy as np

        return np.dtype(x[2]).type(x[1])
    if tag == "py":
        return x[1]
    if tag == "range":
        return range(x[1], x[2], x[3])
    if tag in ("tuple", "list"):
        items = [_unpack(i) for i in x[1]]
        return tuple(items) if tag == "tuple" else items
    cls = type(str(x[1]).isidentifier() and str(x[1]) or "object", (StandIn,), {})
    return cls(str(x[2]))


def _dumps(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _report_message(report: CallReport) -> bytes:
    fields = dict(returned=report.returned, error=report.error, stop=report.stop, verdicts=list(report.verdicts),
                  forbidden=report.forbidden, mutated=list(report.mutated), output=report.output)
    return _dumps(dict(fields=fields, value=_pack(report.value)))


def _read_report(data: bytes) -> CallReport:
    msg = torch.load(io.BytesIO(data), weights_only=True)
    fields = msg["fields"]
    report = CallReport(**{k: fields[k] for k in ("returned", "error", "stop", "forbidden", "output")})
    report.verdicts = [v if v is None else str(v) for v in fields["verdicts"]]
    report.mutated = [str(m) for m in fields["mutated"]]
    report.value = _unpack(msg["value"])
    return report


# --------------------------------------------------------------------------- the child

def resolve(module: str, qualname: str):
    """The object ``module.qualname`` names (imports ``module``; raises what the import or lookup raises)."""
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _is_exercise_answer(fn) -> bool:
    return any(fn is ex.solution or fn is ex.model_answer for ex in load().values())


def _child(conn, spec: dict) -> None:
    """The process that runs the learner's code: load it, then answer case after case."""
    printed = io.StringIO()
    sys.stdout = sys.stderr = printed
    try:
        import fa_lab  # noqa: F401 — the world (simulator / interpreter switches) before any learner import

        ex = get(spec["exercise"])
        own_files = []
        if spec.get("ref"):
            fn = resolve(*spec["ref"])
        else:
            namespace, filename = learner_program.load(spec["program"])
            own_files = [filename]
            if spec["fn_name"] not in namespace:
                raise LookupError(f"your notebook defines no top-level function named {spec['fn_name']!r} "
                                  "(the grader takes the notebook's imports, def/class statements and "
                                  "NAME = ... assignments)")
            fn = namespace[spec["fn_name"]]
        trusted = bool(spec.get("trusted"))
        if not trusted and _is_exercise_answer(fn):
            raise PermissionError("this is the exercise's own solution (exercises.reference), not a function you "
                                  "wrote")
        if not callable(fn):
            raise TypeError(f"{spec.get('fn_name') or 'it'} is a {type(fn).__name__}, not a function")
    except BaseException as exc:  # noqa: BLE001 — anything loading the learner's program does is reported
        text = describe_exception(exc) if not isinstance(exc, (LookupError, PermissionError, TypeError)) \
            else safe_text(exc)
        conn.send_bytes(_dumps(dict(ready=False, error=text, output=printed.getvalue())))
        return
    conn.send_bytes(_dumps(dict(ready=True, output=printed.getvalue())))
    printed.seek(0)
    printed.truncate()
    while True:
        try:
            msg = torch.load(io.BytesIO(conn.recv_bytes()), weights_only=False)   # from the grader: trusted
        except EOFError:
            return
        if msg is None:
            return
        case = msg["case"]
        checks = [ex.structure[i] for i in msg["checks"]] + ([OwnKernel(ex.kind)] if msg["own_kernel"] else [])
        report = call_case(ex, fn, case, checks, msg["remaining"], own_files=own_files, trusted=trusted)
        report.output = printed.getvalue()
        printed.seek(0)
        printed.truncate()
        conn.send_bytes(_report_message(report))


# --------------------------------------------------------------------------- the grader's side

class Isolated:
    """A caller for ``runner.run_check`` that runs the learner's function in a fresh process.

    Give either ``program`` (source, from ``program.extract``) and ``fn_name``, or ``ref``
    ``(module, qualname)`` of an importable function.  ``trusted`` lets the function use
    fa_lab's finished implementations (the exercises' own model answers).
    """

    def __init__(self, ex: Exercise, *, program: str | None = None, fn_name: str | None = None, ref=None,
                 trusted: bool = False):
        self.ex = ex
        spec = dict(exercise=ex.name, program=program, fn_name=fn_name, ref=ref, trusted=trusted)
        ctx = context()
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=_child, args=(child_conn, spec), daemon=True, name="fa_lab-learner")
        self.process.start()
        child_conn.close()
        self.ready: bool | None = None
        self.failure: str | None = None       # why no further case can run

    def _receive(self, seconds: float) -> bytes:
        if not self.conn.poll(max(seconds, 0.0)):
            raise TimeLimitReached("no answer within the time limit")
        return self.conn.recv_bytes(MAX_MESSAGE)

    def _ended(self) -> str:
        self.process.join(2.0)
        code = self.process.exitcode
        return (f"the process running your code ended abruptly (exit code {code}): a crash in compiled code, "
                "os._exit()/sys.exit() at the top of a cell, or running out of memory")

    def _start(self) -> None:
        try:
            msg = torch.load(io.BytesIO(self._receive(STARTUP_TIMEOUT)), weights_only=True)
        except TimeLimitReached:
            self.kill()
            self.failure = f"loading your notebook's code took longer than {STARTUP_TIMEOUT:.0f} s"
            return
        except (EOFError, OSError):
            self.failure = self._ended()
            return
        self.ready = bool(msg["ready"])
        self.printed = str(msg.get("output") or "")
        if not self.ready:
            self.failure = f"your code could not be loaded: {msg['error']}"

    def call(self, case: Case, checks: list, remaining: float) -> CallReport:
        try:
            if self.ready is None and self.failure is None:
                self._start()
            if self.failure is not None:
                return CallReport(error=self.failure, stop=self.failure, output=self._take_printed())
            own = any(isinstance(c, OwnKernel) for c in checks)
            idx = [self.ex.structure.index(c) for c in checks if not isinstance(c, OwnKernel)]
            if remaining <= 0:
                return CallReport(error="time limit for the whole check used up", stop="the time limit was reached")
            self.conn.send_bytes(_dumps(dict(case=case, checks=idx, own_kernel=own, remaining=remaining)))
            t0 = time.monotonic()
            try:
                data = self._receive(remaining + MARGIN)
            except TimeLimitReached:
                self.kill()
                self.failure = "the time limit was reached"
                return CallReport(error=f"no answer within the time limit ({remaining:.3g} s left of the check's "
                                        f"budget; after {time.monotonic() - t0:.3g} s the process running your code "
                                        "was stopped): an infinite loop? a compiled (@njit) loop that never ends?",
                                  stop=self.failure)
            except (EOFError, OSError):
                self.failure = self._ended()
                return CallReport(error=self.failure, stop=self.failure)
            report = _read_report(data)
            report.output = self._take_printed() + report.output
            return report
        except KeyboardInterrupt:     # the stop button: the learner's process goes too
            self.kill()
            raise

    def _take_printed(self) -> str:
        text, self.printed = getattr(self, "printed", ""), ""
        return text

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5.0)

    def close(self) -> None:
        try:
            if self.process.is_alive() and self.failure is None and self.ready:
                self.conn.send_bytes(_dumps(None))
                self.process.join(2.0)
        except (OSError, EOFError, BrokenPipeError):
            pass
        self.kill()
        self.conn.close()
