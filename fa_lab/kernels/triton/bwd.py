"""Chapter 5: the FlashAttention-2 backward pass in Triton, deterministic (no atomics).

Two kernels, both recomputing P = exp(S - lse) from Q, K and the saved lse, in this order:

1. ``bwd_dq``: **Q-stationary**.  A program owns one block of queries and walks the key
   blocks it sees: dQ_i += dS K.  Owning those rows, it first computes their D = rowsum(dO ∘ O)
   and the lse in base 2 (``row_terms``: ``+inf`` for a row that sees no key, so that its P is
   0 rather than NaN) and stores both for the next kernel.
2. ``bwd_dkdv``: **K/V-stationary**.  A program owns one block of keys, keeps K_j, V_j,
   dK_j and dV_j on chip, and walks every query block that sees it — for *every query
   head of its GQA group*, so the group's sum happens in registers:
   dV_j += Pᵀ dO,  dK_j += dSᵀ Q.

FlashAttention-2 computes dQ inside the K/V loop with ``atomicAdd``, whose order (and so
whose rounding) changes from run to run.  Here every gradient element is written by
exactly one program, in a fixed order: the gradients are bit-identical run to run, at the
price of recomputing QKᵀ and dO Vᵀ in the dQ kernel (7 matmuls instead of 5).

Each key/query loop runs in three phases — masked blocks, full blocks, masked blocks —
so that only the blocks on a mask's edge (or a sequence's tail) pay for the mask.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fa_lab.core.world import ON_GPU
from fa_lab.kernels.triton import bwd_ws
from fa_lab.kernels.triton.key_ranges import visible_range
from fa_lab.kernels.triton.launch import descriptor_scratch
from fa_lab.kernels.triton.row_terms import row_terms

LOG2E = 1.4426950408889634   # exp(x) = exp2(x · log2 e): exp2 is the fast instruction


@triton.jit
def load_transposed(ptr, offs, stride, stride_d, n, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    MASK: tl.constexpr):
    """Rows ``offs`` of a ``(rows, HEAD_DIM)`` matrix as a ``[BLOCK_D, len(offs)]`` tile (one row a column):
    zeros past ``HEAD_DIM`` and, under ``MASK``, for rows past ``n``."""
    offs_d = tl.arange(0, BLOCK_D)
    mask = offs_d[:, None] < HEAD_DIM
    if MASK:
        mask = mask & (offs[None, :] < n)
    return tl.load(ptr + offs[None, :] * stride + offs_d[:, None] * stride_d, mask=mask, other=0.0)


@triton.jit
def phase_bounds(lo, hi, full_lo, full_hi, BLOCK: tl.constexpr):
    """``(mid, end_mid)``: tiles of ``BLOCK`` from ``lo``; ``[mid, end_mid)`` are the whole tiles inside
    ``[full_lo, full_hi)`` (no mask), ``[lo, mid)`` and ``[end_mid, hi)`` the masked ones around them."""
    full_lo = tl.minimum(tl.maximum(full_lo, lo), tl.maximum(hi, lo))
    full_hi = tl.minimum(full_hi, hi)
    mid = lo + tl.cdiv(full_lo - lo, BLOCK) * BLOCK
    end_mid = mid + tl.maximum(full_hi - mid, 0) // BLOCK * BLOCK
    return mid, end_mid


@triton.jit
def dkdv_inner(dk, dv, k, v, Q, DO, LSE2, Delta,
                stride_qm, stride_qd, stride_dom, stride_dod,
                start_m, offs_n, N_Q, N_K, qk_scale, WIN_LEFT, WIN_RIGHT,
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, MASK: tl.constexpr,
                PRECISION: tl.constexpr):
    """One query block against this program's key block: dV += Pᵀ dO, dK += dSᵀ Q.

    Works on the transposes (keys as rows): Sᵀ = K Qᵀ, so that Pᵀ is already the left operand of Pᵀ dO.
    """
    offs_m = start_m + tl.arange(0, BLOCK_M)
    qT = load_transposed(ptr=Q, offs=offs_m, stride=stride_qm, stride_d=stride_qd, n=N_Q,
                         HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, MASK=MASK)
    doT = load_transposed(ptr=DO, offs=offs_m, stride=stride_dom, stride_d=stride_dod, n=N_Q,
                          HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, MASK=MASK)
    if MASK:
        lse2 = tl.load(LSE2 + offs_m, mask=offs_m < N_Q, other=float("inf"))
        Di = tl.load(Delta + offs_m, mask=offs_m < N_Q, other=0.0)
    else:
        lse2 = tl.load(LSE2 + offs_m)
        Di = tl.load(Delta + offs_m)
    # Sᵀ and Pᵀ: (BLOCK_N keys, BLOCK_M queries), P recomputed from the saved lse
    pT = tl.math.exp2(tl.dot(k, qT, input_precision=PRECISION) * qk_scale - lse2[None, :])
    if MASK:
        # (rows past N_Q need no mask: their lse2 is +inf, so their P is already 0)
        diag = offs_m[None, :] + (N_K - N_Q)     # the key each query row sits at (bottom-right)
        if HAS_LEFT:
            pT = tl.where(offs_n[:, None] >= diag - WIN_LEFT, pT, 0.0)
        if HAS_RIGHT:
            pT = tl.where(offs_n[:, None] <= diag + WIN_RIGHT, pT, 0.0)
    dv += tl.dot(pT.to(doT.dtype), tl.trans(doT), input_precision=PRECISION)
    dpT = tl.dot(v, doT, input_precision=PRECISION)
    dsT = pT * (dpT - Di[None, :])
    dk += tl.dot(dsT.to(qT.dtype), tl.trans(qT), input_precision=PRECISION)
    return dk, dv


@triton.jit
def dkdv_loop(dk, dv, k, v, Q, DO, LSE2, Delta, stride_qh, stride_qm, stride_qd, stride_doh, stride_dom, stride_dod,
               start, n_blocks, group, offs_n, N_Q, N_K, qk_scale, WIN_LEFT, WIN_RIGHT,
               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
               HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, MASK: tl.constexpr, PRECISION: tl.constexpr):
    """``n_blocks`` query blocks from row ``start``, for every query head of the group, in one flat loop
    (Q, DO, LSE2 and Delta point at the group's first head)."""
    for it in range(0, group * n_blocks):
        # max(.., 1): without a mask a phase's n_blocks is the constant 0, and a division by a constant 0
        # is undefined behaviour the compiler may exploit even in a loop that never runs (it did, on an H100)
        g = it // tl.maximum(n_blocks, 1)
        dk, dv = dkdv_inner(dk=dk, dv=dv, k=k, v=v, Q=Q + g * stride_qh, DO=DO + g * stride_doh,
                            LSE2=LSE2 + g * N_Q, Delta=Delta + g * N_Q,
                            stride_qm=stride_qm, stride_qd=stride_qd, stride_dom=stride_dom, stride_dod=stride_dod,
                            start_m=start + (it - g * n_blocks) * BLOCK_M, offs_n=offs_n, N_Q=N_Q, N_K=N_K,
                            qk_scale=qk_scale, WIN_LEFT=WIN_LEFT, WIN_RIGHT=WIN_RIGHT, HEAD_DIM=HEAD_DIM,
                            BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT, MASK=MASK,
                            PRECISION=PRECISION)
    return dk, dv


@triton.jit
def bwd_dkdv(Q, K, V, DO, LSE2, Delta, DK, DV,
              stride_qb, stride_qh, stride_qm, stride_qd,
              stride_kb, stride_kh, stride_kn, stride_kd,
              stride_vb, stride_vh, stride_vn, stride_vd,
              stride_dob, stride_doh, stride_dom, stride_dod,
              stride_gb, stride_gh, stride_gn, stride_gd,     # dK and dV: one contiguous layout
              H, HKV, N_Q, N_K, sm_scale, qk_scale, WIN_LEFT, WIN_RIGHT,
              HEAD_DIM: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
              PRECISION: tl.constexpr):
    pid_n = tl.program_id(0)
    bhk = tl.program_id(1)
    b = (bhk // HKV).to(tl.int64)
    hk = (bhk % HKV).to(tl.int64)
    group = H // HKV
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    kv_mask = (offs_n[:, None] < N_K) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(K + b * stride_kb + hk * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                mask=kv_mask, other=0.0)
    v = tl.load(V + b * stride_vb + hk * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # Query rows that see some key of this block: [lo, hi).  Rows in [full_lo, full_hi) see
    # all of them, so their blocks skip the mask.  (Keys past N_K need no mask here: their
    # dK/dV rows are never stored.)  The forward's question with the mask transposed: key j
    # sees query i when query i sees key j, so the window's sides swap.
    lo, hi, full_lo, full_hi = visible_range(start=start_n, n_rows=N_K, n_cols=N_Q, left=WIN_RIGHT, right=WIN_LEFT,
                                             BLOCK=BLOCK_N, HAS_LEFT=HAS_RIGHT, HAS_RIGHT=HAS_LEFT)
    mid, end_mid = phase_bounds(lo=lo, hi=hi, full_lo=full_lo, full_hi=full_hi, BLOCK=BLOCK_M)

    # One flat loop per phase over (query head of the group, query block): the group's sum happens
    # in registers, and a flat loop keeps fewer registers live than two nested ones.
    n_pre = (mid - lo) // BLOCK_M
    n_mid = (end_mid - mid) // BLOCK_M
    n_post = tl.cdiv(tl.maximum(hi - end_mid, 0), BLOCK_M)
    q_ptr = Q + b * stride_qb + hk * group * stride_qh
    do_ptr = DO + b * stride_dob + hk * group * stride_doh
    row_ptr = (b * H + hk * group) * N_Q
    lse_ptr = LSE2 + row_ptr
    delta_ptr = Delta + row_ptr
    # the three phases, unrolled at compile time: masked, without a mask, masked
    starts = (lo, mid, end_mid)
    counts = (n_pre, n_mid, n_post)
    for phase in tl.static_range(3):
        dk, dv = dkdv_loop(dk=dk, dv=dv, k=k, v=v, Q=q_ptr, DO=do_ptr, LSE2=lse_ptr, Delta=delta_ptr,
                           stride_qh=stride_qh, stride_qm=stride_qm, stride_qd=stride_qd, stride_doh=stride_doh,
                           stride_dom=stride_dom, stride_dod=stride_dod, start=starts[phase],
                           n_blocks=counts[phase], group=group, offs_n=offs_n, N_Q=N_Q, N_K=N_K,
                           qk_scale=qk_scale, WIN_LEFT=WIN_LEFT, WIN_RIGHT=WIN_RIGHT, HEAD_DIM=HEAD_DIM,
                           BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT,
                           MASK=phase != 1, PRECISION=PRECISION)

    out = b * stride_gb + hk * stride_gh + offs_n[:, None] * stride_gn + offs_d[None, :] * stride_gd
    tl.store(DK + out, (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def dq_inner(dq, q, do, lse2, Di, K, V,
              stride_kn, stride_kd, stride_vn, stride_vd,
              start_n, offs_m, N_Q, N_K, qk_scale, WIN_LEFT, WIN_RIGHT,
              HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
              HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, MASK: tl.constexpr,
              PRECISION: tl.constexpr):
    """This program's query block against one key block: dQ += dS K, with dS = P ∘ (dP - D)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    kT = load_transposed(ptr=K, offs=offs_n, stride=stride_kn, stride_d=stride_kd, n=N_K,
                         HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, MASK=MASK)
    vT = load_transposed(ptr=V, offs=offs_n, stride=stride_vn, stride_d=stride_vd, n=N_K,
                         HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, MASK=MASK)
    p = tl.math.exp2(tl.dot(q, kT, input_precision=PRECISION) * qk_scale - lse2[:, None])
    if MASK:   # keys past N_K are zeros, whose exp is not: they need the mask too
        diag = offs_m[:, None] + (N_K - N_Q)
        ok = offs_n[None, :] < N_K
        if HAS_LEFT:
            ok = ok & (offs_n[None, :] >= diag - WIN_LEFT)
        if HAS_RIGHT:
            ok = ok & (offs_n[None, :] <= diag + WIN_RIGHT)
        p = tl.where(ok, p, 0.0)
    dp = tl.dot(do, vT, input_precision=PRECISION)
    ds = p * (dp - Di[:, None])
    dq += tl.dot(ds.to(kT.dtype), tl.trans(kT), input_precision=PRECISION)
    return dq


@triton.jit
def bwd_dq(Q, K, V, DO, LSE2, Delta, DQ, O, LSE, DLSE,
            stride_qb, stride_qh, stride_qm, stride_qd,
            stride_kb, stride_kh, stride_kn, stride_kd,
            stride_vb, stride_vh, stride_vn, stride_vd,
            stride_dob, stride_doh, stride_dom, stride_dod,
            stride_gb, stride_gh, stride_gm, stride_gd,
            stride_ob, stride_oh, stride_om, stride_od,
            H, HKV, N_Q, N_K, sm_scale, qk_scale, WIN_LEFT, WIN_RIGHT,
            HEAD_DIM: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
            PRECISION: tl.constexpr, HAS_DLSE: tl.constexpr):
    pid_m = tl.program_id(0)
    if HAS_RIGHT:   # causal-like: the last query blocks see the most keys; start them first
        pid_m = tl.num_programs(0) - 1 - pid_m
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    hk = h // (H // HKV)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    in_rows = offs_m < N_Q
    qd_mask = in_rows[:, None] & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=qd_mask, other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod,
                 mask=qd_mask, other=0.0)
    row = (b * H + h) * N_Q + offs_m
    # this program owns these query rows: it computes their D and base-2 lse here, for itself and for the
    # dK/dV pass that runs after it (no separate preprocess kernel, no second read of dO)
    o = tl.load(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
                mask=qd_mask, other=0.0)
    lse = tl.load(LSE + row, mask=in_rows, other=float("-inf"))        # rows past N_Q: lse2 = +inf, P = 0
    dlse = 0.0
    if HAS_DLSE:
        dlse = tl.load(DLSE + row, mask=in_rows, other=0.0)
    lse2, Di = row_terms(o, do, lse, dlse, HAS_DLSE)
    tl.store(Delta + row, Di, mask=in_rows)
    tl.store(LSE2 + row, lse2, mask=in_rows)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Keys that some row of this block sees: [lo, hi); all rows see [full_lo, full_hi).
    lo, hi, full_lo, full_hi = visible_range(start=start_m, n_rows=N_Q, n_cols=N_K, left=WIN_LEFT, right=WIN_RIGHT,
                                             BLOCK=BLOCK_M, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT)
    mid, end_mid = phase_bounds(lo=lo, hi=hi, full_lo=full_lo, full_hi=full_hi, BLOCK=BLOCK_N)

    k_ptr = K + b * stride_kb + hk * stride_kh
    v_ptr = V + b * stride_vb + hk * stride_vh
    # the three phases, unrolled at compile time: keys [lo, mid) masked, [mid, end_mid) without a
    # mask, [end_mid, hi) masked
    bounds = (lo, mid, end_mid, hi)
    for phase in tl.static_range(3):
        for start_n in range(bounds[phase], bounds[phase + 1], BLOCK_N):
            dq = dq_inner(dq=dq, q=q, do=do, lse2=lse2, Di=Di, K=k_ptr, V=v_ptr, stride_kn=stride_kn,
                          stride_kd=stride_kd, stride_vn=stride_vn, stride_vd=stride_vd, start_n=start_n,
                          offs_m=offs_m, N_Q=N_Q, N_K=N_K, qk_scale=qk_scale, WIN_LEFT=WIN_LEFT, WIN_RIGHT=WIN_RIGHT,
                          HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, HAS_LEFT=HAS_LEFT,
                          HAS_RIGHT=HAS_RIGHT, MASK=phase != 1, PRECISION=PRECISION)

    tl.store(DQ + b * stride_gb + h * stride_gh + offs_m[:, None] * stride_gm + offs_d[None, :] * stride_gd,
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=qd_mask)


# ---------------------------------------------------------------------------------------------
# Launch

#: GPU tile configs: (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel, by padded head dim and
#: element size.  dK/dV keeps two (BLOCK_N, D) fp32 accumulators in registers, dQ one (BLOCK_M, D):
#: candidates are the tiles that compile for sm_90 without spilling registers (Triton 3.6); the
#: D = 64 and 128 entries are the fastest of those on an H100 (``tuner.tune_backward``, run by
#: scripts/bench_ch5.py --sections tune), the D = 256 entry on an H200
#: (docs/decisions/d256-backward-tiles.md).
GPU_CONFIGS = {
    # (BLOCK_D, itemsize): (dkdv, dq)
    (16, 2): ((64, 128, 8, 3), (128, 64, 4, 3)),
    (32, 2): ((64, 128, 8, 3), (128, 64, 4, 3)),
    (64, 2): ((64, 64, 4, 2), (128, 64, 8, 3)),
    (128, 2): ((64, 128, 8, 2), (128, 64, 8, 3)),
    (256, 2): ((64, 64, 8, 2), (128, 32, 8, 3)),
    # fp32 runs its dots in IEEE fp32 on CUDA cores (not TF32): small tiles
    (16, 4): ((16, 64, 8, 1), (64, 32, 8, 1)),
    (32, 4): ((16, 64, 8, 1), (64, 32, 8, 1)),
    (64, 4): ((16, 64, 8, 1), (64, 32, 8, 1)),
    (128, 4): ((16, 32, 8, 1), (32, 16, 8, 1)),
    (256, 4): ((16, 32, 8, 1), (32, 16, 8, 1)),
}
#: the descriptor (TMA) tiles (``bwd_ws``) per (BLOCK_D, itemsize), ``(dkdv, dq)``; ``None`` keeps
#: GPU_CONFIGS' tile.  Taken only where ``bwd_ws.eligible`` (whole tiles, row-major tensors): elsewhere
#: GPU_CONFIGS' tile runs.  At D = 64, 128 and 256 the dK/dV pass through descriptors beat the best plain
#: tile on an H200 (``docs/decisions/split-backward-race.md``, ``docs/decisions/d256-backward-tiles.md``,
#: ``docs/decisions/backward-descriptor-copies.md``); the dQ pass through descriptors lost everywhere.
WS_CONFIGS = {
    (64, 2): ((64, 64, 4, 3, True), None),
    (128, 2): ((64, 128, 8, 3, True), None),
    (256, 2): ((64, 64, 8, 2, True), None),
}
#: masked problems with fewer keys than this keep GPU_CONFIGS' dK/dV tile, per BLOCK_D: at D = 64 under a
#: causal mask the plain tile was 16% faster at N = 1024 and tied at N = 2048, while the descriptor tile
#: was 10-32% faster on longer or unmasked problems (H200, ``docs/decisions/backward-descriptor-copies.md``)
WS_MASKED_MIN_KEYS = {64: 2048}
#: Whether the descriptor dK/dV pass asks Triton to warp-specialize its loop (a producer warpgroup and two
#: consumer warpgroups, at 4 warps).  Off: on Hopper, Triton 3.6's split of this loop now and then left a
#: whole dK/dV tile NaN (in 4-13% of calls on unmasked problems), so the gradients were neither right nor
#: deterministic (``docs/decisions/split-backward-race.md``).  At 8 warps Triton never splits it anyway.
WARP_SPECIALIZE_DKDV = False
#: the interpreter runs a program's tile ops in NumPy: small tiles keep the CPU world quick
CPU_CONFIG = ((16, 16, 4, 1), (16, 16, 4, 1))
MAX_HEAD_DIM = 256


def block_d(head_dim: int) -> int:
    """The head dim padded to a power of two (at least 16, the smallest Tensor Core tile)."""
    return max(16, triton.next_power_of_2(head_dim))


def gpu_configs(spec, itemsize: int, tensors=()):
    """``(dkdv, dq)`` GPU tiles for ``spec``: ``WS_CONFIGS``' where ``bwd_ws`` takes the problem and its
    ``tensors`` (q, k, v, dO) and ``WS_MASKED_MIN_KEYS`` does not keep a short masked one plain,
    ``GPU_CONFIGS``' otherwise."""
    key = (block_d(spec.head_dim), itemsize)
    ws = WS_CONFIGS.get(key, (None, None))
    masked = spec.left >= 0 or spec.right >= 0
    if masked and spec.n_k < WS_MASKED_MIN_KEYS.get(key[0], 0):
        ws = (None, None)
    return tuple(w if w is not None and tensors and bwd_ws.eligible(spec, w, tensors) else p
                 for w, p in zip(ws, GPU_CONFIGS[key]))


def configs(spec, dtype: torch.dtype | None = None, tensors=()):
    """``(dkdv, dq)`` tile configs, each ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` (a fifth entry,
    true: the descriptor kernel, ``bwd_ws``).  ``tensors``, the call's q, k, v and dO, decide whether the
    descriptor tiles can run; without them the plain tiles are the answer."""
    if not ON_GPU:
        return CPU_CONFIG
    dtype = dtype or spec.dtype
    return gpu_configs(spec, torch.empty((), dtype=dtype).element_size(), tensors)


def make_launcher(q, k, v, o, lse, do, spec, dlse=None):
    """Check and prepare one backward call; return ``(dq, dkdv, grads)``.

    ``dq(cfg)`` and ``dkdv(cfg)`` launch the two gradient kernels with a tile config
    ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` (and ``warmup=True`` only compiles them).  The dQ
    pass runs first: it also stores D and the base-2 lse of its rows, which the dK/dV pass reads.
    ``grads`` is ``(dq, dk, dv)``, written by the launches, in the dtype the kernels compute in.
    ``tuner.tune_backward`` times each alone.
    """
    if spec.head_dim > MAX_HEAD_DIM:
        raise ValueError(f"the Triton backward supports head dims up to {MAX_HEAD_DIM}, got {spec.head_dim}")
    if spec.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"the Triton backward takes float16, bfloat16 or float32, got {spec.dtype}")
    if not ON_GPU and q.dtype == torch.bfloat16:
        # the interpreter has no bfloat16 arithmetic (tl.dot on bf16 is garbage on the CPU): compute in fp32
        q, k, v, o, do = (t.float() for t in (q, k, v, o, do))
    B, H, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    BD = block_d(D)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"   # fp32 dots stay fp32 (not TF32)

    lse = lse.detach().to(torch.float32).contiguous()
    delta = torch.empty((B, H, Nq), dtype=torch.float32, device=q.device)   # D, written by the dQ pass
    lse2 = torch.empty_like(delta)                                          # lse in base 2, likewise
    dlse_arg = dlse.detach().to(torch.float32).contiguous() if dlse is not None else delta

    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    common = (q, k, v, do, lse2, delta)
    strides = (*q.stride(), *k.stride(), *v.stride(), *do.stride())
    scalars = (H, Hkv, Nq, Nk, spec.scale, spec.scale * LOG2E, max(spec.left, 0), max(spec.right, 0))
    masks = dict(HEAD_DIM=D, HAS_LEFT=spec.left >= 0, HAS_RIGHT=spec.right >= 0, PRECISION=precision)

    def launch(kernel, grid, args, cfg, warmup, **kw):
        bm, bn, warps, stages = cfg[:4]
        kw.update(masks, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
        if ON_GPU and "WARP_SPECIALIZE" in kw:
            triton.set_allocator(descriptor_scratch)   # the kernel builds tensor descriptors
        if warmup:
            return kernel.warmup(*args, grid=grid, **kw)
        kernel[grid](*args, **kw)

    # a dK/dV config's fifth entry, when true, asks for the descriptor kernel (bwd_ws), which only
    # takes problems whose tiles are whole; the others run the kernel above
    def through_descriptors(cfg):
        return len(cfg) > 4 and cfg[4] and bwd_ws.eligible(spec, cfg, (q, k, v, do))

    def dkdv_launch(cfg, warmup=False):
        """Launch the dK/dV pass with tile ``cfg`` (``warmup=True``: only compile it, and return the kernel)."""
        grid = (triton.cdiv(Nk, cfg[1]), B * Hkv)
        if through_descriptors(cfg):
            return launch(bwd_ws.bwd_dkdv_ws, grid, (*common, dk, dv, *scalars), cfg, warmup,
                          WARP_SPECIALIZE=ON_GPU and WARP_SPECIALIZE_DKDV)
        return launch(bwd_dkdv, grid, (*common, dk, dv, *strides, *dk.stride(), *scalars), cfg, warmup, BLOCK_D=BD)

    def dq_launch(cfg, warmup=False):
        # no warp-specialized dQ pass: with D and the lse computed before its loop, Triton 3.6's split
        # fails to compile, and split it was not faster (docs/decisions/one-pass-backward.md)
        grid = (triton.cdiv(Nq, cfg[0]), B * H)
        launch(bwd_dq, grid, (*common, dq, o, lse, dlse_arg, *strides, *dq.stride(), *o.stride(), *scalars), cfg,
               warmup, BLOCK_D=BD, HAS_DLSE=dlse is not None)

    return dq_launch, dkdv_launch, (dq, dk, dv)


def triton_backward(q, k, v, o, lse, do, spec, dlse=None, config=None):
    """``(dq, dk, dv)`` of attention from the saved ``q, k, v, o, lse`` and the incoming ``do``.

    ``lse`` is the forward's natural-log log-sum-exp, ``-inf`` for rows that see no key;
    ``dlse`` an optional gradient on it.  ``config`` overrides ``configs(spec)``: a pair
    ``(dkdv, dq)`` of ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``.
    Deterministic: the same inputs give bit-identical gradients.
    """
    dq, dkdv, grads = make_launcher(q, k, v, o, lse, do, spec, dlse)
    cfg_kv, cfg_q = config or configs(spec, grads[0].dtype, (q, k, v, do))
    dq(cfg_q)      # first: it also writes D and the base-2 lse that the dK/dV pass reads
    dkdv(cfg_kv)
    return tuple(g.to(q.dtype) for g in grads)
