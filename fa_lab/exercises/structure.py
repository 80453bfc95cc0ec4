"""Structure checks: not only *what* the learner's function returns, but *how* it got there.

An exercise about tiling is not passed by code that builds the full (Nq, Nk) score
matrix and calls softmax; "one pass over the keys" is not passed by two.  These checks
watch every PyTorch op the learner's code runs (a ``TorchDispatchMode``, entered in the
thread that runs the learner's code) and judge afterwards:

- ``NoQuadraticBuffer``  no intermediate with Nq·Nk or more elements (S, P or a full mask);
- ``ReadBudget``         each element of the named inputs is read at most ``budget`` times
                         (views and slices are free; an op that reads a view pays its size);
- ``SimLoadBudget``      the same for a Numba kernel in the CUDA simulator: scalar loads from
                         device arrays, per element of the named inputs;
- ``PoisonEmpty``        always on: ``torch.empty``-style buffers come back filled with NaN,
                         so a row the learner never writes shows up as NaN instead of as
                         whatever zeros the allocator happened to return;
- ``TritonDotCount``     the ``tl.dot`` calls the Triton interpreter runs (a chapter's check
                         turns them into the key tiles a kernel computed);
- ``DescriptorsOnly``    every global load and store of the learner's Triton kernel goes through a
                         tensor descriptor, none through a pointer (``TritonMemoryOps`` counts them as
                         the interpreter runs them, ``CompiledMemoryOps`` in the compiled code on a
                         GPU; the counters patch Triton's classes through ``ClassPatch``).

A check applies to the cases whose ``meta`` has ``structure=True`` (large enough that a
tile is clearly smaller than Nq·Nk), unless it overrides ``applies``.  Kernel-style
exercises that write into output arguments get those poisoned by ``judge.prepare_args``
(``Exercise.out_args``); NumPy code, and Numba code outside the simulator, is not seen.
"""
from __future__ import annotations

import re

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten

#: allocation ops whose contents are undefined; PoisonEmpty fills their results
_EMPTY_OPS = {aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default,
              aten.new_empty.default, aten.new_empty_strided.default}


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` with a value no correct kernel writes: NaN for floats, a sentinel for integers."""
    if t.is_floating_point() or t.is_complex():
        return t.fill_(float("nan"))
    if t.dtype == torch.bool:
        return t.fill_(True)
    return t.fill_(torch.iinfo(t.dtype).min)


def _storage_key(t: torch.Tensor):
    try:
        return (t.device, t.untyped_storage().data_ptr())
    except Exception:  # meta / sparse / functional tensors: no storage to compare
        return None


def _tensors(tree):
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


class Watch(TorchDispatchMode):
    """Run every op, then show it to each hook: ``hook.on_op(func, args, kwargs, out)``."""

    def __init__(self, hooks):
        super().__init__()
        self.hooks = list(hooks)

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # True (torch's default) wraps __torch_dispatch__ in torch._dynamo.disable, which imports
        # torch._dynamo: ~3 s in every fresh kernel, for learner code that is never compiled here.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        for hook in self.hooks:
            hook.on_op(func, args, kwargs, out)
        return out


class PoisonEmpty:
    """Hook: uninitialised allocations come back full of NaN (always on unless an exercise opts out)."""

    def __init__(self):
        self.count = 0

    def on_op(self, func, args, kwargs, out):
        if func in _EMPTY_OPS and isinstance(out, torch.Tensor) and out.device.type != "meta":
            poison_(out)
            self.count += 1


class StructureCheck:
    """Base class.  Subclasses set ``label`` and implement ``start`` / ``on_op`` / ``verdict``."""

    label = "structure"

    def applies(self, case) -> bool:
        return bool(case.meta.get("structure"))

    def monitor(self, case, args, kwargs) -> "StructureCheck":
        """A fresh watcher for one call (checks are declared once per exercise)."""
        import copy

        m = copy.copy(self)
        m.start(case, args, kwargs)
        return m

    def start(self, case, args, kwargs) -> None:
        pass

    def on_op(self, func, args, kwargs, out) -> None:
        pass

    def finish(self) -> None:
        """Called after the learner's call however it ended (returned, raised, timed out)."""

    def verdict(self) -> str | None:
        """None if the structure is right, else what is wrong, in words for the learner."""
        return None


class NoQuadraticBuffer(StructureCheck):
    """No intermediate with ``Nq * Nk`` elements or more (``meta['n_q']``, ``meta['n_k']``)."""

    label = "no Nq×Nk buffer"

    def start(self, case, args, kwargs):
        self.n_q, self.n_k = case.meta["n_q"], case.meta["n_k"]
        self.limit = self.n_q * self.n_k
        self.inputs = {_storage_key(t) for t in _tensors((args, kwargs))}
        self.offender = None

    def on_op(self, func, args, kwargs, out):
        if self.offender is not None:
            return
        in_keys = {_storage_key(t) for t in _tensors((args, kwargs))}
        for t in _tensors(out):
            key = _storage_key(t)
            if t.numel() >= self.limit and key not in in_keys and key not in self.inputs:
                self.offender = (str(func.overloadpacket.__name__), tuple(t.shape), t.dtype)
                return

    def verdict(self):
        if self.offender is None:
            return None
        op, shape, dtype = self.offender
        return (f"your code built a tensor of shape {shape} ({str(dtype).replace('torch.', '')}, made by {op}) — "
                f"as large as the whole Nq×Nk = {self.n_q}×{self.n_k} score matrix. A tiled / online algorithm only "
                "ever holds one tile of S at a time (and builds a tile's mask from index arithmetic).")


class ReadBudget(StructureCheck):
    """Each element of the watched arguments is read at most ``budget`` times.

    ``args`` names positional arguments by index, e.g. ``{1: "K", 2: "V"}``.  Taking a view
    or a slice is free; an op that reads a tensor pays its number of elements once.
    """

    def __init__(self, args: dict, budget: float = 1.0, why: str = ""):
        self.watch_args = dict(args)
        self.budget = budget
        self.why = why
        self.label = f"reads of {', '.join(self.watch_args.values())} ≤ {budget:g} per element"

    def start(self, case, args, kwargs):
        self.targets = {}
        for i, name in self.watch_args.items():
            if i < len(args) and isinstance(args[i], torch.Tensor):
                key = _storage_key(args[i])
                if key is not None:
                    self.targets[key] = [name, args[i].numel(), 0]

    def on_op(self, func, args, kwargs, out):
        out_keys = {_storage_key(t) for t in _tensors(out)}
        for t in _tensors((args, kwargs)):
            key = _storage_key(t)
            if key in self.targets and key not in out_keys:   # a view of its input reads nothing
                self.targets[key][2] += t.numel()

    def verdict(self):
        over = [(name, reads / max(n, 1)) for name, n, reads in self.targets.values()
                if reads > self.budget * n + 1e-9]
        if not over:
            return None
        said = ", ".join(f"{name} {per:.3g}×" for name, per in over)
        return (f"each element was read too many times ({said}; budget {self.budget:g}×). "
                + (self.why or "Load each tile once and reuse it while it is in fast memory."))


class SimLoadBudget(StructureCheck):
    """Numba CUDA simulator: global-memory loads per element of the named inputs within a budget.

    Every scalar a kernel reads from a device array (``K[j, d]``) is one load; it is charged to
    the array the simulator copied to the "device", which is matched to an input by its contents
    (so ``cuda.to_device(k.numpy())`` and passing ``k.numpy()`` to the launch both count).  Only in
    the CPU world: on a real GPU (``fa_lab.ON_GPU``) it does not apply and is not scored.
    ``args`` names positional arguments by index, e.g. ``{1: "K", 2: "V"}``.
    """

    def __init__(self, args: dict, budget: float, why: str = ""):
        self.watch_args = dict(args)
        self.budget = budget
        self.why = why
        self.label = f"global loads of {', '.join(self.watch_args.values())} ≤ {budget:g} per element (simulator)"

    def applies(self, case) -> bool:
        from fa_lab.core.world import ON_GPU

        return not ON_GPU and super().applies(case)

    def start(self, case, args, kwargs):
        import threading

        from numba.cuda.simulator.cudadrv.devicearray import FakeWithinKernelCUDAArray

        self.watched = {name: args[i].detach().cpu().numpy() for i, name in self.watch_args.items()
                        if i < len(args) and isinstance(args[i], torch.Tensor)}
        self.loads = {}          # id(root array) -> [root array, scalar loads]
        lock = threading.Lock()  # the simulator runs each CUDA thread as a Python thread
        cls, original = FakeWithinKernelCUDAArray, FakeWithinKernelCUDAArray.__getitem__
        loads = self.loads

        def counting_getitem(arr, idx):
            out = original(arr, idx)
            if not isinstance(out, FakeWithinKernelCUDAArray):   # a scalar: one load (a view loads nothing)
                root = arr._item._ary
                while getattr(root, "base", None) is not None and hasattr(root.base, "shape"):
                    root = root.base
                with lock:
                    entry = loads.setdefault(id(root), [root, 0])
                    entry[1] += 1
            return out

        cls.__getitem__ = counting_getitem
        self._restore = (cls, original)

    def finish(self):
        restore = getattr(self, "_restore", None)
        if restore is not None:
            cls, original = restore
            cls.__getitem__ = original
            self._restore = None

    def verdict(self):
        import numpy as np

        self.finish()
        over = []
        for name, host in self.watched.items():
            n = 0
            for root, count in self.loads.values():
                if root.shape == host.shape and np.array_equal(np.asarray(root, dtype=np.float64),
                                                               host.astype(np.float64), equal_nan=True):
                    n += count
            if n > self.budget * host.size + 1e-9:
                over.append(f"{name} {n / max(host.size, 1):.3g}×")
        if not over:
            return None
        return (f"too many global-memory loads per element ({', '.join(over)}; budget {self.budget:g}×). "
                + (self.why or "Stage each tile in shared memory once and reuse it from there."))


class ClassPatch:
    """Wraps methods of one of Triton's classes (``target()``) while active: ``_wrap(name, make)`` replaces
    ``target().name`` by ``make(original)``; ``stop()`` puts every original back (or use ``with``).

    The patch runs inside the learner's call, so it lives here: the call watch reads code of this
    module as the checks' own instrumentation, and code of an exercise's module as its solution.
    """

    def __init__(self):
        self._originals = {}

    @staticmethod
    def target() -> type:
        raise NotImplementedError

    def _wrap(self, name: str, make) -> None:
        cls = self.target()
        original = getattr(cls, name, None)
        if original is not None:   # a method this Triton release does not have counts nothing
            self._originals[name] = original
            setattr(cls, name, make(original))

    def stop(self) -> None:
        for name, original in self._originals.items():
            setattr(self.target(), name, original)
        self._originals = {}

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class InterpreterPatch(ClassPatch):
    """A ``ClassPatch`` of the Triton interpreter's builder (the CPU world's ``tl`` operations)."""

    @staticmethod
    def target() -> type:
        from triton.runtime.interpreter import InterpreterBuilder

        return InterpreterBuilder


class TritonDotCount(InterpreterPatch):
    """Triton interpreter: counts the ``tl.dot`` calls run while it is active (``count``) and keeps the
    operand shapes of the first one (``first``: ``(a.shape, b.shape)``, None until a dot runs)."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.first = None

    def start(self) -> "TritonDotCount":
        def make(original):
            def counting_dot(builder, a, b, *rest):
                if self.first is None:
                    self.first = (a.data.shape, b.data.shape)
                self.count += 1
                return original(builder, a, b, *rest)
            return counting_dot

        self._wrap("create_dot", make)
        return self


class TritonMemoryOps(InterpreterPatch):
    """Triton interpreter: counts the global loads and stores run while it is active, through pointers
    (``pointer``: ``tl.load``, ``tl.store``) and through tensor descriptors (``descriptor``).

    A descriptor's own copy may be carried out by the interpreter's pointer operations: those are not
    counted twice.
    """

    POINTER = ("create_load", "create_masked_load", "create_store", "create_masked_store")
    DESCRIPTOR = ("create_descriptor_load", "create_descriptor_store")

    def __init__(self):
        super().__init__()
        self.pointer = 0
        self.descriptor = 0
        self._depth = 0

    def start(self) -> "TritonMemoryOps":
        def make(descriptor):
            def wrap(original):
                def counted(builder, *args, **kwargs):
                    if self._depth == 0:
                        if descriptor:
                            self.descriptor += 1
                        else:
                            self.pointer += 1
                    self._depth += descriptor
                    try:
                        return original(builder, *args, **kwargs)
                    finally:
                        self._depth -= descriptor
                return counted
            return wrap

        for name in self.POINTER + self.DESCRIPTOR:
            self._wrap(name, make(name in self.DESCRIPTOR))
        return self


class CompiledMemoryOps(ClassPatch):
    """On a GPU: the global loads and stores in the compiled code (Triton IR) of every kernel launched
    while it is active, through pointers (``pointer``: ``tt.load``, ``tt.store``) and through tensor
    descriptors (``descriptor``).  Counted once per load or store in the code, not per execution: the
    interpreter's count (``TritonMemoryOps``) needs the CPU world.

    It wraps ``JITFunction.run``, which compiles (or finds in its cache) and launches a kernel and
    returns the compiled kernel, whose ``asm["ttir"]`` is the IR.
    """

    POINTER = re.compile(r"\btt\.(?:load|store)\b")
    DESCRIPTOR = re.compile(r"\btt\.descriptor_(?:load|store)\b")

    def __init__(self):
        super().__init__()
        self.pointer = 0
        self.descriptor = 0
        self._seen = set()

    @staticmethod
    def target() -> type:
        from triton.runtime.jit import JITFunction

        return JITFunction

    def add(self, kernel) -> None:
        """Count the loads and stores in one compiled kernel's IR (once per kernel object)."""
        try:
            ttir = kernel.asm["ttir"]
        except Exception:  # noqa: BLE001 — a kernel object without its IR counts nothing
            return
        if isinstance(ttir, str) and id(kernel) not in self._seen:   # a kernel launched in a loop is one kernel
            self._seen.add(id(kernel))
            self.pointer += len(self.POINTER.findall(ttir))
            self.descriptor += len(self.DESCRIPTOR.findall(ttir))

    def start(self) -> "CompiledMemoryOps":
        def make(original):
            def run(fn, *args, **kwargs):
                kernel = original(fn, *args, **kwargs)
                self.add(kernel)
                return kernel
            return run

        self._wrap("run", make)
        return self


class DescriptorsOnly(StructureCheck):
    """Every global load and store of the learner's Triton kernel goes through a tensor descriptor
    (``tl.make_tensor_descriptor``), the form Triton's warp specialization needs.  Counted as they run
    in the interpreter (``TritonMemoryOps``), and in the compiled code on a GPU (``CompiledMemoryOps``)."""

    label = "every load and store through a tensor descriptor"

    def start(self, case, args, kwargs):
        from fa_lab.core.world import ON_GPU

        self.where = "in its compiled code" if ON_GPU else "in the Triton interpreter"
        self.ops = (CompiledMemoryOps() if ON_GPU else TritonMemoryOps()).start()

    def finish(self):
        ops = getattr(self, "ops", None)
        if ops is not None:
            ops.stop()

    def verdict(self):
        self.finish()
        if self.ops.pointer == 0 and self.ops.descriptor == 0:
            return (f"no load or store of a Triton kernel was seen {self.where}: "
                    "launch your Triton kernel from the function")
        if self.ops.pointer == 0:
            return None
        return (f"your kernel has {self.ops.pointer} loads or stores through pointers (tl.load / tl.store) beside "
                f"{self.ops.descriptor} through tensor descriptors, {self.where}. Triton splits a loop into a "
                "producer and consumer warpgroups only when its tiles come through descriptors: build one per "
                "tensor with tl.make_tensor_descriptor(base, shape, strides, block_shape) and use its "
                ".load([row, 0]) and .store([row, 0], tile)")
