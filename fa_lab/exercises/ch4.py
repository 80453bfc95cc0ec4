"""Chapter 4 exercises: skipping masked key blocks, and FlashAttention-2 forward kernels in Triton.

1. ``ch4_key_block_ranges`` — pure Python: for one block of query rows, the three ranges of key
   blocks the kernel loops over (left edge masked, full blocks unmasked, right edge / diagonal
   / tail masked).  Judged by what the loops would do, not by the exact numbers: every
   visible key visited exactly once, no block that no row can see, no mask-free block with a
   hidden key, and no more masked blocks than needed.
2. ``ch4_flash_forward`` — the warm-up kernel: the FA2 loop body with the softmax scale folded
   into ``exp2``, for one head, with tails and bottom-right causal (loads and loop given).
3. ``ch4_flash_kernel`` — the whole FA2 forward kernel: program ids, strided pointers, GQA,
   any head dim (``BLOCK_D`` padded to a power of two), the online softmax in base 2, tails,
   bottom-right causal, the epilogue with ``lse`` in natural log.
4. ``ch4_skip_masked`` — the causal kernel that visits only the key blocks a query block can
   see, masking only the diagonal blocks.  Graded on its values and, in the interpreter, on the
   number of key blocks it computes (``KeyBlocksComputed``).

The Triton exercises are judged by the float64 reference; their model answers (kernels a learner
would write, with launchers) are the ``*_triton`` functions below.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fa_lab.core.world import DEVICE, ON_GPU, pick
from fa_lab.exercises.registry import Case, Exercise, Mistake, register_exercise
from fa_lab.exercises.structure import StructureCheck


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


# --------------------------------------------------------------------------- the Triton exercise

def flash_forward(q, k, v, causal=False):
    """One head of attention, ``q (Nq, D)``, ``k, v (Nk, D)``: returns ``(o in q's dtype, lse float32)``.

    The learner writes it as a Triton kernel (the notebook gives the skeleton); the solution
    here is the float64 reference, so any correct kernel passes.
    """
    from fa_lab.core.reference import reference_attention
    from fa_lab.core.spec import make_spec

    q4, k4, v4 = (t[None, None] for t in (q, k, v))
    o, lse = reference_attention(q4, k4, v4, make_spec(q4, k4, v4, causal=causal))
    return o[0, 0].to(q.dtype), lse[0, 0].to(torch.float32)


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
    from fa_lab.core.world import DEVICE

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


def _softmax_base_e_with_log2_scale(q, k, v, causal=False):
    """exp2 of the plain scaled scores: a softmax at temperature ln 2 (LOG2E not folded into the scale)."""
    return _variant(q, k, v, causal, temperature=math.log(2))


def _lse_in_log2(q, k, v, causal=False):
    o, lse = (flash_forward if q.dim() == 2 else flash_attention)(q, k, v, causal)
    return o, lse / math.log(2)


def _top_left_causal(q, k, v, causal=False):
    return _variant(q, k, v, causal, top_left=True)


def _variant(q, k, v, causal, temperature=1.0, top_left=False, pad_keys_to=None):
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
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m)
    l = p.sum(-1, keepdim=True)
    seen = l > 0
    l_safe = torch.where(seen, l, torch.ones_like(l))
    o = torch.where(seen, (p / l_safe) @ v, torch.zeros((), dtype=p.dtype, device=p.device))
    lse = torch.where(seen, m + torch.log(l_safe), torch.full_like(l, float("-inf")))
    return o.to(q.dtype), lse[..., 0].float()


FLASH_MISTAKES = (
    Mistake("exp2 without LOG2E", _softmax_base_e_with_log2_scale,
            "exp(x) = exp2(x · log2 e): fold LOG2E into the scale (qk_scale = scale · 1.4427) "
            "when you switch to exp2."),
    Mistake("lse left in log2 units", _lse_in_log2,
            "with m_i and l_i in base 2, lse = (m_i + log2(l_i)) · ln 2 (natural log, as the backward expects)."),
    Mistake("a top-left causal mask", _top_left_causal,
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


# --------------------------------------------------------------------------- the whole kernel

LOG2E = 1.4426950408889634  # 1 / ln 2: exp(x) = exp2(x * LOG2E)
#: the skeleton's tiles: the chapter's step-1 tile on a GPU; in the interpreter, whose cost is per tile
#: operation, 32 runs ~4x faster than 16 and still leaves tails and several tiles per case
BLOCK_M, BLOCK_N = pick(cpu=(32, 32), gpu=(64, 64))


def flash_attention(q, k, v, causal=False):
    """``(o, lse)`` for q ``(B, H, Nq, D)``, k and v ``(B, Hkv, Nk, D)``: o in q's dtype, lse float32.

    The judge, the float64 reference (``fa_lab.core.reference``); the learner writes it as a
    Triton kernel and its launcher (the notebook gives the skeleton).
    """
    from fa_lab.core.reference import reference_attention
    from fa_lab.core.spec import make_spec

    o, lse = reference_attention(q, k, v, make_spec(q, k, v, causal=causal))
    return o.to(q.dtype), lse.to(torch.float32)


@triton.jit
def flash_kernel(Q, K, V, O, LSE,
                 stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
                 stride_vb, stride_vh, stride_vn, stride_vd, stride_ob, stride_oh, stride_om, stride_od,
                 n_q, n_k, heads, group, head_dim, qk_scale,
                 CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """The notebook's skeleton of ``ch4_flash_kernel``, filled in: one BLOCK_M × D tile of O per program."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // heads
    h = pid_bh % heads
    h_kv = h // group                                  # GQA: `group` query heads share one K/V head
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)                     # D padded to a power of two
    d_ok = offs_d[None, :] < head_dim                  # ... so the pad columns are masked everywhere
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=(offs_m[:, None] < n_q) & d_ok, other=0.0)
    k_head = K + b * stride_kb + h_kv * stride_kh
    v_head = V + b * stride_vb + h_kv * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(0, n_k, BLOCK_N):
        cols = start_n + offs_n
        kv_ok = (cols[:, None] < n_k) & d_ok
        k = tl.load(k_head + cols[:, None] * stride_kn + offs_d[None, :] * stride_kd, mask=kv_ok, other=0.0)
        v = tl.load(v_head + cols[:, None] * stride_vn + offs_d[None, :] * stride_vd, mask=kv_ok, other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale          # log2 units
        keep = cols[None, :] < n_k                     # a key loaded as 0 would still score 0, not -inf
        if CAUSAL:
            keep = keep & (cols[None, :] <= offs_m[:, None] + (n_k - n_q))
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)   # nothing seen yet: exp2(-inf - 0) = 0, not NaN
        p = tl.math.exp2(s - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    tl.store(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
             (acc / l_safe[:, None]).to(O.dtype.element_ty), mask=(offs_m[:, None] < n_q) & d_ok)
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    tl.store(LSE + pid_bh * n_q + offs_m, lse, mask=offs_m < n_q)


def flash_attention_triton(q, k, v, causal=False):
    """The model answer of ``ch4_flash_kernel``: the notebook's launcher, unchanged."""
    B, H, n_q, D = q.shape
    o = torch.empty_like(q)
    lse = torch.empty((B, H, n_q), dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(n_q, BLOCK_M), B * H)
    flash_kernel[grid](q, k, v, o, lse, *q.stride(), *k.stride(), *v.stride(), *o.stride(),
                       n_q, k.shape[2], H, H // k.shape[1], D, LOG2E / math.sqrt(D),
                       CAUSAL=causal, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                       BLOCK_D=max(16, triton.next_power_of_2(D)))
    return o, lse


# --------------------------------------------------------------------------- skipping masked blocks

def flash_attention_causal(q, k, v):
    """Causal ``(o, lse)`` (bottom-right), the judge of ``ch4_skip_masked``."""
    return flash_attention(q, k, v, causal=True)


@triton.jit
def attend_tiles(acc, l_i, m_i, q, k_head, v_head, stride_kn, stride_kd, stride_vn, stride_vd,
                 start, stop, offs_m, offs_n, offs_d, d_ok, n_k, diag, qk_scale,
                 MASKED: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key tiles ``[start, stop)`` folded into (acc, l_i, m_i); only ``MASKED`` tiles build a mask."""
    for start_n in range(start, stop, BLOCK_N):
        cols = start_n + offs_n
        kv_ok = (cols[:, None] < n_k) & d_ok
        k = tl.load(k_head + cols[:, None] * stride_kn + offs_d[None, :] * stride_kd, mask=kv_ok, other=0.0)
        v = tl.load(v_head + cols[:, None] * stride_vn + offs_d[None, :] * stride_vd, mask=kv_ok, other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        if MASKED:
            keep = (cols[None, :] <= offs_m[:, None] + diag) & (cols[None, :] < n_k)
            s = tl.where(keep, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:  # every row sees every key of the tile: the max is finite
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_sub = m_new
        p = tl.math.exp2(s - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def flash_kernel_skip(Q, K, V, O, LSE,
                      stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
                      stride_vb, stride_vh, stride_vn, stride_vd, stride_ob, stride_oh, stride_om, stride_od,
                      n_q, n_k, heads, group, head_dim, qk_scale,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """The notebook's skeleton of ``ch4_skip_masked``, filled in: causal, invisible key tiles never loaded."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // heads
    h = pid_bh % heads
    h_kv = h // group
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < head_dim
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=(offs_m[:, None] < n_q) & d_ok, other=0.0)
    k_head = K + b * stride_kb + h_kv * stride_kh
    v_head = V + b * stride_vb + h_kv * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    diag = n_k - n_q                                   # bottom-right: query i sits at key i + diag
    # the first row sees keys 0 .. m0 + diag, so does every row: whole tiles below that need no mask
    mid = tl.maximum(tl.minimum(m0 + diag + 1, n_k), 0) // BLOCK_N * BLOCK_N
    # the last row sees up to m0 + BLOCK_M - 1 + diag: no key past it is loaded (clamped at 0 before
    # any division: a block whose rows see no key runs no iteration)
    hi = tl.maximum(tl.minimum(m0 + BLOCK_M + diag, n_k), 0)
    acc, l_i, m_i = attend_tiles(acc, l_i, m_i, q, k_head, v_head, stride_kn, stride_kd, stride_vn, stride_vd,
                                 0, mid, offs_m, offs_n, offs_d, d_ok, n_k, diag, qk_scale,
                                 MASKED=False, BLOCK_N=BLOCK_N)
    acc, l_i, m_i = attend_tiles(acc, l_i, m_i, q, k_head, v_head, stride_kn, stride_kd, stride_vn, stride_vd,
                                 mid, hi, offs_m, offs_n, offs_d, d_ok, n_k, diag, qk_scale,
                                 MASKED=True, BLOCK_N=BLOCK_N)
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    tl.store(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
             (acc / l_safe[:, None]).to(O.dtype.element_ty), mask=(offs_m[:, None] < n_q) & d_ok)
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    tl.store(LSE + pid_bh * n_q + offs_m, lse, mask=offs_m < n_q)


def flash_attention_causal_triton(q, k, v):
    """The model answer of ``ch4_skip_masked``: the notebook's launcher, unchanged."""
    B, H, n_q, D = q.shape
    o = torch.empty_like(q)
    lse = torch.empty((B, H, n_q), dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(n_q, BLOCK_M), B * H)
    flash_kernel_skip[grid](q, k, v, o, lse, *q.stride(), *k.stride(), *v.stride(), *o.stride(),
                            n_q, k.shape[2], H, H // k.shape[1], D, LOG2E / math.sqrt(D),
                            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=max(16, triton.next_power_of_2(D)))
    return o, lse


def causal_key_blocks(n_q, n_k, block_m, block_n):
    """``(needed, all)``: key tiles that hold a key some row of their query block sees (bottom-right
    causal), summed over the query blocks, and the tiles a loop over every key computes."""
    rows, tiles = triton.cdiv(n_q, block_m), triton.cdiv(n_k, block_n)
    needed = 0
    for m0 in range(0, n_q, block_m):
        hi = max(0, min(n_k, min(m0 + block_m, n_q) + n_k - n_q))   # past the last row's last key
        needed += triton.cdiv(hi, block_n)
    return needed, rows * tiles


_DOT_COUNTER = """
def counting_dot(builder, a, b, *rest):
    if seen["first"] is None:
        seen["first"] = (a.data.shape, b.data.shape)
    seen["dots"] += 1
    return original(builder, a, b, *rest)
"""


class KeyBlocksComputed(StructureCheck):
    """Triton interpreter: the key tiles a causal kernel computes, about the ones some row can see.

    Every ``tl.dot`` the interpreter runs is counted (a key tile costs two: S = QKᵀ and PV); the
    tile sizes are read from the first product, ``q [BLOCK_M, D] @ kᵀ [D, BLOCK_N]``.  On a GPU it does
    not apply (the notebook times the kernels instead).
    """

    def __init__(self, slack: float = 1.1):
        self.slack = slack
        self.label = f"key tiles computed ≤ {slack:g} × the tiles some row sees (interpreter)"

    def applies(self, case) -> bool:
        return not ON_GPU and super().applies(case)

    def start(self, case, args, kwargs):
        from triton.runtime.interpreter import InterpreterBuilder

        self.meta = case.meta
        self.seen = {"dots": 0, "first": None}
        original = InterpreterBuilder.create_dot
        namespace = {"seen": self.seen, "original": original}
        # The counter runs inside the learner's call, where every Python call from a file of
        # fa_lab/exercises/ch*.py reads as a call into a solution; compiled under its own name it
        # reads as what it is, the check's instrumentation.
        exec(compile(_DOT_COUNTER, "<structure check: tl.dot counter>", "exec"), namespace)
        InterpreterBuilder.create_dot = namespace["counting_dot"]
        self._restore = (InterpreterBuilder, original)

    def finish(self):
        restore = getattr(self, "_restore", None)
        if restore is not None:
            cls, original = restore
            cls.create_dot = original
            self._restore = None

    def verdict(self):
        self.finish()
        if self.seen["first"] is None:
            return ("no tl.dot ran in the Triton interpreter: the key tiles a kernel computes are counted from its "
                    "tl.dot calls (S = QKᵀ and PV), so launch your Triton kernel from the function")
        (block_m, _), (_, block_n) = self.seen["first"]
        n_q, n_k, bh = self.meta["n_q"], self.meta["n_k"], self.meta["bh"]
        needed, every = (bh * x for x in causal_key_blocks(n_q, n_k, block_m, block_n))
        computed = self.seen["dots"] / 2
        if computed <= self.slack * needed:
            return None
        return (f"your kernel computed {computed:g} key tiles (two tl.dot each: S = QKᵀ and PV) for {bh} (batch, head) "
                f"× {triton.cdiv(n_q, block_m)} query blocks; only {needed} of them hold a key that some row of its "
                f"query block sees — {needed / every:.0%} of the {every} that a loop over every key computes. "
                "Stop each query block's key loop after the last key its last row sees "
                f"(bottom-right: key m0 + BLOCK_M − 1 + Nk − Nq, here Nk − Nq = {n_k - n_q}).")


# --------------------------------------------------------------------------- cases, mistakes, hints

#: bf16 cases run in fp16 in the CPU world: the interpreter's tl.dot cannot multiply bf16
HALF = pick(cpu=torch.float16, gpu=torch.bfloat16)


def _attention_cases(seed, specs, *, causal_only=False):
    """Cases from ``(label, B, H, Hkv, Nq, Nk, D, causal, dtype, extra)``; ``extra``: strided, structure."""
    import random

    rng = random.Random(seed)
    specs = list(specs)
    n_q, n_k, group = rng.randint(1, 70), rng.randint(1, 70), rng.choice([1, 2])
    specs.append(("random", 1, 2 * group, 2, n_q, n_k, rng.choice([16, 24, 40, 64]),
                  causal_only or rng.random() < 0.5, rng.choice([torch.float16, HALF]), {}))
    cases = []
    for index, (label, b, h, h_kv, n_q, n_k, d, causal, dtype, extra) in enumerate(specs):
        g = torch.Generator().manual_seed(seed * 1000 + index)

        def draw(heads, n):
            if extra.get("strided"):   # laid out (B, N, H, D), as a projection writes it, then viewed (B, H, N, D)
                return torch.randn(b, n, heads, d, generator=g).to(device=DEVICE, dtype=dtype).transpose(1, 2)
            return torch.randn(b, heads, n, d, generator=g).to(device=DEVICE, dtype=dtype)

        q, k, v = draw(h, n_q), draw(h_kv, n_k), draw(h_kv, n_k)
        words = f"B={b} H={h}" + (f" Hkv={h_kv}" if h_kv != h else "") + f" Nq={n_q} Nk={n_k} D={d}"
        words += (" causal" if causal else "") + f" {str(dtype).replace('torch.', '')}"
        meta = dict(n_q=n_q, n_k=n_k, causal=causal, bh=b * h, structure=extra.get("structure", False))
        cases.append(Case(f"{label}: {words}", (q, k, v), {} if causal_only else dict(causal=causal), dtype=dtype,
                          meta=meta))
    return cases


#: (label, B, H, Hkv, Nq, Nk, D, causal, dtype, extra): small, every contract corner, both worlds
_KERNEL_SPECS = [
    ("N = 1", 1, 1, 1, 1, 1, 16, True, torch.float16, {}),
    ("tails (N not a multiple of the tile)", 1, 2, 2, 37, 37, 32, False, torch.float16, {}),
    ("tails, causal", 1, 2, 2, 37, 37, 32, True, HALF, {}),
    ("Nq < Nk, D = 24 (padded to 32)", 1, 2, 2, 20, 45, 24, True, torch.float16, {}),
    ("Nq > Nk: the first rows see no key, D = 40", 1, 2, 2, 50, 21, 40, True, torch.float16, {}),
    ("GQA: 4 query heads share 2 K/V heads", 2, 4, 2, 33, 33, 16, True, HALF, {}),
    ("Nk > 100, D = 72", 1, 1, 1, 16, 130, 72, False, torch.float16, {}),
    ("strided inputs, (B, N, H, D) viewed as (B, H, N, D)", 1, 2, 2, 24, 40, 32, False, torch.float16,
     dict(strided=True)),
] + pick(cpu=[], gpu=[
    ("full size", 2, 8, 8, 2048, 2048, 128, True, torch.float16, {}),
    ("full size", 2, 8, 8, 2048, 2048, 64, False, torch.bfloat16, {}),
    ("full size, GQA", 2, 8, 2, 1000, 1536, 72, True, torch.bfloat16, {}),
])

_SKIP_SPECS = [
    ("tails", 1, 2, 2, 37, 37, 32, True, torch.float16, {}),
    ("Nq < Nk (a KV cache), D = 24", 1, 2, 2, 20, 75, 24, True, HALF, {}),
    ("Nq > Nk: the first query blocks see no key", 1, 2, 2, 50, 21, 40, True, torch.float16, {}),
    ("GQA", 2, 2, 1, 33, 33, 16, True, HALF, {}),
    ("N = 192: 6 query blocks", 1, 1, 1, 192, 192, 32, True, torch.float16, dict(structure=True)),
    ("Nq < Nk, 4 query blocks", 1, 1, 1, 128, 160, 16, True, torch.float16, dict(structure=True)),
] + pick(cpu=[], gpu=[
    ("full size", 2, 8, 8, 2048, 2048, 128, True, torch.float16, {}),
    ("full size, GQA", 2, 8, 2, 2048, 2048, 64, True, torch.bfloat16, {}),
])


def _no_tail_mask(q, k, v, causal=False):
    return _variant(q, k, v, causal, pad_keys_to=BLOCK_N)


KERNEL_MISTAKES = (
    Mistake("a top-left causal mask", _top_left_causal,
            "query i sits at key i + Nk − Nq (bottom-right): keep key j when j <= i + Nk − Nq."),
    Mistake("keys past Nk not masked", _no_tail_mask,
            "the last key tile runs past Nk; its missing keys load as 0 (other=0.0), so they score 0, not −inf, "
            "and still take a share of every row's softmax. Set the scores of keys ≥ Nk to −inf."),
    Mistake("lse left in log2 units", _lse_in_log2,
            "with m_i and l_i in base 2, lse = (m_i + log2(l_i)) · ln 2 (natural log, as the backward expects)."),
    Mistake("exp2 without LOG2E", _softmax_base_e_with_log2_scale,
            "exp(x) = exp2(x · log2 e): qk_scale = scale · log2(e), when the loop uses exp2."),
)

def _skip_top_left(q, k, v):
    return _variant(q, k, v, True, top_left=True)


def _skip_lse_in_log2(q, k, v):
    return _lse_in_log2(q, k, v, True)


SKIP_MISTAKES = (Mistake(KERNEL_MISTAKES[0].name, _skip_top_left, KERNEL_MISTAKES[0].message),
                 Mistake(KERNEL_MISTAKES[2].name, _skip_lse_in_log2, KERNEL_MISTAKES[2].message))

KERNEL_HINTS = (
    "Follow one program: which (batch, head) and which query rows are its own, which K/V head it reads, and "
    "which of the addresses it touches can fall outside the tensors (rows past Nq, keys past Nk, columns "
    "past D). Chapter 4's step 1 walks through the same loop.",
    "pid_m = tl.program_id(0) (query block), pid_bh = tl.program_id(1); b = pid_bh // heads, h = pid_bh % heads, "
    "K/V head h // group. Element (row r, column d) of q's head is at Q + b·stride_qb + h·stride_qh + "
    "r·stride_qm + d·stride_qd; offs_d = tl.arange(0, BLOCK_D) and every load/store masks d < head_dim "
    "(other=0.0). In the loop, scores of keys ≥ n_k — and, causal, of keys j > i + n_k − n_q — become −inf "
    "before the row max.",
    "Loop: s = tl.where(keep, tl.dot(q, tl.trans(k)) * qk_scale, -inf); m_new = tl.maximum(m_i, tl.max(s, 1)); "
    "m_sub = tl.where(m_new == -inf, 0.0, m_new); p = tl.math.exp2(s - m_sub[:, None]); "
    "alpha = tl.math.exp2(m_i - m_sub); l_i = l_i * alpha + tl.sum(p, 1); "
    "acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v); m_i = m_new. Epilogue: seen = l_i > 0; "
    "l_safe = tl.where(seen, l_i, 1.0); store (acc / l_safe[:, None]).to(O.dtype.element_ty); "
    "lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, -inf) at LSE + pid_bh * n_q + offs_m.",
)

SKIP_HINTS = (
    "Draw the grid of (query block, key tile) for N = 64 with 16 × 16 tiles under the causal mask: which tiles "
    "hold no visible key, which hold only visible keys, and which hold both? Two rows of a query block decide "
    "where its loops start and stop.",
    "Row i sees keys j <= i + diag, diag = n_k − n_q. The block's first row m0 sees keys 0 .. m0 + diag, and "
    "so does every row of the block: whole tiles up to there need no mask. Its last row sees up to "
    "m0 + BLOCK_M − 1 + diag: stop there (and at n_k). Clamp the bounds at 0 before dividing: a block that "
    "sees no key runs no iteration.",
    "mid = tl.maximum(tl.minimum(m0 + diag + 1, n_k), 0) // BLOCK_N * BLOCK_N; "
    "hi = tl.maximum(tl.minimum(m0 + BLOCK_M + diag, n_k), 0); loop 1: range(0, mid, BLOCK_N) without a "
    "score mask; loop 2: range(mid, hi, BLOCK_N) with keep = (cols <= offs_m + diag) & (cols < n_k). "
    "A @triton.jit helper holding the loop body, with a MASKED: tl.constexpr flag, keeps the two loops short.",
)

register_exercise(Exercise(
    name="ch4_flash_kernel", chapter=4, title="The whole FlashAttention-2 forward kernel in Triton",
    signature="flash_attention(q, k, v, causal=False) -> (o, lse)   # q (B, H, Nq, D), k/v (B, Hkv, Nk, D); "
              "launches your Triton kernel",
    solution=flash_attention, make_cases=lambda seed: _attention_cases(seed, _KERNEL_SPECS),
    outputs=("o", "lse"), mistakes=KERNEL_MISTAKES, tile=(BLOCK_M, BLOCK_N), judge_dtype=torch.float64,
    kind="triton", model_answer=flash_attention_triton, hint=KERNEL_HINTS[0], hints=KERNEL_HINTS,
))

register_exercise(Exercise(
    name="ch4_skip_masked", chapter=4, title="Causal attention that skips the key tiles no row can see",
    signature="flash_attention_causal(q, k, v) -> (o, lse)   # bottom-right causal; launches your Triton kernel",
    solution=flash_attention_causal, make_cases=lambda seed: _attention_cases(seed, _SKIP_SPECS, causal_only=True),
    outputs=("o", "lse"), structure=(KeyBlocksComputed(),),
    mistakes=SKIP_MISTAKES, tile=(BLOCK_M, BLOCK_N), judge_dtype=torch.float64,
    kind="triton", model_answer=flash_attention_causal_triton, hint=SKIP_HINTS[0], hints=SKIP_HINTS,
))
