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
is queued while the softmax runs.

At D ≤ 128 the grid is **persistent**: one program per multiprocessor walks tile after tile (``tile_of``),
its ring running on from one tile into the next, so the loader brings the next tile's first K/V blocks
and Q while the consumers finish this tile's products and store its O.  ``docs/decisions/gluon-forward.md``
measures all three choices.

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
    launch,
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
def tile_of(tile, n, heads, kv_heads, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """Tile ``tile`` of the persistent walk: its first query row (in Q's rows and in its head), its head's first
    K/V row, and how many key blocks it visits, of which the first ``n_unmasked`` need no mask.  Tiles go head
    by head, so the programs running at one time share a few heads' K/V in L2; under the causal mask a head's
    last query blocks (the most keys) come first."""
    n_m = n // ROWS
    bh = tile // n_m
    pid_m = tile - bh * n_m
    if CAUSAL:
        pid_m = n_m - 1 - pid_m
    kv_bh = (bh // heads) * kv_heads + (bh % heads) // (heads // kv_heads)
    row0 = pid_m * ROWS
    if CAUSAL:
        n_blocks = (row0 + ROWS) // BLOCK_N   # up to the diagonal
        n_unmasked = row0 // BLOCK_N          # blocks left of it need no mask
    else:
        n_blocks = n // BLOCK_N
        n_unmasked = n_blocks
    return bh * n + row0, row0, kv_bh * n, n_blocks, n_unmasked


@gluon.jit
def load_partition(desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty,
                   v_empty, n, heads, kv_heads, n_tiles, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """The loader warp: for each of the program's tiles, K_j and V_j into the ring and, once the previous
    tile's are free, both consumers' Q tiles.  The ring runs on across tiles, so the next tile's first key
    blocks arrive while the consumers still finish this one."""
    STAGES: gl.constexpr = k_smem.type.shape[0]
    ROWS: gl.constexpr = desc_q.block_type.shape[0]
    it = 0        # key blocks issued so far, over all tiles: the ring's position
    count = 0     # tiles begun
    for tile in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        q_row, _, kv_row, n_blocks, _ = tile_of(tile, n, heads, kv_heads, 2 * ROWS, BLOCK_N, CAUSAL)
        for j in range(n_blocks):
            stage = it % STAGES
            # an mbarrier starts in phase 0, so the first lap's wait for "phase 1 done" passes at once
            phase = (it // STAGES) & 1
            mbarrier.wait(k_empty.index(stage), phase ^ 1)
            mbarrier.expect(k_ready.index(stage), desc_k.block_type.nbytes)
            tma_load(desc_k, [kv_row + j * BLOCK_N, 0], k_ready.index(stage), k_smem.index(stage))
            mbarrier.wait(v_empty.index(stage), phase ^ 1)
            mbarrier.expect(v_ready.index(stage), desc_v.block_type.nbytes)
            tma_load(desc_v, [kv_row + j * BLOCK_N, 0], v_ready.index(stage), v_smem.index(stage))
            if j == 0:
                # Q after the first K/V tile: that one need not wait for the previous tile's Q to be free
                mbarrier.wait(q_empty, (count & 1) ^ 1)
                mbarrier.expect(q_ready, 2 * desc_q.block_type.nbytes)
                tma_load(desc_q, [q_row, 0], q_ready, q_smem.index(0))
                tma_load(desc_q, [q_row + ROWS, 0], q_ready, q_smem.index(1))
            it += 1
        count += 1


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
def consumer_partition(desc_o, LSE, q_smem, o_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty,
                       v_empty, n, heads, kv_heads, n_tiles, qk_scale,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                       CAUSAL: gl.constexpr, O_APART: gl.constexpr, WG: gl.constexpr):
    """Consumer warpgroup ``WG``: rows ``[WG * BLOCK_M, (WG + 1) * BLOCK_M)`` of each of the program's tiles.
    With ``O_APART`` O has a buffer of its own and Q's is free for the next tile once the tile's last S is
    computed; without, O leaves through Q's buffer and the next Q waits for that copy."""
    STAGES: gl.constexpr = k_smem.type.shape[0]
    dtype: gl.constexpr = q_smem.dtype
    # wgmma layouts for one warpgroup (4 warps): S and acc, and P as the register operand of P·V
    s_layout: gl.constexpr = mma_layout(BLOCK_N)
    o_layout: gl.constexpr = mma_layout(HEAD_DIM)
    p_layout: gl.constexpr = operand_layout(o_layout)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    q_tile = q_smem.index(WG)
    o_tile = o_smem.index(WG)
    s_init = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)   # ignored (use_acc=False): gives S its layout
    base = 0      # key blocks consumed so far, over all tiles: the ring's position
    count = 0     # tiles begun
    for tile in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        q_row, row0, _, n_blocks, n_unmasked = tile_of(tile, n, heads, kv_heads, 2 * BLOCK_M, BLOCK_N, CAUSAL)
        q_row = q_row + WG * BLOCK_M
        row0 = row0 + WG * BLOCK_M
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
        l_i = gl.full([BLOCK_M], 0.0, gl.float32, row_s)
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)

        mbarrier.wait(q_ready, count & 1)
        # key block 0: S_0 and its softmax, before the loop
        stage = base % STAGES
        mbarrier.wait(k_ready.index(stage), (base // STAGES) & 1)
        s_tok = warpgroup_mma(q_tile, k_smem.index(stage).permute((1, 0)), s_init, use_acc=False, is_async=True)
        s, _, _ = warpgroup_mma_wait(0, deps=(s_tok, q_tile, k_smem.index(stage)))
        mbarrier.arrive(k_empty.index(stage), count=1)
        p, alpha, m_i, l_i = softmax_update(s, m_i, l_i, qk_scale, 0, row0, CAUSAL and n_unmasked == 0, s_layout,
                                            BLOCK_M, BLOCK_N)
        p_op = gl.convert_layout(p.to(dtype), p_layout)

        # region: overlap
        for j in range(1, n_blocks):
            stage = (base + j) % STAGES
            prev = (base + j - 1) % STAGES
            # issue S_j = Q K_jᵀ, then P_{j-1} V_{j-1}; wait for S_j only (the older of the two groups)
            mbarrier.wait(k_ready.index(stage), ((base + j) // STAGES) & 1)
            s_tok = warpgroup_mma(q_tile, k_smem.index(stage).permute((1, 0)), s_init, use_acc=False,
                                  is_async=True)
            mbarrier.wait(v_ready.index(prev), ((base + j - 1) // STAGES) & 1)
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
        if O_APART:
            mbarrier.arrive(q_empty, count=1)   # every S of the tile is done: the loader may bring the next Q

        last = (base + n_blocks - 1) % STAGES
        mbarrier.wait(v_ready.index(last), ((base + n_blocks - 1) // STAGES) & 1)
        acc_tok = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
        acc, _, _ = warpgroup_mma_wait(0, deps=(acc_tok, p_op, v_smem.index(last)))
        mbarrier.arrive(v_empty.index(last), count=1)

        acc = acc / gl.expand_dims(gl.convert_layout(l_i, row_o), 1)
        tma.store_wait(0)   # the previous tile's O has left the buffer
        fence_async_shared()
        o_tile.store(acc.to(dtype))
        fence_async_shared()
        tma_store(desc_o, [q_row, 0], o_tile)
        lse = (m_i + gl.log2(l_i)) * 0.6931471805599453   # natural log, as every forward of the book
        gl.store(LSE + q_row + gl.arange(0, BLOCK_M, layout=row_s), lse)
        if not O_APART:
            tma.store_wait(0)
            mbarrier.arrive(q_empty, count=1)
        base += n_blocks
        count += 1
    tma.store_wait(0)


@gluon.jit
def attn_fwd_ws(desc_q, desc_k, desc_v, desc_o, LSE, qk_scale, n, heads, kv_heads, n_tiles,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                STAGES: gl.constexpr, CAUSAL: gl.constexpr, O_APART: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    """A persistent program: tiles of 2 * BLOCK_M query rows of one (batch, head), ``program_id``, then every
    ``num_programs``-th after it; each tile's K/V streamed once for both consumers.  O has a buffer of its own
    with ``O_APART`` (``o_apart``), else it leaves through Q's."""
    dtype: gl.constexpr = desc_q.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2] + desc_q.block_type.shape, desc_q.layout)
    if O_APART:
        o_smem = gl.allocate_shared_memory(dtype, [2] + desc_o.block_type.shape, desc_o.layout)
    else:
        o_smem = q_smem
    k_smem = gl.allocate_shared_memory(dtype, [STAGES] + desc_k.block_type.shape, desc_k.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES] + desc_v.block_type.shape, desc_v.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    mbarrier.init(q_empty, count=2)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        # a stage is free once both consumers are done with it
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_empty.index(i), count=2)
    gl.warp_specialize([
        (consumer_partition, (desc_o, LSE, q_smem, o_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready,
                              k_empty, v_empty, n, heads, kv_heads, n_tiles, qk_scale, BLOCK_M, BLOCK_N, HEAD_DIM,
                              CAUSAL, O_APART, 0)),
        (consumer_partition, (desc_o, LSE, q_smem, o_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready,
                              k_empty, v_empty, n, heads, kv_heads, n_tiles, qk_scale, BLOCK_M, BLOCK_N, HEAD_DIM,
                              CAUSAL, O_APART, 1)),
        (load_partition, (desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready,
                          k_empty, v_empty, n, heads, kv_heads, n_tiles, BLOCK_N, CAUSAL)),
    ], [4, 1], [CONSUMER_REGS, 24])


def o_apart(head_dim: int) -> bool:
    """Whether O gets a shared-memory buffer of its own: up to D = 128.  At D = 256 Q, two K/V stages and an O
    buffer would need 256 KiB, more than a block may have."""
    return head_dim <= 128


def programs(n_tiles: int, apart: bool, device: torch.device) -> int:
    """The grid: one program per multiprocessor (a program's shared memory fills one), or fewer tiles, when O
    has a buffer of its own (``apart``) so a program loads its next Q while it stores an O.  Without one a
    persistent program would wait on each store, and one program per tile measured faster."""
    if not apart:
        return n_tiles
    return min(n_tiles, torch.cuda.get_device_properties(device).multi_processor_count)


def gluon_forward(q, k, v, spec):
    """``(o, lse)``: o in q's dtype, lse float32 ``(B, H, N)``, natural log (inputs checked by the registry)."""
    q, k, v = (t.contiguous() for t in (q, k, v))
    B, H, N, D = q.shape
    o = torch.empty_like(q)
    lse = torch.empty(B, H, N, device=q.device, dtype=torch.float32)
    block_n, stages = TILES[D]
    n_tiles = B * H * (N // (2 * BLOCK_M))
    causal, apart = spec.mask == "causal", o_apart(D)
    descriptors = (descriptor(q, BLOCK_M), descriptor(k, block_n), descriptor(v, block_n), descriptor(o, BLOCK_M))
    meta = dict(BLOCK_M=BLOCK_M, BLOCK_N=block_n, HEAD_DIM=D, STAGES=stages, CAUSAL=causal, O_APART=apart,
                CONSUMER_REGS=CONSUMER_REGS)
    launch(attn_fwd_ws, (programs(n_tiles, apart, q.device),),
           (*descriptors, lse, spec.scale * LOG2E, N, H, k.shape[1], n_tiles), meta,
           key=(q.dtype, q.device, N, H, k.shape[1], n_tiles, D, causal))
    return o, lse


__all__ = ["gluon_forward"]
