"""A warp-specialized forward for Hopper in Gluon: ``gluon_forward(q, k, v, spec) -> (o, lse)``.

Triton's compiler decides which warps do what.  Gluon, Triton's lower-level language, lets the kernel
say it, as FlashAttention-3 does in CUDA: each program (128 query rows) has three partitions,

* a **loader** warp that issues the TMA copies of Q, then of every K and V tile, into a ring of
  ``STAGES`` shared-memory buffers, each guarded by a ``ready`` and an ``empty`` mbarrier;
* two **consumer** warpgroups, 64 query rows each, that run the online softmax of chapter 4 on the
  Tensor Cores (``wgmma``): S_j = Q K_jᵀ, then P_j V_j into ``acc``.

The two consumers share the K/V tiles but synchronize only through the mbarriers, so while one
computes its softmax (the special-function unit) the other's products run on the Tensor Cores.
Within a consumer, S_j's product is issued before P_{j-1} V_{j-1}'s, so that the next product
is queued while the softmax runs.  ``docs/decisions/gluon-forward.md`` measures both.

Runs on Hopper (sm_90) only, at D = 64, 128 and 256, fp16/bf16, Nq = Nk a multiple of 128, no mask
or the causal one, GQA included; ``problems.gluon_limits`` names what else it refuses.  Gluon has no
interpreter: the CPU world never runs it.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from fa_lab.kernels.gluon.copies import (
    CONSUMER_REGS,
    LOG2E,
    descriptor,
    mma_layout,
    operand_layout,
    tma_load,
    tma_store,
)

#: rows of one consumer warpgroup (a wgmma's M)
BLOCK_M = 64
#: per head dim: (key columns per tile, K/V ring depth).  D = 256 takes 64-key tiles: 128 would need 64
#: more registers a thread for S and P beside its 128 of acc.  At D = 128 three stages measured 1-5%
#: slower than two; at D = 64 a stage is 16 KiB a tensor and three fit easily
TILES = {64: (128, 3), 128: (128, 2), 256: (64, 2)}


@gluon.jit
def load_partition(desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
                   q_row, kv_row, n_blocks, BLOCK_N: gl.constexpr):
    """The loader warp: both consumers' Q tiles once, then K_j and V_j into stage j % STAGES."""
    STAGES: gl.constexpr = k_smem.type.shape[0]
    ROWS: gl.constexpr = desc_q.block_type.shape[0]
    mbarrier.expect(q_bar, 2 * desc_q.block_type.nbytes)
    tma_load(desc_q, [q_row, 0], q_bar, q_smem.index(0))
    tma_load(desc_q, [q_row + ROWS, 0], q_bar, q_smem.index(1))
    for j in range(n_blocks):
        stage = j % STAGES
        # an mbarrier starts in phase 0, so the first lap's wait for "phase 1 done" passes at once
        phase = (j // STAGES) & 1
        mbarrier.wait(k_empty.index(stage), phase ^ 1)
        mbarrier.expect(k_ready.index(stage), desc_k.block_type.nbytes)
        tma_load(desc_k, [kv_row + j * BLOCK_N, 0], k_ready.index(stage), k_smem.index(stage))
        mbarrier.wait(v_empty.index(stage), phase ^ 1)
        mbarrier.expect(v_ready.index(stage), desc_v.block_type.nbytes)
        tma_load(desc_v, [kv_row + j * BLOCK_N, 0], v_ready.index(stage), v_smem.index(stage))


@gluon.jit
def softmax_update(s, m_i, l_i, qk_scale, col0, row0, MASKED: gl.constexpr, s_layout: gl.constexpr,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """One tile of the online softmax in base 2: P (fp32), the rescale alpha, the new m_i and l_i."""
    if MASKED:
        # the causal diagonal: key col is visible to row r when col <= r (Nq = Nk); every row keeps its
        # own key 0 <= col, so no row of a tile is all -inf
        rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
        cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s = gl.where(gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1), s * qk_scale, float("-inf"))
        m_ij = gl.maximum(m_i, gl.max(s, 1))
        p = gl.exp2(s - gl.expand_dims(m_ij, 1))
    else:
        # the scale rides on the max and the subtraction: one FMA per score
        m_ij = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_ij, 1))
    alpha = gl.exp2(m_i - m_ij)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_ij, l_i


@gluon.jit
def consumer_partition(desc_o, LSE, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
                       q_row, row0, n_blocks, n_unmasked, qk_scale,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                       CAUSAL: gl.constexpr, WG: gl.constexpr):
    """Consumer warpgroup ``WG``: rows ``[WG * BLOCK_M, (WG + 1) * BLOCK_M)`` of the program's tile."""
    STAGES: gl.constexpr = k_smem.type.shape[0]
    dtype: gl.constexpr = q_smem.dtype
    # wgmma layouts for one warpgroup (4 warps): S and acc, and P as the register operand of P·V
    s_layout: gl.constexpr = mma_layout(BLOCK_N)
    o_layout: gl.constexpr = mma_layout(HEAD_DIM)
    p_layout: gl.constexpr = operand_layout(o_layout)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    q_tile = q_smem.index(WG)
    q_row = q_row + WG * BLOCK_M
    row0 = row0 + WG * BLOCK_M

    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
    l_i = gl.full([BLOCK_M], 0.0, gl.float32, row_s)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    s_init = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)   # ignored (use_acc=False): gives S its layout

    mbarrier.wait(q_bar, 0)
    # key block 0: S_0 and its softmax, before the loop
    mbarrier.wait(k_ready.index(0), 0)
    s_tok = warpgroup_mma(q_tile, k_smem.index(0).permute((1, 0)), s_init, use_acc=False, is_async=True)
    s, _, _ = warpgroup_mma_wait(0, deps=(s_tok, q_tile, k_smem.index(0)))
    mbarrier.arrive(k_empty.index(0), count=1)
    p, alpha, m_i, l_i = softmax_update(s, m_i, l_i, qk_scale, 0, row0, CAUSAL and n_unmasked == 0, s_layout,
                                        BLOCK_M, BLOCK_N)
    p_op = gl.convert_layout(p.to(dtype), p_layout)

    # region: overlap
    for j in range(1, n_blocks):
        stage = j % STAGES
        prev = (j - 1) % STAGES
        # issue S_j = Q K_jᵀ, then P_{j-1} V_{j-1}; wait for S_j only (the older of the two groups)
        mbarrier.wait(k_ready.index(stage), (j // STAGES) & 1)
        s_tok = warpgroup_mma(q_tile, k_smem.index(stage).permute((1, 0)), s_init, use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
        acc_tok = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
        s, _, _ = warpgroup_mma_wait(1, deps=(s_tok, q_tile, k_smem.index(stage)))
        mbarrier.arrive(k_empty.index(stage), count=1)
        if CAUSAL and j >= n_unmasked:
            p, alpha, m_new, l_i = softmax_update(s, m_i, l_i, qk_scale, j * BLOCK_N, row0, True, s_layout,
                                                  BLOCK_M, BLOCK_N)
        else:
            p, alpha, m_new, l_i = softmax_update(s, m_i, l_i, qk_scale, j * BLOCK_N, row0, False, s_layout,
                                                  BLOCK_M, BLOCK_N)
        acc, _, _ = warpgroup_mma_wait(0, deps=(acc_tok, p_op, v_smem.index(prev)))
        mbarrier.arrive(v_empty.index(prev), count=1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        m_i = m_new
    # endregion: overlap

    last = (n_blocks - 1) % STAGES
    mbarrier.wait(v_ready.index(last), ((n_blocks - 1) // STAGES) & 1)
    acc_tok = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
    acc, _, _ = warpgroup_mma_wait(0, deps=(acc_tok, p_op, v_smem.index(last)))
    mbarrier.arrive(v_empty.index(last), count=1)

    acc = acc / gl.expand_dims(gl.convert_layout(l_i, row_o), 1)
    # O goes out through Q's buffer: every product that read Q has completed
    fence_async_shared()
    q_tile.store(acc.to(dtype))
    fence_async_shared()
    tma_store(desc_o, [q_row, 0], q_tile)
    lse = (m_i + gl.log2(l_i)) * 0.6931471805599453   # natural log, as every forward of the book
    gl.store(LSE + q_row + gl.arange(0, BLOCK_M, layout=row_s), lse)
    tma.store_wait(0)


@gluon.jit
def attn_fwd_ws(desc_q, desc_k, desc_v, desc_o, LSE, qk_scale, n, heads, kv_heads,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                STAGES: gl.constexpr, CAUSAL: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    """One program: 2 * BLOCK_M query rows of one (batch, head), its K/V streamed once for both consumers."""
    pid_m = gl.program_id(0)
    bh = gl.program_id(1)
    kv_bh = (bh // heads) * kv_heads + (bh % heads) // (heads // kv_heads)
    row0 = pid_m * 2 * BLOCK_M
    q_row = bh * n + row0
    kv_row = kv_bh * n
    if CAUSAL:
        n_blocks = (row0 + 2 * BLOCK_M) // BLOCK_N   # up to the diagonal
        n_unmasked = row0 // BLOCK_N                 # blocks left of it need no mask
    else:
        n_blocks = n // BLOCK_N
        n_unmasked = n_blocks
    dtype: gl.constexpr = desc_q.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2] + desc_q.block_type.shape, desc_q.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES] + desc_k.block_type.shape, desc_k.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES] + desc_v.block_type.shape, desc_v.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        # a stage is free once both consumers are done with it
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_empty.index(i), count=2)
    gl.warp_specialize([
        (consumer_partition, (desc_o, LSE, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
                              q_row, row0, n_blocks, n_unmasked, qk_scale, BLOCK_M, BLOCK_N, HEAD_DIM, CAUSAL, 0)),
        (consumer_partition, (desc_o, LSE, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
                              q_row, row0, n_blocks, n_unmasked, qk_scale, BLOCK_M, BLOCK_N, HEAD_DIM, CAUSAL, 1)),
        (load_partition, (desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty,
                          v_empty, q_row, kv_row, n_blocks, BLOCK_N)),
    ], [4, 1], [CONSUMER_REGS, 24])


def gluon_forward(q, k, v, spec):
    """``(o, lse)``: o in q's dtype, lse float32 ``(B, H, N)``, natural log (inputs checked by the registry)."""
    q, k, v = (t.contiguous() for t in (q, k, v))
    B, H, N, D = q.shape
    o = torch.empty_like(q)
    lse = torch.empty(B, H, N, device=q.device, dtype=torch.float32)
    block_n, stages = TILES[D]
    grid = (N // (2 * BLOCK_M), B * H)
    # 12 warps launch (the loader's warpgroup counts whole) on at most 65,536 / (12 · 32) = 170 registers a
    # thread, 168 in steps of 8; setmaxnreg then moves them from the loader (24) to the consumers (240)
    attn_fwd_ws[grid](descriptor(q, BLOCK_M), descriptor(k, block_n), descriptor(v, block_n),
                      descriptor(o, BLOCK_M), lse, spec.scale * LOG2E, N, H, k.shape[1],
                      BLOCK_M, block_n, D, stages, spec.mask == "causal", CONSUMER_REGS,
                      num_warps=4, maxnreg=168)
    return o, lse


__all__ = ["gluon_forward"]
