"""Chapter 3, step by step: from one thread per query row to the tiled FlashAttention kernel.

Each step is a kernel of its own, registered so that the book, the tests and the
benchmarks run it like any implementation:

1. ``numba_rowwise`` — one thread per query row, the online softmax of chapter 2 on the
   GPU.  The row of Q and the accumulator sit in registers, but every thread reads
   every K and V row it needs from global memory itself.
2. ``numba_smem`` — a block of ``BLOCK_M`` threads (still one row each) loads a tile of
   ``BLOCK_N`` keys and values into shared memory once, and all its threads read it
   from there: global traffic for K and V drops by ``BLOCK_M``.  One rescale per tile.
3. ``numba_regtile`` — register tiling: each thread computes a small ``ROWS x KEYS``
   tile of S and a ``ROWS x DIMS`` tile of O, so a value read from shared memory is
   used several times from a register (the SGEMM micro-kernel trick).  This is
   ``fa_lab.kernels.numba.tiled``'s kernel with every key tile computed, masked ones included.
4. ``numba_tiled`` (``fa_lab.kernels.numba.tiled``) — the same kernel looping only over the key
   tiles its block can see: under a causal mask about half of them are never touched.

All steps honour the full contract (tails, Nq != Nk, causal, windows, GQA, lse, rows
with no key) so that each speedup compares two correct kernels.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import torch
from numba import cuda, float32, uint32, uint64

from fa_lab.core.registry import register
from fa_lab.core.world import pick
from fa_lab.kernels.numba.bridge import as_array, require_float32, simulator_speed, stream
from fa_lab.kernels.numba.heads import head_starts
from fa_lab.kernels.numba.tiled import MAX_HEAD_DIM, NEG_BIG, head_dim_bucket, launch_tiled

ROWWISE_THREADS = pick(cpu=4, gpu=128)
SMEM_BLOCK_M = pick(cpu=4, gpu=128)
SMEM_BLOCK_N = pick(cpu=4, gpu=32)


@functools.lru_cache(maxsize=None)
def build_rowwise(d_pad: int):
    """Step 1: one thread per query row; K and V straight from global memory.

    Arrays are flat and indexed with unsigned offsets, as in ``numba_tiled`` (see
    ``build_kernel``'s note), so that every step pays the same small index arithmetic
    and the speedups measure the memory hierarchy, not Numba's index checks.
    """
    D_PAD, THREADS = d_pad, ROWWISE_THREADS
    ZERO = float32(0.0)

    @cuda.jit(fastmath=True)
    def rowwise_fwd(Q, K, V, O, LSE, H, group, Nq, Nk, D, scale_, left, right):
        i = cuda.blockIdx.x * THREADS + cuda.threadIdx.x
        bh = cuda.blockIdx.y
        if i >= Nq:
            return
        q_head, kv_head = head_starts(bh, H, group, Nq, Nk, D)   # this head's Q/O, its (grouped) K/V head
        scale = float32(scale_)
        u_d = uint64(D)
        q_row = q_head + uint64(i) * u_d
        q = cuda.local.array(D_PAD, float32)
        acc = cuda.local.array(D_PAD, float32)
        for d in range(D_PAD):
            q[d] = Q[q_row + uint32(d)] * scale if d < D else ZERO
            acc[d] = ZERO
        diag = i + Nk - Nq
        lo = 0 if left < 0 else max(0, diag - left)
        hi = Nk if right < 0 else min(Nk, diag + right + 1)
        hi = max(lo, hi)                     # empty for a row that sees no key (never negative: unsigned below)
        m_i = NEG_BIG
        l_i = ZERO
        j = uint64(lo)
        kv_at = kv_head + j * u_d
        while j < uint64(hi):                # this row's visible keys, one at a time
            s = ZERO
            for d in range(D_PAD):
                if d < D:
                    s += q[d] * K[kv_at + uint32(d)]
            m_new = max(m_i, s)
            alpha = math.exp(m_i - m_new)
            p = math.exp(s - m_new)
            l_i = l_i * alpha + p
            for d in range(D_PAD):
                if d < D:
                    acc[d] = acc[d] * alpha + p * V[kv_at + uint32(d)]
            m_i = m_new
            j += uint64(1)
            kv_at += u_d
        # Whether the row sees a key comes from the mask, not from l_i > 0: a NaN input makes
        # l_i NaN (and fastmath may fold NaN tests away), and NaN must come out, not an empty row.
        sees = hi > lo
        inv = float32(1.0) / l_i if sees else ZERO
        for d in range(D_PAD):               # constant bounds keep acc in registers
            if d < D:
                O[q_row + uint32(d)] = acc[d] * inv
        if sees:
            LSE[bh * Nq + i] = m_i + math.log(l_i)
        else:                                # the row sees no key
            LSE[bh * Nq + i] = -math.inf

    return rowwise_fwd


@functools.lru_cache(maxsize=None)
def build_smem(d_pad: int):
    """Step 2: a block of BLOCK_M rows shares each K/V tile through shared memory."""
    D_PAD, BLOCK_M, BLOCK_N = d_pad, SMEM_BLOCK_M, SMEM_BLOCK_N
    TILE = BLOCK_N * D_PAD
    LOADS = -(-TILE // BLOCK_M)
    ZERO = float32(0.0)
    U0, U1, U_D_PAD, U_BLOCK_N, U_TILE = (np.uint32(x) for x in (0, 1, D_PAD, BLOCK_N, TILE))

    @cuda.jit(fastmath=True)
    def smem_fwd(Q, K, V, O, LSE, H, group, Nq, Nk, D, scale_, left, right):
        tid = cuda.threadIdx.x
        i = cuda.blockIdx.x * BLOCK_M + tid
        bh = cuda.blockIdx.y
        q_head, kv_head = head_starts(bh, H, group, Nq, Nk, D)   # this head's Q/O, its (grouped) K/V head
        scale = float32(scale_)
        u_d = uint64(D)
        q_row = q_head + uint64(i) * u_d
        k_s = cuda.shared.array(TILE, float32)       # [n][d]
        v_s = cuda.shared.array(TILE, float32)
        q = cuda.local.array(D_PAD, float32)
        acc = cuda.local.array(D_PAD, float32)
        s = cuda.local.array(BLOCK_N, float32)
        for d in range(D_PAD):
            q[d] = Q[q_row + uint32(d)] * scale if (i < Nq and d < D) else ZERO
            acc[d] = ZERO
        diag = i + Nk - Nq
        m_i = NEG_BIG
        l_i = ZERO
        for n_start in range(0, Nk, BLOCK_N):        # every tile, masked or not
            cuda.syncthreads()
            tile_kv = kv_head + uint64(n_start) * u_d
            n_valid = uint64(min(Nk - n_start, BLOCK_N))
            for t in range(LOADS):                   # the block loads the tile together
                e = uint32(tid + t * BLOCK_M)
                if e < U_TILE:
                    c, d = e // U_D_PAD, e % U_D_PAD
                    ok = c < n_valid and d < u_d
                    k_s[e] = K[tile_kv + c * u_d + d] if ok else ZERO
                    v_s[e] = V[tile_kv + c * u_d + d] if ok else ZERO
            cuda.syncthreads()
            m_new = m_i
            for c in range(BLOCK_N):                 # all threads read the same k_s row: a broadcast
                x = ZERO
                for d in range(D_PAD):
                    x += q[d] * k_s[uint32(c * D_PAD + d)]
                j = n_start + c
                if j >= Nk or (left >= 0 and j < diag - left) or (right >= 0 and j > diag + right):
                    x = NEG_BIG
                s[c] = x
                m_new = max(m_new, x)
            m_use = m_new if m_new > NEG_BIG else ZERO
            alpha = math.exp(m_i - m_use)            # one rescale per tile, not per key
            l_i *= alpha
            for d in range(D_PAD):
                acc[d] *= alpha
            for c in range(BLOCK_N):
                p = math.exp(s[c] - m_use)
                l_i += p
                for d in range(D_PAD):
                    acc[d] += p * v_s[uint32(c * D_PAD + d)]
            m_i = m_new
        if i < Nq:
            # as in step 1: the mask, not l_i, says whether the row sees a key (NaN in, NaN out)
            lo = 0 if left < 0 else max(0, diag - left)
            hi = Nk if right < 0 else min(Nk, diag + right + 1)
            sees = hi > lo
            inv = float32(1.0) / l_i if sees else ZERO
            for d in range(D_PAD):
                if d < D:
                    O[q_row + uint32(d)] = acc[d] * inv
            if sees:
                LSE[bh * Nq + i] = m_i + math.log(l_i)
            else:
                LSE[bh * Nq + i] = -math.inf

    return smem_fwd


def _launch_rows(kernel, rows_per_block, q, k, v, spec, name):
    require_float32(spec, name)
    head_dim_bucket(spec.head_dim)   # ValueError above 128
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = torch.empty_like(q)
    lse = torch.empty(spec.batch, spec.heads, spec.n_q, device=q.device, dtype=torch.float32)
    grid = (math.ceil(spec.n_q / rows_per_block), spec.batch * spec.heads)
    with simulator_speed():
        kernel[grid, rows_per_block, stream()](*(as_array(t.view(-1)) for t in (q, k, v, o, lse)),
                                               spec.heads, spec.group, spec.n_q, spec.n_k, spec.head_dim,
                                               np.float32(spec.scale), spec.left, spec.right)
    return o, lse


def numba_rowwise(q, k, v, spec):
    kernel = build_rowwise(head_dim_bucket(spec.head_dim))
    return _launch_rows(kernel, ROWWISE_THREADS, q, k, v, spec, "numba_rowwise")


def numba_smem(q, k, v, spec):
    kernel = build_smem(head_dim_bucket(spec.head_dim))
    return _launch_rows(kernel, SMEM_BLOCK_M, q, k, v, spec, "numba_smem")


def numba_regtile(q, k, v, spec):
    return launch_tiled(q, k, v, spec, skip_masked_tiles=False, name="numba_regtile")


#: the chapter's steps in order, with what each one changes (the final step is numba_tiled)
STEPS = {
    "numba_naive": "chapter 1: three kernels, S and P written to global memory",
    "numba_rowwise": "step 1: one thread per query row, online softmax, K/V read from global memory",
    "numba_smem": "step 2: K/V tiles staged in shared memory, shared by the block's rows",
    "numba_regtile": "step 3: register tiling, each thread a 4x4 tile of S and a 4xDIMS tile of O",
    "numba_tiled": "step 4: key tiles that the mask hides entirely are skipped",
}

_COMMON = dict(chapter=3, dtypes=(torch.float32,), head_dims=(1, MAX_HEAD_DIM),
               extra_memory=lambda s: 4 * s.batch * s.heads * s.n_q, step_of="numba_tiled")
register("numba_rowwise", description="ch3 step 1: one thread per query row, K/V from global memory",
         **_COMMON)(numba_rowwise)
register("numba_smem", description="ch3 step 2: K/V tiles in shared memory, one query row per thread",
         **_COMMON)(numba_smem)
register("numba_regtile", description="ch3 step 3: register-tiled S and O, every key tile computed",
         **_COMMON)(numba_regtile)
