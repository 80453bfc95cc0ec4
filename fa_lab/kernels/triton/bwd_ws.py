"""Chapter 5's dK/dV pass through tensor descriptors, for problems whose tiles are whole.

The same gradients as ``fa_lab.kernels.triton.bwd`` (K/V-stationary dK and dV, each element written by
one program: deterministic), written the way Triton's warp specialization needs a loop on Hopper: every
tile comes through a tensor descriptor (the copy engine, TMA) and the pass has one loop.  Under
``tl.range(..., warp_specialize=True)`` Triton can then split a 4-warp program into a producer warpgroup
that issues the copies and two consumer warpgroups that each take half of the tile, with more registers
each (``setmaxnreg``): FlashAttention-3's structure (``docs/decisions/one-pass-backward.md``).  The
library runs it unsplit (``bwd.WARP_SPECIALIZE_DKDV``): Triton 3.6's split of this loop now and then
returned a whole dK/dV tile of NaN (``docs/decisions/split-backward-race.md``); at 8 warps, unsplit, the
descriptor loads and their software pipeline still beat the plain kernel.  The rows' base-2 lse and D
come by plain pointer loads, after the Q and dO copies, up to D = 128: two 1-D copies per step each cost a
barrier of the whole program (chapter 11's profile) and the pass was up to 7.6% slower with them; at D = 256
the pointer loads spill registers and the copies stay (``docs/decisions/backward-descriptor-copies.md``).

Only problems whose tiles are whole take this path (``eligible``): sequence lengths multiples of the
tiles, head dim equal to its padded width.  Under a mask (causal, a window) each loop still walks only
the tiles some row sees, but applies the mask to every one of them: Triton splits one loop, and a
second, unmasked loop beside it makes its pass fail.  Without a mask, the rows of a GQA group's query
heads are consecutive in memory, and the dK/dV loop walks them as one range of rows.
"""
from __future__ import annotations

import triton
import triton.language as tl

from fa_lab.kernels.triton.key_ranges import visible_range


@triton.jit
def bwd_dkdv_ws(Q, K, V, DO, LSE2, Delta, DK, DV, H, HKV, N_Q, N_K, sm_scale, qk_scale, WIN_LEFT, WIN_RIGHT,
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                PRECISION: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """Grid (key blocks, batch · K/V heads).  Q, DO: (B·H·N_Q, D) rows; K, V, DK, DV: (B·HKV·N_K, D)."""
    bhk = tl.program_id(1)
    group = H // HKV
    q_rows = tl.num_programs(1) * group * N_Q
    kv_rows = tl.num_programs(1) * N_K
    desc_q = tl.make_tensor_descriptor(Q, [q_rows, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_M, HEAD_DIM])
    desc_do = tl.make_tensor_descriptor(DO, [q_rows, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_M, HEAD_DIM])
    # lse and D by pointer up to D = 128 (one barrier fewer per copy); at D = 256 the registers are not there
    if HEAD_DIM > 128:
        lse_src = tl.make_tensor_descriptor(LSE2, [q_rows], [1], [BLOCK_M])
        delta_src = tl.make_tensor_descriptor(Delta, [q_rows], [1], [BLOCK_M])
    else:
        lse_src = LSE2
        delta_src = Delta
    offs_m = tl.arange(0, BLOCK_M)
    start_n = tl.program_id(0) * BLOCK_N
    kv_row = bhk * N_K + start_n
    k = tl.make_tensor_descriptor(K, [kv_rows, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_N, HEAD_DIM]).load([kv_row, 0])
    v = tl.make_tensor_descriptor(V, [kv_rows, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_N, HEAD_DIM]).load([kv_row, 0])
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    # the group's query heads are heads hk·group ... hk·group + group - 1 of batch b: consecutive rows
    first = bhk * group * N_Q
    if HAS_LEFT or HAS_RIGHT:
        # The query rows that see some key of this block, [lo, hi) (the forward's question with the mask
        # transposed), in whole query blocks of every head of the group: one flat loop, the mask applied
        # to every tile.  Warp specialization takes one loop only (a second loop for the unmasked tiles
        # makes Triton 3.6's pass fail), and unsplit the plain kernel's three phases were slower
        # (docs/decisions/backward-mask-loops.md).
        lo, hi, _, _ = visible_range(start=start_n, n_rows=N_K, n_cols=N_Q, left=WIN_RIGHT, right=WIN_LEFT,
                                     BLOCK=BLOCK_N, HAS_LEFT=HAS_RIGHT, HAS_RIGHT=HAS_LEFT)
        lo = lo // BLOCK_M * BLOCK_M
        n_blocks = tl.maximum(tl.cdiv(hi - lo, BLOCK_M), 0)
        for it in tl.range(0, group * n_blocks, warp_specialize=WARP_SPECIALIZE):
            g = it // tl.maximum(n_blocks, 1)   # (the loop does not run when n_blocks is 0)
            start_m = lo + (it - g * n_blocks) * BLOCK_M
            row = first + g * N_Q + start_m
            diag = start_m + tl.arange(0, BLOCK_M) + (N_K - N_Q)     # the key each query row sits at
            keep = tl.full([BLOCK_N, BLOCK_M], 1, tl.int1)
            if HAS_LEFT:
                keep = keep & (offs_n[:, None] >= diag[None, :] - WIN_LEFT)
            if HAS_RIGHT:
                keep = keep & (offs_n[:, None] <= diag[None, :] + WIN_RIGHT)
            q, do, lse2, Di = query_tile(desc_q, desc_do, lse_src, delta_src, row, offs_m, HEAD_DIM > 128)
            dk, dv = dkdv_tile(dk, dv, k, v, q, do, lse2, Di, keep, qk_scale, MASKED=True, PRECISION=PRECISION)
    else:
        for row in tl.range(first, first + group * N_Q, BLOCK_M, warp_specialize=WARP_SPECIALIZE):
            q, do, lse2, Di = query_tile(desc_q, desc_do, lse_src, delta_src, row, offs_m, HEAD_DIM > 128)
            dk, dv = dkdv_tile(dk, dv, k, v, q, do, lse2, Di, None, qk_scale, MASKED=False, PRECISION=PRECISION)
    # through descriptors: under warp specialization the forward's masked pointer stores came out wrong
    tl.make_tensor_descriptor(DK, [kv_rows, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_N, HEAD_DIM]).store(
        [kv_row, 0], (dk * sm_scale).to(DK.dtype.element_ty))
    tl.make_tensor_descriptor(DV, [kv_rows, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_N, HEAD_DIM]).store(
        [kv_row, 0], dv.to(DV.dtype.element_ty))


@triton.jit
def query_tile(desc_q, desc_do, lse_src, delta_src, row, offs_m, STATS_BY_TMA: tl.constexpr):
    """Q and dO of query rows ``row + offs_m`` (TMA copies), then their base-2 lse and D: through two 1-D
    descriptors, or by pointer.  The pointer loads come after the copies: written before them, they made
    unmasked problems 4-11% slower."""
    q = desc_q.load([row, 0])
    do = desc_do.load([row, 0])
    if STATS_BY_TMA:
        return q, do, lse_src.load([row]), delta_src.load([row])
    else:
        return q, do, tl.load(lse_src + row + offs_m), tl.load(delta_src + row + offs_m)


@triton.jit
def dkdv_tile(dk, dv, k, v, q, do, lse2, Di, keep, qk_scale, MASKED: tl.constexpr, PRECISION: tl.constexpr):
    """One query tile against the key block: dV += Pᵀ dO, dK += dSᵀ Q (keys as rows)."""
    # Pᵀ, recomputed from the saved lse: the left operand of Pᵀ dO as it is
    pT = tl.math.exp2(tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale - lse2[None, :])
    if MASKED:
        pT = tl.where(keep, pT, 0.0)
    dv += tl.dot(pT.to(do.dtype), do, input_precision=PRECISION)
    dsT = pT * (tl.dot(v, tl.trans(do), input_precision=PRECISION) - Di[None, :])
    dk += tl.dot(dsT.to(q.dtype), q, input_precision=PRECISION)
    return dk, dv


def eligible(spec, cfg, tensors) -> bool:
    """Whether tile ``cfg`` (``BLOCK_M`` queries, ``BLOCK_N`` keys) covers the problem's sequences whole and
    ``tensors`` are row-major: the only problems these kernels take (a descriptor has no masked rows)."""
    tiles_fit = spec.n_q % cfg[0] == 0 and spec.n_k % cfg[1] == 0
    return (tiles_fit and spec.head_dim == triton.next_power_of_2(spec.head_dim) and spec.head_dim >= 16
            and all(t.is_contiguous() for t in tensors))


__all__ = ["bwd_dkdv_ws", "eligible"]
