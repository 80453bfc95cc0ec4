"""Chapter 10 kernel exercise: the score modification inside a FlashAttention-2 forward kernel.

``ch10_score_mod_kernel`` — the notebook gives a whole forward kernel (chapter 4's: strided loads,
GQA, tails, bottom-right causal, the online softmax in base 2, the epilogue) that calls a
``@triton.jit`` function ``score_mod`` on every tile of scores between ``tl.dot`` and the softmax.
The learner writes ``score_mod`` — scale, then the soft cap ``cap·tanh(s/cap)``, then ALiBi's
``-slope·|i + Nk - Nq - j|`` — and the line of the kernel that loads this program's slope.

Judged by the float64 reference (``fa_lab.core.reference``) on cases with tails, Nq != Nk both
ways, causal and not, GQA, the cap on and off and per-head slopes of shape ``(H,)`` and ``(B, H)``.
The model answer is the kernel and launcher below (the notebook's, filled in); the typical wrong
answers (the cap before the scale, ALiBi's sign, its alignment, the slope of the K/V head, ...) are
float64 twins of the reference that make exactly that mistake.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fa_lab.core.reference import attention_from_scores, reference_attention
from fa_lab.core.spec import make_spec
from fa_lab.core.world import DEVICE, pick
from fa_lab.exercises.ch10 import slopes_list
from fa_lab.exercises.registry import Case, Exercise, Mistake, register_exercise

LOG2E = 1.4426950408889634   # exp(x) = exp2(x · LOG2E)
#: the skeleton's tiles (the interpreter's cost is per tile operation: 32 keeps it quick and leaves tails)
BLOCK_M, BLOCK_N = pick(cpu=(32, 32), gpu=(64, 64))


def flash_attention_mods(q, k, v, causal=False, softcap=0.0, alibi_slopes=None):
    """``(o, lse)`` with the score modifications: the judge, the float64 reference.

    q ``(B, H, Nq, D)``, k and v ``(B, Hkv, Nk, D)``; ``softcap > 0`` caps the scaled scores,
    ``alibi_slopes`` (float32 ``(H,)`` or ``(B, H)``) adds ``-slope·|i + Nk - Nq - j|``.
    o in q's dtype, lse float32 (natural log).
    """
    slopes = None if alibi_slopes is None else alibi_slopes.to(device=q.device, dtype=torch.float32)
    spec = make_spec(q, k, v, causal=causal, softcap=float(softcap), alibi_slopes=slopes)
    o, lse = reference_attention(q, k, v, spec)
    return o.to(q.dtype), lse.to(torch.float32)


# --------------------------------------------------------------------------- the model answer

@triton.jit
def score_mod(qk, scale, q_idx, kv_idx, n_q, n_k, softcap, slope, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr):
    """The modified scores of a tile, in natural-log units: scale, then the cap, then ALiBi.

    ``qk`` is ``q·kᵀ`` ``[BLOCK_M, BLOCK_N]`` (float32), ``q_idx`` ``[BLOCK_M, 1]`` the query rows,
    ``kv_idx`` ``[1, BLOCK_N]`` the keys.
    """
    s = qk * scale
    if SOFTCAP:
        # tanh(x) = 2·sigmoid(2x) − 1: saturates to ±1 without overflow
        s = softcap * (2.0 * tl.sigmoid(2.0 * (s / softcap)) - 1.0)
    if ALIBI:
        # bottom-right: query i sits at key i + n_k − n_q; the bias falls with the distance either way
        s = s - slope * tl.abs(q_idx + (n_k - n_q) - kv_idx).to(tl.float32)
    return s


@triton.jit
def flash_mods_kernel(Q, K, V, O, LSE, SLOPES,
                      stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
                      stride_vb, stride_vh, stride_vn, stride_vd, stride_ob, stride_oh, stride_om, stride_od,
                      stride_sb, stride_sh, n_q, n_k, heads, group, head_dim, scale, softcap,
                      CAUSAL: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """The notebook's kernel with its one TODO line filled in: one BLOCK_M × D tile of O per program."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // heads
    h = pid_bh % heads
    h_kv = h // group
    slope = 0.0
    if ALIBI:
        slope = tl.load(SLOPES + b * stride_sb + h * stride_sh)    # the query head's slope, not the K/V head's
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
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
    for start_n in range(0, n_k, BLOCK_N):
        cols = start_n + offs_n
        kv_ok = (cols[:, None] < n_k) & d_ok
        k = tl.load(k_head + cols[:, None] * stride_kn + offs_d[None, :] * stride_kd, mask=kv_ok, other=0.0)
        v = tl.load(v_head + cols[:, None] * stride_vn + offs_d[None, :] * stride_vd, mask=kv_ok, other=0.0)
        s = score_mod(tl.dot(q, tl.trans(k)), scale, offs_m[:, None], cols[None, :], n_q, n_k, softcap, slope,
                      SOFTCAP=SOFTCAP, ALIBI=ALIBI)
        # the mask comes after the modification: a capped −inf would be −cap, a key the row must not see
        keep = cols[None, :] < n_k
        if CAUSAL:
            keep = keep & (cols[None, :] <= offs_m[:, None] + (n_k - n_q))
        s = tl.where(keep, s * 1.4426950408889634, float("-inf"))   # log2 units for exp2
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
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


def flash_attention_mods_triton(q, k, v, causal=False, softcap=0.0, alibi_slopes=None):
    """The model answer of ``ch10_score_mod_kernel``: the notebook's launcher, unchanged."""
    B, H, n_q, D = q.shape
    o = torch.empty_like(q)
    lse = torch.empty((B, H, n_q), dtype=torch.float32, device=q.device)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(torch.float32).expand(B, H)   # (H,) -> (B, H) with batch stride 0
        slope_args = (slopes, slopes.stride(0), slopes.stride(1))
    else:
        slope_args = (lse, 0, 0)                                # never read: ALIBI is False
    grid = (triton.cdiv(n_q, BLOCK_M), B * H)
    flash_mods_kernel[grid](q, k, v, o, lse, slope_args[0], *q.stride(), *k.stride(), *v.stride(), *o.stride(),
                            slope_args[1], slope_args[2], n_q, k.shape[2], H, H // k.shape[1], D,
                            1.0 / math.sqrt(D), float(softcap),
                            CAUSAL=causal, SOFTCAP=softcap > 0, ALIBI=alibi_slopes is not None,
                            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=max(16, triton.next_power_of_2(D)))
    return o, lse


# --------------------------------------------------------------------------- cases

#: bf16 cases run in fp16 in the CPU world: the interpreter's tl.dot cannot multiply bf16
HALF = pick(cpu=torch.float16, gpu=torch.bfloat16)

#: (label, B, H, Hkv, Nq, Nk, D, causal, dtype, softcap, slopes, q gain): slopes None, "standard" (H,) or
#: "random" (B, H); the gain scales q so that the scores reach the cap
_SPECS = [
    ("no modification: the skeleton alone", 1, 2, 2, 37, 37, 32, False, torch.float16, 0.0, None, 1.0),
    ("softcap 5, tails", 1, 2, 2, 37, 37, 32, False, torch.float16, 5.0, None, 3.0),
    ("softcap 2, causal, Nq > Nk: the first rows see no key", 1, 2, 2, 45, 21, 16, True, HALF, 2.0, None, 2.0),
    ("ALiBi, standard slopes (H,), causal, Nq < Nk", 1, 4, 4, 20, 45, 24, True, torch.float16, 0.0, "standard",
     1.0),
    ("ALiBi, slopes (B, H), no mask, Nq < Nk: keys on both sides", 2, 2, 2, 17, 40, 16, False, torch.float16, 0.0,
     "random", 1.0),
    ("GQA: 4 query heads share 2 K/V heads, softcap 3 and ALiBi, causal", 2, 4, 2, 33, 33, 16, True, HALF, 3.0,
     "standard", 2.0),
    ("softcap 30 with large scores, ALiBi, D = 40, Nk > 64", 1, 2, 1, 24, 70, 40, False, torch.float16, 30.0,
     "random", 8.0),
] + pick(cpu=[], gpu=[
    ("full size, softcap 50", 2, 8, 8, 2048, 2048, 128, True, torch.bfloat16, 50.0, None, 4.0),
    ("full size, ALiBi, GQA", 2, 8, 2, 1000, 1536, 64, True, torch.bfloat16, 0.0, "standard", 1.0),
    ("full size, both, no mask", 1, 8, 8, 1024, 1024, 128, False, torch.float16, 20.0, "random", 3.0),
])


def _slopes(kind, b, h, g):
    if kind is None:
        return None
    if kind == "standard":
        return torch.tensor(slopes_list(h), dtype=torch.float32, device=DEVICE)
    return (0.05 + 0.7 * torch.rand(b, h, generator=g)).to(DEVICE)


def _cases(seed):
    import random

    rng = random.Random(seed)
    specs = list(_SPECS)
    n_q, n_k, group = rng.randint(1, 70), rng.randint(1, 70), rng.choice([1, 2])
    specs.append(("random", rng.choice([1, 2]), 2 * group, 2, n_q, n_k, rng.choice([16, 24, 40, 64]),
                  rng.random() < 0.5, rng.choice([torch.float16, HALF]), rng.choice([0.0, 2.0, 10.0]),
                  rng.choice([None, "standard", "random"]), rng.choice([1.0, 3.0])))
    cases = []
    for index, (label, b, h, h_kv, n_q, n_k, d, causal, dtype, cap, kind, gain) in enumerate(specs):
        g = torch.Generator().manual_seed(seed * 1000 + index)
        q = (torch.randn(b, h, n_q, d, generator=g) * gain).to(device=DEVICE, dtype=dtype)
        k, v = (torch.randn(b, h_kv, n_k, d, generator=g).to(device=DEVICE, dtype=dtype) for _ in range(2))
        slopes = _slopes(kind, b, h, g)
        words = f"B={b} H={h}" + (f" Hkv={h_kv}" if h_kv != h else "") + f" Nq={n_q} Nk={n_k} D={d}"
        words += (" causal" if causal else "") + (f" softcap={cap:g}" if cap else "")
        words += (f" ALiBi {tuple(slopes.shape)}" if slopes is not None else "")
        words += f" {str(dtype).replace('torch.', '')}"
        cases.append(Case(f"{label}: {words}", (q, k, v), dict(causal=causal, softcap=cap, alibi_slopes=slopes),
                          dtype=dtype, meta=dict(n_q=n_q, n_k=n_k, causal=causal, bh=b * h, softcap=cap,
                                                 alibi=kind is not None)))
    return cases


# --------------------------------------------------------------------------- typical wrong answers

def mods_variant(q, k, v, causal=False, softcap=0.0, alibi_slopes=None, *, cap_before_scale=False, clamp=False,
                 no_cap=False, alibi_sign=-1.0, top_left=False, signed=False, kv_head_slope=False):
    """Attention in float64 with the score modifications made with one mistake (the keywords)."""
    B, H, n_q, d = q.shape
    n_k, h_kv = k.shape[2], k.shape[1]
    group = H // h_kv
    kk, vv = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    qk = q.double() @ kk.transpose(-1, -2)
    scale = 1.0 / math.sqrt(d)
    if softcap > 0 and not no_cap:
        if cap_before_scale:
            s = softcap * torch.tanh(qk / softcap) * scale
        elif clamp:
            s = (qk * scale).clamp(-softcap, softcap)
        else:
            s = softcap * torch.tanh(qk * scale / softcap)
    else:
        s = qk * scale
    if alibi_slopes is not None:
        slopes = alibi_slopes.double().expand(B, H)
        if kv_head_slope:
            slopes = slopes[:, torch.arange(H, device=slopes.device) // group]
        i = torch.arange(n_q, device=q.device, dtype=torch.float64)[:, None]
        j = torch.arange(n_k, device=q.device, dtype=torch.float64)[None, :]
        dist = (i + (0 if top_left else n_k - n_q)) - j
        dist = dist if signed else dist.abs()
        s = s + alibi_sign * slopes[:, :, None, None] * dist
    if causal:
        i = torch.arange(n_q, device=q.device)[:, None]
        j = torch.arange(n_k, device=q.device)[None, :]
        s = s.masked_fill(j > i + n_k - n_q, float("-inf"))
    o, lse = attention_from_scores(s, vv)
    return o.to(q.dtype), lse.float()


def _mistake(**kw):
    def fn(q, k, v, causal=False, softcap=0.0, alibi_slopes=None):
        return mods_variant(q, k, v, causal, softcap, alibi_slopes, **kw)
    fn.__name__ = "flash_attention_mods_" + "_".join(kw)
    return fn


MISTAKES = (
    Mistake("softcap applied before the scale", _mistake(cap_before_scale=True),
            "the cap bounds the scaled score: s = qk · scale first, then softcap · tanh(s / softcap) "
            "(capping qk and scaling afterwards bounds the scores at softcap · scale instead)."),
    Mistake("a hard clamp instead of tanh", _mistake(clamp=True),
            "the soft cap is softcap · tanh(s / softcap): smooth, and already bending well below the cap; a clamp "
            "leaves the scores inside it unchanged."),
    Mistake("the cap left out", _mistake(no_cap=True),
            "with SOFTCAP set, replace s by softcap · tanh(s / softcap) (tanh(x) = 2·sigmoid(2x) − 1 in Triton)."),
    Mistake("ALiBi added with the wrong sign", _mistake(alibi_sign=1.0),
            "ALiBi is a penalty: s − slope · distance, so that far keys weigh less."),
    Mistake("ALiBi distance measured top-left", _mistake(top_left=True),
            "query i sits at key i + n_k − n_q (bottom-right, like the causal mask): the distance is "
            "|i + n_k − n_q − j|, not |i − j|."),
    Mistake("a signed distance", _mistake(signed=True),
            "the distance is |i + n_k − n_q − j|: keys after the query (no causal mask) are penalised too, "
            "not rewarded."),
    Mistake("the slope of the K/V head", _mistake(kv_head_slope=True),
            "each query head has its own slope: load it at (b, h), not at (b, h // group)."),
)

HINTS = (
    "Follow one score through the formula of the chapter: what is scaled first, what is capped, and from where "
    "is the distance measured when Nq ≠ Nk? Then ask which head's slope a program of query head h needs.",
    "s = qk · scale; if SOFTCAP: s = softcap · tanh(s / softcap), with tanh(x) = 2 · sigmoid(2x) − 1 (Triton has "
    "tl.sigmoid); if ALIBI: s = s − slope · |q_idx + n_k − n_q − kv_idx| (cast the integer distance to float32). "
    "In the kernel, the slope of (batch b, query head h) sits at SLOPES + b · stride_sb + h · stride_sh.",
    "s = qk * scale;  if SOFTCAP: s = softcap * (2.0 * tl.sigmoid(2.0 * (s / softcap)) - 1.0);  "
    "if ALIBI: s = s - slope * tl.abs(q_idx + (n_k - n_q) - kv_idx).to(tl.float32);  return s.  "
    "In the kernel: slope = 0.0; if ALIBI: slope = tl.load(SLOPES + b * stride_sb + h * stride_sh).",
)

register_exercise(Exercise(
    name="ch10_score_mod_kernel", chapter=10, title="Softcap and ALiBi inside a FlashAttention kernel",
    signature="flash_attention_mods(q, k, v, causal=False, softcap=0.0, alibi_slopes=None) -> (o, lse)   "
              "# q (B, H, Nq, D), k/v (B, Hkv, Nk, D); launches your Triton kernel",
    solution=flash_attention_mods, make_cases=_cases, outputs=("o", "lse"), mistakes=MISTAKES,
    tile=(BLOCK_M, BLOCK_N), judge_dtype=torch.float64, kind="triton", model_answer=flash_attention_mods_triton,
    hint=HINTS[0], hints=HINTS,
))
