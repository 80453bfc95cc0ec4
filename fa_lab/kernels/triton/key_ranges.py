"""The forward kernel's key-loop bounds in Python, for figures, tests and exercises.

The same arithmetic as the ``key-ranges`` region of ``kernel.attn_fwd_block``: per query block,
which key blocks run with a mask, which without, and which are never loaded.
"""
from __future__ import annotations


def key_block_ranges(m_start, block_m, block_n, n_q, n_k, left=-1, right=-1):
    """The kernel's loop bounds for one query block.

    Returns ``(lo, mid_lo, mid_hi, hi)``: keys ``[lo, mid_lo)`` and ``[mid_hi, hi)`` run with a
    mask, key blocks ``range(mid_lo, mid_hi, block_n)`` without one; every other key is never
    loaded.  The kernel walks the two masked ranges in tiles of ``min(block_n, block_m)`` keys
    (``BLOCK_N_EDGE``).
    """
    diag = n_k - n_q
    lo, hi, full_lo, full_hi = 0, n_k, 0, n_k
    if left >= 0:
        lo = max(m_start + diag - left, 0)                       # the first row's first key
        full_lo = max(m_start + block_m - 1 + diag - left, 0)    # the last row's first key
    if right >= 0:
        hi = min(m_start + block_m + diag + right, n_k)          # past the last row's last key
        full_hi = max(min(m_start + diag + right + 1, n_k), 0)   # past the first row's last key
    hi = max(hi, lo)
    lo = lo // block_n * block_n
    mid_lo = min(max(-(-full_lo // block_n) * block_n, lo), hi)
    mid_hi = max(full_hi // block_n * block_n, mid_lo)
    return lo, mid_lo, mid_hi, hi
