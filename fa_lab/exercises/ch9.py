"""Chapter 9 exercises, the warm-up: merging the partial outputs of S key splits, in PyTorch.

``ch9_merge_partials`` — split-KV decoding (flash-decoding) cuts each query row's keys into S
splits; split ``s`` returns its output ``o_s``, normalised over its own keys, and the
log-sum-exp ``lse_s`` of its scores.  The learner merges them into the row's output and lse:

    lse = logsumexp_s lse_s,    o = Σ_s exp(lse_s − lse) · o_s

around the largest ``lse_s`` (no exponential overflows), an empty split (``lse_s = −inf``)
weighing exactly 0 and a row whose splits are all empty giving ``o = 0``, ``lse = −inf``.
Chapter 2's ``ch2_merge_states`` merged two ``(m, l)`` states; here S states carry their
outputs and nothing but their lse.

The kernel exercise (``ch9_combine_kernel`` in ``ch9_kernels``) asks for the same merge as a
Triton kernel and shares this module's cases, judge and wrong answers.
"""
from __future__ import annotations

import torch

from fa_lab.core.world import DEVICE, pick
from fa_lab.exercises.registry import Case, Exercise, Mistake, register_exercise

NEG_INF = float("-inf")


def merge_partials(o_parts, lse_parts):
    """Merge ``o_parts (rows, S, D)`` and ``lse_parts (rows, S)`` into ``(o (rows, D), lse (rows,))``.

    The judge (run in float64): the softmax over the union of the splits' keys.  A split with
    ``lse_s = -inf`` saw no key; a row whose splits all saw none gives zeros and ``-inf``.
    """
    return merge(o_parts, lse_parts)


def merge(o_parts, lse_parts, *, subtract_max=True, guard_max=True, guard_sum=True, normalise=True,
          log_sum=True, equal_weights=False, empty_as_zero=False, pad_to=None):
    """``merge_partials``'s computation.  Each keyword set away from its default makes one classic
    mistake (``MISTAKES``), so the solution and its wrong twins share every other line."""
    if pad_to is not None and pad_to > lse_parts.shape[-1]:
        # a kernel's padding splits loaded with lse = 0 (other=0.0) and o = 0
        extra = pad_to - lse_parts.shape[-1]
        lse_parts = torch.cat([lse_parts, lse_parts.new_zeros(lse_parts.shape[0], extra)], dim=-1)
        o_parts = torch.cat([o_parts, o_parts.new_zeros(o_parts.shape[0], extra, o_parts.shape[-1])], dim=-2)
    if empty_as_zero:
        lse_parts = torch.where(lse_parts == NEG_INF, torch.zeros_like(lse_parts), lse_parts)
    if equal_weights:
        lse_parts = torch.zeros_like(lse_parts)
    m = lse_parts.amax(dim=-1)
    if not subtract_max:
        m = torch.zeros_like(m)
    elif guard_max:
        m = torch.where(m == NEG_INF, torch.zeros_like(m), m)   # every split empty: exp(-inf - 0) = 0, not NaN
    w = torch.exp(lse_parts - m[:, None])                        # each <= 1: nothing overflows
    l = w.sum(dim=-1)
    acc = (w[:, :, None] * o_parts).sum(dim=-2)
    seen = l != 0                                                # NaN counts as seen: NaN in, NaN out
    if not normalise:
        o = acc
    elif guard_sum:
        o = acc / torch.where(seen, l, torch.ones_like(l))[:, None]
    else:
        o = acc / l[:, None]
    lse = m + torch.log(torch.where(seen, l, torch.ones_like(l))) if log_sum else m
    return o, torch.where(seen, lse, torch.full_like(lse, NEG_INF))


# --------------------------------------------------------------------------- cases

def _partials(g, rows, splits, d, *, spread=3.0, offset=0.0):
    """Random partials: each o_s a convex combination of values (|o| <~ 3), lse_s around ``offset``."""
    o = torch.randn(rows, splits, d, generator=g) * 1.5
    lse = offset + torch.randn(rows, splits, generator=g) * spread
    return o, lse


def _empty(o, lse, where):
    """Mark the splits at ``where`` (a bool (rows, S) tensor) empty: lse = -inf and o = 0, as a kernel writes them."""
    lse = lse.masked_fill(where, NEG_INF)
    o = o.masked_fill(where[:, :, None], 0.0)
    return o, lse


def _case(label, o, lse, **meta):
    rows, splits, d = o.shape
    words = f"{rows} rows, S={splits}, D={d}"
    return Case(f"{label}: {words}", (o.to(DEVICE).contiguous(), lse.to(DEVICE).contiguous()), dtype=torch.float32,
                meta=dict(rows=rows, splits=splits, head_dim=d, **meta))


def merge_cases(seed):
    """The cases both chapter 9 exercises are judged on: S from 1 to 8, D not a power of two, lse far from 0,
    empty splits, rows whose splits are all empty, NaN in a partial."""
    import random

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    cases = [_case("S = 1: the merge is the identity", *_partials(g, 5, 1, 16)),
             _case("S = 3, D = 40", *_partials(g, 7, 3, 40)),
             _case("S = 8, D = 72", *_partials(g, 6, 8, 72))]

    # lse far from 0: exp(lse) overflows float32 past 88.7 and is 0 below -103
    o, lse = _partials(g, 8, 5, 24, spread=2.0)
    lse += torch.tensor([120.0, -120.0, 300.0, -300.0, 90.0, -110.0, 0.0, 150.0])[:, None]
    cases.append(_case("S = 5, lse near ±100 and beyond (exp(lse) overflows float32)", o, lse))

    o, lse = _partials(g, 9, 6, 20)
    empty = torch.rand(9, 6, generator=g) < 0.4
    empty[torch.arange(9), torch.randint(0, 6, (9,), generator=g)] = False   # every row keeps a split
    empty[0] = torch.tensor([True, True, True, True, True, False])
    cases.append(_case("S = 6, some splits empty (lse = −inf, o = 0)", *_empty(o, lse, empty)))

    o, lse = _partials(g, 6, 4, 12)
    empty = torch.zeros(6, 4, dtype=torch.bool)
    empty[[0, 3]] = True                       # rows that see no key at all
    empty[1, 2:] = True
    cases.append(_case("S = 4, rows whose splits are all empty (o = 0, lse = −inf)", *_empty(o, lse, empty)))

    o, lse = _partials(g, 5, 3, 8)
    o[1, 2, 5] = float("nan")
    lse[3, 0] = float("nan")
    cases.append(_case("S = 3, NaN in a partial (NaN in, NaN out)", o, lse))

    o, lse = _partials(g, 4, 7, 3)
    cases.append(_case("S = 7, D = 3", o, lse))

    rows, splits = rng.randint(1, 20), rng.randint(1, 8)
    d = rng.choice([8, 24, 40, 64, 72, 100])
    o, lse = _partials(g, rows, splits, d, offset=rng.choice([0.0, 50.0, -50.0]))
    empty = torch.rand(rows, splits, generator=g) < 0.25
    cases.append(_case("random, some splits empty", *_empty(o, lse, empty)))

    for rows, splits, d in pick(cpu=[], gpu=[(4096, 16, 128), (8192, 4, 64), (2048, 33, 80)]):
        o, lse = _partials(g, rows, splits, d, offset=20.0)
        empty = torch.rand(rows, splits, generator=g) < 0.2
        empty[:7] = True
        cases.append(_case("full size, some empty splits and rows", *_empty(o, lse, empty)))
    return cases


# --------------------------------------------------------------------------- typical wrong answers

def _mistaken(**mistake):
    def fn(o_parts, lse_parts):
        return merge(o_parts, lse_parts, **mistake)
    fn.__name__ = "merge_" + "_".join(mistake)
    return fn


MISTAKES = (
    Mistake("splits averaged with equal weights", _mistaken(equal_weights=True),
            "a split's output is normalised over its own keys only: weigh it by the share of the row's softmax "
            "mass its keys hold, exp(lse_s − lse), not 1/S."),
    Mistake("weights not divided by their sum", _mistaken(normalise=False),
            "exp(lse_s − m) is a weight relative to the largest split; divide Σ_s w_s·o_s by l = Σ_s w_s (or "
            "weigh by exp(lse_s − lse) directly)."),
    Mistake("lse left at the largest lse_s", _mistaken(log_sum=False),
            "the row's lse is the log-sum-exp of the splits' lse: m + log(Σ_s exp(lse_s − m)), not m alone."),
    Mistake("no max subtraction (exp(lse) overflows)", _mistaken(subtract_max=False),
            "exp(lse_s) overflows float32 for lse_s > 88.7 (inf / inf = NaN) and is 0 below −103 (0 / 0): "
            "subtract the largest lse_s first, so that every weight exp(lse_s − m) lies in (0, 1]."),
    Mistake("an empty split given weight (its lse −inf replaced by 0)", _mistaken(empty_as_zero=True),
            "a split with lse = −inf saw no key: its weight exp(−inf − m) is exactly 0. Replacing its −inf by 0 "
            "gives it a share of the row (its zero output dilutes the others)."),
    Mistake("NaN where every split is empty: exp(−inf − (−inf))", _mistaken(guard_max=False),
            "when all of a row's lse_s are −inf the max is −inf too and lse_s − m is NaN: use 0 as the max of "
            "such a row, so every weight is exp(−inf) = 0; then o = 0 and lse = −inf."),
    Mistake("0 / 0 where every split is empty", _mistaken(guard_sum=False),
            "a row whose splits are all empty has l = Σ_s w_s = 0: divide by l only where it is not 0, and give "
            "that row o = 0 (and lse = −inf)."),
)

HINTS = (
    "Each o_s is normalised over its own split's keys, and lse_s says how much softmax mass that split holds. "
    "What share of the whole row's mass is split s's, written with the lse values alone? Compute it so that no "
    "exponential can overflow, and ask what a split — or a whole row — with lse = −inf must contribute.",
    "lse = logsumexp over s of lse_s, and o = Σ_s exp(lse_s − lse)·o_s. Evaluate it around m = max_s lse_s: "
    "w_s = exp(lse_s − m) is at most 1, l = Σ_s w_s, o = Σ_s w_s·o_s / l, lse = m + log l. An empty split has "
    "w_s = 0. A row whose splits are all empty has m = −inf: use 0 in its place so that w_s = exp(−inf) = 0, "
    "not NaN, and give it o = 0, lse = −inf.",
    "m = lse_parts.amax(-1); m = torch.where(m == -inf, 0, m); w = torch.exp(lse_parts - m[:, None]); "
    "l = w.sum(-1); seen = l != 0; o = (w[:, :, None] * o_parts).sum(1) / torch.where(seen, l, 1)[:, None]; "
    "lse = torch.where(seen, m + torch.log(torch.where(seen, l, 1)), -inf).  (seen is True for a NaN l: "
    "NaN stays NaN.)",
)

register_exercise(Exercise(
    name="ch9_merge_partials", chapter=9, title="Merging the partial outputs of S key splits",
    signature="merge_partials(o_parts, lse_parts) -> (o, lse)   # o_parts (rows, S, D), lse_parts (rows, S), "
              "float32",
    solution=merge_partials, make_cases=merge_cases, outputs=("o", "lse"), judge_dtype=torch.float64,
    mistakes=MISTAKES, hint=HINTS[0], hints=HINTS,
))
