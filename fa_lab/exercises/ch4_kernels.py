"""Chapter 4 kernel exercises: FlashAttention-2 forward kernels in Triton.

3. ``ch4_flash_kernel`` — the whole FA2 forward kernel: program ids, strided pointers, GQA,
   any head dim (``BLOCK_D`` padded to a power of two), the online softmax in base 2, tails,
   bottom-right causal, the epilogue with ``lse`` in natural log.
4. ``ch4_skip_masked`` — the causal kernel that visits only the key blocks a query block can
   see, masking only the diagonal blocks.  Graded on its values and, in the interpreter, on the
   number of key blocks it computes (``KeyBlocksComputed``).

The warm-ups (the key-block ranges, the loop body) are in ``ch4``, with the reference and the
wrong answers these exercises share.  The Triton exercises are judged by the float64 reference;
their model answers (kernels a learner would write, with launchers) are the ``*_triton`` functions
below.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fa_lab.core.world import DEVICE, ON_GPU, pick
from fa_lab.exercises.ch4 import (
    attention_variant,
    lse_in_log2,
    reference_forward,
    softmax_base_e_with_log2_scale,
    top_left_causal,
)
from fa_lab.exercises.registry import Case, Exercise, Mistake, register_exercise
from fa_lab.exercises.structure import StructureCheck, TritonDotCount

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
    return reference_forward(q, k, v, causal)


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
        self.meta = case.meta
        # the counter runs inside the learner's call: it lives in structure.py, which the call watch
        # knows as the grader's instrumentation (code of this module there would read as a solution)
        self.dots = TritonDotCount().start()

    def finish(self):
        dots = getattr(self, "dots", None)
        if dots is not None:
            dots.stop()

    def verdict(self):
        self.finish()
        if self.dots.first is None:
            return ("no tl.dot ran in the Triton interpreter: the key tiles a kernel computes are counted from its "
                    "tl.dot calls (S = QKᵀ and PV), so launch your Triton kernel from the function")
        (block_m, _), (_, block_n) = self.dots.first
        n_q, n_k, bh = self.meta["n_q"], self.meta["n_k"], self.meta["bh"]
        needed, every = (bh * x for x in causal_key_blocks(n_q, n_k, block_m, block_n))
        computed = self.dots.count / 2
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
    return attention_variant(q, k, v, causal, pad_keys_to=BLOCK_N)


KERNEL_MISTAKES = (
    Mistake("a top-left causal mask", top_left_causal,
            "query i sits at key i + Nk − Nq (bottom-right): keep key j when j <= i + Nk − Nq."),
    Mistake("keys past Nk not masked", _no_tail_mask,
            "the last key tile runs past Nk; its missing keys load as 0 (other=0.0), so they score 0, not −inf, "
            "and still take a share of every row's softmax. Set the scores of keys ≥ Nk to −inf."),
    Mistake("lse left in log2 units", lse_in_log2,
            "with m_i and l_i in base 2, lse = (m_i + log2(l_i)) · ln 2 (natural log, as the backward expects)."),
    Mistake("exp2 without LOG2E", softmax_base_e_with_log2_scale,
            "exp(x) = exp2(x · log2 e): qk_scale = scale · log2(e), when the loop uses exp2."),
)

def _skip_top_left(q, k, v):
    return attention_variant(q, k, v, True, top_left=True)


def _skip_lse_in_log2(q, k, v):
    return lse_in_log2(q, k, v, True)


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
