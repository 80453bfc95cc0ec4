"""One registry of implementations, used by the book, the benchmarks, the grader and the tests.

A kernel appears everywhere by being registered once, with what it supports.  The
registry (not each kernel) turns an unsupported request into a clear ``ValueError``:
``checked_spec`` is the one check every entry point calls before it runs a kernel.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from fa_lab.core.dtypes import long_name
from fa_lab.core.spec import AttentionSpec, make_spec
from fa_lab.core.world import WORLD, import_order_problem

#: Modules that register implementations when imported, in the book's order, and the names each one
#: registers.  Asking for one implementation imports only its module (a first call of `triton` does not
#: wait for Numba to import); listing them imports them all.  (tests/test_registry.py checks the names.)
IMPLEMENTATION_MODULES = {
    "fa_lab.core.reference": ("reference",),
    "fa_lab.kernels.naive": ("naive_numpy", "naive_torch"),
    "fa_lab.kernels.online": ("online_numba",),
    "fa_lab.kernels.numba.naive": ("numba_naive",),
    "fa_lab.kernels.numba.tiled": ("numba_tiled",),                                 # chapter 3
    "fa_lab.kernels.numba.steps": ("numba_rowwise", "numba_smem", "numba_regtile"),  # its steps
    "fa_lab.kernels.triton.fwd": ("triton",),                                       # chapter 4
    "fa_lab.kernels.triton.steps": ("triton_minimal", "triton_exp2", "triton_skip", "triton_desc",
                                    "triton_autotuned"),                            # its steps
    "fa_lab.autograd": ("torch_tiled", "flash_triton", "torch_compile_bwd"),        # chapter 5
    "fa_lab.kernels.varlen.registered": ("triton_varlen",),   # chapter 8: packed variable-length sequences
    "fa_lab.kernels.decode.adapter": ("triton_decode",),      # chapter 9: split-KV decoding over a KV cache
    "fa_lab.kernels.gluon.registered": ("flash_gluon",),      # chapter 11: Gluon on Hopper
}

ALL_MASKS = ("none", "causal", "window")


@dataclass(frozen=True)
class Implementation:
    """A registered attention implementation and what it can do."""

    name: str
    fn: Callable  # fn(q, k, v, spec: AttentionSpec) -> (o, lse); inputs already validated
    chapter: int
    description: str
    dtypes: tuple = (torch.float32,)
    masks: tuple = ALL_MASKS
    head_dims: tuple = (1, 1024)          # inclusive range of D
    worlds: tuple = ("cpu", "gpu")        # where it runs: "gpu" real CUDA, "cpu" simulator/host
    gqa: bool = True
    backward: bool = False
    autograd: bool = False                # no backward of its own, but PyTorch autograd differentiates its ops
    host_only: bool = False               # runs on the host (NumPy / Numba @njit): any tensor device, copied
    any_device: bool = False              # plain PyTorch ops: runs on whatever device its tensors are on
    #: the library whose kernels it launches ("numba.cuda" or "triton"), tied to the world's mode of it;
    #: left out, it is read from where ``fn`` is defined (fa_lab.kernels.numba / fa_lab.kernels.triton)
    backend: str | None = None
    #: limits beyond dtypes, masks and the head-dim range: spec -> why not (None if fine)
    limits: Callable | None = None
    extra_memory: Callable | None = None  # spec -> bytes of workspace beyond inputs and outputs (model)
    notes: str = ""
    #: the chapter's final implementation this one is an intermediate step towards (None: not a step)
    step_of: str | None = None
    tags: tuple = field(default_factory=tuple)
    #: score modifications it applies (Part II): "softcap", "alibi"; anything else is refused
    score_mods: tuple = ()

    @property
    def dtype_names(self) -> list[str]:
        return [long_name(d) for d in self.dtypes]

    def unsupported(self, spec: AttentionSpec, world: str) -> str | None:
        """Why this implementation cannot run ``spec`` in ``world`` (None if it can)."""
        if world not in self.worlds:
            return f"implementation {self.name!r} runs only on {'/'.join(self.worlds)}, this is the {world} world"
        if spec.dtype not in self.dtypes:
            return f"implementation {self.name!r} supports dtypes {self.dtype_names}, got {spec.dtype}"
        if spec.mask not in self.masks:
            return f"implementation {self.name!r} supports masks {list(self.masks)}, got {spec.mask!r}"
        lo, hi = self.head_dims
        if not lo <= spec.head_dim <= hi:
            return f"implementation {self.name!r} supports head dims {lo}..{hi}, got {spec.head_dim}"
        missing = [m for m in spec.score_mods if m not in self.score_mods]
        if missing:
            return (f"implementation {self.name!r} does not apply {' or '.join(missing)} "
                    f"(supported score modifications: {', '.join(self.score_mods) or 'none'})")
        if spec.group > 1 and not self.gqa:
            return (f"implementation {self.name!r} does not support grouped-query attention "
                    f"(H={spec.heads}, Hkv={spec.kv_heads})")
        if not (self.host_only or self.any_device):   # a kernel tied to the world's device
            want = "cuda" if world == "gpu" else "cpu"
            if spec.device.type != want:
                return (f"implementation {self.name!r} ({self.backend or 'kernels'}) in the {world} world "
                        f"expects {want} tensors, got tensors on {spec.device} (use fa_lab.DEVICE)")
        if self.limits is not None:
            why = self.limits(spec)
            if why:
                return f"implementation {self.name!r}: {why}"
        if world == WORLD:
            why = import_order_problem(self.backend)
            if why:
                return f"implementation {self.name!r} cannot run: {why}"
        return None


_REGISTRY: dict[str, Implementation] = {}
_loaded = False


def register(name: str, **info):
    """Decorator: ``@register("naive_torch", chapter=1, description=..., dtypes=...)``."""

    def wrap(fn):
        if name in _REGISTRY:
            raise ValueError(f"implementation {name!r} is registered twice")
        info.setdefault("backend", _backend_of(fn))
        _REGISTRY[name] = Implementation(name=name, fn=fn, **info)
        return fn

    return wrap


def _backend_of(fn) -> str | None:
    module = getattr(fn, "__module__", "") or ""
    for package, backend in (("fa_lab.kernels.numba.", "numba.cuda"), ("fa_lab.kernels.triton", "triton")):
        if module.startswith(package):
            return backend
    return None


def checked_spec(impl: str, q, k, v, **mask) -> tuple[Implementation, AttentionSpec]:
    """The one input check: validate ``q, k, v`` and the mask, and refuse what ``impl`` cannot run.

    Returns ``(implementation, spec)``.  Raises ValueError/TypeError naming what was expected —
    including inputs that require grad for an implementation without a backward, whose output
    would otherwise silently carry no gradient.
    """
    implementation = get(impl)
    return implementation, check(implementation, q, k, v, **mask)


#: specs that passed the checks, by everything the checks read (see ``_spec_key``): at small sizes the
#: host path is most of a call's time, and a training loop asks the same question every step
_CHECKED: dict = {}
_CHECKED_MAX = 1024
_PLAIN = (bool, int, float, type(None))


def _spec_key(implementation: Implementation, q, k, v, mask: dict):
    """What decides ``check``'s answer, hashable; None where a value is not plain (then nothing is cached).

    Values carry their type: ``causal=1`` must still be refused although ``1 == True``.  Built in
    one pass: this runs on every call, and at small sizes a call is mostly host time.
    """
    if type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor:
        return None
    key = [implementation.name, q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device]
    for name, value in mask.items():
        kind = type(value)
        if kind in _PLAIN:
            key += (name, kind, value)
        elif kind is tuple or kind is list:
            kinds = tuple(map(type, value))
            if not all(t in _PLAIN for t in kinds):
                return None
            key += (name, kind, kinds, tuple(value))
        else:   # a tensor (ALiBi slopes): checked every call
            return None
    return tuple(key)


def check(implementation: Implementation, q, k, v, **mask) -> AttentionSpec:
    """``checked_spec`` for an implementation already in hand (a registered one, or a benchmark peer)."""
    key = _spec_key(implementation, q, k, v, mask)
    found = _CHECKED.get(key) if key is not None else None
    # the entry holds its implementation: a peer that shares a registered name does not share its answers
    spec = found[1] if found is not None and found[0] is implementation else None
    if spec is None:
        spec = _checked_spec(implementation, q, k, v, mask)
        if key is not None:
            if len(_CHECKED) >= _CHECKED_MAX:
                _CHECKED.clear()
            _CHECKED[key] = (implementation, spec)
    if not (implementation.backward or implementation.autograd) and torch.is_grad_enabled() and (
            q.requires_grad or k.requires_grad or v.requires_grad):
        with_backward = ", ".join(n for n, i in implementations().items() if i.backward)
        raise ValueError(f"implementation {implementation.name!r} has no backward pass, but q, k or v requires "
                         f"grad: its output would carry no gradient. Use one with a backward ({with_backward}), "
                         "or call it under torch.no_grad() or on detached tensors.")
    return spec


def _checked_spec(implementation: Implementation, q, k, v, mask: dict) -> AttentionSpec:
    spec = make_spec(q, k, v, **mask)
    if spec.device.type == "meta":   # a spec may describe shapes alone (the models do); a run needs data
        raise ValueError("q, k, v are meta tensors (shapes without data): attention needs real tensors; "
                         "allocate them on a device such as fa_lab.DEVICE")
    why = implementation.unsupported(spec, WORLD)
    if why:
        raise ValueError(why)
    return spec


def _load_all() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for mod in IMPLEMENTATION_MODULES:
            importlib.import_module(mod)


def implementations(*, runnable: bool = False) -> dict[str, Implementation]:
    """Registered implementations by name, in the book's order.

    Iterating gives the names; each value says chapter, description, dtypes, masks,
    head dims, worlds and whether it has a backward.  ``runnable=True`` keeps only
    those that run in the current world.
    """
    _load_all()
    # by chapter (stable within one), whatever order the modules happened to be imported in
    ordered = sorted(_REGISTRY.values(), key=lambda impl: impl.chapter)
    return {i.name: i for i in ordered if not runnable or WORLD in i.worlds}


#: names ``get`` has resolved: every call of an entry point asks, and its host time counts
_RESOLVED: dict[str, Implementation] = {}


def get(name: str) -> Implementation:
    """The implementation registered as ``name``, importing only the module that registers it.

    That module is imported before the name is looked up, so a name registered elsewhere first
    (a notebook's ``register("triton")``) meets the package's own registration and is refused.
    """
    found = _RESOLVED.get(name) if isinstance(name, str) else None
    if found is not None:
        return found
    if isinstance(name, str):
        module = next((m for m, names in IMPLEMENTATION_MODULES.items() if name in names), None)
        if module is not None:
            importlib.import_module(module)
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"unknown impl {name!r}; known implementations: {', '.join(implementations())}")
    _RESOLVED[name] = _REGISTRY[name]
    return _REGISTRY[name]


def table():
    """The registry as a pandas DataFrame (one row per implementation)."""
    import pandas as pd

    rows = []
    for impl in implementations().values():
        rows.append(dict(name=impl.name, chapter=impl.chapter, description=impl.description,
                         dtypes=", ".join(impl.dtype_names), masks=", ".join(impl.masks),
                         head_dims=f"{impl.head_dims[0]}..{impl.head_dims[1]}",
                         worlds=", ".join(impl.worlds), gqa=impl.gqa, backward=impl.backward))
    return pd.DataFrame(rows).set_index("name")
