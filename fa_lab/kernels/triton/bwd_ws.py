"""Chapter 5's two backward passes, warp-specialized, for problems without a mask.

The same gradients as ``fa_lab.kernels.triton.bwd`` (K/V-stationary dK and dV, then Q-stationary dQ,
each element written by one program: deterministic), written the way Triton's warp specialization
needs a loop on Hopper: every tile comes through a tensor descriptor (the copy engine, TMA) and the
loop is one loop with no mask.  Under ``tl.range(..., warp_specialize=True)`` Triton then splits a
4-warp program into a producer warpgroup that issues the copies and two consumer warpgroups that
each take half of the tile, with more registers each (``setmaxnreg``): FlashAttention-3's structure
(``docs/decisions/one-pass-backward.md``).

Only problems where every tile is whole and every row sees every key take this path
(``eligible``): no causal mask or window, sequence lengths multiples of the tiles, head dim equal to
its padded width.  The rows of a GQA group's query heads are consecutive in memory, so the dK/dV
loop walks them as one range of rows.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def bwd_dkdv_ws(Q, K, V, DO, LSE2, Delta, DK, DV, H, HKV, N_Q, N_K, sm_scale, qk_scale,
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                PRECISION: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """Grid (key blocks, batch · K/V heads).  Q, DO: (B·H·N_Q, D) rows; K, V, DK, DV: (B·HKV·N_K, D)."""
    bhk = tl.program_id(1)
    group = H // HKV
    q_rows = tl.num_programs(1) * group * N_Q
    kv_rows = tl.num_programs(1) * N_K
    desc_q = tl.make_tensor_descriptor(Q, [q_rows, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_M, HEAD_DIM])
    desc_do = tl.make_tensor_descriptor(DO, [q_rows, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_M, HEAD_DIM])
    desc_lse = tl.make_tensor_descriptor(LSE2, [q_rows], [1], [BLOCK_M])
    desc_delta = tl.make_tensor_descriptor(Delta, [q_rows], [1], [BLOCK_M])
    kv_row = bhk * N_K + tl.program_id(0) * BLOCK_N
    k = tl.make_tensor_descriptor(K, [kv_rows, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_N, HEAD_DIM]).load([kv_row, 0])
    v = tl.make_tensor_descriptor(V, [kv_rows, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_N, HEAD_DIM]).load([kv_row, 0])
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    # the group's query heads are heads hk·group ... hk·group + group - 1 of batch b: consecutive rows
    first = bhk * group * N_Q
    for row in tl.range(first, first + group * N_Q, BLOCK_M, warp_specialize=WARP_SPECIALIZE):
        q = desc_q.load([row, 0])
        do = desc_do.load([row, 0])
        lse2 = desc_lse.load([row])
        Di = desc_delta.load([row])
        # Pᵀ (keys as rows), recomputed from the saved lse: the left operand of Pᵀ dO as it is
        pT = tl.math.exp2(tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale - lse2[None, :])
        dv += tl.dot(pT.to(do.dtype), do, input_precision=PRECISION)
        dsT = pT * (tl.dot(v, tl.trans(do), input_precision=PRECISION) - Di[None, :])
        dk += tl.dot(dsT.to(q.dtype), q, input_precision=PRECISION)
    # through descriptors: under warp specialization the forward's masked pointer stores came out wrong
    tl.make_tensor_descriptor(DK, [kv_rows, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_N, HEAD_DIM]).store(
        [kv_row, 0], (dk * sm_scale).to(DK.dtype.element_ty))
    tl.make_tensor_descriptor(DV, [kv_rows, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_N, HEAD_DIM]).store(
        [kv_row, 0], dv.to(DV.dtype.element_ty))


@triton.jit
def bwd_dq_ws(Q, K, V, DO, LSE2, Delta, DQ, H, HKV, N_Q, N_K, sm_scale, qk_scale,
              HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              PRECISION: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """Grid (query blocks, batch · heads): dQ += dS K over every key block."""
    bh = tl.program_id(1)
    q_rows = tl.num_programs(1) * N_Q
    kv_rows = tl.num_programs(1) // (H // HKV) * N_K
    q_row = bh * N_Q + tl.program_id(0) * BLOCK_M
    desc_q = tl.make_tensor_descriptor(Q, [q_rows, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_M, HEAD_DIM])
    desc_do = tl.make_tensor_descriptor(DO, [q_rows, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_M, HEAD_DIM])
    desc_k = tl.make_tensor_descriptor(K, [kv_rows, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_N, HEAD_DIM])
    desc_v = tl.make_tensor_descriptor(V, [kv_rows, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_N, HEAD_DIM])
    q = desc_q.load([q_row, 0])
    do = desc_do.load([q_row, 0])
    lse2 = tl.make_tensor_descriptor(LSE2, [q_rows], [1], [BLOCK_M]).load([q_row])
    Di = tl.make_tensor_descriptor(Delta, [q_rows], [1], [BLOCK_M]).load([q_row])
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    first = (bh // H * HKV + bh % H // (H // HKV)) * N_K      # this head's K/V head (GQA), its first row
    for row in tl.range(first, first + N_K, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        k = desc_k.load([row, 0])
        v = desc_v.load([row, 0])
        p = tl.math.exp2(tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale - lse2[:, None])
        ds = p * (tl.dot(do, tl.trans(v), input_precision=PRECISION) - Di[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    tl.make_tensor_descriptor(DQ, [q_rows, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_M, HEAD_DIM]).store(
        [q_row, 0], (dq * sm_scale).to(DQ.dtype.element_ty))


def eligible(spec, dkdv_cfg, dq_cfg, tensors) -> bool:
    """Whether these tiles cover the problem whole, with no mask: the only problems these kernels take."""
    tiles_fit = (spec.n_q % dkdv_cfg[0] == 0 and spec.n_k % dkdv_cfg[1] == 0
                 and spec.n_q % dq_cfg[0] == 0 and spec.n_k % dq_cfg[1] == 0)
    return (spec.left < 0 and spec.right < 0 and tiles_fit and spec.head_dim == triton.next_power_of_2(spec.head_dim)
            and spec.head_dim >= 16 and all(t.is_contiguous() for t in tensors))


__all__ = ["bwd_dkdv_ws", "bwd_dq_ws", "eligible"]
