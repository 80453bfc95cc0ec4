"""Chapter 3: the FlashAttention-2 forward, tiled, on CUDA cores (Numba CUDA, fp32).

One thread block owns a tile of ``BLOCK_M`` query rows of one (batch, head).  It
streams the keys and values through shared memory in tiles of ``BLOCK_N`` rows and
keeps the online-softmax state of its rows on chip — the running maximum ``m_i``,
the running sum ``l_i`` and the unnormalised output ``acc`` — so that O and the
log-sum-exp are written to global memory (HBM) exactly once, and S and P never are.

Inside a block the work is split as in an SGEMM micro-kernel: the block's threads form
a ``THREADS_M x THREADS_N`` grid and each thread computes a small register tile of S
(``ROWS`` query rows x ``KEYS`` keys) and of O (``ROWS`` rows x ``DIMS`` features).
Every value read from shared memory is then used several times from a register
(chapter 3 measures what that is worth against one query row per thread).

Key tiles that no row of the block can see (outside the causal triangle or the
sliding window) are skipped: the tile loop runs only over ``block_key_range``.  Tiles
that are partly visible — the diagonal, the window edges, the tail past ``Nk`` —
are masked element by element.

The K/V tile lives in dynamic shared memory, sized at launch: a block may have more than
48 KiB of shared memory only through it (the Q and P tiles are static arrays).  Local arrays
need sizes known when the kernel is compiled, so a kernel is compiled per ``TileConfig``
(``fa_lab.kernels.numba.tile_config``): one per head-dim bucket (D padded with zeros to 16,
32, 64 or 128).  Head dims above 128 are refused with a ``ValueError``.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import torch
from numba import cuda, float32, uint32, uint64

from fa_lab.core.registry import register
from fa_lab.core.world import ON_GPU
from fa_lab.kernels.numba.bridge import allow_shared_bytes, as_array, require_float32, simulator_speed, stream
from fa_lab.kernels.numba.heads import head_starts
from fa_lab.kernels.numba.tile_config import (
    CPU_CONFIGS,
    GPU_CONFIGS,
    HEAD_DIM_BUCKETS,
    MAX_HEAD_DIM,
    SHARED_LIMIT,
    STATIC_SHARED_LIMIT,
    VEC,
    TileConfig,
    config_for,
    head_dim_bucket,
)

# "Minus infinity" inside the kernels.  A finite sentinel, because fastmath lets the
# compiler assume no value is ever infinite; exp(NEG_BIG - m) still underflows to 0.
NEG_BIG = float32(-1e30)
LOG2E, LN2 = float32(math.log2(math.e)), float32(math.log(2.0))

#: Shared tiles start on 16-byte boundaries so that runs of VEC floats are aligned (the simulator takes no alignment).
ALIGN = 16 if ON_GPU else None
#: On the GPU a row's threads combine their maxima with warp shuffles; the simulator has none.
SHUFFLE = ON_GPU
FULL_MASK = 0xFFFFFFFF


@functools.lru_cache(maxsize=None)
def build_kernel(cfg: TileConfig, skip_masked_tiles: bool = True):
    """Compile (lazily, at first launch) the tiled forward kernel for one ``TileConfig``.

    The constants below are frozen into the kernel: Numba sizes shared and local arrays
    from them and unrolls the loops over them, so ``s``, ``acc``, ``m_i`` and ``l_i``
    live in registers.  ``skip_masked_tiles=False`` gives chapter 3's step 3: every key
    tile is computed and the masked scores are thrown away.

    A note on indices.  Numba checks every signed index for "negative, count from the
    end" (Python's ``a[-1]``): three extra integer instructions per load, more than the
    arithmetic they feed in the inner loops.  So the hot loops index flat arrays with
    *unsigned* offsets (``uint32``/``uint64``): a per-thread base, plus the loop counter,
    plus a constant per register-tile element (``uint32(i * step + f)`` folds to a constant
    once the compiler unrolls the loops over the register tile).  They step with ``while``
    loops on unsigned counters, which compile to pointer increments and loads at fixed
    offsets.

    A note on wide loads.  The inner loops read runs of ``VEC`` = 4 consecutive floats (four
    head-dim values of a Q or K row, four keys of a P row, four features of a V row).  The
    shared tiles start on 16-byte boundaries (``alignment=16``), every row length is a
    multiple of 4 floats, and every offset is a multiple of 4 the compiler can see (bases
    times strides that are multiples of 4, counters stepping by 4 from 0): so each run is
    one 128-bit load (``ld.shared.v4.f32``) instead of four.
    """
    cfg.check()
    BLOCK_M, BLOCK_N, THREADS_N, D_PAD = cfg.block_m, cfg.block_n, cfg.threads_n, cfg.d_pad
    THREADS_M, THREADS, ROWS, KEYS, GROUPS = cfg.threads_m, cfg.threads, cfg.rows, cfg.keys, cfg.dims // VEC
    Q_STRIDE, K_STRIDE, P_STRIDE, R_STRIDE, V_AT = cfg.q_stride, cfg.k_stride, cfg.p_stride, cfg.red_stride, cfg.v_at
    Q_SIZE, P_SIZE, R_SIZE = (cfg.shared_floats()[tile] for tile in ("q", "p", "red"))
    LOADS = BLOCK_N * D_PAD // THREADS    # elements of a K (or V) tile each thread loads
    SHARE_KV, SKIP = cfg.share_kv, skip_masked_tiles
    Q_ROW_STEP, P_ROW_STEP, R_ROW_STEP = THREADS_M * Q_STRIDE, THREADS_M * P_STRIDE, THREADS_M * R_STRIDE
    K_COL_STEP, V_GROUP_STEP = THREADS_N * K_STRIDE, VEC * THREADS_N
    # lane distances of a butterfly over a row's THREADS_N neighbouring lanes: THREADS_N/2, ..., 1
    XOR_LANES = tuple(THREADS_N >> k for k in range(1, THREADS_N.bit_length()))
    ZERO = float32(0.0)
    U0, U_VEC, U_D_PAD, U_BLOCK_N, U_K_STRIDE, U_V_AT = (np.uint32(x) for x in (0, VEC, D_PAD, BLOCK_N,
                                                                             K_STRIDE, V_AT))

    options = dict(fastmath=True)
    if ON_GPU and cfg.max_registers:          # the simulator's jit takes no register cap
        options["max_registers"] = cfg.max_registers

    @cuda.jit(device=True, inline="always")
    def load_runs(out, A, at, step):
        # out[i, f] = A[at + i·step + f]: out.shape[0] runs of VEC consecutive floats, one 128-bit load each.
        for i in range(out.shape[0]):
            for f in range(VEC):
                out[i, f] = A[at + uint32(i * step + f)]

    @cuda.jit(device=True, inline="always")
    def fetch(regs, X, n_start, kv_head, Nk, u_d, tid):
        # This thread's LOADS elements of the K (or V) tile at key n_start, global memory -> registers:
        # the loads are issued here, and a register is waited for only where it is first used.
        # A full tile with D == D_PAD is one contiguous run of BLOCK_N·D floats: element e of the run
        # is element e of the tile, no bounds checks.  Tail tiles and padded D check, and load zeros.
        tile_kv = kv_head + uint64(n_start) * u_d
        n_valid = uint64(min(Nk - n_start, BLOCK_N))   # rows of the tile before the end of K
        full = n_valid == U_BLOCK_N and u_d == U_D_PAD
        for t in range(LOADS):
            e = uint32(tid + t * THREADS)
            c, d = e // U_D_PAD, e % U_D_PAD
            x = ZERO
            if full:
                x = X[tile_kv + e]
            elif c < n_valid and d < u_d:
                x = X[tile_kv + c * u_d + d]
            regs[t] = x

    @cuda.jit(device=True, inline="always")
    def stash(buf, at, stride, regs, tid):
        # The fetched elements, registers -> a shared tile whose rows are `stride` floats apart.
        for t in range(LOADS):
            e = uint32(tid + t * THREADS)
            buf[at + (e // U_D_PAD) * stride + e % U_D_PAD] = regs[t]

    @cuda.jit(**options)
    def flash_attention_fwd(Q, K, V, O, LSE, H, group, Nq, Nk, D, scale_, left, right):
        # Q, O: flat (B, H, Nq, D); K, V: flat (B, H // group, Nk, D); LSE: flat (B, H, Nq).
        # Heavier query tiles first (under a causal mask the last rows see the most keys),
        # so the long blocks do not start last and leave the GPU idle at the end.
        tile = cuda.gridDim.x - 1 - cuda.blockIdx.x
        bh = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        ty, tx = tid // THREADS_N, tid % THREADS_N
        m_start = tile * BLOCK_M
        m_end = min(m_start + BLOCK_M, Nq)
        # Scores in base 2: Q is pre-scaled by scale·log2(e), so exp(x·scale) = 2^(x·scale·log2 e) is one
        # ex2 instruction (exp would be a multiply and an ex2).  m_i is in the same units; lse converts back.
        scale = float32(scale_ * LOG2E)
        shift = Nk - Nq                       # bottom-right alignment: row i sits at key i + Nk - Nq
        u_d = uint64(D)
        q_head, kv_head = head_starts(bh, H, group, Nq, Nk, D)   # this head's Q (and O), its K/V head (GQA)

        q_s = cuda.shared.array(Q_SIZE, float32, alignment=ALIGN)   # Q tile [m][d], pre-scaled
        p_s = cuda.shared.array(P_SIZE, float32, alignment=ALIGN)   # P tile [m][n] (padded rows)
        red_s = cuda.shared.array(R_SIZE, float32)   # [m][thread]: row sums at the end (and, without shuffles, maxima)
        # K tile [n][d] (padded rows) and V tile [n][d]: dynamic shared memory (size 0 here, set at launch), the
        # only kind a block may have more than 48 KiB of.  Only this tile is dynamic: Q and P as arrays of their
        # own tell the compiler that a store to P cannot change a Q or K value it has loaded (offsets into one
        # buffer do not, and that ran slower).
        kv_s = cuda.shared.array(0, float32, alignment=ALIGN)

        # Where this thread's first row / key / feature sits in each shared tile (unsigned).
        u_tx = uint32(tx)
        q_base = uint32(ty * Q_STRIDE)
        k_base = uint32(tx * K_STRIDE)
        p_base = uint32(ty * P_STRIDE)
        r_base = uint32(ty * R_STRIDE)
        v_base = uint32(V_AT + VEC * tx)

        # Q tile, read once and pre-multiplied by the scale; zeros past Nq and past D (and in the row padding).
        for e in range(tid, BLOCK_M * Q_STRIDE, THREADS):
            r, d = e // Q_STRIDE, e % Q_STRIDE
            x = ZERO
            if m_start + r < Nq and d < D:
                x = Q[q_head + uint64((m_start + r) * D + d)] * scale
            q_s[e] = x

        m_i = cuda.local.array(ROWS, float32)
        l_i = cuda.local.array(ROWS, float32)   # this thread's share of the row sum (reduced at the end)
        tile_max = cuda.local.array(ROWS, float32)
        acc = cuda.local.array((ROWS, GROUPS, VEC), float32)   # row i, feature VEC·(tx + THREADS_N·g) + f
        s = cuda.local.array((ROWS, KEYS), float32)
        qa = cuda.local.array((ROWS, VEC), float32)      # operands of one step of the products, in registers
        kb = cuda.local.array((KEYS, VEC), float32)
        vb = cuda.local.array((GROUPS, VEC), float32)
        for i in range(ROWS):
            m_i[i] = NEG_BIG
            l_i[i] = ZERO
            for g in range(GROUPS):
                for f in range(VEC):
                    acc[i, g, f] = ZERO

        # The keys any row of this block may see: [lo, hi).  Tiles outside are never loaded.
        lo, hi = 0, Nk
        if SKIP:
            if left >= 0:
                lo = max(0, m_start + shift - left)
            if right >= 0:
                hi = min(Nk, m_end - 1 + shift + right + 1)
            lo = (lo // BLOCK_N) * BLOCK_N

        k_regs = cuda.local.array(LOADS, float32)   # a tile's K and V on their way to shared memory
        v_regs = cuda.local.array(LOADS, float32)
        for n_start in range(lo, hi, BLOCK_N):
            cuda.syncthreads()                # everyone is done with the previous tile
            fetch(k_regs, K, n_start, kv_head, Nk, u_d, tid)
            stash(kv_s, U0, U_K_STRIDE, k_regs, tid)
            cuda.syncthreads()
            # V's loads take hundreds of cycles: issued now, they are in flight while S is
            # computed and are waited for only when stored below.
            fetch(v_regs, V, n_start, kv_head, Nk, u_d, tid)

            # S tile = Q Kᵀ: thread (ty, tx) owns rows ty + THREADS_M·i and keys tx + THREADS_N·j.
            # Each step reads four head-dim values of each of its rows and keys, then does
            # ROWS·KEYS·4 FMAs with them.
            for i in range(ROWS):
                for j in range(KEYS):
                    s[i, j] = ZERO
            d = U0
            while d < U_D_PAD:
                load_runs(qa, q_s, q_base + d, Q_ROW_STEP)
                load_runs(kb, kv_s, k_base + d, K_COL_STEP)
                for f in range(VEC):
                    for i in range(ROWS):
                        for j in range(KEYS):
                            s[i, j] += qa[i, f] * kb[j, f]
                d += U_VEC

            # Mask element by element only where the tile is not entirely visible to every row.
            inside = n_start + BLOCK_N <= Nk
            if left >= 0 and n_start < m_end - 1 + shift - left:
                inside = False
            if right >= 0 and n_start + BLOCK_N - 1 > m_start + shift + right:
                inside = False
            if not inside:
                for i in range(ROWS):
                    diag = m_start + ty + THREADS_M * i + shift
                    for j in range(KEYS):
                        col = n_start + tx + THREADS_N * j
                        if col >= Nk or (left >= 0 and col < diag - left) or (right >= 0 and col > diag + right):
                            s[i, j] = NEG_BIG

            # Row maxima of the tile: each thread's part, then combined across the row's threads.  They
            # are neighbouring lanes of one warp, so on the GPU a butterfly of warp shuffles combines them
            # in registers; the simulator has no shuffles and goes through shared memory (and a barrier).
            for i in range(ROWS):
                mx = s[i, 0]
                for j in range(1, KEYS):
                    mx = max(mx, s[i, j])
                if SHUFFLE:
                    for lanes in XOR_LANES:
                        mx = max(mx, cuda.shfl_xor_sync(FULL_MASK, mx, lanes))
                else:
                    red_s[r_base + u_tx + uint32(i * R_ROW_STEP)] = mx
                tile_max[i] = mx
            if SHARE_KV or not SHUFFLE:
                cuda.syncthreads()            # maxima in red_s; and every thread is done reading K

            stash(kv_s, U_V_AT, U_D_PAD, v_regs, tid)   # with SHARE_KV, in K's place: K was read by everyone

            # Online softmax: new max, rescale what was accumulated, P tile to shared memory.
            for i in range(ROWS):
                m_new = max(m_i[i], tile_max[i])
                if not SHUFFLE:
                    for t in range(THREADS_N):
                        m_new = max(m_new, red_s[r_base + uint32(i * R_ROW_STEP + t)])
                m_use = m_new if m_new > NEG_BIG else ZERO   # nothing visible yet: 2^NEG_BIG = 0
                alpha = math.exp2(m_i[i] - m_use)
                m_i[i] = m_new
                row_sum = ZERO
                for j in range(KEYS):
                    p = math.exp2(s[i, j] - m_use)
                    p_s[p_base + u_tx + uint32(i * P_ROW_STEP + j * THREADS_N)] = p
                    row_sum += p
                l_i[i] = l_i[i] * alpha + row_sum
                for g in range(GROUPS):
                    for f in range(VEC):
                        acc[i, g, f] *= alpha
            cuda.syncthreads()

            # acc += P V: thread (ty, tx) owns rows ty + THREADS_M·i and runs of four features
            # VEC·(tx + THREADS_N·g) + f.  Each step reads four keys' P values of each of its rows,
            # then, key by key, that key's V runs.
            n = U0
            v_at = v_base
            while n < U_BLOCK_N:
                load_runs(qa, p_s, p_base + n, P_ROW_STEP)   # qa[i, f] = P[row i, key n + f]
                for f in range(VEC):
                    load_runs(vb, kv_s, v_at + uint32(f * D_PAD), V_GROUP_STEP)
                    for i in range(ROWS):
                        for g in range(GROUPS):
                            for e in range(VEC):
                                acc[i, g, e] += qa[i, f] * vb[g, e]
                n += U_VEC
                v_at += U_VEC * U_D_PAD

        # Each thread summed only its own keys: add up l_i across the row, then write O and lse once.
        cuda.syncthreads()
        for i in range(ROWS):
            red_s[r_base + u_tx + uint32(i * R_ROW_STEP)] = l_i[i]
        cuda.syncthreads()
        for i in range(ROWS):
            row = m_start + ty + THREADS_M * i
            if row < Nq:
                l_row = ZERO
                for t in range(THREADS_N):
                    l_row += red_s[r_base + uint32(i * R_ROW_STEP + t)]
                # Whether the row sees a key comes from the mask, not from l_row > 0: a NaN input
                # makes l_row NaN (and fastmath may fold NaN tests away); NaN must come out.
                diag = row + shift
                row_lo = 0 if left < 0 else max(0, diag - left)
                row_hi = Nk if right < 0 else min(Nk, diag + right + 1)
                sees = row_hi > row_lo
                inv = ZERO
                if sees:
                    inv = float32(1.0) / l_row
                for g in range(GROUPS):
                    for f in range(VEC):
                        d = VEC * (tx + THREADS_N * g) + f
                        if d < D:
                            O[q_head + uint64(row * D + d)] = acc[i, g, f] * inv   # a row that sees no key: zeros
                if tx == 0:
                    if sees:   # m_i and log2(l) are in base 2: lse = ln 2 · (m_i + log2 l)
                        LSE[bh * Nq + row] = LN2 * (m_i[i] + math.log2(l_row))
                    else:
                        LSE[bh * Nq + row] = -math.inf

    return flash_attention_fwd


def launch_tiled(q, k, v, spec, *, cfg: TileConfig | None = None, skip_masked_tiles: bool = True, name="numba_tiled"):
    """Run the tiled kernel; returns ``(o, lse)``.  ``cfg`` overrides the per-head-dim choice."""
    require_float32(spec, name)
    cfg = cfg or config_for(spec.head_dim)
    if spec.head_dim > cfg.d_pad:
        raise ValueError(f"{name}: head_dim={spec.head_dim} is larger than the kernel's d_pad={cfg.d_pad}")
    if spec.batch * spec.heads > 65535:
        raise ValueError(f"{name}: batch*heads = {spec.batch * spec.heads} is over the grid's 65535 limit")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = torch.empty_like(q)
    lse = torch.empty(spec.batch, spec.heads, spec.n_q, device=q.device, dtype=torch.float32)
    kernel = build_kernel(cfg, skip_masked_tiles)
    grid = (math.ceil(spec.n_q / cfg.block_m), spec.batch * spec.heads)
    args = (*(as_array(t.view(-1)) for t in (q, k, v, o, lse)), spec.heads, spec.group, spec.n_q, spec.n_k,
            spec.head_dim, np.float32(spec.scale), spec.left, spec.right)
    if cfg.shared_bytes() > STATIC_SHARED_LIMIT:
        allow_shared_bytes(kernel, args, cfg.dynamic_bytes())
    with simulator_speed():
        kernel[grid, cfg.threads, stream(), cfg.dynamic_bytes()](*args)
    return o, lse


def numba_tiled(q, k, v, spec):
    return launch_tiled(q, k, v, spec)


def hbm_bytes(spec, block_m: int | None = None, block_n: int | None = None) -> dict:
    """Bytes the tiled kernel moves to and from global memory, by the model of the chapter.

    Q, O and lse cross once; every block reads the K/V tiles of its key range once, so
    K and V are read ``ceil(Nq / BLOCK_M)`` times per (batch, head) — fewer under a mask.
    (On the GPU most of those repeated reads hit the L2 cache: this counts them all.)
    """
    from fa_lab.core.masks import block_key_range

    cfg = config_for(spec.head_dim)
    block_m, block_n = block_m or cfg.block_m, block_n or cfg.block_n
    B, H, D = spec.batch, spec.heads, spec.head_dim   # each query head reads its K/V head's tiles
    kv_rows = 0
    for m0 in range(0, spec.n_q, block_m):
        lo, hi = block_key_range(m0, min(m0 + block_m, spec.n_q), spec.n_q, spec.n_k, spec.left, spec.right)
        if hi > lo:
            kv_rows += min(spec.n_k, -(-hi // block_n) * block_n) - lo // block_n * block_n
    return dict(q=4 * B * H * spec.n_q * D, o=4 * B * H * spec.n_q * D, lse=4 * B * H * spec.n_q,
                kv=4 * 2 * B * H * kv_rows * D, s_and_p=0)


register(
    "numba_tiled", chapter=3,
    description="FlashAttention-2 forward in Numba CUDA: Q tile per block, K/V tiles through shared memory, "
                "register-tiled S and O, masked tiles skipped",
    dtypes=(torch.float32,), head_dims=(1, MAX_HEAD_DIM),
    extra_memory=lambda s: 4 * s.batch * s.heads * s.n_q,   # only lse beyond O
)(numba_tiled)

__all__ = ["TileConfig", "HEAD_DIM_BUCKETS", "MAX_HEAD_DIM", "SHARED_LIMIT", "build_kernel", "config_for",
           "head_dim_bucket", "launch_tiled", "numba_tiled", "hbm_bytes", "GPU_CONFIGS", "CPU_CONFIGS"]
