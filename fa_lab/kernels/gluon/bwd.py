"""Chapter 5's two-pass backward in Gluon for Hopper: ``gluon_backward(q, k, v, o, lse, do, spec)``.

The same two deterministic passes as ``fa_lab.kernels.triton.bwd`` (each gradient element written by one
program, no atomics), laid out as the forward of ``fwd.py``: a loader warp streams tiles through
mbarrier-guarded stages, two consumer warpgroups share them and synchronize only through those barriers.

* ``bwd_dq_ws`` (Q-stationary), first: each consumer owns 64 query rows, computes their D = rowsum(O ∘ dO)
  and base-2 lse (stored for the second pass), then walks the K/V tiles: S = Q Kᵀ, dP = dO Vᵀ,
  dS = P ∘ (dP − D), dQ += dS K.
* ``bwd_dkdv_ws`` (K/V-stationary): each consumer owns 64 keys and walks the query tiles of every head of
  its GQA group: Sᵀ = K Qᵀ, Pᵀ from the saved lse, dV += Pᵀ dO, dSᵀ = Pᵀ ∘ (V dOᵀ − D), dK += dSᵀ Q.

The problems it takes are the forward's (``problems.gluon_limits``: Nq = Nk a multiple of 128) at the head dims
of ``problems.BACKWARD_HEAD_DIMS``; ``flash_gluon`` (``registered.py``) sends the others, like a gradient on the
lse, to the Triton backward.
"""
# The backward's own measurements are in docs/decisions/gluon-backward.md.
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
from fa_lab.kernels.gluon.problems import BACKWARD_HEAD_DIMS

#: rows (queries or keys) of one consumer warpgroup
BLOCK = 64
#: per head dim, keys of the K/V tiles streamed past the dQ pass's consumers.  At D = 64 tiles of 128 keys
#: halve the barrier round trips and measured 5% faster
KEY_TILE = {64: 128, 128: 64}
#: per head dim, KEY_TILE boxes in one streamed K/V tile of the dQ pass: 2 takes them as a pair whose products
#: interleave (``dq_pair``)
KEY_SLICES = {64: 1, 128: 2}
#: per head dim, queries of the Q/dO tiles streamed past the dK/dV pass's consumers: a consumer takes a tile of
#: 128 as two slices of 64 whose products interleave (``dkdv_pair``; at D = 128 that would need 256 registers a
#: thread)
QUERY_TILE = {64: 128, 128: 64}
#: depth of the streamed ring (a stage: one tile of each of two tensors, 32 KiB at D = 128)
STAGES = 2


@gluon.jit
def stream_partition(desc_a, desc_b, desc_c, desc_d, c_smem, d_smem, a_smem, b_smem, fixed_bar, ready, empty,
                     fixed_row, first, n_rows, n_tiles, n_iters, start):
    """The loader warp: the consumers' fixed tiles of C and D once (two halves each, one per consumer), then
    tile ``it`` of A and B into stage ``it % STAGES``, walking ``n_tiles`` tiles from ``start`` in each of
    ``n_iters // n_tiles`` heads of ``n_rows`` rows after ``first``.  A tile is ``SLICES`` boxes of ``desc_a``'s
    rows (the ring holds ``SLICES`` buffers a stage), all behind the stage's one barrier."""
    STAGES: gl.constexpr = ready.type.shape[0]
    SLICES: gl.constexpr = a_smem.type.shape[0] // STAGES
    BLOCK: gl.constexpr = desc_c.block_type.shape[0]
    BOX: gl.constexpr = desc_a.block_type.shape[0]
    mbarrier.expect(fixed_bar, 4 * desc_c.block_type.nbytes)
    tma_load(desc_c, [fixed_row, 0], fixed_bar, c_smem.index(0))
    tma_load(desc_c, [fixed_row + BLOCK, 0], fixed_bar, c_smem.index(1))
    tma_load(desc_d, [fixed_row, 0], fixed_bar, d_smem.index(0))
    tma_load(desc_d, [fixed_row + BLOCK, 0], fixed_bar, d_smem.index(1))
    for it in range(n_iters):
        g = it // n_tiles
        row = first + g * n_rows + start + (it - g * n_tiles) * SLICES * BOX
        stage = it % STAGES
        mbarrier.wait(empty.index(stage), ((it // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(stage), 2 * SLICES * desc_a.block_type.nbytes)
        for h in gl.static_range(SLICES):
            tma_load(desc_a, [row + h * BOX, 0], ready.index(stage), a_smem.index(stage * SLICES + h))
            tma_load(desc_b, [row + h * BOX, 0], ready.index(stage), b_smem.index(stage * SLICES + h))


@gluon.jit
def dq_consumer(desc_dq, O, LSE, LSE2, Delta, q_smem, do_smem, k_smem, v_smem, fixed_bar, ready, empty,
                q_row, row0, n_iters, sm_scale, qk_scale, BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr,
                CAUSAL: gl.constexpr, WG: gl.constexpr):
    """Consumer ``WG`` of the dQ pass: query rows ``row0 + WG·BLOCK ...`` against K/V tiles 0 .. n_iters."""
    STAGES: gl.constexpr = ready.type.shape[0]
    BOX: gl.constexpr = k_smem.type.shape[1]
    SLICES: gl.constexpr = k_smem.type.shape[0] // STAGES
    BLOCK_N: gl.constexpr = SLICES * BOX
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = mma_layout(BOX)
    g_layout: gl.constexpr = mma_layout(HEAD_DIM)
    a_layout: gl.constexpr = operand_layout(g_layout)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    q_tile = q_smem.index(WG)
    do_tile = do_smem.index(WG)
    q_row = q_row + WG * BLOCK
    rows = row0 + WG * BLOCK + gl.arange(0, BLOCK, layout=row_s)

    mbarrier.wait(fixed_bar, 0)
    # this warpgroup's rows: D = rowsum(O ∘ dO) and the base-2 lse, here and for the dK/dV pass
    offs = q_row + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, io_layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, io_layout))
    o = gl.load(O + gl.expand_dims(offs, 1) * HEAD_DIM + gl.expand_dims(cols, 0))
    do = do_tile.load(io_layout)
    delta = gl.convert_layout(gl.sum(o.to(gl.float32) * do.to(gl.float32), 1), row_s)
    lse2 = gl.load(LSE + q_row + gl.arange(0, BLOCK, layout=row_s)) * 1.4426950408889634
    gl.store(Delta + q_row + gl.arange(0, BLOCK, layout=row_s), delta)
    gl.store(LSE2 + q_row + gl.arange(0, BLOCK, layout=row_s), lse2)

    dq = gl.zeros([BLOCK, HEAD_DIM], gl.float32, g_layout)
    s_init = gl.zeros([BLOCK, BOX], gl.float32, s_layout)
    for j in range(n_iters):
        stage = j % STAGES
        mbarrier.wait(ready.index(stage), (j // STAGES) & 1)
        if SLICES == 2:
            # the last tile meets the diagonal of these rows; before it every key is kept.  One call for both
            # cases (see dkdv_consumer)
            limit = rows + gl.where(j * BLOCK_N >= row0, 0, n_iters * BLOCK_N)
            dq = dq_pair(q_tile, do_tile, k_smem.index(2 * stage), k_smem.index(2 * stage + 1),
                         v_smem.index(2 * stage), v_smem.index(2 * stage + 1), dq, lse2, delta, limit,
                         j * BLOCK_N, qk_scale, CAUSAL)
        else:
            k_tile = k_smem.index(stage)
            v_tile = v_smem.index(stage)
            s_tok = warpgroup_mma(q_tile, k_tile.permute((1, 0)), s_init, use_acc=False, is_async=True)
            dp_tok = warpgroup_mma(do_tile, v_tile.permute((1, 0)), s_init, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(1, deps=(s_tok,))
            p = gl.exp2(s * qk_scale - gl.expand_dims(lse2, 1))
            if CAUSAL:
                if j * BLOCK_N >= row0:   # the program's last key tiles meet the diagonal of its rows
                    keys = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_s)
                    p = gl.where(gl.expand_dims(keys, 0) <= gl.expand_dims(rows, 1), p, 0.0)
            dp = warpgroup_mma_wait(0, deps=(dp_tok,))
            ds_op = gl.convert_layout((p * (dp - gl.expand_dims(delta, 1))).to(dtype), a_layout)
            dq_tok = warpgroup_mma(ds_op, k_tile, dq, is_async=True)
            dq, _, _ = warpgroup_mma_wait(0, deps=(dq_tok, ds_op, k_tile))
        mbarrier.arrive(empty.index(stage), count=1)
    # dQ leaves through Q's buffer (every product that read it has completed)
    fence_async_shared()
    q_tile.store((dq * sm_scale).to(dtype))
    fence_async_shared()
    tma_store(desc_dq, [q_row, 0], q_tile)
    tma.store_wait(0)


@gluon.jit
def dq_pair(q_tile, do_tile, k_a, k_b, v_a, v_b, dq, lse2, delta, limit, first_key, qk_scale, MASKED: gl.constexpr):
    """Two slices (a, b) of a streamed K/V tile, keys ``first_key ...``, against this warpgroup's query rows, their
    products interleaved as in ``dkdv_pair``.  With ``MASKED`` row r sees key c only when c <= ``limit[r]``."""
    BLOCK_N: gl.constexpr = k_a.type.shape[0]
    BLOCK: gl.constexpr = q_tile.type.shape[0]
    dtype: gl.constexpr = q_tile.dtype
    s_layout: gl.constexpr = mma_layout(BLOCK_N)
    a_layout: gl.constexpr = operand_layout(mma_layout(q_tile.type.shape[1]))
    offs = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    s_init = gl.zeros([BLOCK, BLOCK_N], gl.float32, s_layout)
    sa_tok = warpgroup_mma(q_tile, k_a.permute((1, 0)), s_init, use_acc=False, is_async=True)
    dpa_tok = warpgroup_mma(do_tile, v_a.permute((1, 0)), s_init, use_acc=False, is_async=True)
    sa = warpgroup_mma_wait(1, deps=(sa_tok,))                     # pending: dPa
    sb_tok = warpgroup_mma(q_tile, k_b.permute((1, 0)), s_init, use_acc=False, is_async=True)
    pa = gl.exp2(sa * qk_scale - gl.expand_dims(lse2, 1))
    if MASKED:
        pa = gl.where(gl.expand_dims(first_key + offs, 0) <= gl.expand_dims(limit, 1), pa, 0.0)
    dpa = warpgroup_mma_wait(1, deps=(dpa_tok,))                   # pending: Sb
    dpb_tok = warpgroup_mma(do_tile, v_b.permute((1, 0)), s_init, use_acc=False, is_async=True)
    dsa_op = gl.convert_layout((pa * (dpa - gl.expand_dims(delta, 1))).to(dtype), a_layout)
    dq = warpgroup_mma(dsa_op, k_a, dq, is_async=True)
    sb = warpgroup_mma_wait(2, deps=(sb_tok,))                     # pending: dPb, dQ(a)
    pb = gl.exp2(sb * qk_scale - gl.expand_dims(lse2, 1))
    if MASKED:
        pb = gl.where(gl.expand_dims(first_key + BLOCK_N + offs, 0) <= gl.expand_dims(limit, 1), pb, 0.0)
    dpb = warpgroup_mma_wait(1, deps=(dpb_tok,))                   # pending: dQ(a)
    dsb_op = gl.convert_layout((pb * (dpb - gl.expand_dims(delta, 1))).to(dtype), a_layout)
    dq = warpgroup_mma(dsb_op, k_b, dq, is_async=True)
    dq, _, _, _, _ = warpgroup_mma_wait(0, deps=(dq, dsa_op, dsb_op, k_a, k_b))
    return dq


@gluon.jit
def dkdv_slice(k_tile, v_tile, q_tile, do_tile, dk, dv, LSE2, Delta, row, keys, first_query, diagonal, qk_scale,
               MASKED: gl.constexpr):
    """A slice of ``BLOCK`` queries, Q's rows ``row ...``: Sᵀ = K Qᵀ and dPᵀ = V dOᵀ, then dV += Pᵀ dO and
    dK += dSᵀ Q.  With ``MASKED`` and ``diagonal``, key ``keys[r]`` sees query ``first_query + c`` only when
    it is not later."""
    BLOCK: gl.constexpr = q_tile.type.shape[0]
    dtype: gl.constexpr = q_tile.dtype
    s_layout: gl.constexpr = mma_layout(BLOCK)
    a_layout: gl.constexpr = operand_layout(mma_layout(q_tile.type.shape[1]))
    s_init = gl.zeros([BLOCK, BLOCK], gl.float32, s_layout)
    sT_tok = warpgroup_mma(k_tile, q_tile.permute((1, 0)), s_init, use_acc=False, is_async=True)
    dpT_tok = warpgroup_mma(v_tile, do_tile.permute((1, 0)), s_init, use_acc=False, is_async=True)
    offs = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, s_layout))
    lse2 = gl.load(LSE2 + row + offs)
    Di = gl.load(Delta + row + offs)
    sT = warpgroup_mma_wait(1, deps=(sT_tok,))
    pT = gl.exp2(sT * qk_scale - gl.expand_dims(lse2, 0))
    if MASKED:
        if diagonal:
            pT = gl.where(gl.expand_dims(keys, 1) <= gl.expand_dims(first_query + offs, 0), pT, 0.0)
    pT_op = gl.convert_layout(pT.to(dtype), a_layout)
    dv_tok = warpgroup_mma(pT_op, do_tile, dv, is_async=True)
    dpT = warpgroup_mma_wait(1, deps=(dpT_tok,))
    dsT_op = gl.convert_layout((pT * (dpT - gl.expand_dims(Di, 0))).to(dtype), a_layout)
    dk_tok = warpgroup_mma(dsT_op, q_tile, dk, is_async=True)
    dv, dk, _, _, _, _ = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, pT_op, dsT_op, q_tile, do_tile))
    return dk, dv


@gluon.jit
def dkdv_pair(k_tile, v_tile, q_a, q_b, do_a, do_b, dk, dv, LSE2, Delta, row, shift, qk_scale, MASKED: gl.constexpr):
    """A streamed tile of two ``BLOCK``-query slices (a, b), Q's rows ``row ...``, with their products interleaved:
    each wait leaves the other slice's products in flight, so the Tensor Cores have work while this warpgroup
    computes exponentials or dS (``warpgroup_mma_wait(n)`` returns once at most n groups, oldest first, are
    pending).  With ``MASKED`` key row r sees query column c of slice a only when r <= c + ``shift``."""
    BLOCK: gl.constexpr = k_tile.type.shape[0]
    dtype: gl.constexpr = q_a.dtype
    s_layout: gl.constexpr = mma_layout(BLOCK)
    a_layout: gl.constexpr = operand_layout(mma_layout(q_a.type.shape[1]))
    offs = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, s_layout))
    s_init = gl.zeros([BLOCK, BLOCK], gl.float32, s_layout)
    sa_tok = warpgroup_mma(k_tile, q_a.permute((1, 0)), s_init, use_acc=False, is_async=True)
    dpa_tok = warpgroup_mma(v_tile, do_a.permute((1, 0)), s_init, use_acc=False, is_async=True)
    lse_a = gl.load(LSE2 + row + offs)
    d_a = gl.load(Delta + row + offs)
    sa = warpgroup_mma_wait(1, deps=(sa_tok,))                     # pending: dPᵀa
    sb_tok = warpgroup_mma(k_tile, q_b.permute((1, 0)), s_init, use_acc=False, is_async=True)
    pa = gl.exp2(sa * qk_scale - gl.expand_dims(lse_a, 0))
    if MASKED:
        rows = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, s_layout))
        pa = gl.where(gl.expand_dims(rows, 1) <= gl.expand_dims(offs + shift, 0), pa, 0.0)
    pa_op = gl.convert_layout(pa.to(dtype), a_layout)
    dv = warpgroup_mma(pa_op, do_a, dv, is_async=True)
    dpa = warpgroup_mma_wait(2, deps=(dpa_tok,))                   # pending: Sᵀb, dV += Pᵀa dOa
    dpb_tok = warpgroup_mma(v_tile, do_b.permute((1, 0)), s_init, use_acc=False, is_async=True)
    dsa_op = gl.convert_layout((pa * (dpa - gl.expand_dims(d_a, 0))).to(dtype), a_layout)
    dk = warpgroup_mma(dsa_op, q_a, dk, is_async=True)
    lse_b = gl.load(LSE2 + row + BLOCK + offs)
    d_b = gl.load(Delta + row + BLOCK + offs)
    sb = warpgroup_mma_wait(3, deps=(sb_tok,))                     # pending: dV(a), dPᵀb, dK(a)
    pb = gl.exp2(sb * qk_scale - gl.expand_dims(lse_b, 0))
    if MASKED:
        rows = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, s_layout))
        pb = gl.where(gl.expand_dims(rows, 1) <= gl.expand_dims(offs + shift + BLOCK, 0), pb, 0.0)
    pb_op = gl.convert_layout(pb.to(dtype), a_layout)
    dv = warpgroup_mma(pb_op, do_b, dv, is_async=True)
    dpb = warpgroup_mma_wait(2, deps=(dpb_tok,))                   # pending: dK(a), dV(b)
    dsb_op = gl.convert_layout((pb * (dpb - gl.expand_dims(d_b, 0))).to(dtype), a_layout)
    dk = warpgroup_mma(dsb_op, q_b, dk, is_async=True)
    dv, dk, _, _, _, _ = warpgroup_mma_wait(0, deps=(dv, dk, pa_op, pb_op, dsa_op, dsb_op))
    return dk, dv


@gluon.jit
def dkdv_consumer(desc_dk, desc_dv, LSE2, Delta, k_smem, v_smem, q_smem, do_smem, fixed_bar, ready, empty,
                  kv_row, first, n_q, n_tiles, n_iters, m0, k_start, sm_scale, qk_scale,
                  BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, WG: gl.constexpr):
    """Consumer ``WG`` of the dK/dV pass: keys ``k_start + WG·BLOCK ...`` against the streamed query tiles, of one
    slice of ``BLOCK`` queries (``dkdv_slice``) or of two whose products interleave (``dkdv_pair``)."""
    STAGES: gl.constexpr = ready.type.shape[0]
    SLICES: gl.constexpr = q_smem.type.shape[0] // STAGES
    BLOCK_N: gl.constexpr = SLICES * BLOCK
    dtype: gl.constexpr = q_smem.dtype
    g_layout: gl.constexpr = mma_layout(HEAD_DIM)
    k_tile = k_smem.index(WG)
    v_tile = v_smem.index(WG)
    keys = k_start + WG * BLOCK + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, mma_layout(BLOCK)))
    dk = gl.zeros([BLOCK, HEAD_DIM], gl.float32, g_layout)
    dv = gl.zeros([BLOCK, HEAD_DIM], gl.float32, g_layout)
    mbarrier.wait(fixed_bar, 0)
    for it in range(n_iters):
        g = it // n_tiles
        t = it - g * n_tiles
        row = first + g * n_q + m0 + t * BLOCK_N   # the tile's first query, in Q's rows
        stage = it % STAGES
        mbarrier.wait(ready.index(stage), (it // STAGES) & 1)
        if SLICES == 2:
            # under the causal mask only a head's first tile (m0 = k_start) meets the diagonal of these keys; past
            # it a shift of BLOCK keeps every score.  One call, not one per case: with two, the compiled kernel
            # lost a product in one of them
            shift = gl.where(t == 0, -WG * BLOCK, BLOCK)
            dk, dv = dkdv_pair(k_tile, v_tile, q_smem.index(2 * stage), q_smem.index(2 * stage + 1),
                               do_smem.index(2 * stage), do_smem.index(2 * stage + 1), dk, dv, LSE2, Delta, row,
                               shift, qk_scale, CAUSAL)
        else:
            # under the causal mask the first query tiles meet the diagonal of this program's keys
            dk, dv = dkdv_slice(k_tile, v_tile, q_smem.index(stage), do_smem.index(stage), dk, dv, LSE2, Delta, row,
                                keys, m0 + t * BLOCK_N, t * BLOCK_N < 2 * BLOCK, qk_scale, CAUSAL)
        mbarrier.arrive(empty.index(stage), count=1)
    # dK and dV leave through the K and V buffers (every product that read them has completed)
    fence_async_shared()
    k_tile.store((dk * sm_scale).to(dtype))
    v_tile.store(dv.to(dtype))
    fence_async_shared()
    tma_store(desc_dk, [kv_row + WG * BLOCK, 0], k_tile)
    tma_store(desc_dv, [kv_row + WG * BLOCK, 0], v_tile)
    tma.store_wait(0)


@gluon.jit
def _allocate(fixed, streamed, STAGES: gl.constexpr, SLICES: gl.constexpr):
    """Two fixed tiles (``fixed``'s block) of each of two tensors, a ring of ``STAGES`` stages of ``SLICES``
    buffers (``streamed``'s block) for each of two more, and the barriers: the shared memory of either pass."""
    dtype: gl.constexpr = fixed.dtype
    fixed_a = gl.allocate_shared_memory(dtype, [2] + fixed.block_type.shape, fixed.layout)
    fixed_b = gl.allocate_shared_memory(dtype, [2] + fixed.block_type.shape, fixed.layout)
    ring_a = gl.allocate_shared_memory(dtype, [STAGES * SLICES] + streamed.block_type.shape, streamed.layout)
    ring_b = gl.allocate_shared_memory(dtype, [STAGES * SLICES] + streamed.block_type.shape, streamed.layout)
    fixed_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(fixed_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)   # free once both consumers are done with it
    return fixed_a, fixed_b, ring_a, ring_b, fixed_bar, ready, empty


@gluon.jit
def bwd_dq_ws(desc_q, desc_do, desc_k, desc_v, desc_dq, O, LSE, LSE2, Delta, n, heads, kv_heads,
              sm_scale, qk_scale, BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
              CAUSAL: gl.constexpr, SLICES: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    """Grid (query blocks of 2·BLOCK rows, batch · heads); K and V stream past in tiles of ``SLICES`` boxes of
    ``desc_k``'s rows."""
    BLOCK_N: gl.constexpr = SLICES * desc_k.block_type.shape[0]
    pid_m = gl.program_id(0)
    if CAUSAL:   # the last query blocks see the most keys: start them first
        pid_m = gl.num_programs(0) - 1 - pid_m
    bh = gl.program_id(1)
    kv_bh = (bh // heads) * kv_heads + (bh % heads) // (heads // kv_heads)
    row0 = pid_m * 2 * BLOCK
    q_row = bh * n + row0
    if CAUSAL:
        n_iters = (row0 + 2 * BLOCK) // BLOCK_N    # key tiles up to the diagonal
    else:
        n_iters = n // BLOCK_N
    q_smem, do_smem, k_smem, v_smem, fixed_bar, ready, empty = _allocate(desc_q, desc_k, STAGES, SLICES)
    gl.warp_specialize([
        (dq_consumer, (desc_dq, O, LSE, LSE2, Delta, q_smem, do_smem, k_smem, v_smem, fixed_bar, ready, empty,
                       q_row, row0, n_iters, sm_scale, qk_scale, BLOCK, HEAD_DIM, CAUSAL, 0)),
        (dq_consumer, (desc_dq, O, LSE, LSE2, Delta, q_smem, do_smem, k_smem, v_smem, fixed_bar, ready, empty,
                       q_row, row0, n_iters, sm_scale, qk_scale, BLOCK, HEAD_DIM, CAUSAL, 1)),
        (stream_partition, (desc_k, desc_v, desc_q, desc_do, q_smem, do_smem, k_smem, v_smem, fixed_bar, ready,
                            empty, q_row, kv_bh * n, n, n_iters, n_iters, 0)),
    ], [4, 1], [CONSUMER_REGS, 24])


@gluon.jit
def bwd_dkdv_ws(desc_q, desc_do, desc_k, desc_v, desc_dk, desc_dv, LSE2, Delta, n, heads, kv_heads,
                sm_scale, qk_scale, BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                CAUSAL: gl.constexpr, SLICES: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    """Grid (key blocks of 2·BLOCK keys, batch · K/V heads); Q and dO stream past in tiles of ``SLICES`` (1 or 2)
    slices of ``BLOCK`` queries."""
    BLOCK_N: gl.constexpr = SLICES * BLOCK
    bhk = gl.program_id(1)
    group = heads // kv_heads
    k_start = gl.program_id(0) * 2 * BLOCK
    kv_row = bhk * n + k_start
    first = bhk * group * n      # the group's query heads are consecutive rows of Q and dO
    if CAUSAL:
        m0 = k_start             # queries before the program's first key see none of its keys
    else:
        m0 = 0
    n_tiles = (n - m0) // BLOCK_N
    k_smem, v_smem, q_smem, do_smem, fixed_bar, ready, empty = _allocate(desc_k, desc_q, STAGES, SLICES)
    gl.warp_specialize([
        (dkdv_consumer, (desc_dk, desc_dv, LSE2, Delta, k_smem, v_smem, q_smem, do_smem, fixed_bar, ready, empty,
                         kv_row, first, n, n_tiles, group * n_tiles, m0, k_start, sm_scale, qk_scale,
                         BLOCK, HEAD_DIM, CAUSAL, 0)),
        (dkdv_consumer, (desc_dk, desc_dv, LSE2, Delta, k_smem, v_smem, q_smem, do_smem, fixed_bar, ready, empty,
                         kv_row, first, n, n_tiles, group * n_tiles, m0, k_start, sm_scale, qk_scale,
                         BLOCK, HEAD_DIM, CAUSAL, 1)),
        (stream_partition, (desc_q, desc_do, desc_k, desc_v, k_smem, v_smem, q_smem, do_smem, fixed_bar, ready,
                            empty, kv_row, first, n, n_tiles, group * n_tiles, m0)),
    ], [4, 1], [CONSUMER_REGS, 24])


def gluon_backward(q, k, v, o, lse, do, spec):
    """``(dq, dk, dv)`` from the saved ``q, k, v, o, lse`` and the incoming ``do``; deterministic."""
    if spec.head_dim not in BACKWARD_HEAD_DIMS:
        raise ValueError(f"the Gluon backward is built for head dims {', '.join(map(str, BACKWARD_HEAD_DIMS))}, "
                         f"got {spec.head_dim} (flash_gluon runs chapter 5's Triton backward there)")
    q, k, v, o, do = (t.contiguous() for t in (q, k, v, o, do))
    B, H, N, D = q.shape
    Hkv = k.shape[1]
    lse = lse.detach().to(torch.float32).contiguous()
    lse2 = torch.empty_like(lse)
    delta = torch.empty_like(lse)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    # each tensor is a consumer's fixed tile (BLOCK rows) in one pass and streamed in the other: K and V in
    # KEY_TILE rows, Q and dO in slices of BLOCK rows
    blocks = {name: descriptor(t, BLOCK) for name, t in dict(q=q, do=do, k=k, v=v, dq=dq, dk=dk, dv=dv).items()}
    key_tiles = {name: descriptor(t, KEY_TILE[D]) for name, t in dict(k=k, v=v).items()}
    causal = spec.mask == "causal"
    meta = dict(BLOCK=BLOCK, HEAD_DIM=D, STAGES=STAGES, CAUSAL=causal, CONSUMER_REGS=CONSUMER_REGS)
    scalars = (N, H, Hkv, spec.scale, spec.scale * LOG2E)
    # the JIT specializes on the integers and on the alignment of the pointers passed as such
    key = (q.dtype, q.device, N, H, Hkv, D, causal, o.data_ptr() % 16, lse.data_ptr() % 16)
    launch(bwd_dq_ws, (N // (2 * BLOCK), B * H), (blocks["q"], blocks["do"], key_tiles["k"], key_tiles["v"],
                                                   blocks["dq"], o, lse, lse2, delta, *scalars),
           dict(meta, SLICES=KEY_SLICES[D]), (*key, KEY_TILE[D], KEY_SLICES[D]))
    launch(bwd_dkdv_ws, (N // (2 * BLOCK), B * Hkv), (blocks["q"], blocks["do"], blocks["k"], blocks["v"],
                                                       blocks["dk"], blocks["dv"], lse2, delta, *scalars),
           dict(meta, SLICES=QUERY_TILE[D] // BLOCK), (*key, QUERY_TILE[D]))
    return dq, dk, dv


__all__ = ["gluon_backward"]
