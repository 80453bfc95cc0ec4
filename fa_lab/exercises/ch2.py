"""Chapter 2 exercises: merging two online-softmax states, and one-pass attention over key blocks."""
from __future__ import annotations

import functools
import math

import torch

from fa_lab.exercises.registry import Case, Exercise, Mistake, register_exercise
from fa_lab.exercises.structure import NoQuadraticBuffer, ReadBudget


def merge_states(m_a, l_a, m_b, l_b):
    """Combine two partial softmax states (max, sum of exp(x - max)) into one.

    Each argument is a tensor of shape (rows,).  An empty part has m = -inf, l = 0.
    """
    m = torch.maximum(m_a, m_b)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # both parts empty: keep l = 0
    l = l_a * torch.exp(m_a - m_safe) + l_b * torch.exp(m_b - m_safe)
    return m, l


def online_attention(q, k, v, block_n: int, causal: bool = False):
    """One head, one pass over keys in blocks of ``block_n``: returns (o, lse), both in q's dtype.

    Keep per query row the running max ``m_i``, the running sum ``l_i`` and the
    unnormalised output ``acc``; never build the full (Nq, Nk) score matrix: each
    block of keys is loaded once, for all query rows together.
    """
    return _one_pass(q, k, v, block_n, causal)


def _one_pass(q, k, v, block_n, causal=False, *, rescale_acc=True, carry_max=True, bottom_right=True,
              drop_tail=False, scale=True, log2=False, init_rows=True):
    """``online_attention``'s loop.  Each keyword set away from its default makes one classic
    mistake (``ONLINE_MISTAKES``), so the solution and its wrong twins share every other line."""
    n_q, d = q.shape
    n_k = k.shape[0]
    m_i = torch.full((n_q,), float("-inf"), dtype=q.dtype)
    l_i = torch.zeros(n_q, dtype=q.dtype)
    acc = torch.zeros(n_q, d, dtype=q.dtype)
    rows = torch.arange(n_q)[:, None]
    stop = n_k // block_n * block_n if drop_tail else n_k
    for start in range(0, stop, block_n):
        kb, vb = k[start:start + block_n], v[start:start + block_n]
        s = q @ kb.T / (math.sqrt(d) if scale else 1.0)
        if causal:  # this block's part of the bottom-right mask, from index arithmetic
            cols = torch.arange(start, start + kb.shape[0])[None, :]
            s = s.masked_fill(cols > rows + ((n_k - n_q) if bottom_right else 0), float("-inf"))
        m_new = torch.maximum(m_i, s.amax(dim=1)) if carry_max else s.amax(dim=1)
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp(m_i - m_safe)          # rescale what was summed under the old max
        p = torch.exp(s - m_safe[:, None])
        l_i = l_i * alpha + p.sum(dim=1)
        acc = (acc * alpha[:, None] if rescale_acc else acc) + p @ vb
        m_i = m_new
    seen = l_i > 0
    l_safe = torch.where(seen, l_i, torch.ones_like(l_i))
    lse = m_i + torch.log(l_safe)
    if log2:
        lse = lse / math.log(2)
    if not init_rows:  # only the rows that saw a key are written
        o, lse_out = torch.empty_like(acc), torch.empty_like(l_i)
        o[seen] = acc[seen] / l_safe[seen, None]
        lse_out[seen] = lse[seen]
        return o, lse_out
    o = torch.where(seen[:, None], acc / l_safe[:, None], torch.zeros_like(acc))
    return o, torch.where(seen, lse, torch.full_like(l_i, float("-inf")))


# --------------------------------------------------------------------------- cases

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


def _huge_scores(g, n_q, n_k, block_n):
    """Scores near +100 in the first key tile and near -100 after it, exact in float32 (integers, D = 16).

    With the running max carried, later tiles just add exp(-200) ≈ 0; an implementation that
    rescales by exp(m_old - m_tile) with the *tile's own* max overflows to inf.
    """
    d = 16  # scale 1/sqrt(16) = 0.25: every score is exact in float32
    q = torch.randint(-2, 3, (n_q, d), generator=g).float()
    k = torch.randint(-3, 4, (n_k, d), generator=g).float()
    q[:, 0] = 8
    k[:, 0] = -50
    k[:block_n, 0] = 50
    v = torch.randn(n_k, d, generator=g)
    return q, k, v


def _online_cases(seed):
    g = torch.Generator().manual_seed(seed)
    specs = [  # n_q, n_k, block_n, causal, dtype
        (1, 1, 16, False, torch.float32),     # N = 1
        (1, 37, 16, False, torch.float32),    # one query (decoding), tail tile of 5 keys
        (17, 17, 16, True, torch.float32),    # a tail tile of 1 key
        (5, 23, 8, True, torch.float32),      # Nq < Nk
        (23, 9, 4, True, torch.float32),      # Nq > Nk: rows 0-13 see no key
        (20, 50, 16, False, torch.float32),
        (9, 30, 8, True, torch.float64),
        (6, 130, 16, True, torch.float32),    # keys past 100: nothing may stop at a fixed length
    ]
    cases = []
    for n_q, n_k, block_n, causal, dtype in specs:
        d = (3, 8, 12, 16, 20, 32)[int(torch.randint(0, 6, (1,), generator=g))]   # D % 8 != 0 too
        q, k, v = (torch.randn(n, d, generator=g).to(dtype) * 2 for n in (n_q, n_k, n_k))
        cases.append(_online_case(q, k, v, block_n, causal, dtype))
    q, k, v = _huge_scores(g, 12, 40, 8)
    cases.append(_online_case(q, k, v, 8, False, torch.float32,
                              note="scores ±100 that change between tiles (carry the running max)"))
    # large enough that a tile (Nq x 16), K and V (Nk x 16) are far smaller than S (Nq x Nk):
    # the structure checks (no Nq x Nk buffer, each K/V element read once) run here
    for n_q, n_k, causal in [(32, 48, True), (48, 80, seed % 2 == 0)]:   # 48 = 3 tiles exactly; 80 = 5
        q, k, v = (torch.randn(n, 16, generator=g) * 2 for n in (n_q, n_k, n_k))
        cases.append(_online_case(q, k, v, 16, causal, torch.float32, structure=True))
    return cases


def _online_case(q, k, v, block_n, causal, dtype, note="", structure=False):
    n_q, d = q.shape
    n_k = k.shape[0]
    tail = n_k % block_n
    label = (f"n_q={n_q} n_k={n_k} D={d} block_n={block_n}" + (f" (tail tile of {tail})" if tail else "")
             + f" causal={causal}" + ("" if dtype == torch.float32 else f" {str(dtype).replace('torch.', '')}")
             + (f" — {note}" if note else ""))
    return Case(label, (q, k, v, block_n), dict(causal=causal), dtype=dtype,
                meta=dict(n_q=n_q, n_k=n_k, causal=causal, block_n=block_n, tail=tail, structure=structure))


# --------------------------------------------------------------------------- typical wrong answers

def _merge_no_rescale(m_a, l_a, m_b, l_b):
    return torch.maximum(m_a, m_b), l_a + l_b


def _merge_nan_when_empty(m_a, l_a, m_b, l_b):
    m = torch.maximum(m_a, m_b)
    return m, l_a * torch.exp(m_a - m) + l_b * torch.exp(m_b - m)


def _mistaken_online(**mistake):
    """online_attention with one thing wrong (each keyword of ``_one_pass`` is one classic mistake)."""
    return functools.partial(_one_pass, **mistake)


ONLINE_MISTAKES = (
    Mistake("missing rescale of acc", _mistaken_online(rescale_acc=False),
            "when the running max grows, everything accumulated so far was weighted by exp(s − m_old): "
            "multiply acc (not only l_i) by alpha = exp(m_old − m_new)."),
    Mistake("running max not carried across tiles", _mistaken_online(carry_max=False),
            "m_new must be max(m_i, max of this tile); with the tile's own max, exp(m_old − m_new) overflows "
            "as soon as a later tile has much smaller scores."),
    Mistake("a top-left causal mask", _mistaken_online(bottom_right=False),
            "query i sits at key position i + Nk − Nq (bottom-right alignment); mask key j when j > i + Nk − Nq."),
    Mistake("the tail tile skipped", _mistaken_online(drop_tail=True),
            "when Nk is not a multiple of block_n the last tile is partial: loop with range(0, n_k, block_n) "
            "and slice k[start:start + block_n] (a slice stops at the end)."),
    Mistake("the softmax scale forgotten", _mistaken_online(scale=False),
            "scores are q·k / sqrt(D)."),
    Mistake("lse in log2", _mistaken_online(log2=True),
            "lse is a natural log: m_i + log(l_i)."),
    Mistake("uninitialised output rows", _mistaken_online(init_rows=False),
            "rows that see no key must still be written: o = 0 and lse = −inf (torch.empty holds garbage)."),
)

register_exercise(Exercise(
    name="ch2_merge_states", chapter=2, title="Merging two online-softmax states",
    signature="merge_states(m_a, l_a, m_b, l_b) -> (m, l)",
    solution=merge_states, make_cases=_merge_cases, outputs=("m", "l"), judge_dtype=torch.float64,
    hints=("Each l was summed relative to its own maximum. What is the maximum of the two parts together?",
           "Rescale each sum to the common maximum: l = l_a·exp(m_a − m) + l_b·exp(m_b − m).",
           "m = max(m_a, m_b); where m = −inf (both parts empty) use 0 in the exponents so that l stays 0."),
    mistakes=(Mistake("sums added without rescaling", _merge_no_rescale,
                      "each l was summed relative to its own max: bring both to the common max with exp(m_x − m)."),
              Mistake("NaN when both parts are empty", _merge_nan_when_empty,
                      "with m_a = m_b = −inf, exp(m_a − m) = exp(−inf + inf) = NaN: use 0 as the max of an empty "
                      "merge (the sum stays 0)."))
))
register_exercise(Exercise(
    name="ch2_online_attention", chapter=2, title="One pass over the keys",
    signature="online_attention(q, k, v, block_n, causal=False) -> (o, lse), in q's dtype",
    solution=online_attention, make_cases=_online_cases, outputs=("o", "lse"), judge_dtype=torch.float64,
    tile=lambda case: (None, case.args[3]),
    structure=(NoQuadraticBuffer(),
               ReadBudget({1: "K", 2: "V"}, budget=1.0,
                          why="One pass: each key/value tile is loaded once, for all query rows together, and "
                              "folded into (m_i, l_i, acc) — no second pass over the keys, no loop over rows.")),
    mistakes=ONLINE_MISTAKES,
    hints=("Keep three things per query row while walking over the key blocks: a running max, a running sum, "
           "and an unnormalised output. Divide only at the end.",
           "When the max grows, everything summed so far was measured against the old max: multiply it by "
           "alpha = exp(m_old − m_new).",
           "For each key block: new max, alpha = exp(m_old − m_new), rescale l_i and acc by alpha, add the block "
           "(p = exp(s − m_new), l_i += rowsum(p), acc += p @ v_block)."),
))
