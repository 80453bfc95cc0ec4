"""Which (batch, head) a block works on, and where that head's rows start: device functions.

Every kernel of chapters 1 and 3 gives each (batch, head) pair one layer of its grid,
``bh = b·H + h``.  Under grouped-query attention ``group`` consecutive query heads share
one K/V head, ``hk = h // group``, and K and V hold ``H // group`` heads.

``inline="always"`` inlines them at Numba's IR level: the kernels compile as if the lines
were written in place (the simulator ignores the option).
"""
from __future__ import annotations

from numba import cuda, uint64


@cuda.jit(device=True, inline="always")
def batch_head(bh, H, group):
    """``(b, h, hk)``: the batch, the query head and the K/V head of grid layer ``bh``."""
    b, h = bh // H, bh % H
    return b, h, h // group


@cuda.jit(device=True, inline="always")
def head_starts(bh, H, group, Nq, Nk, D):
    """Where grid layer ``bh``'s Q (and O) and its K/V head start in flat (B, heads, N, D) arrays.

    Unsigned offsets (``uint64``), as the kernels index with them (see ``tiled.build_kernel``).
    """
    b, h, hk = batch_head(bh, H, group)
    u_d = uint64(D)
    return uint64(bh) * uint64(Nq) * u_d, (uint64(b) * uint64(H // group) + uint64(hk)) * uint64(Nk) * u_d
