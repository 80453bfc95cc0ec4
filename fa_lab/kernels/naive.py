"""Chapter 1: attention as the formula reads, materialising S = QKᵀ and P = softmax(S).

Two versions: NumPy on the CPU (the baseline every speedup is measured from) and
PyTorch (runs on the GPU, and shows the N² memory wall: S and P are B·H·Nq·Nk each).
"""
from __future__ import annotations

import numpy as np
import torch

from fa_lab.core.masks import visible
from fa_lab.core.registry import register


def _naive_scores_memory(spec, itemsize):
    return 2 * itemsize * spec.batch * spec.heads * spec.n_q * spec.n_k  # S and P


def naive_numpy(q, k, v, spec):
    """softmax(Q Kᵀ · scale) V in NumPy, one (batch, head) at a time, float32 (float64 for float64 input)."""
    work = np.float64 if q.dtype == torch.float64 else np.float32
    Q, K, V = (t.detach().cpu().to(torch.float64 if work is np.float64 else torch.float32).numpy()
               for t in (q, k, v))
    ok = visible(spec.n_q, spec.n_k, spec.left, spec.right).numpy()
    o = np.zeros(Q.shape, dtype=work)
    lse = np.full(Q.shape[:3], -np.inf, dtype=work)
    for b in range(spec.batch):
        for h in range(spec.heads):
            hk = h // spec.group                     # the K/V head this query head shares
            S = (Q[b, h] @ K[b, hk].T) * work(spec.scale)
            S = np.where(ok, S, -np.inf)
            m = S.max(axis=1, keepdims=True)
            m = np.where(np.isinf(m), 0, m)          # rows that see no key: avoid -inf - -inf
            P = np.exp(S - m)
            l = P.sum(axis=1, keepdims=True)
            # rows that see a key, from the mask (not from l > 0: a NaN input makes l NaN, and NaN must come out)
            seen = ok.any(axis=1)
            o[b, h, seen] = (P[seen] / l[seen]) @ V[b, hk]
            lse[b, h, seen] = m[seen, 0] + np.log(l[seen, 0])
    return torch.from_numpy(o).to(q.device), torch.from_numpy(lse).to(q.device)


def naive_torch(q, k, v, spec):
    """The same formula in PyTorch: S and P are materialised in memory (B·H·Nq·Nk each)."""
    if spec.group > 1:  # a copy of K and V per query head: the simple, memory-hungry way
        k = k.repeat_interleave(spec.group, dim=1)
        v = v.repeat_interleave(spec.group, dim=1)
    # Everything in float32 (float64 stays float64), cast once at the end: fp16 products of
    # large logits overflow to inf (then NaN rows), and bf16 ones lose 3 digits before the softmax.
    work = torch.promote_types(q.dtype, torch.float32)
    S = torch.matmul(q.to(work), k.to(work).transpose(-1, -2)) * spec.scale
    ok = visible(spec.n_q, spec.n_k, spec.left, spec.right, device=q.device)
    S = S.masked_fill(~ok, float("-inf"))
    lse = torch.logsumexp(S, dim=-1)
    # A row that sees no key has lse = -inf; exp(S - lse) would be NaN there, and must be 0.
    # (A NaN lse — NaN in the input — stays NaN, and so does the row.)
    P = torch.exp(S - torch.where(torch.isneginf(lse), 0.0, lse).unsqueeze(-1))
    o = torch.matmul(P, v.to(work))
    return o.to(q.dtype), lse


register(
    "naive_numpy", chapter=1,
    description="NumPy on the CPU, materialises S and P: the baseline",
    dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float64),
    host_only=True, extra_memory=lambda s: _naive_scores_memory(s, 4) // (s.batch * s.heads),
)(naive_numpy)

register(
    "naive_torch", chapter=1,
    description="PyTorch, materialises S and P (B·H·Nq·Nk floats each): the N² memory wall",
    dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float64), any_device=True,
    autograd=True,   # chapter 5 differentiates it to show what a naive backward keeps: S and P
    extra_memory=lambda s: _naive_scores_memory(s, 4),   # S and P in float32
)(naive_torch)
