"""Chapter 1 exercises: the bottom-right causal mask, a safe softmax, naive attention for one head."""
from __future__ import annotations

import math

import torch

from fa_lab.exercises.registry import Case, Exercise, Mistake, register_exercise

# lengths deliberately not multiples of 16, N = 1 (alone and as a decoding step), Nq != Nk both ways
_LENGTHS = [(1, 1), (1, 19), (17, 17), (5, 23), (23, 9), (33, 40)]


def causal_mask(n_q: int, n_k: int) -> torch.Tensor:
    """Boolean (n_q, n_k): True where query i may see key j, bottom-right aligned."""
    i = torch.arange(n_q).unsqueeze(1)
    j = torch.arange(n_k).unsqueeze(0)
    return j <= i + (n_k - n_q)


def softmax_rows(s: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension that survives large scores and -inf; a row of only -inf gives zeros."""
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


# --------------------------------------------------------------------------- cases

def _mask_cases(seed):
    g = torch.Generator().manual_seed(seed)
    extra = tuple(int(x) for x in torch.randint(2, 40, (2,), generator=g))
    return [Case(f"n_q={nq} n_k={nk}", (nq, nk), meta=dict(n_q=nq, n_k=nk)) for nq, nk in _LENGTHS + [(9, 1), extra]]


def _softmax_cases(seed):
    g = torch.Generator().manual_seed(seed)
    cases = []
    for rows, cols in [(1, 1), (3, 17), (8, 33)]:
        cases.append(Case(f"random {rows}x{cols}", (torch.randn(rows, cols, generator=g),)))
    cases.append(Case("a batch of heads (2, 3, 17): softmax over the last dim",
                      (torch.randn(2, 3, 17, generator=g) * 2,)))
    big = torch.randn(4, 19, generator=g) * 300  # exp(300) overflows float32: a naive softmax gives NaN
    cases.append(Case("scores up to ±1000 (overflow)", (big,)))
    masked = torch.randn(5, 13, generator=g)
    masked[masked > 0.5] = float("-inf")
    masked[2] = float("-inf")  # a row that sees nothing
    cases.append(Case("-inf entries and an all -inf row", (masked,)))
    half = (torch.randn(6, 21, generator=g) * 3).half()
    cases.append(Case("float16 6x21", (half,), dtype=torch.float16))
    return cases


#: head dims of the attention cases: multiples of 8 and not (nothing may assume D % 8 == 0)
_HEAD_DIMS = (3, 8, 12, 16, 20, 32, 40)


def _attention_cases(seed):
    g = torch.Generator().manual_seed(seed)
    cases = []
    shapes = [(nq, nk, causal, torch.float32) for (nq, nk), causal in
              zip(_LENGTHS, [False, True, True, True, True, False])]
    shapes += [(9, 14, True, torch.float16), (7, 12, True, torch.float64),
               (6, 130, True, torch.float32)]          # keys past 100: nothing may stop at a fixed length
    for nq, nk, causal, dtype in shapes:
        d = _HEAD_DIMS[int(torch.randint(0, len(_HEAD_DIMS), (1,), generator=g))]
        q, k, v = (torch.randn(n, d, generator=g).to(dtype) for n in (nq, nk, nk))
        name = str(dtype).replace("torch.", "")
        cases.append(Case(f"n_q={nq} n_k={nk} D={d} causal={causal} {name}", (q, k, v), dict(causal=causal),
                          dtype=dtype, meta=dict(n_q=nq, n_k=nk, causal=causal)))
    return cases


# --------------------------------------------------------------------------- typical wrong answers

def _mask_top_left(n_q, n_k):
    return torch.arange(n_k)[None, :] <= torch.arange(n_q)[:, None]


def _mask_strict(n_q, n_k):
    return torch.arange(n_k)[None, :] < torch.arange(n_q)[:, None] + (n_k - n_q)


def _softmax_unsafe(s):
    e = torch.exp(s)
    return e / e.sum(dim=-1, keepdim=True)


def _softmax_nan_rows(s):
    e = torch.exp(s - s.amax(dim=-1, keepdim=True))
    return e / e.sum(dim=-1, keepdim=True)


def _softmax_dim1(s):
    m = s.amax(dim=1, keepdim=True)
    e = torch.exp(s - torch.where(torch.isinf(m), torch.zeros_like(m), m))
    l = e.sum(dim=1, keepdim=True)
    return e / torch.where(l == 0, torch.ones_like(l), l)


def _attention_no_scale(q, k, v, causal=False):
    s = q @ k.T
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[0], k.shape[0]), float("-inf"))
    return softmax_rows(s) @ v


def _attention_top_left(q, k, v, causal=False):
    s = q @ k.T / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(~_mask_top_left(q.shape[0], k.shape[0]), float("-inf"))
    return softmax_rows(s) @ v


_TOP_LEFT = ("query i sits at key position i + Nk − Nq (bottom-right alignment, as in FlashAttention 2.1+); "
             "a top-left mask only agrees with it when Nq == Nk.")

register_exercise(Exercise(
    name="ch1_causal_mask", chapter=1, title="The bottom-right causal mask",
    signature="causal_mask(n_q, n_k) -> bool Tensor (n_q, n_k)",
    solution=causal_mask, make_cases=_mask_cases, outputs=("mask",),
    hints=("Draw the n_q × n_k grid for n_q = 2, n_k = 4: the last query is the newest token and sees every key. "
           "Where does the first query sit?",
           "Query i sits at key position i + n_k − n_q; it sees keys up to and including that one.",
           "Compare a column of key indices with a row of query positions: j <= i + (n_k − n_q), built with "
           "torch.arange and broadcasting."),
    mistakes=(Mistake("a top-left causal mask (j <= i)", _mask_top_left, _TOP_LEFT),
              Mistake("a strict inequality (j < i + n_k − n_q)", _mask_strict,
                      "a query also sees the key at its own position: use <=.")),
))
register_exercise(Exercise(
    name="ch1_safe_softmax", chapter=1, title="A softmax that does not overflow",
    signature="softmax_rows(s) -> Tensor, same shape (softmax over the last dimension)",
    solution=softmax_rows, make_cases=_softmax_cases, judge_dtype=torch.float64,
    hints=("softmax(x) does not change when the same number is subtracted from every element of a row: "
           "which number keeps exp from overflowing?",
           "Subtract each row's maximum before exp; a row with no finite score must give zeros, not NaN.",
           "m = rowmax; use 0 where m = −inf; p = exp(s − m); l = rowsum(p); divide by l where l > 0, else by 1."),
    # the most specific mistake first: on an all −inf row the unguarded safe softmax and the unsafe one agree
    mistakes=(Mistake("no guard for a row that is all −inf", _softmax_nan_rows,
                      "in an all −inf row the maximum is −inf and exp(−inf − (−inf)) = NaN: use 0 as that row's "
                      "maximum, and divide by 1 where the sum is 0."),
              Mistake("exp without subtracting the row maximum", _softmax_unsafe,
                      "exp(x) overflows float32 for x > 88: subtract each row's maximum first."),
              Mistake("softmax over dim=1 instead of the last dimension", _softmax_dim1,
                      "normalise over the last dimension (dim=-1): the keys.")),
))
register_exercise(Exercise(
    name="ch1_naive_attention", chapter=1, title="Naive attention for one head",
    signature="naive_attention(q, k, v, causal=False) -> Tensor (Nq, D), in q's dtype",
    solution=naive_attention, make_cases=_attention_cases, judge_dtype=torch.float64, outputs=("o",),
    hints=("Three steps: scores, probabilities, a weighted sum of the values. Your two earlier functions do "
           "most of the work.",
           "The scores are scaled by 1/sqrt(D); masked scores become −inf before the softmax.",
           "S = q kᵀ / sqrt(D); mask it (bottom-right) if causal; P = softmax of each row; O = P v."),
    mistakes=(Mistake("the softmax scale forgotten", _attention_no_scale,
                      "scores are q·k / sqrt(D): without the scale the softmax is far too peaked."),
              Mistake("a top-left causal mask", _attention_top_left, _TOP_LEFT)),
))
