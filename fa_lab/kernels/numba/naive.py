"""Chapter 1 on the GPU: the naive attention kernel in Numba CUDA.

Three launches, each simple enough to read at a glance, and S = QKᵀ written to
global memory (HBM) in between — exactly the traffic FlashAttention removes:

1. ``scores``: one thread per (query i, key j) computes S[i, j] = q_i · k_j · scale;
2. ``softmax_rows``: one thread per row turns S into P in place and writes lse;
3. ``pv``: one thread per (query i, feature d) computes O[i, d] = Σ_j P[i, j] V[j, d].
"""
from __future__ import annotations

import math

import torch
from numba import cuda

from fa_lab.core.registry import register
from fa_lab.core.world import pick
from fa_lab.kernels.numba.bridge import as_array, require_float32, stream
from fa_lab.kernels.numba.heads import batch_head

TILE = pick(cpu=4, gpu=16)  # threads per block side; the simulator runs one Python thread per CUDA thread


@cuda.jit
def scores(Q, K, S, scale, left, right, group):
    j, i = cuda.grid(2)
    H, Nq, Nk = Q.shape[1], Q.shape[2], K.shape[2]
    if i >= Nq or j >= Nk:
        return
    b, h, hk = batch_head(cuda.blockIdx.z, H, group)   # one grid layer per (batch, head); hk: its K/V head
    diag = i + Nk - Nq
    if (left >= 0 and j < diag - left) or (right >= 0 and j > diag + right):
        S[b, h, i, j] = -math.inf
        return
    s = 0.0
    for d in range(Q.shape[3]):
        s += Q[b, h, i, d] * K[b, hk, j, d]
    S[b, h, i, j] = s * scale


@cuda.jit
def softmax_rows(S, LSE):
    i = cuda.grid(1)
    bh = cuda.blockIdx.y
    H, Nq, Nk = S.shape[1], S.shape[2], S.shape[3]
    if i >= Nq:
        return
    b, h = bh // H, bh % H
    m = -math.inf
    seen = False                             # a NaN score counts as seen: NaN in must give NaN out
    for j in range(Nk):
        x = S[b, h, i, j]
        if x != -math.inf:
            seen = True
        m = max(m, x)
    if not seen:                             # the row sees no key: P = 0, lse = -inf
        for j in range(Nk):
            S[b, h, i, j] = 0.0
        LSE[b, h, i] = -math.inf
        return
    l = 0.0
    for j in range(Nk):
        p = math.exp(S[b, h, i, j] - m)
        S[b, h, i, j] = p
        l += p
    for j in range(Nk):
        S[b, h, i, j] /= l
    LSE[b, h, i] = m + math.log(l)


@cuda.jit
def pv(P, V, O, group):
    d, i = cuda.grid(2)
    H, Nq, D = O.shape[1], O.shape[2], O.shape[3]
    if i >= Nq or d >= D:
        return
    b, h, hk = batch_head(cuda.blockIdx.z, H, group)
    acc = 0.0
    for j in range(P.shape[3]):
        acc += P[b, h, i, j] * V[b, hk, j, d]
    O[b, h, i, d] = acc


def numba_naive(q, k, v, spec):
    require_float32(spec, "numba_naive")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    B, H, Nq, Nk, D = spec.batch, spec.heads, spec.n_q, spec.n_k, spec.head_dim
    S = torch.empty(B, H, Nq, Nk, device=q.device, dtype=torch.float32)  # the N² buffer in HBM
    o = torch.empty_like(q)
    lse = torch.empty(B, H, Nq, device=q.device, dtype=torch.float32)
    Qa, Ka, Va, Sa, Oa, La = (as_array(t) for t in (q, k, v, S, o, lse))
    st = stream()
    grid_s = (math.ceil(Nk / TILE), math.ceil(Nq / TILE), B * H)
    scores[grid_s, (TILE, TILE), st](Qa, Ka, Sa, spec.scale, spec.left, spec.right, spec.group)
    softmax_rows[(math.ceil(Nq / (TILE * TILE)), B * H), TILE * TILE, st](Sa, La)
    grid_o = (math.ceil(D / TILE), math.ceil(Nq / TILE), B * H)
    pv[grid_o, (TILE, TILE), st](Sa, Va, Oa, spec.group)
    return o, lse


register(
    "numba_naive", chapter=1,
    description="Numba CUDA, three kernels with S written to global memory (HBM) between them",
    dtypes=(torch.float32,), head_dims=(1, 1024),
    extra_memory=lambda s: 4 * s.batch * s.heads * s.n_q * s.n_k,
)(numba_naive)
