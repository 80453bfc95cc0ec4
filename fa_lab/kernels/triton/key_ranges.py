"""Which keys a block of queries sees: once for the kernels (@triton.jit), once in Python.

``visible_range`` is the kernels' arithmetic: the forward's key loop and the dQ kernel ask it
which keys a query block sees, the dK/dV kernel asks it (with the roles of rows and columns
swapped) which queries a key block is seen by.  ``key_block_ranges`` is the same arithmetic in
Python, together with the forward's split into key tiles (the ``key-ranges`` region of
``kernel.attn_fwd_block``), for figures, tests and exercises.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def visible_range(start, n_rows, n_cols, left, right, BLOCK: tl.constexpr,
                  HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """``(lo, hi, full_lo, full_hi)`` for the rows ``[start, start + BLOCK)`` of a mask.

    Row ``i`` sees columns ``i + diag - left .. i + diag + right`` of ``[0, n_cols)`` (bottom-right
    aligned: ``diag = n_cols - n_rows``; a side without a flag is unbounded).  Some row sees a
    column of ``[lo, hi)`` (``hi <= lo``: none); every row sees ``[full_lo, full_hi)``.
    """
    diag = n_cols - n_rows
    lo = 0
    hi = n_cols
    full_lo = 0
    full_hi = n_cols
    if HAS_LEFT:
        lo = tl.maximum(start + diag - left, 0)                            # the first row's first column
        full_lo = tl.maximum(start + BLOCK - 1 + diag - left, 0)           # the last row's first column
    if HAS_RIGHT:
        hi = tl.minimum(start + BLOCK + diag + right, n_cols)              # past the last row's last column
        full_hi = tl.maximum(tl.minimum(start + diag + right + 1, n_cols), 0)  # past the first row's last
    return lo, hi, full_lo, full_hi


def key_block_ranges(m_start, block_m, block_n, n_q, n_k, left=-1, right=-1):
    """The forward kernel's loop bounds for one query block.

    Returns ``(lo, mid_lo, mid_hi, hi)``: keys ``[lo, mid_lo)`` and ``[mid_hi, hi)`` run with a
    mask, key blocks ``range(mid_lo, mid_hi, block_n)`` without one; every other key is never
    loaded.  The kernel walks the two masked ranges in tiles of ``min(block_n, block_m)`` keys
    (``BLOCK_N_EDGE``).
    """
    # visible_range
    diag = n_k - n_q
    lo, hi, full_lo, full_hi = 0, n_k, 0, n_k
    if left >= 0:
        lo = max(m_start + diag - left, 0)                       # the first row's first key
        full_lo = max(m_start + block_m - 1 + diag - left, 0)    # the last row's first key
    if right >= 0:
        hi = min(m_start + block_m + diag + right, n_k)          # past the last row's last key
        full_hi = max(min(m_start + diag + right + 1, n_k), 0)   # past the first row's last key
    # attn_fwd_block: whole key tiles
    hi = max(hi, lo)
    lo = lo // block_n * block_n
    mid_lo = min(max(-(-full_lo // block_n) * block_n, lo), hi)
    mid_hi = max(full_hi // block_n * block_n, mid_lo)
    return lo, mid_lo, mid_hi, hi
