"""The pieces every varlen kernel shares (@triton.jit): tile loads, the mask, the modified scores.

Positions are sequence-local: query ``i`` and key ``j`` of one sequence, bottom-right aligned
(query ``i`` sits at key ``i + Lk - Lq``).  The score tiles may be transposed (keys as rows, in
the dK/dV kernel), so the helpers take the two positions as broadcastable tiles, ``q_pos`` (the
key position each query sits at) and ``k_pos``, instead of assuming an orientation.

Scores are in log2 units (``exp2`` is the fast instruction): the host folds ``log2 e`` into the
scale, the soft cap and the ALiBi slope.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_rows(base, rows, stride, offs_d, n_rows, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
              CHECK_ROWS: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Rows ``rows`` (relative to ``base``) of a ``(rows, HEAD_DIM)`` matrix whose last dim is contiguous.

    ``[len(rows), BLOCK_D]``, or ``[BLOCK_D, len(rows)]`` when ``TRANSPOSED``; zeros past
    ``HEAD_DIM`` and, under ``CHECK_ROWS``, for rows ``>= n_rows`` (another sequence's rows,
    possibly NaN, must not leak in).  ``rows * stride`` stays small: ``base`` already points at
    the tile's first row (an int64 offset computed once per tile).
    """
    if TRANSPOSED:
        ptrs = base + rows[None, :] * stride + offs_d[:, None]
        if CHECK_ROWS:
            mask = rows[None, :] < n_rows
            if HEAD_DIM != BLOCK_D:
                mask = mask & (offs_d[:, None] < HEAD_DIM)
            tile = tl.load(ptrs, mask=mask, other=0.0)
        elif HEAD_DIM != BLOCK_D:
            tile = tl.load(ptrs, mask=offs_d[:, None] < HEAD_DIM, other=0.0)
        else:
            tile = tl.load(ptrs)
    else:
        ptrs = base + rows[:, None] * stride + offs_d[None, :]
        if CHECK_ROWS:
            mask = rows[:, None] < n_rows
            if HEAD_DIM != BLOCK_D:
                mask = mask & (offs_d[None, :] < HEAD_DIM)
            tile = tl.load(ptrs, mask=mask, other=0.0)
        elif HEAD_DIM != BLOCK_D:
            tile = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
        else:
            tile = tl.load(ptrs)
    return tile


@triton.jit
def visible(q_pos, k_pos, n_k, left, right, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Where the query at key position ``q_pos`` sees key ``k_pos`` (and the key exists)."""
    ok = k_pos < n_k
    if HAS_LEFT:
        ok = ok & (k_pos >= q_pos - left)
    if HAS_RIGHT:
        ok = ok & (k_pos <= q_pos + right)
    return ok


@triton.jit
def tanh(x):
    """``tanh`` from one exp2: 1 - 2 / (1 + e^{2x}); saturates to ±1 (e^{2x} = inf or 0), NaN stays NaN."""
    return 1.0 - 2.0 / (1.0 + tl.math.exp2(x * 2.8853900817779268))   # 2·log2(e)


@triton.jit
def modified_scores(qk, q_pos, k_pos, qk_scale, softcap, slope, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr):
    """``(s, t)``: the scores of ``qk = q·k`` in log2 units, and ``t = tanh(·)`` of the soft cap.

    Without a cap ``s = qk · qk_scale`` (``qk_scale = scale · log2 e``).  With one,
    ``s = softcap · tanh(qk · qk_scale)`` (here ``qk_scale = scale / cap`` and ``softcap = cap · log2 e``);
    the backward needs ``t`` for the derivative ``1 - t²``.  ALiBi then subtracts
    ``slope · |q_pos - k_pos|`` (``slope`` in log2 units too).
    """
    if SOFTCAP:
        t = tanh(qk * qk_scale)
        s = softcap * t
    else:
        t = qk
        s = qk * qk_scale
    if ALIBI:
        s = s - slope * tl.abs(q_pos - k_pos).to(tl.float32)
    return s, t


@triton.jit
def phase_bounds(lo, hi, full_lo, full_hi, BLOCK: tl.constexpr):
    """Split the visible range ``[lo, hi)`` into tiles of ``BLOCK`` from ``lo``: ``(mid, end_mid)``.

    Tiles in ``[mid, end_mid)`` lie inside ``[full_lo, full_hi)``, which every row sees: they run
    without a mask; ``[lo, mid)`` and ``[end_mid, hi)`` are the masked edges.  ``hi <= lo``: all empty.
    """
    hi = tl.maximum(hi, lo)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(full_hi, hi)
    mid = lo + tl.cdiv(full_lo - lo, BLOCK) * BLOCK
    end_mid = mid + tl.maximum(full_hi - mid, 0) // BLOCK * BLOCK
    return hi, mid, end_mid
