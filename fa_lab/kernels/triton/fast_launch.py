"""Repeated launches of the forward kernel straight through the compiled kernel (GPU only).

Triton's JIT entry point (``kernel[grid](...)``) re-derives the specialisation key from every
argument on every call, which costs more host time than the launch itself at small sizes.
So the first launch of a (problem, launch config, device) goes through the JIT, which compiles
or finds the kernel and returns it; later launches call ``compiled[grid](*args)`` directly.
Every argument the key depends on is fixed by the problem (shapes, masks, dtypes) or by
``prepare_inputs`` (16-byte aligned pointers), so the cached kernel is the one the JIT would pick.

This relies on one detail of Triton's ``CompiledKernel``: its launcher takes *every* argument
of the kernel's signature, in signature order, constexprs included (Triton 3.2 to 3.9 do).
``direct_launch_supported`` checks that on the first compiled kernel, from the signature the
kernel was compiled with; where it does not hold, every launch goes through the JIT.
"""
from __future__ import annotations

import inspect

#: (problem, launch config, device) -> (compiled kernel bound to its grid, constexpr values in signature order)
_COMPILED: dict[tuple, tuple] = {}
#: whether this Triton keeps the calling convention above: None until the first compiled kernel says
_SUPPORTED: bool | None = None


def kernel_parameters(kernel) -> tuple[str, ...]:
    """The names of a @triton.jit function's parameters, in signature order (GPU and interpreter)."""
    return tuple(inspect.signature(getattr(kernel, "fn", kernel)).parameters)


def constexpr_parameters(kernel) -> tuple[str, ...]:
    """The names of a @triton.jit function's ``tl.constexpr`` parameters, in signature order."""
    params = inspect.signature(getattr(kernel, "fn", kernel)).parameters.values()
    return tuple(p.name for p in params if "constexpr" in str(p.annotation))


def direct_launch_supported(compiled, kernel) -> bool:
    """Whether ``compiled[grid](*every argument in signature order)`` launches ``compiled`` correctly.

    True when ``compiled`` can be indexed by a grid and the signature it was compiled with
    (``compiled.src.signature``) lists the kernel's parameters in order, its constexprs marked
    ``"constexpr"``: then its launcher expects exactly the arguments this module passes.
    """
    signature = getattr(getattr(compiled, "src", None), "signature", None)
    if not isinstance(signature, dict) or not callable(getattr(type(compiled), "__getitem__", None)):
        return False
    params, constexprs = kernel_parameters(kernel), constexpr_parameters(kernel)
    if tuple(signature) != params or params[len(params) - len(constexprs):] != constexprs:
        return False  # (the launch below passes the constexprs after all other arguments)
    return all(signature[name] == "constexpr" for name in constexprs)


def launch(kernel, key: tuple, grid: tuple, args: tuple, meta: dict, num_warps: int, num_stages: int):
    """Launch ``kernel[grid](*args, **meta)``, the repeats of ``key`` through the compiled kernel.

    ``args`` are the non-constexpr arguments in signature order, ``meta`` the constexprs by name.
    """
    global _SUPPORTED
    cached = _COMPILED.get(key)
    if cached is not None:
        run, constexprs = cached
        return run(*args, *constexprs)
    compiled = kernel[grid](*args, **meta, num_warps=num_warps, num_stages=num_stages)
    if _SUPPORTED is None:
        _SUPPORTED = direct_launch_supported(compiled, kernel)
    if _SUPPORTED:
        # the compiled kernel's grid has all three dims
        order = constexpr_parameters(kernel)
        _COMPILED[key] = (compiled[(*grid, 1)[:3]], tuple(meta[name] for name in order))
    return compiled


def reset() -> None:
    """Forget the compiled kernels and the check (tests, or after changing Triton's settings)."""
    global _SUPPORTED
    _COMPILED.clear()
    _SUPPORTED = None
