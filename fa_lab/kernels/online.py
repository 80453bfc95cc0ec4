"""Chapter 2: one pass over the keys with the online softmax, compiled for the CPU by Numba.

For each query row we keep three things while streaming keys: the running maximum
``m_i``, the running normaliser ``l_i`` (sum of exp(s - m_i)) and the unnormalised
output ``acc``.  When a new key raises the maximum, everything so far is rescaled by
``alpha = exp(m_old - m_new)``.  No row of S or P is ever stored.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit, prange

from fa_lab.core.registry import register


@njit(parallel=True, cache=True)
def online_attention_kernel(Q, K, V, scale, left, right, O, LSE):
    """O and LSE of every query row, each row one pass over its visible keys (float arrays, in place)."""
    B, H, Nq, D = Q.shape
    Hkv, Nk = K.shape[1], K.shape[2]
    group = H // Hkv
    for row in prange(B * H * Nq):
        b = row // (H * Nq)
        h = (row // Nq) % H
        i = row % Nq
        hk = h // group
        diag = i + Nk - Nq                      # bottom-right alignment
        lo = 0 if left < 0 else max(0, diag - left)
        hi = Nk if right < 0 else min(Nk, diag + right + 1)
        m_i = -np.inf
        l_i = 0.0
        acc = np.zeros(D, dtype=O.dtype)
        for j in range(lo, hi):
            s = 0.0
            for d in range(D):
                s += Q[b, h, i, d] * K[b, hk, j, d]
            s *= scale
            m_new = max(m_i, s)
            alpha = math.exp(m_i - m_new)       # rescales what was accumulated under the old max
            p = math.exp(s - m_new)
            l_i = l_i * alpha + p
            for d in range(D):
                acc[d] = acc[d] * alpha + p * V[b, hk, j, d]
            m_i = m_new
        # Whether the row sees a key comes from the mask, not from l_i > 0: a NaN in the
        # input makes l_i NaN, and NaN must come out, not an empty row.
        if hi > lo:
            for d in range(D):
                O[b, h, i, d] = acc[d] / l_i
            LSE[b, h, i] = m_i + math.log(l_i)
        else:                                   # the row sees no key
            for d in range(D):
                O[b, h, i, d] = 0.0
            LSE[b, h, i] = -np.inf


def online_numba(q, k, v, spec):
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    Q, K, V = (t.detach().cpu().to(work).contiguous().numpy() for t in (q, k, v))
    O = np.empty_like(Q)
    LSE = np.empty(Q.shape[:3], dtype=Q.dtype)
    online_attention_kernel(Q, K, V, spec.scale, spec.left, spec.right, O, LSE)
    return torch.from_numpy(O).to(q.device), torch.from_numpy(LSE).to(q.device)


register(
    "online_numba", chapter=2,
    description="one pass over keys with the online softmax (m_i, l_i, acc), Numba @njit on the CPU",
    dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float64),
    host_only=True, extra_memory=lambda s: 4 * s.head_dim * 2,  # one acc row per CPU thread
)(online_numba)
