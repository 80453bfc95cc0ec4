"""The packed variable-length FlashAttention-2 forward kernel (@triton.jit code only).

One program computes one ``BLOCK_M × D`` tile of the output of one query head of one sequence.
Which sequence and which block of it comes from the work table (``schedule``): the grid is
``(programs, H)``, with no program for the padding of short sequences.  From there on it is
chapter 4's kernel: the query tile stays on chip, key/value tiles of ``BLOCK_N`` stream past
it, both products are ``tl.dot`` and the softmax runs online (``m_i``, ``l_i``, ``acc``) in
log2 units with the scale folded into ``exp2``.

Sequences sit back to back in q ``(total_q, H, D)``, k and v ``(total_k, Hkv, D)``: a tile that
hangs past its sequence would read the next one, so the loads on a sequence's edge are masked
(zeros, never another sequence's values), as are the scores of keys a row does not see.  Only
the key tiles on a mask's edge pay for it; the tiles every row sees in full run without one,
and tiles no row sees are never loaded.
"""
from __future__ import annotations

import triton
import triton.language as tl

from fa_lab.kernels.triton.key_ranges import visible_range
from fa_lab.kernels.varlen.schedule import scheduled_block
from fa_lab.kernels.varlen.tiles import load_rows, modified_scores, phase_bounds, visible

LN2 = tl.constexpr(0.6931471805599453)   # lse = (m + log2 l) · ln 2


@triton.jit
def fwd_inner(acc, l_i, m_i, q, K_seq, V_seq, start, stop, q_pos, offs_n, offs_d, n_k, left, right,
              stride_kn, stride_vn, qk_scale, softcap, slope,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
              HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
              PRECISION: tl.constexpr):
    """Stream the key tiles ``[start, stop)`` of one sequence past the query tile: update (acc, l_i, m_i)."""
    # the tiles' first rows: an int64 offset once (a long packed batch overflows int32), then a step per tile
    k_tile = K_seq + tl.cast(start, tl.int64) * stride_kn
    v_tile = V_seq + tl.cast(start, tl.int64) * stride_vn
    for start_n in range(start, stop, BLOCK_N):
        k = load_rows(k_tile, offs_n, stride_kn, offs_d, n_k - start_n,
                      HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, CHECK_ROWS=MASKED, TRANSPOSED=False)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if MASKED or SOFTCAP or ALIBI:
            k_pos = (start_n + offs_n)[None, :]
            s, t = modified_scores(qk, q_pos, k_pos, qk_scale, softcap, slope, SOFTCAP=SOFTCAP, ALIBI=ALIBI)
            if MASKED:
                s = tl.where(visible(q_pos, k_pos, n_k, left, right, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT),
                             s, float("-inf"))
            m_ij = tl.maximum(m_i, tl.max(s, 1))
            # a row that has seen no key yet subtracts 0, not -inf: exp2(-inf - 0) = 0, never NaN
            m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij)
            p = tl.math.exp2(s - m_sub[:, None])
            alpha = tl.math.exp2(m_i - m_sub)
        else:
            # the hot loop: every row sees every key, plain scores.  The scale rides on the max and on
            # one fused multiply-add per score (the host makes qk_scale >= 0, see varlen_forward)
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.math.exp2(qk * qk_scale - m_ij[:, None])
            alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = load_rows(v_tile, offs_n, stride_vn, offs_d, n_k - start_n,
                      HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, CHECK_ROWS=MASKED, TRANSPOSED=False)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
        m_i = m_ij
        k_tile += BLOCK_N * stride_kn
        v_tile += BLOCK_N * stride_vn
    return acc, l_i, m_i


@triton.jit
def varlen_fwd(Q, K, V, O, LSE, CU_Q, CU_K, SCHEDULE, SLOPES,
               stride_qm, stride_qh, stride_km, stride_kh, stride_vm, stride_vh, stride_om, stride_oh,
               stride_sb, stride_sh, total_q, n_programs, group, left, right, qk_scale, softcap,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
               PRECISION: tl.constexpr):
    """Grid ``(programs, H)``: O ``(total_q, H, D)`` and lse ``(H, total_q)`` (natural log)."""
    # region: locate
    seq, block = scheduled_block(SCHEDULE, tl.program_id(0), n_programs)
    if seq < 0:   # past the last real block: nothing to do
        return
    h = tl.program_id(1).to(tl.int64)
    q_start = tl.load(CU_Q + seq)
    n_q = tl.load(CU_Q + seq + 1) - q_start
    k_start = tl.load(CU_K + seq)
    n_k = tl.load(CU_K + seq + 1) - k_start
    # endregion: locate
    m0 = block * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)          # query rows of this sequence
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = load_rows(Q + (q_start + m0).to(tl.int64) * stride_qm + h * stride_qh, tl.arange(0, BLOCK_M), stride_qm,
                  offs_d, n_q - m0, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, CHECK_ROWS=True, TRANSPOSED=False)
    K_seq = K + k_start.to(tl.int64) * stride_km + (h // group) * stride_kh   # GQA: the shared K/V head
    V_seq = V + k_start.to(tl.int64) * stride_vm + (h // group) * stride_vh
    slope = 0.0
    if ALIBI:
        slope = tl.load(SLOPES + seq * stride_sb + h * stride_sh)
    q_pos = (offs_m + (n_k - n_q))[:, None]       # bottom-right: the key each query row sits at

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # region: key-loops
    # keys [lo, hi) that some row of the block sees, [full_lo, full_hi) that all of them see
    lo, hi, full_lo, full_hi = visible_range(start=m0, n_rows=n_q, n_cols=n_k, left=left, right=right,
                                             BLOCK=BLOCK_M, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT)
    hi, mid, end_mid = phase_bounds(lo, hi, full_lo, full_hi, BLOCK=BLOCK_N)
    bounds = (lo, mid, end_mid, hi)
    for phase in tl.static_range(3):   # masked edge, no mask, masked edge (the diagonal, the tail)
        acc, l_i, m_i = fwd_inner(acc, l_i, m_i, q, K_seq, V_seq, bounds[phase], bounds[phase + 1], q_pos,
                                  offs_n, offs_d, n_k, left, right, stride_km, stride_vm, qk_scale, softcap, slope,
                                  HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, MASKED=phase != 1,
                                  HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT, SOFTCAP=SOFTCAP, ALIBI=ALIBI,
                                  PRECISION=PRECISION)
    # endregion: key-loops

    # normalise once; a row that saw no key gives zeros and lse = -inf.  l_i != 0 rather than
    # > 0: a NaN row stays NaN (NaN in, NaN out) instead of reading as empty
    seen = l_i != 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * LN2, float("-inf"))
    row_ok = offs_m < n_q
    rows = tl.arange(0, BLOCK_M)
    o_ptrs = O + (q_start + m0).to(tl.int64) * stride_om + h * stride_oh + rows[:, None] * stride_om + offs_d[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))
    tl.store(LSE + h * total_q + q_start + offs_m, lse, mask=row_ok)
