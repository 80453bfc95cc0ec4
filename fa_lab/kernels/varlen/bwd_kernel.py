"""The packed variable-length FlashAttention-2 backward kernels (@triton.jit code only).

Chapter 5's deterministic backward, one sequence at a time through the work table, in this order:

1. ``varlen_bwd_dq``: **Q-stationary**.  A program owns one query block: dQ += dS K.  Owning those
   rows, it first computes their ``delta = rowsum(dO ∘ O)`` (minus ``dlse`` when the lse has a
   gradient) and the lse in base 2 (``+inf`` for a row that sees no key, so that its recomputed P is
   0) with ``row_terms``, and stores both for the next kernel.
2. ``varlen_bwd_dkdv``: **K/V-stationary**.  A program owns one key block of one sequence and
   one K/V head, keeps K, V, dK and dV on chip, and walks the query blocks that see the block
   for every query head of its GQA group: dV += Pᵀ dO, dK += dSᵀ Q.

Every gradient element is written by one program: no atomics, bit-identical runs.  P is
recomputed from Q, K and the saved lse; with a soft cap the chain rule goes through the tanh
(``dS_raw = dS · (1 - t²)``); ALiBi's slopes are constants and get no gradient.
"""
from __future__ import annotations

import triton
import triton.language as tl

from fa_lab.kernels.triton.key_ranges import visible_range
from fa_lab.kernels.triton.row_terms import row_terms
from fa_lab.kernels.varlen.schedule import scheduled_block
from fa_lab.kernels.varlen.tiles import load_rows, modified_scores, phase_bounds, visible


@triton.jit
def dkdv_step(dk, dv, k, v, q_tile, do_tile, LSE2_h, DELTA_h, start_m, offs_k, n_q, n_k, left, right,
              stride_qm, stride_dom, qk_scale, softcap, slope,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
              HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
              PRECISION: tl.constexpr):
    """One query tile (rows ``start_m ..``, pointers ``q_tile`` / ``do_tile``) against the key block.

    Works on the transposes (keys as rows): Sᵀ = K Qᵀ, so that Pᵀ is already the left operand of Pᵀ dO.
    Rows past the sequence load as zeros with lse2 = +inf: their P is 0, no mask needed for them.
    """
    rows = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_m = start_m + rows
    qT = load_rows(q_tile, rows, stride_qm, offs_d, n_q - start_m, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
                   CHECK_ROWS=MASKED, TRANSPOSED=True)
    doT = load_rows(do_tile, rows, stride_dom, offs_d, n_q - start_m, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
                    CHECK_ROWS=MASKED, TRANSPOSED=True)
    if MASKED:
        lse2 = tl.load(LSE2_h + offs_m, mask=offs_m < n_q, other=float("inf"))
        Di = tl.load(DELTA_h + offs_m, mask=offs_m < n_q, other=0.0)
    else:
        lse2 = tl.load(LSE2_h + offs_m)
        Di = tl.load(DELTA_h + offs_m)
    q_pos = (offs_m + (n_k - n_q))[None, :]
    k_pos = offs_k[:, None]
    sT, tT = modified_scores(tl.dot(k, qT, input_precision=PRECISION), q_pos, k_pos, qk_scale, softcap, slope,
                             SOFTCAP=SOFTCAP, ALIBI=ALIBI)
    pT = tl.math.exp2(sT - lse2[None, :])
    if MASKED:
        pT = tl.where(visible(q_pos, k_pos, n_k, left, right, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT), pT, 0.0)
    dv += tl.dot(pT.to(doT.dtype), tl.trans(doT), input_precision=PRECISION)
    dpT = tl.dot(v, doT, input_precision=PRECISION)
    dsT = pT * (dpT - Di[None, :])
    if SOFTCAP:   # through the cap: d(cap·tanh(x))/dx = 1 - tanh²  (the scale is applied at the end)
        dsT = dsT * (1.0 - tT * tT)
    dk += tl.dot(dsT.to(qT.dtype), tl.trans(qT), input_precision=PRECISION)
    return dk, dv


@triton.jit
def dkdv_phase(dk, dv, k, v, Q_seq, DO_seq, LSE2_seq, DELTA_seq, SLOPES_seq, start, n_blocks, group, offs_k,
               n_q, n_k, left, right, stride_qm, stride_qh, stride_dom, stride_doh, stride_sh, total_q,
               qk_scale, softcap,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
               HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
               PRECISION: tl.constexpr):
    """``n_blocks`` query tiles from row ``start``, for every query head of the group, in one flat loop.

    The ``*_seq`` pointers sit at the group's first head and the sequence's first row.  One flat loop
    keeps fewer registers live than two nested ones; the group's sum happens in registers.
    """
    for it in range(0, group * n_blocks):
        # max(.., 1): a division by a constant 0 is undefined even in a loop that never runs
        g = it // tl.maximum(n_blocks, 1)
        start_m = start + (it - g * n_blocks) * BLOCK_M
        row = tl.cast(start_m, tl.int64)
        g = tl.cast(g, tl.int64)   # head offsets of an arbitrary layout may pass int32
        slope = 0.0
        if ALIBI:
            slope = tl.load(SLOPES_seq + g * stride_sh)
        dk, dv = dkdv_step(dk, dv, k, v, Q_seq + g * stride_qh + row * stride_qm,
                           DO_seq + g * stride_doh + row * stride_dom, LSE2_seq + g * total_q,
                           DELTA_seq + g * total_q, start_m, offs_k, n_q, n_k, left, right, stride_qm, stride_dom,
                           qk_scale, softcap, slope, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M,
                           MASKED=MASKED, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT, SOFTCAP=SOFTCAP, ALIBI=ALIBI,
                           PRECISION=PRECISION)
    return dk, dv


@triton.jit
def varlen_bwd_dkdv(Q, K, V, DO, LSE2, DELTA, DK, DV, CU_Q, CU_K, SCHEDULE, SLOPES,
                    stride_qm, stride_qh, stride_km, stride_kh, stride_vm, stride_vh, stride_dom, stride_doh,
                    stride_dkm, stride_dkh, stride_dvm, stride_dvh, stride_sb, stride_sh,
                    total_q, n_programs, group, left, right, qk_scale, softcap, sm_scale,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
                    PRECISION: tl.constexpr):
    """Grid ``(programs over key blocks, Hkv)``: dK and dV of one key block of one sequence."""
    seq, block = scheduled_block(SCHEDULE, tl.program_id(0), n_programs)
    if seq < 0:
        return
    kh = tl.program_id(1).to(tl.int64)
    q_start = tl.load(CU_Q + seq)
    n_q = tl.load(CU_Q + seq + 1) - q_start
    k_start = tl.load(CU_K + seq)
    n_k = tl.load(CU_K + seq + 1) - k_start
    n0 = block * BLOCK_N
    rows = tl.arange(0, BLOCK_N)
    offs_k = n0 + rows
    offs_d = tl.arange(0, BLOCK_D)
    k_row = (k_start + n0).to(tl.int64)
    k = load_rows(K + k_row * stride_km + kh * stride_kh, rows, stride_km, offs_d, n_k - n0,
                  HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, CHECK_ROWS=True, TRANSPOSED=False)
    v = load_rows(V + k_row * stride_vm + kh * stride_vh, rows, stride_vm, offs_d, n_k - n0,
                  HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, CHECK_ROWS=True, TRANSPOSED=False)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # Query rows that see some key of the block: [lo, hi); rows in [full_lo, full_hi) see all of them.
    # The forward's question with the mask transposed: key j is seen by query i when query i sees
    # key j, so the window's sides swap.  (Keys past n_k need no mask: their rows are never stored.)
    lo, hi, full_lo, full_hi = visible_range(start=n0, n_rows=n_k, n_cols=n_q, left=right, right=left,
                                             BLOCK=BLOCK_N, HAS_LEFT=HAS_RIGHT, HAS_RIGHT=HAS_LEFT)
    hi, mid, end_mid = phase_bounds(lo, hi, full_lo, full_hi, BLOCK=BLOCK_M)
    h0 = kh * group   # the group's first query head
    q_seq = tl.cast(q_start, tl.int64)
    Q_seq = Q + q_seq * stride_qm + h0 * stride_qh
    DO_seq = DO + q_seq * stride_dom + h0 * stride_doh
    LSE2_seq = LSE2 + h0 * total_q + q_start
    DELTA_seq = DELTA + h0 * total_q + q_start
    SLOPES_seq = SLOPES + seq * stride_sb + h0 * stride_sh
    starts = (lo, mid, end_mid)
    counts = ((mid - lo) // BLOCK_M, (end_mid - mid) // BLOCK_M, tl.cdiv(tl.maximum(hi - end_mid, 0), BLOCK_M))
    for phase in tl.static_range(3):   # masked, without a mask, masked
        dk, dv = dkdv_phase(dk, dv, k, v, Q_seq, DO_seq, LSE2_seq, DELTA_seq, SLOPES_seq, starts[phase],
                            counts[phase], group, offs_k, n_q, n_k, left, right, stride_qm, stride_qh, stride_dom,
                            stride_doh, stride_sh, total_q, qk_scale, softcap, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
                            BLOCK_M=BLOCK_M, MASKED=phase != 1, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT,
                            SOFTCAP=SOFTCAP, ALIBI=ALIBI, PRECISION=PRECISION)

    mask = (offs_k < n_k)[:, None] & (offs_d[None, :] < HEAD_DIM)
    tl.store(DK + k_row * stride_dkm + kh * stride_dkh + rows[:, None] * stride_dkm + offs_d[None, :],
             (dk * sm_scale).to(DK.dtype.element_ty), mask=mask)
    tl.store(DV + k_row * stride_dvm + kh * stride_dvh + rows[:, None] * stride_dvm + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=mask)


@triton.jit
def dq_phase(dq, q, do, lse2, Di, K_seq, V_seq, start, stop, q_pos, offs_n, offs_d, n_k, left, right,
             stride_kn, stride_vn, qk_scale, softcap, slope,
             HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
             HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
             PRECISION: tl.constexpr):
    """The query tile against the key tiles ``[start, stop)``: dQ += dS K, with dS = P ∘ (dP - delta)."""
    k_tile = K_seq + tl.cast(start, tl.int64) * stride_kn
    v_tile = V_seq + tl.cast(start, tl.int64) * stride_vn
    for start_n in range(start, stop, BLOCK_N):
        kT = load_rows(k_tile, offs_n, stride_kn, offs_d, n_k - start_n, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
                       CHECK_ROWS=MASKED, TRANSPOSED=True)
        vT = load_rows(v_tile, offs_n, stride_vn, offs_d, n_k - start_n, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
                       CHECK_ROWS=MASKED, TRANSPOSED=True)
        k_pos = (start_n + offs_n)[None, :]
        s, t = modified_scores(tl.dot(q, kT, input_precision=PRECISION), q_pos, k_pos, qk_scale, softcap, slope,
                               SOFTCAP=SOFTCAP, ALIBI=ALIBI)
        p = tl.math.exp2(s - lse2[:, None])
        if MASKED:   # keys past n_k load as zeros, whose exp is not 0: they need the mask too
            p = tl.where(visible(q_pos, k_pos, n_k, left, right, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT), p, 0.0)
        dp = tl.dot(do, vT, input_precision=PRECISION)
        ds = p * (dp - Di[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq = tl.dot(ds.to(kT.dtype), tl.trans(kT), dq, input_precision=PRECISION)
        k_tile += BLOCK_N * stride_kn
        v_tile += BLOCK_N * stride_vn
    return dq


@triton.jit
def varlen_bwd_dq(Q, K, V, DO, LSE2, DELTA, DQ, O, LSE, DLSE, CU_Q, CU_K, SCHEDULE, SLOPES,
                  stride_qm, stride_qh, stride_km, stride_kh, stride_vm, stride_vh, stride_dom, stride_doh,
                  stride_dqm, stride_dqh, stride_om, stride_oh, stride_sb, stride_sh,
                  total_q, n_programs, group, left, right, qk_scale, softcap, sm_scale,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
                  PRECISION: tl.constexpr, HAS_DLSE: tl.constexpr):
    """Grid ``(programs over query blocks, H)``: dQ of one query block of one sequence, and the block's
    delta and base-2 lse, written to DELTA and LSE2 ``(H, total_q)`` for the dK/dV pass."""
    seq, block = scheduled_block(SCHEDULE, tl.program_id(0), n_programs)
    if seq < 0:
        return
    h = tl.program_id(1).to(tl.int64)
    q_start = tl.load(CU_Q + seq)
    n_q = tl.load(CU_Q + seq + 1) - q_start
    k_start = tl.load(CU_K + seq)
    n_k = tl.load(CU_K + seq + 1) - k_start
    m0 = block * BLOCK_M
    rows = tl.arange(0, BLOCK_M)
    offs_m = m0 + rows
    offs_d = tl.arange(0, BLOCK_D)
    q_row = (q_start + m0).to(tl.int64)
    q = load_rows(Q + q_row * stride_qm + h * stride_qh, rows, stride_qm, offs_d, n_q - m0,
                  HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, CHECK_ROWS=True, TRANSPOSED=False)
    do = load_rows(DO + q_row * stride_dom + h * stride_doh, rows, stride_dom, offs_d, n_q - m0,
                   HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, CHECK_ROWS=True, TRANSPOSED=False)
    rows_ok = offs_m < n_q
    # this program owns these rows: their delta and base-2 lse are computed here, for its own loop and for
    # the dK/dV pass that runs after it (no separate kernel, no second read of dO)
    o = load_rows(O + (q_start + m0).to(tl.int64) * stride_om + h * stride_oh, rows, stride_om, offs_d, n_q - m0,
                  HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, CHECK_ROWS=True, TRANSPOSED=False)
    at = h * total_q + q_start + offs_m
    lse = tl.load(LSE + at, mask=rows_ok, other=float("-inf"))   # past n_q: lse2 = +inf, P = 0
    dlse = 0.0
    if HAS_DLSE:
        dlse = tl.load(DLSE + at, mask=rows_ok, other=0.0)
    lse2, Di = row_terms(o, do, lse, dlse, HAS_DLSE)
    tl.store(DELTA + at, Di, mask=rows_ok)
    tl.store(LSE2 + at, lse2, mask=rows_ok)
    slope = 0.0
    if ALIBI:
        slope = tl.load(SLOPES + seq * stride_sb + h * stride_sh)
    q_pos = (offs_m + (n_k - n_q))[:, None]
    K_seq = K + tl.cast(k_start, tl.int64) * stride_km + (h // group) * stride_kh
    V_seq = V + tl.cast(k_start, tl.int64) * stride_vm + (h // group) * stride_vh
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    lo, hi, full_lo, full_hi = visible_range(start=m0, n_rows=n_q, n_cols=n_k, left=left, right=right,
                                             BLOCK=BLOCK_M, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT)
    hi, mid, end_mid = phase_bounds(lo, hi, full_lo, full_hi, BLOCK=BLOCK_N)
    bounds = (lo, mid, end_mid, hi)
    offs_n = tl.arange(0, BLOCK_N)
    for phase in tl.static_range(3):   # keys [lo, mid) masked, [mid, end_mid) without a mask, [end_mid, hi) masked
        dq = dq_phase(dq, q, do, lse2, Di, K_seq, V_seq, bounds[phase], bounds[phase + 1], q_pos, offs_n, offs_d,
                      n_k, left, right, stride_km, stride_vm, qk_scale, softcap, slope, HEAD_DIM=HEAD_DIM,
                      BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, MASKED=phase != 1, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT,
                      SOFTCAP=SOFTCAP, ALIBI=ALIBI, PRECISION=PRECISION)

    tl.store(DQ + q_row * stride_dqm + h * stride_dqh + rows[:, None] * stride_dqm + offs_d[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=rows_ok[:, None] & (offs_d[None, :] < HEAD_DIM))
