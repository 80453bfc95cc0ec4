"""The two numbers per query row the backward needs beside Q, K, V and dO: D and the lse in base 2.

D = rowsum(dO ∘ O) turns the softmax's backward into an element-wise formula per tile,
dS = P ∘ (dP − D); the kernels rebuild P = 2^(S·log2 e − lse2) with ``exp2``.  The dQ pass owns its
query rows, so it computes both there and stores them for the dK/dV pass that runs after it.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def row_terms(o, do, lse, dlse, HAS_DLSE: tl.constexpr):
    """``(lse2, D)`` of a block of query rows from their O and dO tiles, natural-log lse and lse gradient.

    A row that sees no key has lse −inf: its base-2 lse is +inf, so that its P is 2^−inf = 0, not NaN.
    A gradient on lse adds P ∘ dlse to dS, the same as using D − dlse.
    """
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    if HAS_DLSE:
        delta -= dlse
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    return lse2, delta


__all__ = ["row_terms"]
