"""Chapter 2 exercises: merging two online-softmax states, and one-pass attention over key blocks."""
from __future__ import annotations

import math

import torch

from .ch1 import causal_mask
from .core import Case, Exercise, register_exercise


def merge_states(m_a, l_a, m_b, l_b):
    """Combine two partial softmax states (max, sum of exp(x - max)) into one.

    Each argument is a tensor of shape (rows,).  An empty part has m = -inf, l = 0.
    """
    m = torch.maximum(m_a, m_b)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # both parts empty: keep l = 0
    l = l_a * torch.exp(m_a - m_safe) + l_b * torch.exp(m_b - m_safe)
    return m, l


def online_attention(q, k, v, block_n: int, causal: bool = False):
    """One head, one pass over keys in blocks of ``block_n``: returns (o, lse).

    Keep per query row the running max ``m_i``, the running sum ``l_i`` and the
    unnormalised output ``acc``; never build the full (Nq, Nk) score matrix.
    """
    n_q, d = q.shape
    n_k = k.shape[0]
    m_i = torch.full((n_q,), float("-inf"))
    l_i = torch.zeros(n_q)
    acc = torch.zeros(n_q, d)
    for start in range(0, n_k, block_n):
        kb, vb = k[start:start + block_n], v[start:start + block_n]
        s = q @ kb.T / math.sqrt(d)
        if causal:
            s = s.masked_fill(~causal_mask(n_q, n_k)[:, start:start + block_n], float("-inf"))
        m_new = torch.maximum(m_i, s.amax(dim=1))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp(m_i - m_safe)          # rescale what was summed under the old max
        p = torch.exp(s - m_safe[:, None])
        l_i = l_i * alpha + p.sum(dim=1)
        acc = acc * alpha[:, None] + p @ vb
        m_i = m_new
    seen = l_i > 0
    o = torch.where(seen[:, None], acc / torch.where(seen, l_i, 1)[:, None], 0.0)
    lse = torch.where(seen, m_i + torch.log(torch.where(seen, l_i, 1)), float("-inf"))
    return o, lse


def _merge_cases(seed):
    g = torch.Generator().manual_seed(seed)
    cases = []
    for n, label in [(1, "one row"), (7, "random"), (33, "random")]:
        xa, xb = torch.randn(n, 5, generator=g) * 4, torch.randn(n, 9, generator=g) * 4
        m_a, m_b = xa.amax(1), xb.amax(1)
        l_a, l_b = torch.exp(xa - m_a[:, None]).sum(1), torch.exp(xb - m_b[:, None]).sum(1)
        cases.append(Case(f"{label}, {n} rows", (m_a, l_a, m_b, l_b)))
    m = torch.randn(4, generator=g) * 50
    l = torch.rand(4, generator=g) + 1
    cases.append(Case("maxima far apart (±150)", (m * 3, l, -m * 3, l)))
    empty_m, empty_l = torch.full((4,), float("-inf")), torch.zeros(4)
    cases.append(Case("one part empty (m=-inf, l=0)", (empty_m, empty_l, m, l)))
    cases.append(Case("both parts empty", (empty_m, empty_l, empty_m.clone(), empty_l.clone())))
    return cases


def _online_cases(seed):
    g = torch.Generator().manual_seed(seed)
    cases = []
    for nq, nk, block_n, causal in [(1, 1, 16, False), (17, 17, 16, True), (5, 23, 8, True),
                                    (23, 9, 4, True), (20, 50, 16, False)]:
        d = int(torch.randint(1, 5, (1,), generator=g)) * 8
        q, k, v = (torch.randn(n, d, generator=g) * 2 for n in (nq, nk, nk))
        cases.append(Case(f"n_q={nq} n_k={nk} D={d} block_n={block_n} causal={causal}",
                          (q, k, v, block_n), dict(causal=causal)))
    return cases


register_exercise(Exercise(
    name="ch2_merge_states", chapter=2, title="Merging two online-softmax states",
    signature="merge_states(m_a, l_a, m_b, l_b) -> (m, l)",
    solution=merge_states, make_cases=_merge_cases,
    hint="Rescale each sum to the common maximum: l = l_a·exp(m_a − m) + l_b·exp(m_b − m). Two empty parts stay empty.",
))
register_exercise(Exercise(
    name="ch2_online_attention", chapter=2, title="One pass over the keys",
    signature="online_attention(q, k, v, block_n, causal=False) -> (o, lse)",
    solution=online_attention, make_cases=_online_cases,
    hint="For each key block: new max, alpha = exp(m_old − m_new), rescale l_i and acc by alpha, add the block.",
))
