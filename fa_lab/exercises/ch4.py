"""Chapter 4 exercises, the warm-ups: skipping masked key blocks, and the FA2 loop body in Triton.

1. ``ch4_key_block_ranges`` — pure Python: for one block of query rows, the three ranges of key
   blocks the kernel loops over (left edge masked, full blocks unmasked, right edge / diagonal
   / tail masked).  Judged by what the loops would do, not by the exact numbers: every
   visible key visited exactly once, no block that no row can see, no mask-free block with a
   hidden key, and no more masked blocks than needed.
2. ``ch4_flash_forward`` — the warm-up kernel: the FA2 loop body with the softmax scale folded
   into ``exp2``, for one head, with tails and bottom-right causal (loads and loop given).

The whole kernels (``ch4_flash_kernel``, ``ch4_skip_masked``) are the exercises of ``ch4_kernels``,
which shares this module's reference (``reference_forward``) and its wrong answers.  The Triton
exercise is judged by the float64 reference; its model answer (a kernel a learner would write, with
its launcher) is ``flash_forward_triton`` below.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fa_lab.core.reference import reference_attention
from fa_lab.core.spec import make_spec
from fa_lab.core.world import DEVICE
from fa_lab.core.reference import attention_from_scores
from fa_lab.exercises.registry import Case, Exercise, Mistake, register_exercise


def key_block_ranges(m_start, block_m, block_n, n_q, n_k, left=-1, right=-1):
    """Ranges of key-block starts for the query rows ``m_start .. m_start + block_m - 1``.

    Returns ``(lo, mid_lo, mid_hi, hi)``; the kernel visits key blocks
    ``range(lo, mid_lo, block_n)`` with a mask, ``range(mid_lo, mid_hi, block_n)`` without
    one, and ``range(mid_hi, hi, block_n)`` with a mask.  Query ``i`` sees key ``j`` when
    ``i + n_k - n_q - left <= j <= i + n_k - n_q + right`` (``-1`` = unbounded) and ``0 <= j < n_k``.
    (The solution is the kernel's own arithmetic, ``fa_lab.kernels.triton.key_block_ranges``.)
    """
    from fa_lab.kernels.triton import key_block_ranges as kernel_ranges

    return kernel_ranges(m_start, block_m, block_n, n_q, n_k, left, right)


def _visible(i, j, n_q, n_k, left, right):
    d = i + n_k - n_q
    return 0 <= j < n_k and (left < 0 or j >= d - left) and (right < 0 or j <= d + right)


def _simulate(ranges, m_start, block_m, block_n, n_q, n_k, left, right):
    """What the three loops visit: ({block start: masked?}, error message or '')."""
    if not (isinstance(ranges, (tuple, list)) and len(ranges) == 4
            and all(isinstance(x, int) and not isinstance(x, bool) for x in ranges)):
        return None, "return four Python ints (lo, mid_lo, mid_hi, hi)"
    lo, mid_lo, mid_hi, hi = ranges
    visits = {}
    for start, stop, masked, name in ((lo, mid_lo, True, "range(lo, mid_lo)"),
                                      (mid_lo, mid_hi, False, "range(mid_lo, mid_hi)"),
                                      (mid_hi, hi, True, "range(mid_hi, hi)")):
        for s in range(start, stop, block_n):
            if s in visits or any(abs(s - t) < block_n for t in visits):
                return None, f"{name} visits the keys at {s}..{s + block_n - 1} a second time (ranges overlap)"
            if len(visits) > 100_000:
                return None, "far too many blocks"
            visits[s] = masked
    return visits, ""


def _compare_ranges(got, expected, case):
    m_start, block_m, block_n, n_q, n_k = case.args[:5]
    left, right = case.kwargs.get("left", -1), case.kwargs.get("right", -1)
    visits, err = _simulate(got, m_start, block_m, block_n, n_q, n_k, left, right)
    if err:
        raise AssertionError(err)
    rows = range(m_start, min(m_start + block_m, n_q))
    for s in visits:
        if s % block_n:
            raise AssertionError(f"a block starts at key {s}, not a multiple of block_n={block_n}: "
                                 "tiles are aligned (round lo down)")
    for i in rows:
        for j in range(n_k):
            if _visible(i, j, n_q, n_k, left, right) and (j // block_n) * block_n not in visits:
                raise AssertionError(f"query {i} sees key {j}, but its block ({j // block_n * block_n}.."
                                     f"{j // block_n * block_n + block_n - 1}) is never visited")
    for s, masked in sorted(visits.items()):
        cols = range(s, s + block_n)
        if not any(_visible(i, j, n_q, n_k, left, right) for i in rows for j in cols):
            raise AssertionError(f"the block at keys {s}..{s + block_n - 1} is visited, but no row of this "
                                 "query block can see any of its keys: skip it (that is the point)")
        if not masked and not all(_visible(i, j, n_q, n_k, left, right) for i in rows for j in cols):
            i, j = next((i, j) for i in rows for j in cols if not _visible(i, j, n_q, n_k, left, right))
            raise AssertionError(f"the block at keys {s}..{s + block_n - 1} runs without a mask, but query {i} "
                                 f"must not see key {j}")
    best = len(range(expected[0], expected[1], block_n)) + len(range(expected[2], expected[3], block_n))
    masked = sum(visits.values())
    if masked > best:
        raise AssertionError(f"{masked} blocks are masked where {best} suffice: only blocks on a boundary "
                             "(window edge, diagonal, the ragged end of the keys) need the mask")


def _range_cases(seed):
    import random

    rng = random.Random(seed)
    cases = [
        Case("no mask, Nk a multiple of the tile", (0, 64, 32, 128, 128)),
        Case("no mask, ragged end: Nk=100", (64, 64, 32, 128, 100)),
        Case("causal Nq=Nk=256, block 2 of 4", (128, 64, 64, 256, 256), dict(right=0)),
        Case("causal, Nq=300 > Nk=100: the first rows see nothing", (0, 64, 32, 300, 100), dict(right=0)),
        Case("causal, Nq=37 < Nk=500 (KV cache)", (0, 64, 64, 37, 500), dict(right=0)),
        Case("sliding window (64, 0)", (192, 64, 32, 512, 512), dict(left=64, right=0)),
        Case("window (10, 20), Nq != Nk", (32, 32, 16, 90, 130), dict(left=10, right=20)),
        Case("N = 1", (0, 16, 16, 1, 1), dict(right=0)),
    ]
    for _ in range(3):
        n_q, n_k = rng.randint(1, 400), rng.randint(1, 400)
        bm, bn = rng.choice([16, 32, 64]), rng.choice([16, 32, 64])
        m_start = rng.randrange(0, n_q, bm) if n_q > bm else 0
        left, right = rng.choice([-1, rng.randint(0, 150)]), rng.choice([-1, 0, rng.randint(0, 150)])
        cases.append(Case(f"random: m_start={m_start} Nq={n_q} Nk={n_k} tiles {bm}x{bn} window=({left}, {right})",
                          (m_start, bm, bn, n_q, n_k), dict(left=left, right=right)))
    return cases


def _ranges_all_masked(m_start, block_m, block_n, n_q, n_k, left=-1, right=-1):
    lo, _, _, hi = key_block_ranges(m_start, block_m, block_n, n_q, n_k, left, right)
    return lo, hi, hi, hi


def _ranges_every_block(m_start, block_m, block_n, n_q, n_k, left=-1, right=-1):
    return 0, n_k, n_k, n_k


def _ranges_top_left(m_start, block_m, block_n, n_q, n_k, left=-1, right=-1):
    return key_block_ranges(m_start, block_m, block_n, n_k, n_k, left, right)


RANGE_MISTAKES = (
    Mistake("every visited block masked", _ranges_all_masked,
            "right, but slow: blocks that every row sees in full need no mask — put them in the middle range."),
    Mistake("every block visited", _ranges_every_block,
            "blocks that no row of this query block can see are loaded and computed for nothing: start at the "
            "first key the first row sees (rounded down to a tile) and stop after the last key the last row sees."),
    Mistake("a top-left diagonal", _ranges_top_left,
            "query i sits at key i + n_k − n_q (bottom-right alignment), not at key i."),
)


# --------------------------------------------------------------------------- the Triton warm-up

def reference_forward(q, k, v, causal=False):
    """``(o in q's dtype, lse float32)`` by the float64 reference, for q ``(B, H, Nq, D)`` and k, v
    ``(B, Hkv, Nk, D)``, or for one head: q ``(Nq, D)``, k, v ``(Nk, D)``."""
    if q.dim() == 2:
        o, lse = reference_forward(q[None, None], k[None, None], v[None, None], causal)
        return o[0, 0], lse[0, 0]
    o, lse = reference_attention(q, k, v, make_spec(q, k, v, causal=causal))
    return o.to(q.dtype), lse.to(torch.float32)


def flash_forward(q, k, v, causal=False):
    """One head of attention, ``q (Nq, D)``, ``k, v (Nk, D)``: returns ``(o in q's dtype, lse float32)``.

    The learner writes it as a Triton kernel (the notebook gives the skeleton); the solution
    here is the float64 reference, so any correct kernel passes.
    """
    return reference_forward(q, k, v, causal)


@triton.jit
def _flash_kernel(Q, K, V, O, LSE, qk_scale, n_q, n_k, D: tl.constexpr, CAUSAL: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The exercise's kernel, filled in (the notebook's skeleton has TODOs in the loop and the epilogue)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + offs_m[:, None] * D + offs_d[None, :], mask=offs_m[:, None] < n_q, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start_n in range(0, n_k, BLOCK_N):
        cols = start_n + offs_n
        k = tl.load(K + cols[:, None] * D + offs_d[None, :], mask=cols[:, None] < n_k, other=0.0)
        v = tl.load(V + cols[:, None] * D + offs_d[None, :], mask=cols[:, None] < n_k, other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale                      # scores in log2 units
        keep = cols[None, :] < n_k
        if CAUSAL:
            keep = keep & (cols[None, :] <= offs_m[:, None] + (n_k - n_q))
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    tl.store(O + offs_m[:, None] * D + offs_d[None, :], (acc / l_safe[:, None]).to(O.dtype.element_ty),
             mask=offs_m[:, None] < n_q)
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    tl.store(LSE + offs_m, lse, mask=offs_m < n_q)


def flash_forward_triton(q, k, v, causal=False):
    """A Triton solution of ``ch4_flash_forward`` (for instructors and the tests)."""
    n_q, d = q.shape
    o = torch.empty_like(q)
    lse = torch.empty(n_q, dtype=torch.float32, device=q.device)
    _flash_kernel[(triton.cdiv(n_q, 16),)](q.contiguous(), k.contiguous(), v.contiguous(), o, lse,
                                           1.4426950408889634 / math.sqrt(d), n_q, k.shape[0], D=d,
                                           CAUSAL=causal, BLOCK_M=16, BLOCK_N=16)
    return o, lse


def _flash_cases(seed):
    g = torch.Generator().manual_seed(seed)
    specs = [  # n_q, n_k, D, causal, dtype
        (1, 1, 16, False, torch.float16),
        (20, 20, 16, True, torch.float16),     # tails: 20 = 16 + 4
        (9, 40, 32, False, torch.float16),     # Nq < Nk
        (37, 23, 16, True, torch.float16),     # Nq > Nk: the first 14 rows see no key
        (33, 33, 16, True, torch.float16),
    ]
    cases = []
    for n_q, n_k, d, causal, dtype in specs:
        q, k, v = (torch.randn(n, d, generator=g).to(device=DEVICE, dtype=dtype) for n in (n_q, n_k, n_k))
        label = f"n_q={n_q} n_k={n_k} D={d} causal={causal} {str(dtype).replace('torch.', '')}"
        cases.append(Case(label, (q, k, v), dict(causal=causal), dtype=dtype,
                          meta=dict(n_q=n_q, n_k=n_k, causal=causal, block_m=16, block_n=16)))
    return cases


# typical wrong answers, of the loop body here and of the whole kernels in ch4_kernels: q 2-D or (B, H, Nq, D)

def softmax_base_e_with_log2_scale(q, k, v, causal=False):
    """exp2 of the plain scaled scores: a softmax at temperature ln 2 (LOG2E not folded into the scale)."""
    return attention_variant(q, k, v, causal, temperature=math.log(2))


def lse_in_log2(q, k, v, causal=False):
    o, lse = reference_forward(q, k, v, causal)
    return o, lse / math.log(2)


def top_left_causal(q, k, v, causal=False):
    return attention_variant(q, k, v, causal, top_left=True)


def attention_variant(q, k, v, causal, temperature=1.0, top_left=False, pad_keys_to=None):
    """Attention in float64 with one mistake; q ``(..., Nq, D)``, k and v ``(..., Nk, D)`` (GQA for 4-D)."""
    n_q, d = q.shape[-2:]
    n_k = k.shape[-2]
    if q.dim() == 4 and q.shape[1] != k.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    k, v = k.double(), v.double()
    if pad_keys_to:  # the zero keys a last, partial key tile loads (other=0.0)
        k, v = (torch.nn.functional.pad(t, (0, 0, 0, -n_k % pad_keys_to)) for t in (k, v))
    s = (q.double() @ k.transpose(-1, -2)) / math.sqrt(d) * temperature
    if causal:
        i = torch.arange(n_q, device=q.device)[:, None]
        j = torch.arange(s.shape[-1], device=q.device)[None, :]
        s = s.masked_fill(j > i + (0 if top_left else n_k - n_q), float("-inf"))
    o, lse = attention_from_scores(s, v)
    return o.to(q.dtype), lse.float()


FLASH_MISTAKES = (
    Mistake("exp2 without LOG2E", softmax_base_e_with_log2_scale,
            "exp(x) = exp2(x · log2 e): fold LOG2E into the scale (qk_scale = scale · 1.4427) "
            "when you switch to exp2."),
    Mistake("lse left in log2 units", lse_in_log2,
            "with m_i and l_i in base 2, lse = (m_i + log2(l_i)) · ln 2 (natural log, as the backward expects)."),
    Mistake("a top-left causal mask", top_left_causal,
            "query i sits at key i + Nk − Nq (bottom-right): keep key j when j <= i + Nk − Nq."),
)


RANGE_HINTS = (
    "Only two rows decide the ranges: the block's first and its last. Which keys does each of them see, and "
    "which keys does every row of the block see?",
    "Query i sees keys i + n_k − n_q − left .. i + n_k − n_q + right. The first row i0 = m_start sees the "
    "leftmost keys, the last row i1 = m_start + block_m − 1 the rightmost; every row sees "
    "[i1 + diag − left, i0 + diag + right]. Clip to [0, n_k), and drop a bound that is −1.",
    "lo = the first key i0 sees, rounded down to a tile; hi = one past the last key i1 sees; the middle range is "
    "the whole tiles inside the interval every row sees: mid_lo = its start rounded up, mid_hi = its end rounded "
    "down (and lo <= mid_lo <= mid_hi <= hi).",
)

FLASH_HINTS = (
    "The loop body is chapter 2's online softmax on a tile of scores, in base 2: what must happen to the scores "
    "a row may not see before the row max is taken, and what must a row that has seen nothing yet subtract so "
    "that it gives 0 rather than NaN?",
    "Mask (key past n_k, or causal j > i + n_k − n_q) to −inf; m_new = max(m_i, rowmax(s)); subtract 0 where "
    "m_new is −inf; p = exp2(s − m); alpha = exp2(m_i − m_new) rescales l_i and acc.",
    "In the loop: s = tl.where(keep, s, -inf); m_new = tl.maximum(m_i, tl.max(s, 1)); "
    "m_sub = tl.where(m_new == -inf, 0.0, m_new); p = tl.math.exp2(s - m_sub[:, None]); "
    "alpha = tl.math.exp2(m_i - m_sub); l_i = l_i * alpha + tl.sum(p, 1); "
    "acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v); m_i = m_new.  After it: seen = l_i > 0, "
    "o = acc / where(seen, l_i, 1), lse = where(seen, (m_i + log2(l_i)) * ln 2, -inf).",
)

register_exercise(Exercise(
    name="ch4_key_block_ranges", chapter=4, title="Which key blocks a query block visits",
    signature="key_block_ranges(m_start, block_m, block_n, n_q, n_k, left=-1, right=-1) -> (lo, mid_lo, mid_hi, hi)",
    solution=key_block_ranges, make_cases=_range_cases, compare=_compare_ranges,
    outputs=("lo", "mid_lo", "mid_hi", "hi"), mistakes=RANGE_MISTAKES, hint=RANGE_HINTS[0], hints=RANGE_HINTS,
))

register_exercise(Exercise(
    name="ch4_flash_forward", chapter=4, title="The FA2 loop body in Triton, with exp2",
    signature="flash_forward(q, k, v, causal=False) -> (o, lse)   # q (Nq, D), k/v (Nk, D); runs a Triton kernel",
    solution=flash_forward, make_cases=_flash_cases, outputs=("o", "lse"), mistakes=FLASH_MISTAKES,
    tile=(16, 16), kind="triton", model_answer=flash_forward_triton, hint=FLASH_HINTS[0], hints=FLASH_HINTS,
))
