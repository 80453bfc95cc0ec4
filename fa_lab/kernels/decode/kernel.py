"""Split-KV decoding (flash-decoding) over a KV cache: the @triton.jit code of the first kernel.

One program handles one (sequence, K/V head, split) and one tile of query rows:

* **GQA packing.**  The query heads that share a K/V head, times the ``Nq`` queries, are the
  rows of one ``BLOCK_M`` tile (row ``r`` is query ``r // group`` of head ``r % group`` of the
  group; padded to at least 16 rows for ``tl.dot``).  Each K/V byte is then read once per K/V
  head, not once per query head: one-query decoding is bound by memory bandwidth, and this is
  the factor ``group`` in bytes.
* **Split-KV.**  The keys the tile sees are cut into ``num_programs(1)`` splits of whole
  ``BLOCK_N`` tiles.  With one split the program writes O and lse; with several it writes an
  fp32 partial output and its lse, which ``combine.py`` merges.
* **The cache**: contiguous (one row per sequence, ``cache_batch_idx`` picking the row), or
  paged, key ``j`` of sequence ``b`` at row ``j % page_size`` of block
  ``block_table[b, j // page_size]``.  When ``page_size`` is a multiple of ``BLOCK_N`` a tile
  never leaves its page: one block-table read per tile.  Otherwise each key finds its block.
* **Pool order** (``POOL_ORDER``, pages that tile a key tile): the program visits its split's
  pages in ascending block number rather than in key order (``pool_order.py``).

The online softmax is chapter 2's: a running max ``m_i``, sum ``l_i`` and unnormalised
``acc`` per row, all fp32, with the scale folded into ``exp2``.  Keys past the sequence's
length are never loaded (whatever the cache holds there cannot leak in); keys outside a row's
window get ``-inf``.  A row that sees no key gives zeros and ``lse = -inf``.
"""
from __future__ import annotations

import triton
import triton.language as tl

from fa_lab.kernels.decode.pool_order import pool_order

LOG2E = 1.4426950408889634  # exp(x) = exp2(x · LOG2E)
LN2 = tl.constexpr(0.6931471805599453)  # lse = (m + log2 l) · LN2

#: how the cache is laid out (the LAYOUT constexpr)
CONTIGUOUS, PAGE_TILES, PAGE_GATHER = 0, 1, 2


@triton.jit
def tanh(x):
    """tanh from one exp2 (the interpreter has no libdevice): odd, and exact to fp32 rounding of 1 - e."""
    e = tl.math.exp2(-2.0 * 1.4426950408889634 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def kv_row_offsets(start_n, offs_n, key_ok, k_seq, v_seq, SEQ_BLOCKS, stride_kb, stride_kn, stride_vb, stride_vn,
                   LAYOUT: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, OFFS32: tl.constexpr,
                   KV_SAME: tl.constexpr):
    """Element offsets of the K and V rows of keys ``start_n + offs_n`` of one sequence.

    ``k_seq``/``v_seq`` are the sequence's row offsets in a contiguous cache; ``SEQ_BLOCKS``
    points at its row of the block table in a paged one.  The offsets are int32 when every
    element of the caches is within 2^31 of its start (``OFFS32``), int64 otherwise: one
    multiply-add per row instead of a 64-bit chain, in a loop bound by how fast it issues.
    When the K and V caches have the same strides (``KV_SAME``) one set of offsets serves both.
    """
    # region: paged
    if LAYOUT == 0:
        # contiguous: the sequence's keys are consecutive rows of its cache row
        rows = start_n + offs_n
    elif LAYOUT == 1:
        # the tile lies in one page (PAGE_SIZE % BLOCK_N == 0 and tiles start at multiples of BLOCK_N)
        block = tl.load(SEQ_BLOCKS + start_n // PAGE_SIZE)
        rows = start_n % PAGE_SIZE + offs_n
    elif BLOCK_N % PAGE_SIZE == 0:
        # whole pages tile the key tile, and tiles start at multiples of BLOCK_N: key offs_n of every tile
        # sits at the same page of the tile and the same row of its page, so those are computed once,
        # outside the loop, and each key looks up only its block (pages past the length are not read)
        block = tl.load(SEQ_BLOCKS + start_n // PAGE_SIZE + offs_n // PAGE_SIZE, mask=key_ok, other=0)
        rows = offs_n % PAGE_SIZE
    else:
        # any other page size: each key finds its page and row from its position
        cols = start_n + offs_n
        block = tl.load(SEQ_BLOCKS + cols // PAGE_SIZE, mask=key_ok, other=0)
        rows = cols % PAGE_SIZE
    if not OFFS32:
        rows = rows.to(tl.int64)
        if LAYOUT != 0:
            block = block.to(tl.int64)
    if LAYOUT == 0:
        k_rows = k_seq + rows * stride_kn
        v_rows = v_seq + rows * stride_vn
    else:
        k_rows = block * stride_kb + rows * stride_kn
        v_rows = block * stride_vb + rows * stride_vn
    if KV_SAME:
        v_rows = k_rows
    # endregion: paged
    return k_rows, v_rows


@triton.jit
def decode_split_kv(
    Q, K, V, O, LSE, O_PART, LSE_PART, SEQLENS, BLOCK_TABLE, BATCH_IDX, SLOPES, ORDER,
    stride_qb, stride_qn, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_ob, stride_on, stride_oh, stride_od,
    stride_lb, stride_lh, stride_ln,
    stride_bt, stride_ab, stride_ah,
    n_q, n_k_max, heads, kv_heads, left, right, qk_scale, softcap_scale, softcap,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    LAYOUT: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_SEQLENS: tl.constexpr, HAS_BATCH_IDX: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    SPLIT: tl.constexpr, PRECISION: tl.constexpr, OFFS32: tl.constexpr, KV_SAME: tl.constexpr,
    POOL_ORDER: tl.constexpr, MAX_PAGES: tl.constexpr,
):
    """Grid ``(batch · kv_heads, splits, query tiles)``.

    ``qk_scale`` is ``scale · log2 e``; with a soft cap the scores are
    ``softcap · tanh(q·k · softcap_scale)`` (``softcap`` already times ``log2 e``).
    """
    pid_bk = tl.program_id(0)
    split = tl.program_id(1)
    pid_m = tl.program_id(2)
    b = pid_bk // kv_heads
    kvh = pid_bk % kv_heads
    group = heads // kv_heads
    b64 = b.to(tl.int64)

    # region: gqa-tile
    # rows of the tile: query i = r // group of head kvh · group + r % group
    offs_r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_r < group * n_q
    q_i = offs_r // group
    h = kvh * group + offs_r % group
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q_ptrs = Q + b64 * stride_qb + q_i[:, None] * stride_qn + h[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # stays on chip for the whole loop
    # endregion: gqa-tile

    # region: split-range
    if HAS_SEQLENS:
        n_k = tl.load(SEQLENS + b)
        n_k = tl.minimum(tl.maximum(n_k, 0), n_k_max)  # in bounds whatever the lengths say
    else:
        n_k = n_k_max
    diag = n_k - n_q              # bottom-right alignment: query i sits at key i + diag
    q_pos = q_i + diag
    # keys [lo, hi) that some row of this tile sees, in whole BLOCK_N tiles from lo
    i_lo = (pid_m * BLOCK_M) // group
    i_hi = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // group, n_q - 1)
    lo = 0
    hi = n_k
    if HAS_LEFT:
        lo = tl.maximum(i_lo + diag - left, 0)
    if HAS_RIGHT:
        hi = tl.minimum(i_hi + diag + right + 1, n_k)
    lo = lo // BLOCK_N * BLOCK_N
    n_tiles = tl.maximum(hi - lo + BLOCK_N - 1, 0) // BLOCK_N
    tiles_per_split = tl.cdiv(n_tiles, tl.num_programs(1))
    start = lo + split * tiles_per_split * BLOCK_N
    stop = tl.minimum(start + tiles_per_split * BLOCK_N, hi)
    # endregion: split-range

    if HAS_BATCH_IDX:
        cache_row = tl.load(BATCH_IDX + b)
    else:
        cache_row = b
    if not OFFS32:
        cache_row = cache_row.to(tl.int64)
    k_seq = cache_row * stride_kb   # (only a contiguous cache reads these)
    v_seq = cache_row * stride_vb
    seq_blocks = BLOCK_TABLE + b64 * stride_bt
    if POOL_ORDER:
        # this program's row of ORDER: one per (sequence, K/V head, split, query tile)
        row = (pid_bk * tl.num_programs(1) + split) * tl.num_programs(2) + pid_m
        seq_blocks = pool_order(seq_blocks, ORDER, row, start, stop, PAGE_SIZE=PAGE_SIZE, MAX_PAGES=MAX_PAGES)
    k_head = K + kvh.to(tl.int64) * stride_kh
    v_head = V + kvh.to(tl.int64) * stride_vh
    if HAS_ALIBI:
        # slope · log2 e per row: the bias -slope · |i + diag - j| in exp2 units
        slope = tl.load(SLOPES + b64 * stride_ab + h * stride_ah, mask=row_ok, other=0.0) * 1.4426950408889634

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)

    # region: key-loop
    for start_n in range(start, stop, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        key_ok = cols < hi     # only the range's last tile is partial
        k_rows, v_rows = kv_row_offsets(start_n, offs_n, key_ok, k_seq, v_seq, seq_blocks, stride_kb, stride_kn,
                                        stride_vb, stride_vn, LAYOUT=LAYOUT, PAGE_SIZE=PAGE_SIZE, BLOCK_N=BLOCK_N,
                                        OFFS32=OFFS32, KV_SAME=KV_SAME)
        if HEAD_DIM == BLOCK_D:
            kv_mask = key_ok[:, None]   # a mask constant along D: the loads stay 16-byte vectors
        else:
            kv_mask = key_ok[:, None] & d_ok[None, :]
        k = tl.load(k_head + k_rows[:, None] + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if HAS_SOFTCAP:
            s = softcap * tanh(qk * softcap_scale)
        else:
            s = qk * qk_scale
        if HAS_ALIBI:
            s -= slope[:, None] * tl.abs(q_pos[:, None] - cols[None, :]).to(tl.float32)
        keep = key_ok[None, :]
        if HAS_LEFT:
            keep = keep & (cols[None, :] >= q_pos[:, None] - left)
        if HAS_RIGHT:
            keep = keep & (cols[None, :] <= q_pos[:, None] + right)
        s = tl.where(keep, s, float("-inf"))
        # a row that has seen no key yet subtracts 0, not -inf (exp2(-inf) = 0, never NaN)
        m_ij = tl.maximum(m_i, tl.max(s, 1))
        m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij)
        p = tl.math.exp2(s - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        v = tl.load(v_head + v_rows[:, None] + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_ij
    # endregion: key-loop

    # region: epilogue
    # l_i != 0 rather than > 0: a NaN row stays NaN instead of reading as empty
    seen = l_i != 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * LN2, float("-inf"))
    out_mask = row_ok[:, None] & d_ok[None, :]
    if SPLIT:
        # partials (B, Nq, H, splits, D) and (B, Nq, H, splits), fp32, for combine.py
        part = ((b64 * n_q + q_i) * heads + h) * tl.num_programs(1) + split
        tl.store(O_PART + part[:, None] * HEAD_DIM + offs_d[None, :], out, mask=out_mask)
        tl.store(LSE_PART + part, lse, mask=row_ok)
    else:
        o_ptrs = O + b64 * stride_ob + q_i[:, None] * stride_on + h[:, None] * stride_oh + offs_d[None, :] * stride_od
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=out_mask)
        tl.store(LSE + b64 * stride_lb + h * stride_lh + q_i * stride_ln, lse, mask=row_ok)
    # endregion: epilogue


def layout_of(page_size: int, block_n: int) -> int:
    """The LAYOUT constexpr: contiguous (page_size 0), whole tiles from one page, or a per-key gather."""
    if page_size == 0:
        return CONTIGUOUS
    return PAGE_TILES if page_size % block_n == 0 else PAGE_GATHER

