"""Launching the decoding kernels with little host time: decoding is called once per generated token.

One decoding step on a GPU takes tens of microseconds, about what Triton's JIT entry point
(``kernel[grid](...)``) spends in Python re-deriving the specialisation key from every argument.
So the repeats of a launch go straight to the compiled kernel
(``fa_lab.kernels.triton.fast_launch``), keyed by everything Triton specialises on: the value of
every scalar argument (shapes, strides), the dtype and 16-byte alignment of every tensor, the
constexprs, the grid and the device.  Unlike the forward's inputs, a cache's tensors come from
the caller as they are, hence the alignment in the key.  In the CPU world every launch goes
through the interpreter.
"""
from __future__ import annotations

from typing import NamedTuple

from fa_lab.core.world import ON_GPU
from fa_lab.kernels.triton import fast_launch


class Launch(NamedTuple):
    """Everything about a launch but its tensors: the kernel's parameters are its tensors, then
    ``scalars``, then the constexprs ``meta``."""

    kernel: object
    grid: tuple
    scalars: tuple
    meta: dict
    num_warps: int
    num_stages: int

    def key(self, device) -> tuple:
        """The part of the fast-launch key this launch fixes: computed once by a caller that repeats it."""
        return (self.kernel, self.grid, self.scalars, tuple(self.meta.items()), self.num_warps, self.num_stages,
                device.index)


def run(launch: Launch, tensors: tuple, key: tuple | None = None) -> None:
    """``kernel[grid](*tensors, *scalars, **meta)``; ``key`` is ``launch.key(device)`` if the caller kept it."""
    kernel, grid, scalars, meta, warps, stages = launch
    if not ON_GPU:
        kernel[grid](*tensors, *scalars, **meta, num_warps=warps, num_stages=stages)
        return
    if key is None:
        key = launch.key(tensors[0].device)
    full = (key, tuple((t.dtype, t.data_ptr() % 16 == 0) for t in tensors))
    # the compiled kernel's launcher takes all three grid dims
    fast_launch.launch(kernel, full, (*grid, 1, 1)[:3], (*tensors, *scalars), meta, warps, stages)
