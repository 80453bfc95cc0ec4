"""Chapter 5 exercises: the FlashAttention-2 backward pass, one formula at a time.

One head, 2-D tensors: q ``(Nq, D)``, k and v ``(Nk, D)``; the scale is ``1/sqrt(D)`` and
the causal mask bottom-right aligned (query i sees key j when j <= i + Nk - Nq).

1. ``recompute_p``: P from Q, K and the saved lse — no softmax, no row max.
2. ``dv_and_delta``: dV = Pᵀ dO and D = rowsum(dO ∘ O).
3. ``ds_from_dp``: dS = P ∘ (dP − D).
4. ``attention_backward``: all of it — dQ, dK, dV from Q, K, V, O, lse and dO.

Those four are warm-ups on whole matrices; the two Triton kernels of the backward are the
exercises of ``ch5_kernels``.
"""
from __future__ import annotations

import math

import torch

from fa_lab.core.masks import visible
from fa_lab.exercises.registry import Case, Exercise, Mistake, register_exercise


def _visible(n_q, n_k, causal, device=None):
    return visible(n_q, n_k, -1, 0 if causal else -1, device=device)   # bottom-right causal, or everything


def recompute_p(q, k, lse, causal=False):
    """P = exp(q kᵀ / sqrt(D) − lse) with masked entries 0; a row with lse = −inf (no key) is all 0."""
    s = (q @ k.T) / math.sqrt(q.shape[1])
    lse_safe = torch.where(torch.isinf(lse), torch.full_like(lse, float("inf")), lse)   # exp(s - inf) = 0
    p = torch.exp(s - lse_safe[:, None])
    return p.masked_fill(~_visible(q.shape[0], k.shape[0], causal, q.device), 0.0)


def dv_and_delta(p, o, do):
    """dV = Pᵀ dO  (Nk, D);  D = rowsum(dO ∘ O)  (Nq,)."""
    return p.T @ do, (do * o).sum(dim=1)


def ds_from_dp(p, dp, delta):
    """dS = P ∘ (dP − D), D broadcast along each row."""
    return p * (dp - delta[:, None])


def attention_backward(q, k, v, o, lse, do, causal=False):
    """(dq, dk, dv) of one head, recomputing P from the saved lse."""
    scale = 1.0 / math.sqrt(q.shape[1])
    p = recompute_p(q, k, lse, causal)
    dv, delta = dv_and_delta(p, o, do)
    ds = ds_from_dp(p, do @ v.T, delta)
    return scale * ds @ k, scale * ds.T @ q, dv


# --------------------------------------------------------------------------- cases

def _head(g, n_q, n_k, d, causal, dtype=torch.float32):
    """Random q, k, v, and the o, lse, do a forward and a loss would give (computed in float64)."""
    q, k, v = (torch.randn(n, d, generator=g, dtype=torch.float64) for n in (n_q, n_k, n_k))
    s = (q @ k.T) / math.sqrt(d)
    s = s.masked_fill(~_visible(n_q, n_k, causal), float("-inf"))
    lse = torch.logsumexp(s, dim=1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[:, None])
    o = p @ v
    do = torch.randn(n_q, d, generator=g, dtype=torch.float64)
    return tuple(t.to(dtype) for t in (q, k, v, o, lse, do))


SHAPES = [  # n_q, n_k, D, causal
    (1, 1, 8, False),
    (17, 17, 16, True),
    (5, 23, 8, True),      # Nq < Nk: every row sees a key
    (23, 9, 16, True),     # Nq > Nk: rows 0..13 see no key (lse = -inf)
    (20, 33, 24, False),
]


def _warmup_cases(build, empty_note="", causal_kwarg=True):
    """seed -> cases: ``build(q, k, v, o, lse, do, causal)`` gives the arguments, on every shape."""
    def make(seed):
        g = torch.Generator().manual_seed(seed)
        cases = []
        for n_q, n_k, d, causal in SHAPES:
            q, k, v, o, lse, do = _head(g, n_q, n_k, d, causal)
            note = f" — {empty_note}" if empty_note and causal and n_q > n_k else ""
            cases.append(Case(f"n_q={n_q} n_k={n_k} D={d} causal={causal}{note}",
                              build(q, k, v, o, lse, do, causal), dict(causal=causal) if causal_kwarg else {},
                              meta=dict(n_q=n_q, n_k=n_k, causal=causal)))
        return cases
    return make


_p_cases = _warmup_cases(lambda q, k, v, o, lse, do, c: (q, k, lse), "rows with no key: lse = -inf")
_dv_cases = _warmup_cases(lambda q, k, v, o, lse, do, c: (recompute_p(q, k, lse, c), o, do), causal_kwarg=False)
_ds_cases = _warmup_cases(lambda q, k, v, o, lse, do, c: (recompute_p(q, k, lse, c), do @ v.T, (do * o).sum(1)),
                          causal_kwarg=False)
_bwd_cases = _warmup_cases(lambda q, k, v, o, lse, do, c: (q, k, v, o, lse, do), "rows with no key: their dq is 0")


# --------------------------------------------------------------------------- typical wrong answers

def _p_nan_rows(q, k, lse, causal=False):
    s = (q @ k.T) / math.sqrt(q.shape[1])
    s = s.masked_fill(~_visible(q.shape[0], k.shape[0], causal), float("-inf"))
    return torch.exp(s - lse[:, None])          # -inf - (-inf) = NaN on rows with no key


def _p_no_scale(q, k, lse, causal=False):
    return recompute_p(q * math.sqrt(q.shape[1]), k, lse, causal)


def _p_top_left(q, k, lse, causal=False):
    n_q, n_k = q.shape[0], k.shape[0]
    s = (q @ k.T) / math.sqrt(q.shape[1])
    p = torch.exp(s - torch.where(torch.isinf(lse), float("inf"), lse)[:, None])
    if causal:
        p = p.masked_fill(torch.arange(n_k)[None, :] > torch.arange(n_q)[:, None], 0.0)
    return p


def _delta_rowsum_do(p, o, do):
    return p.T @ do, do.sum(dim=1)


def _ds_without_p(p, dp, delta):
    return dp - delta[:, None]


def _ds_delta_on_columns(p, dp, delta):
    n = min(p.shape)
    d = torch.zeros(p.shape[1], dtype=p.dtype)
    d[:n] = delta[:n]
    return p * (dp - d[None, :])


def _bwd_no_scale(q, k, v, o, lse, do, causal=False):
    scale = 1.0 / math.sqrt(q.shape[1])
    dq, dk, dv = attention_backward(q, k, v, o, lse, do, causal)
    return dq / scale, dk / scale, dv


def _bwd_no_delta(q, k, v, o, lse, do, causal=False):
    scale = 1.0 / math.sqrt(q.shape[1])
    p = recompute_p(q, k, lse, causal)
    ds = p * (do @ v.T)
    return scale * ds @ k, scale * ds.T @ q, p.T @ do


register_exercise(Exercise(
    name="ch5_recompute_p", chapter=5, title="P again, from Q, K and the saved lse",
    signature="recompute_p(q, k, lse, causal=False) -> p  (Nq, Nk)",
    solution=recompute_p, make_cases=_p_cases, outputs=("p",), judge_dtype=torch.float64,
    hints=("The forward saved one number per query row. What does softmax(s) become if you already know "
           "log Σ_j exp(s_j)?",
           "p = exp(q kᵀ / sqrt(D) − lse[:, None]): the lse already holds the max and the normaliser.",
           "Masked entries are 0, and a row whose lse is −inf (it sees no key) must come out 0, not NaN: "
           "treat its lse as +inf."),
    mistakes=(Mistake("NaN on rows that see no key", _p_nan_rows,
                      "when lse = −inf, S − lse is −inf − (−inf) = NaN: treat lse = −inf as +inf (exp → 0)."),
              Mistake("the softmax scale forgotten", _p_no_scale, "scores are q·k / sqrt(D)."),
              Mistake("a top-left causal mask", _p_top_left,
                      "query i sits at key position i + Nk − Nq: mask key j when j > i + Nk − Nq.")),
))
register_exercise(Exercise(
    name="ch5_dv_and_delta", chapter=5, title="dV and D",
    signature="dv_and_delta(p, o, do) -> (dv (Nk, D), delta (Nq,))",
    solution=dv_and_delta, make_cases=_dv_cases, outputs=("dv", "delta"), judge_dtype=torch.float64,
    hints=("Start from O = P V: which matrix multiplies dO to give the gradient of V?",
           "O = P V, so dV = Pᵀ dO.",
           "D_i = Σ_d dO_id · O_id (equal to Σ_j P_ij dP_ij, but needs no dP)."),
    mistakes=(Mistake("D as the row sum of dO alone", _delta_rowsum_do, "D is rowsum(dO ∘ O): multiply by O first."),),
))
register_exercise(Exercise(
    name="ch5_ds_from_dp", chapter=5, title="dS from dP: the softmax's backward",
    signature="ds_from_dp(p, dp, delta) -> ds  (Nq, Nk)",
    solution=ds_from_dp, make_cases=_ds_cases, outputs=("ds",), judge_dtype=torch.float64,
    hints=("Differentiate p_j = exp(s_j) / Σ_k exp(s_k) with respect to s_i, for one row: two cases, i = j "
           "and i ≠ j.",
           "The softmax Jacobian row by row: dS_ij = P_ij (dP_ij − D_i).",
           "D_i is one number per query row: subtract delta[:, None] before multiplying by P elementwise."),
    mistakes=(Mistake("P ∘ left out", _ds_without_p, "each dS_ij is weighted by its own P_ij."),
              Mistake("D broadcast along the wrong axis", _ds_delta_on_columns,
                      "D has one entry per query row: subtract delta[:, None], not delta[None, :].")),
))
register_exercise(Exercise(
    name="ch5_attention_backward", chapter=5, title="The whole backward pass of one head",
    signature="attention_backward(q, k, v, o, lse, do, causal=False) -> (dq, dk, dv)",
    solution=attention_backward, make_cases=_bwd_cases, outputs=("dq", "dk", "dv"), judge_dtype=torch.float64,
    hints=("Chain the three warm-ups: rebuild P, then the gradients of the two matrix products and the "
           "softmax between them.",
           "P from lse; D = rowsum(dO∘O); dV = Pᵀ dO; dP = dO Vᵀ; dS = P∘(dP − D).",
           "S = scale · Q Kᵀ, so dQ = scale · dS K and dK = scale · dSᵀ Q."),
    mistakes=(Mistake("the scale left out of dQ and dK", _bwd_no_scale,
                      "S = scale · Q Kᵀ, so dQ = scale · dS K and dK = scale · dSᵀ Q."),
              Mistake("D left out of dS", _bwd_no_delta,
                      "dS = P ∘ (dP − D): without D it is the gradient of P, not of S.")),
))
