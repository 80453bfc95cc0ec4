"""Whose code computed the answer: calls into finished implementations, and the kernels launched.

A kernel exercise is not passed by calling ``fa_lab.attention``, ``exercises.reference(...)``
or PyTorch's SDPA, and it is not passed without launching a kernel of the kind it teaches.
``CallWatch`` is a hook for ``guard.call_with_timeout``: it installs a profile function in the
thread that runs the learner's code (``sys.setprofile`` sees every Python call there; the other
events return at once), a torch function mode (PyTorch's attention functions, which are builtins)
and watches the PyTorch ops that thread runs (attention ops reached some other way).  The
profile function is installed wherever the learner's code runs in a process of the grader's own
(``isolate``) and in ``run_check``; a lambda or closure that ``check`` runs in the notebook's own
process is not profiled (a profiled thread there was seen to miss the exception that stops it when the user
presses stop), so its kernel row says to define the function at the top level.  Afterwards:

- ``forbidden``  what finished implementation was called, in words (None if none);
- ``launches``   ``{"triton": n, "numba": n}``: kernels launched whose Python source is the learner's.

A kernel's source is the learner's when it is not inside the ``fa_lab`` package, or when it is in
the file the checked function itself comes from (a model answer shipped in ``fa_lab/exercises``).
Numba's simulator runs a kernel's threads as other Python threads, which the profile function
does not see: the launch itself happens in the learner's thread and is what counts.
"""
from __future__ import annotations

import os
from pathlib import Path

from torch.overrides import TorchFunctionMode

from fa_lab.exercises.structure import StructureCheck

_FA_LAB = str(Path(__file__).resolve().parent.parent) + os.sep

#: fa_lab files a learner's function may run through (helpers, the grader's own hooks); the rest of
#: the package under these prefixes is a finished implementation or a solution
_FORBIDDEN_PREFIXES = ("api.py", "autograd.py", "kernels" + os.sep, os.path.join("core", "reference.py"),
                       os.path.join("exercises", "registry.py"), os.path.join("exercises", "ch"),
                       os.path.join("bench", "peers.py"))
_ALLOWED = (os.path.join("kernels", "numba", "bridge.py"),)

#: PyTorch's fused attention: the learner writes attention, not a call to it
_ATTENTION_OPS = ("scaled_dot_product", "_flash_attention", "_efficient_attention", "_cudnn_attention",
                  "flex_attention")

_IGNORE, _FORBIDDEN, _LAUNCH = 0, 1, 2


def _describe_fa_lab(filename: str, name: str) -> str:
    rel = filename[len(_FA_LAB):].replace(os.sep, "/")
    if rel.startswith("exercises/"):
        return f"the exercises' own solution ({rel[:-3].replace('/', '.')}.{name})"
    return f"fa_lab's finished implementation ({rel[:-3].replace('/', '.')}.{name})"


def _kernel_function(obj):
    """The Python function behind a Triton / Numba kernel object (None if there is none)."""
    for _ in range(4):
        if obj is None or hasattr(obj, "__code__"):
            return obj
        obj = getattr(obj, "py_func", None) or getattr(obj, "fn", None) or getattr(obj, "dispatcher", None)
    return None


class CallWatch:
    """Hook: records forbidden calls and the learner's kernel launches (see the module docstring)."""

    def __init__(self, own_files=(), trusted: bool = False, profile: bool = True):
        self.own_files = {os.path.realpath(f) for f in own_files if f}
        self.trusted = trusted          # the exercises' own model answers may use fa_lab's helpers
        # profile calls: in a process of the grader's own, or for trusted code; a learner's closure run in
        # the notebook's process is not profiled (a profiled thread there was seen to miss the exception
        # that stops it when the user presses stop)
        self.profiled = profile
        self.forbidden: str | None = None
        self.launches = {"triton": 0, "numba": 0}
        self._kind: dict = {}           # code object -> _IGNORE / _FORBIDDEN / _LAUNCH (+ which)

    # ---------------------------------------------------------------- classification, cached per code object
    def _classify(self, code):
        filename = code.co_filename
        if filename.startswith(_FA_LAB):
            rel = filename[len(_FA_LAB):]
            own = os.path.realpath(filename) in self.own_files
            if not own and not self.trusted and rel.startswith(_FORBIDDEN_PREFIXES) and not rel.startswith(_ALLOWED):
                return (_FORBIDDEN, _describe_fa_lab(filename, code.co_name))
            return (_IGNORE,)
        norm = filename.replace("\\", "/")
        if "/triton/runtime/" in norm and code.co_name in ("run", "__call__"):
            return (_LAUNCH, "triton")
        if "/numba/cuda/" in norm and code.co_name in ("__call__", "call") and (
                "simulator/kernel.py" in norm or norm.endswith("dispatcher.py")):
            return (_LAUNCH, "numba")
        if "flex_attention" in norm and not self.trusted:
            return (_FORBIDDEN, "PyTorch's FlexAttention")
        return (_IGNORE,)

    def _launch(self, kind: str, frame) -> None:
        fn = _kernel_function(frame.f_locals.get("self"))
        if fn is None:
            return
        filename = fn.__code__.co_filename
        if self.trusted or not filename.startswith(_FA_LAB) or os.path.realpath(filename) in self.own_files:
            self.launches[kind] += 1
        elif self.forbidden is None:
            self.forbidden = f"a kernel of fa_lab's ({_describe_fa_lab(filename, fn.__name__)})"

    # ---------------------------------------------------------------- hooks
    def trace(self, frame, event, arg):
        """``sys.setprofile`` function: acts on each Python call, returns at once for every other event."""
        if event == "call":
            code = frame.f_code
            kind = self._kind.get(code)
            if kind is None:
                kind = self._kind[code] = self._classify(code)
            if kind[0] == _FORBIDDEN and self.forbidden is None:
                self.forbidden = kind[1]
            elif kind[0] == _LAUNCH:
                self._launch(kind[1], frame)
        return None

    def context(self):
        """A torch function mode for the learner's thread: PyTorch's attention functions by name (they are
        builtins, which the trace function does not see)."""
        return _AttentionFunctions(self)

    def on_op(self, func, args, kwargs, out) -> None:
        if self.trusted or self.forbidden is not None:
            return
        name = str(getattr(func, "__name__", func))
        if any(op in name for op in _ATTENTION_OPS):
            self.forbidden = f"PyTorch's fused attention ({name})"

    def message(self) -> str | None:
        """Why the answer does not count, in words for the learner (None when it does)."""
        if self.forbidden is None:
            return None
        return (f"your function called {self.forbidden}: the exercise is to compute it yourself "
                "(fa_lab's implementations, exercises.reference and PyTorch's attention are off limits here)")

    def kernel_verdict(self, kind: str) -> str | None:
        """For a kernel exercise: None when a kernel of ``kind`` written by the learner was launched."""
        if self.forbidden is not None:
            return self.message()
        if not self.profiled:
            return ("not judged: define your function at the top level of a notebook cell, so that check() can "
                    "run it in a process of its own and see the kernels it launches")
        if self.launches.get(kind, 0) == 0:
            what = {"triton": "a Triton kernel (a @triton.jit function launched as kernel[grid](...))",
                    "numba": "a Numba CUDA kernel (a @cuda.jit function launched as kernel[blocks, threads](...))"}
            return f"no kernel of yours was launched: this exercise asks for {what[kind]}"
        return None


class _AttentionFunctions(TorchFunctionMode):
    def __init__(self, watch: CallWatch):
        super().__init__()
        self.watch = watch

    def __torch_function__(self, func, types, args=(), kwargs=None):
        watch = self.watch
        if not watch.trusted and watch.forbidden is None:
            name = getattr(func, "__name__", "")
            if "scaled_dot_product" in name or "multi_head_attention" in name:
                watch.forbidden = f"PyTorch's {name}"
        return func(*args, **(kwargs or {}))


class OwnKernel(StructureCheck):
    """The row a kernel exercise adds to every case: a kernel of the learner's, of the right kind, was launched.

    Planned like any structure check (so ``max_score`` counts it); its verdict comes from the
    ``CallWatch`` of the call, not from watching ops.
    """

    def __init__(self, kind: str):
        self.kind = kind
        self.label = f"your own {'Numba CUDA' if kind == 'numba' else kind.capitalize()} kernel"

    def applies(self, case) -> bool:
        return True


def own_file(fn) -> str | None:
    """The file ``fn`` was written in, when it is the learner's (outside the fa_lab package)."""
    code = getattr(fn, "__code__", None) or getattr(getattr(fn, "__call__", None), "__code__", None)
    if code is None:
        return None
    return None if code.co_filename.startswith(_FA_LAB) else code.co_filename


