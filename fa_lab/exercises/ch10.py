"""Chapter 10 exercises, the warm-ups: ALiBi's slopes, and the soft cap's backward, in PyTorch.

1. ``ch10_alibi_slopes`` — the per-head slopes of ALiBi (Press et al.): for ``H`` a power of two the
   geometric sequence ``2^(-8h/H)``, ``h = 1..H``; otherwise the slopes of the largest power of two
   below ``H``, then every other slope of the sequence for twice that power, until there are ``H``.
2. ``ch10_softcap_backward`` — the factor the soft cap puts on the gradient of a score: with
   ``c = cap·tanh(s/cap)``, ``dL/ds = dL/dc · (1 - (c/cap)²)``, computed from the capped score
   ``c`` alone (the backward recomputes ``c``, not ``s``).  ``cap = 0`` means no cap.

The kernel exercise (``ch10_score_mod_kernel``) is in ``ch10_kernels``: the score modification
inside a FlashAttention forward kernel, judged by the float64 reference.
"""
from __future__ import annotations

import math

import torch

from fa_lab.core.world import DEVICE
from fa_lab.exercises.registry import Case, Exercise, Mistake, register_exercise

# --------------------------------------------------------------------------- 10.1 the slopes

def _geometric(n: int, step: float = 8.0, first: int = 1) -> list[float]:
    """``2^(-step·h/n)`` for ``h = first .. first + n - 1``."""
    return [2.0 ** (-step * h / n) for h in range(first, first + n)]


def slopes_list(n_heads: int, *, interpolate: bool = True, step: float = 8.0, first: int = 1) -> list[float]:
    """ALiBi's slopes as Python floats.  The keywords away from their defaults make the classic mistakes."""
    if n_heads < 1:
        raise ValueError(f"n_heads must be >= 1, got {n_heads}")
    power = 2 ** int(math.floor(math.log2(n_heads)))
    if power == n_heads or not interpolate:
        return _geometric(n_heads, step, first)
    # the power of two below, then the odd members of the sequence for twice as many heads: their
    # slopes fall between the first ones, so the heads still spread evenly over the scales
    return _geometric(power, step, first) + _geometric(2 * power, step, first)[0::2][:n_heads - power]


def alibi_slopes(n_heads):
    """ALiBi's slope of each head, float32 ``(n_heads,)``: ``2^(-8/H), 2^(-16/H), ..., 2^(-8)`` for ``H`` a
    power of two; for any other ``H`` the slopes of the largest power of two below it, followed by every other
    slope of the sequence for twice that power."""
    return torch.tensor(slopes_list(int(n_heads)), dtype=torch.float32, device=DEVICE)


def _slope_cases(seed):
    import random

    rng = random.Random(seed)
    heads = [1, 2, 8, 16, 12, 6, 20, 40]
    heads.append(rng.choice([3, 5, 7, 24, 32, 48, 64, 96]))
    return [Case(f"H = {h}" + ("" if h & (h - 1) == 0 else " (not a power of two)"), (h,),
                 meta=dict(n_heads=h)) for h in heads]


def _slopes_mistake(**kw):
    def fn(n_heads):
        return torch.tensor(slopes_list(int(n_heads), **kw), dtype=torch.float32, device=DEVICE)
    fn.__name__ = "alibi_slopes_" + "_".join(kw)
    return fn


SLOPE_MISTAKES = (
    Mistake("heads counted from 0", _slopes_mistake(first=0),
            "the first head's slope is 2^(-8/H), not 2^0 = 1: the exponent runs over h = 1 .. H."),
    Mistake("2^(-h/H) without the 8", _slopes_mistake(step=1.0),
            "the slopes span 2^(-8/H) down to 2^(-8) = 1/256: the ratio between neighbours is 2^(-8/H)."),
    Mistake("one geometric sequence for every H", _slopes_mistake(interpolate=False),
            "for H not a power of two, Press et al. take the slopes of the largest power of two P below H, then "
            "every other slope of the sequence for 2P (its 1st, 3rd, 5th, ...) for the H − P heads left."),
)

SLOPE_HINTS = (
    "Write the sequence for eight heads first: its first slope and its ratio are the same number. Which number makes "
    "the eighth slope 1/256? For other H, which heads does the paper's rule borrow from a larger power of two?",
    "For H a power of two the slopes are 2^(-8h/H) for h = 1..H. Otherwise let P be the largest power of two "
    "below H: the first P slopes are those of P heads, the other H − P are taken from the 2P-head sequence, "
    "every other one starting with its first (2^(-8/(2P)), 2^(-24/(2P)), ...).",
    "P = 2 ** floor(log2(H)); base = [2 ** (-8 * h / P) for h in range(1, P + 1)]; if P < H: "
    "extra = [2 ** (-8 * h / (2 * P)) for h in range(1, 2 * P + 1)][0::2][:H - P]; "
    "return torch.tensor(base + extra, dtype=torch.float32).",
)

register_exercise(Exercise(
    name="ch10_alibi_slopes", chapter=10, title="ALiBi's slope for each head",
    signature="alibi_slopes(n_heads) -> Tensor   # float32 (n_heads,)",
    solution=alibi_slopes, make_cases=_slope_cases, outputs=("slopes",), mistakes=SLOPE_MISTAKES,
    hint=SLOPE_HINTS[0], hints=SLOPE_HINTS,
))


# --------------------------------------------------------------------------- 10.2 the cap's backward

def softcap_backward(s_capped, ds_capped, softcap):
    """``dL/ds`` from the capped scores ``c = cap·tanh(s/cap)`` and ``dL/dc``: ``dL/dc · (1 - (c/cap)²)``.

    ``softcap = 0`` means no cap: the gradient passes unchanged.
    """
    return softcap_factor(s_capped, ds_capped, softcap)


def softcap_factor(s_capped, ds_capped, softcap, *, mistake: str | None = None):
    """``softcap_backward``'s computation; ``mistake`` makes one of the classic wrong ones instead."""
    if softcap <= 0:
        return ds_capped.clone()
    if mistake == "no derivative":
        return ds_capped.clone()
    if mistake == "tanh again":
        return ds_capped * (1 - torch.tanh(s_capped / softcap) ** 2)
    if mistake == "cap left out":
        return ds_capped * (1 - s_capped ** 2)
    t = s_capped / softcap          # tanh(s / cap), read back from the capped score
    return ds_capped * (1 - t * t)


def _softcap_cases(seed):
    g = torch.Generator().manual_seed(seed)
    specs = [  # label, shape, cap, how far the raw scores spread (in units of the cap)
        ("cap 50 (Gemma 2's attention), scores inside it", (2, 3, 7, 9), 50.0, 0.3),
        ("cap 30, some scores near the cap", (1, 2, 16, 33), 30.0, 1.5),
        ("cap 5, many scores saturated", (2, 2, 5, 40), 5.0, 3.0),
        ("cap 1, D-sized tile", (1, 1, 64, 64), 1.0, 2.0),
        ("softcap = 0: no cap, the gradient passes unchanged", (1, 2, 8, 8), 0.0, 1.0),
    ]
    cases = []
    for label, shape, cap, spread in specs:
        raw = torch.randn(shape, generator=g, dtype=torch.float64) * spread * (cap or 5.0)
        s = cap * torch.tanh(raw / cap) if cap > 0 else raw
        ds = torch.randn(shape, generator=g, dtype=torch.float64) * 1e-2
        args = (s.to(torch.float32).to(DEVICE), ds.to(torch.float32).to(DEVICE), cap)
        cases.append(Case(f"{label}: shape {shape}", args, dtype=torch.float32, meta=dict(softcap=cap)))
    return cases


def _cap_mistake(name):
    def fn(s_capped, ds_capped, softcap):
        return softcap_factor(s_capped, ds_capped, softcap, mistake=name)
    fn.__name__ = "softcap_backward_" + name.replace(" ", "_")
    return fn


SOFTCAP_MISTAKES = (
    Mistake("the tanh derivative forgotten", _cap_mistake("no derivative"),
            "c = cap·tanh(s/cap) is not the identity: dc/ds = 1 − tanh²(s/cap), which is 0 where the cap saturates."),
    Mistake("tanh applied to the capped score again", _cap_mistake("tanh again"),
            "s_capped is already cap·tanh(s/cap): tanh(s/cap) = s_capped / cap, so the factor is "
            "1 − (s_capped / cap)², with no second tanh."),
    Mistake("the cap left out of the square", _cap_mistake("cap left out"),
            "tanh(s/cap) = s_capped / cap lies in (−1, 1); the factor is 1 − (s_capped / cap)², not 1 − s_capped²."),
)

SOFTCAP_HINTS = (
    "Differentiate the capped score c, cap·tanh(s/cap), with respect to s. Then write the derivative with c instead "
    "of s: the backward pass has the capped score at hand, not the raw one. And what should a cap of 0 mean?",
    "dc/ds = cap · (1/cap) · (1 − tanh²(s/cap)) = 1 − tanh²(s/cap), and tanh(s/cap) = c / cap. By the chain "
    "rule dL/ds = dL/dc · dc/ds. With softcap = 0 there is no cap: return the gradient as it is.",
    "if softcap == 0: return ds_capped.clone();  t = s_capped / softcap;  return ds_capped * (1 - t * t)",
)

register_exercise(Exercise(
    name="ch10_softcap_backward", chapter=10, title="The soft cap's factor on the gradient of a score",
    signature="softcap_backward(s_capped, ds_capped, softcap) -> ds   # same shape and dtype as ds_capped",
    solution=softcap_backward, make_cases=_softcap_cases, outputs=("ds",), judge_dtype=torch.float64,
    mistakes=SOFTCAP_MISTAKES, hint=SOFTCAP_HINTS[0], hints=SOFTCAP_HINTS,
))
