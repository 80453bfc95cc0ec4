"""Chapter 1 exercises: the bottom-right causal mask, a safe softmax, naive attention for one head."""
from __future__ import annotations

import math

import torch

from .core import Case, Exercise, register_exercise

# lengths deliberately not multiples of 16, plus N = 1 and Nq != Nk both ways
_LENGTHS = [(1, 1), (17, 17), (5, 23), (23, 9), (33, 40)]


def causal_mask(n_q: int, n_k: int) -> torch.Tensor:
    """Boolean (n_q, n_k): True where query i may see key j, bottom-right aligned."""
    i = torch.arange(n_q).unsqueeze(1)
    j = torch.arange(n_k).unsqueeze(0)
    return j <= i + (n_k - n_q)


def softmax_rows(s: torch.Tensor) -> torch.Tensor:
    """Row-wise softmax that survives large scores and -inf; a row of only -inf gives zeros."""
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = torch.exp(s - m)
    l = e.sum(dim=-1, keepdim=True)
    return e / torch.where(l == 0, torch.ones_like(l), l)


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """One head: q (Nq, D), k and v (Nk, D) → o (Nq, D) = softmax(q kᵀ / sqrt(D)) v."""
    s = q @ k.T / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[0], k.shape[0]), float("-inf"))
    return softmax_rows(s) @ v


def _mask_cases(seed):
    g = torch.Generator().manual_seed(seed)
    extra = tuple(int(x) for x in torch.randint(2, 40, (2,), generator=g))
    return [Case(f"n_q={nq} n_k={nk}", (nq, nk)) for nq, nk in _LENGTHS + [extra]]


def _softmax_cases(seed):
    g = torch.Generator().manual_seed(seed)
    cases = []
    for rows, cols in [(1, 1), (3, 17), (8, 33)]:
        cases.append(Case(f"random {rows}x{cols}", (torch.randn(rows, cols, generator=g),)))
    big = torch.randn(4, 19, generator=g) * 300  # exp(300) overflows float32: a naive softmax gives NaN
    cases.append(Case("scores up to ±1000 (overflow)", (big,)))
    masked = torch.randn(5, 13, generator=g)
    masked[masked > 0.5] = float("-inf")
    masked[2] = float("-inf")  # a row that sees nothing
    cases.append(Case("-inf entries and an all -inf row", (masked,)))
    return cases


def _attention_cases(seed):
    g = torch.Generator().manual_seed(seed)
    cases = []
    for (nq, nk), causal in zip(_LENGTHS, [False, True, True, True, False]):
        d = int(torch.randint(1, 5, (1,), generator=g)) * 8
        q, k, v = (torch.randn(n, d, generator=g) for n in (nq, nk, nk))
        cases.append(Case(f"n_q={nq} n_k={nk} D={d} causal={causal}", (q, k, v), dict(causal=causal)))
    return cases


register_exercise(Exercise(
    name="ch1_causal_mask", chapter=1, title="The bottom-right causal mask",
    signature="causal_mask(n_q, n_k) -> bool Tensor (n_q, n_k)",
    solution=causal_mask, make_cases=_mask_cases,
    hint="Query i sits at key position i + n_k - n_q; it sees keys up to and including that one.",
))
register_exercise(Exercise(
    name="ch1_safe_softmax", chapter=1, title="A softmax that does not overflow",
    signature="softmax_rows(s) -> Tensor, same shape",
    solution=softmax_rows, make_cases=_softmax_cases,
    hint="Subtract each row's maximum before exp; a row with no finite score must give zeros, not NaN.",
))
register_exercise(Exercise(
    name="ch1_naive_attention", chapter=1, title="Naive attention for one head",
    signature="naive_attention(q, k, v, causal=False) -> Tensor (Nq, D)",
    solution=naive_attention, make_cases=_attention_cases,
    hint="S = q kᵀ / sqrt(D); mask it (bottom-right) if causal; P = softmax of each row; O = P v.",
))
