"""Chapter 5 kernel exercises: the two Triton kernels of the FlashAttention-2 backward.

On (B, H, N, D) tensors with GQA, judged by autograd through the float64 reference (the model
answers, kernel and launcher, are written the way a learner would); the formulas they put
together are the warm-ups of ``ch5``:

5. ``attention_dkdv`` (``dkdv_kernel``): K/V-stationary — a program keeps a block of keys: dK, dV.
6. ``attention_dq`` (``dq_kernel``): Q-stationary — a program keeps a block of queries: dQ.

q, o, do (B, H, Nq, D); k, v (B, Hkv, Nk, D); lse, delta (B, H, Nq) float32.  Query head h
reads K/V head h // (H // Hkv).  The judge is autograd through the float64 reference.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

import fa_lab
import fa_lab.exercises.ch5  # noqa: F401  (the chapter's warm-ups register first: names() keeps the book's order)
from fa_lab.core.reference import reference_attention
from fa_lab.core.spec import make_spec
from fa_lab.core.world import DEVICE
from fa_lab.exercises.registry import Case, Exercise, Mistake, register_exercise
from fa_lab.exercises.structure import NoQuadraticBuffer


def _autograd_grads(q, k, v, do, causal):
    q, k, v = (t.detach().to(torch.float64).requires_grad_() for t in (q, k, v))
    o, _ = reference_attention(q, k, v, make_spec(q, k, v, causal=causal))
    return torch.autograd.grad(o, (q, k, v), do.to(torch.float64))


def dkdv_reference(q, k, v, o, do, lse, delta, causal=False):
    """The judge of ``attention_dkdv``: (dk, dv) by autograd through the float64 reference."""
    _, dk, dv = _autograd_grads(q, k, v, do, causal)
    return dk.to(k.dtype), dv.to(v.dtype)


def dq_reference(q, k, v, o, do, lse, delta, causal=False):
    """The judge of ``attention_dq``: dq by autograd through the float64 reference."""
    return _autograd_grads(q, k, v, do, causal)[0].to(q.dtype)


# --------------------------------------------------------------------------- model answers

@triton.jit
def dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, sm_scale, H, HKV, N_Q, N_K,
                HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_n = tl.program_id(0)                 # which block of keys
    bhk = tl.program_id(1)                   # which (batch, K/V head)
    b = bhk // HKV
    group = H // HKV
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    kv_mask = (offs_n[:, None] < N_K) & (offs_d[None, :] < HEAD_DIM)
    kv_ptrs = bhk * N_K * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    # K_j, V_j stay on chip for the whole program; dK_j, dV_j accumulate there in fp32
    k = tl.load(K + kv_ptrs, mask=kv_mask, other=0.0)
    v = tl.load(V + kv_ptrs, mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    diag = N_K - N_Q                         # bottom-right: query i sits at key i + diag
    lo = 0
    if CAUSAL:   # query i sees key j when j <= i + diag: earlier query blocks see none of these keys
        lo = tl.maximum(pid_n * BLOCK_N - diag, 0) // BLOCK_M * BLOCK_M
    for g in range(group):                   # every query head that reads this K/V head adds to dK_j, dV_j
        bh = b * H + (bhk % HKV) * group + g
        for start_m in range(lo, N_Q, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            q_mask = (offs_m[:, None] < N_Q) & (offs_d[None, :] < HEAD_DIM)
            q_ptrs = bh * N_Q * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
            q = tl.load(Q + q_ptrs, mask=q_mask, other=0.0)
            do = tl.load(DO + q_ptrs, mask=q_mask, other=0.0)
            lse = tl.load(LSE + bh * N_Q + offs_m, mask=offs_m < N_Q, other=0.0)
            lse = tl.where(lse == float("-inf"), float("inf"), lse)    # a row that sees no key: P = 0, not NaN
            Di = tl.load(DELTA + bh * N_Q + offs_m, mask=offs_m < N_Q, other=0.0)
            # transposed tiles (keys as rows), so that Pᵀ is the left operand of Pᵀ dO
            pT = tl.exp(tl.dot(k, tl.trans(q)) * sm_scale - lse[None, :])
            ok = offs_m[None, :] < N_Q                 # (keys past N_K need no mask: their rows are never stored)
            if CAUSAL:
                ok = ok & (offs_n[:, None] <= offs_m[None, :] + diag)
            pT = tl.where(ok, pT, 0.0)
            dv += tl.dot(pT.to(do.dtype), do)
            dpT = tl.dot(v, tl.trans(do))
            dsT = pT * (dpT - Di[None, :])
            dk += tl.dot(dsT.to(q.dtype), q)
    tl.store(DK + kv_ptrs, (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + kv_ptrs, dv.to(DV.dtype.element_ty), mask=kv_mask)


def attention_dkdv(q, k, v, o, do, lse, delta, causal=False):
    """(dk, dv) from one K/V-stationary Triton kernel: a program per (key block, batch, K/V head)."""
    B, H, n_q, d = q.shape
    h_kv, n_k = k.shape[1], k.shape[2]
    q, k, v, do, lse, delta = (t.contiguous() for t in (q, k, v, do, lse, delta))
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    block = fa_lab.pick(cpu=16, gpu=64)
    grid = (triton.cdiv(n_k, block), B * h_kv)
    dkdv_kernel[grid](q, k, v, do, lse, delta, dk, dv, 1.0 / math.sqrt(d), H, h_kv, n_q, n_k,
                      HEAD_DIM=d, CAUSAL=causal, BLOCK_M=block, BLOCK_N=block,
                      BLOCK_D=max(16, triton.next_power_of_2(d)))
    return dk, dv


@triton.jit
def dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, sm_scale, H, HKV, N_Q, N_K,
              HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m = tl.program_id(0)                 # which block of queries
    bh = tl.program_id(1)                    # which (batch, query head)
    bhk = (bh // H) * HKV + (bh % H) // (H // HKV)     # its K/V head
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_mask = (offs_m[:, None] < N_Q) & (offs_d[None, :] < HEAD_DIM)
    q_ptrs = bh * N_Q * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    # Q_i, dO_i, lse_i, D_i stay on chip; dQ_i accumulates there in fp32
    q = tl.load(Q + q_ptrs, mask=q_mask, other=0.0)
    do = tl.load(DO + q_ptrs, mask=q_mask, other=0.0)
    lse = tl.load(LSE + bh * N_Q + offs_m, mask=offs_m < N_Q, other=0.0)
    lse = tl.where(lse == float("-inf"), float("inf"), lse)        # a row that sees no key: P = 0, not NaN
    Di = tl.load(DELTA + bh * N_Q + offs_m, mask=offs_m < N_Q, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    diag = N_K - N_Q
    hi = N_K
    if CAUSAL:   # the block's last row sees keys up to its index + diag: later key blocks are all masked
        hi = tl.minimum(pid_m * BLOCK_M + BLOCK_M + diag, N_K)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_mask = (offs_n[:, None] < N_K) & (offs_d[None, :] < HEAD_DIM)
        kv_ptrs = bhk * N_K * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
        k = tl.load(K + kv_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(V + kv_ptrs, mask=kv_mask, other=0.0)
        p = tl.exp(tl.dot(q, tl.trans(k)) * sm_scale - lse[:, None])
        ok = offs_n[None, :] < N_K                         # keys past N_K are zeros, and exp(0 - lse) is not 0
        if CAUSAL:
            ok = ok & (offs_n[None, :] <= offs_m[:, None] + diag)
        p = tl.where(ok, p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - Di[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
    tl.store(DQ + q_ptrs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=q_mask)


def attention_dq(q, k, v, o, do, lse, delta, causal=False):
    """dq from one Q-stationary Triton kernel: a program per (query block, batch, query head)."""
    B, H, n_q, d = q.shape
    h_kv, n_k = k.shape[1], k.shape[2]
    q, k, v, do, lse, delta = (t.contiguous() for t in (q, k, v, do, lse, delta))
    dq = torch.empty_like(q)
    block = fa_lab.pick(cpu=16, gpu=64)
    grid = (triton.cdiv(n_q, block), B * H)
    dq_kernel[grid](q, k, v, do, lse, delta, dq, 1.0 / math.sqrt(d), H, h_kv, n_q, n_k,
                    HEAD_DIM=d, CAUSAL=causal, BLOCK_M=block, BLOCK_N=block,
                    BLOCK_D=max(16, triton.next_power_of_2(d)))
    return dq


# --------------------------------------------------------------------------- cases

F16, F32 = torch.float16, torch.float32
KERNEL_SHAPES = fa_lab.pick(  # B, H, Hkv, Nq, Nk, D, causal, dtype, what the case is for
    cpu=[(1, 1, 1, 1, 1, 16, False, F32, "N = 1"),
         (1, 2, 1, 20, 20, 16, True, F16, "tails (20 = 16 + 4), 2 query heads per K/V head"),
         (1, 1, 1, 37, 23, 16, True, F32, "Nq > Nk: rows 0-13 see no key, lse = -inf"),
         (2, 4, 2, 9, 40, 12, False, F16, "D = 12 (pad to BLOCK_D = 16), GQA 4 -> 2"),
         (1, 2, 1, 64, 64, 16, True, F32, "4 x 4 blocks"),
         (1, 1, 1, 7, 130, 16, True, F16, "Nk = 130: many key blocks")],
    gpu=[(1, 1, 1, 1, 1, 64, False, F16, "N = 1"),
         (2, 8, 2, 1000, 1000, 64, True, F16, "tails (1000 = 15 x 64 + 40), GQA 8 -> 2"),
         (1, 4, 2, 1500, 777, 128, True, F16, "Nq > Nk: rows 0-722 see no key, lse = -inf"),
         (2, 8, 2, 333, 1234, 100, True, F16, "D = 100 (pad to BLOCK_D = 128), Nq < Nk"),
         (2, 8, 2, 2048, 2048, 64, False, F16, "full size")],
)


def kernel_cases(seed, tile=False, shapes=KERNEL_SHAPES):
    """q, k, v, o, do, lse, delta as a forward and a loss give them (o, lse, delta from float64), one case
    per ``(B, H, Hkv, Nq, Nk, D, causal, dtype, what)`` of ``shapes``."""
    g = torch.Generator().manual_seed(seed)
    cases = []
    for B, H, h_kv, n_q, n_k, d, causal, dtype, what in shapes:
        q = torch.randn(B, H, n_q, d, generator=g).to(DEVICE, dtype)
        k, v = (torch.randn(B, h_kv, n_k, d, generator=g).to(DEVICE, dtype) for _ in range(2))
        do = torch.randn(B, H, n_q, d, generator=g).to(DEVICE, dtype)
        q64, k64, v64 = (t.double() for t in (q, k, v))
        o64, lse = reference_attention(q64, k64, v64, make_spec(q64, k64, v64, causal=causal))
        delta = (do.double() * o64).sum(-1)    # rowsum(dO ∘ O) with the exact O
        args = (q, k, v, o64.to(dtype), do, lse.float(), delta.float())
        # an Nq×Nk buffer is larger than every input here: the structure row can tell them apart
        big = n_q * n_k > max(t.numel() for t in args)
        meta = dict(n_q=n_q, n_k=n_k, structure=big)
        if tile:   # dq's rows are query rows: the feedback can name row tiles and rows that see no key
            meta.update(causal=causal, block_m=fa_lab.pick(cpu=16, gpu=64), block_n=fa_lab.pick(cpu=16, gpu=64))
        label = (f"B={B} H={H} Hkv={h_kv} Nq={n_q} Nk={n_k} D={d} causal={causal} "
                 f"{str(dtype).replace('torch.', '')} — {what}")
        cases.append(Case(label, args, dict(causal=causal), dtype=dtype, meta=meta))
    return cases


# --------------------------------------------------------------------------- typical wrong kernels

def _grads(q, k, v, do, lse, delta, causal, *, use_delta=True, scale_dq=True, scale_dk=True,
           top_left=False, heads="all", kv_head="grouped"):
    """(dq, dk, dv) in float64 from the formulas and the given lse and delta, with one mistake switched on."""
    q, k, v, do, lse, delta = (t.double() for t in (q, k, v, do, lse, delta))
    H, n_q, d = q.shape[1:]
    h_kv, n_k = k.shape[1], k.shape[2]
    group, scale = H // h_kv, 1.0 / math.sqrt(d)
    head = torch.arange(H, device=q.device)
    kv_of = head // group if kv_head == "grouped" else head % h_kv
    kx, vx = k[:, kv_of], v[:, kv_of]
    s = q @ kx.transpose(-1, -2) * scale
    lse = torch.where(torch.isinf(lse), torch.full_like(lse, float("inf")), lse)
    p = torch.exp(s - lse[..., None])
    if causal:
        i = torch.arange(n_q, device=q.device)[:, None] + (0 if top_left else n_k - n_q)
        p = p.masked_fill(torch.arange(n_k, device=q.device)[None, :] > i, 0.0)
    ds = p * (do @ vx.transpose(-1, -2) - (delta[..., None] if use_delta else 0.0))
    dq = ds @ kx * (scale if scale_dq else 1.0)
    dk_h, dv_h = ds.transpose(-1, -2) @ q * (scale if scale_dk else 1.0), p.transpose(-1, -2) @ do
    rank = head // h_kv if kv_head != "grouped" else head % group      # place of a head within its group
    keep = {"all": rank >= 0, "first": rank == 0, "last": rank == group - 1}[heads]
    dk, dv = (torch.zeros_like(k).index_add_(1, kv_of[keep], t[:, keep]) for t in (dk_h, dv_h))
    return dq, dk, dv


def _mistake(exercise, **mistake):
    """A wrong answer to ``exercise`` ("dkdv" or "dq") with the signature of the learner's function."""
    def fn(q, k, v, o, do, lse, delta, causal=False):
        dq, dk, dv = _grads(q, k, v, do, lse, delta, causal, **mistake)
        return dq.to(q.dtype) if exercise == "dq" else (dk.to(k.dtype), dv.to(v.dtype))
    return fn


NO_DELTA = ("D (delta) left out of dS", "dS = P ∘ (dP − D): without D it is the gradient with respect to P, not "
            "to S. Subtract the query row's delta from every entry of its row of dP.")
TOP_LEFT = ("a top-left causal mask", "query i sits at key i + Nk − Nq (bottom-right): it sees key j when "
            "j <= i + Nk − Nq — in the mask, and in where the loop starts or stops.")
INTERLEAVED = ("GQA: the wrong K/V head", "query head h reads K/V head h // (H // Hkv): consecutive query heads "
               "share a K/V head (not h % Hkv).")
DKDV_MISTAKES = (
    Mistake(NO_DELTA[0], _mistake("dkdv", use_delta=False), NO_DELTA[1]),
    Mistake("the scale left out of dK", _mistake("dkdv", scale_dk=False),
            "S = scale · Q Kᵀ, so dK = scale · dSᵀ Q: multiply dk by sm_scale (once, before the store)."),
    Mistake("GQA: only the group's first query head", _mistake("dkdv", heads="first"),
            "a K/V head is read by H // Hkv query heads, and its dK, dV are the sum over all of them: loop over "
            "the group's query heads inside the program, accumulating into the same dk, dv."),
    Mistake("GQA: only the group's last query head (the others overwritten)", _mistake("dkdv", heads="last"),
            "programs of different query heads store to the same dK, dV rows and the last store wins: one program "
            "per K/V head, looping over its group's query heads, sums them in registers."),
    Mistake(TOP_LEFT[0], _mistake("dkdv", top_left=True), TOP_LEFT[1]),
    Mistake(INTERLEAVED[0], _mistake("dkdv", kv_head="interleaved"), INTERLEAVED[1]),
)
DQ_MISTAKES = (
    Mistake(NO_DELTA[0], _mistake("dq", use_delta=False), NO_DELTA[1]),
    Mistake("the scale left out of dQ", _mistake("dq", scale_dq=False),
            "S = scale · Q Kᵀ, so dQ = scale · dS K: multiply dq by sm_scale (once, before the store)."),
    Mistake(TOP_LEFT[0], _mistake("dq", top_left=True), TOP_LEFT[1]),
    Mistake(INTERLEAVED[0], _mistake("dq", kv_head="interleaved"), INTERLEAVED[1]),
)

_IO = ("q, o, do (B, H, Nq, D); k, v (B, Hkv, Nk, D); lse, delta (B, H, Nq) float32; "
       "runs a Triton kernel; no Nq×Nk buffer")
register_exercise(Exercise(
    name="ch5_dkdv_kernel", chapter=5, title="dK and dV in Triton: the K/V-stationary kernel",
    signature=f"attention_dkdv(q, k, v, o, do, lse, delta, causal=False) -> (dk, dv)   # {_IO}",
    solution=dkdv_reference, model_answer=attention_dkdv, kind="triton", make_cases=kernel_cases,
    outputs=("dk", "dv"), judge_dtype=torch.float64, mistakes=DKDV_MISTAKES, structure=(NoQuadraticBuffer(),),
    hint="One program per (key block, batch, K/V head) keeps K_j, V_j and fp32 dK_j, dV_j on chip and walks the "
         "query blocks of every query head of its group. hint('ch5_dkdv_kernel', 1) and on for more.",
    hints=(
        "Go back to the chapter's formulas for dV and dK: which index does each one sum over? This program owns "
        "a fixed block of keys, so whatever is indexed by those keys can be loaded (or accumulated) once, and "
        "whatever is indexed by queries is what its loop walks over. Also ask: which query heads read this "
        "K/V head, and which query rows can see these keys under the causal mask?",
        "Per query tile, on transposed tiles (keys as rows): Pᵀ = exp(K Qᵀ·scale − lse) with lse along the "
        "columns (masked entries and rows that see no key give 0); dV += Pᵀ dO; dPᵀ = V dOᵀ; "
        "dSᵀ = Pᵀ ∘ (dPᵀ − delta); dK += dSᵀ Q; dK is scaled once at the end. The program of K/V head hk loops "
        "over query heads hk·group … hk·group + group − 1 (group = H // Hkv) into the same accumulators. "
        "Causal: query i sees key j when j <= i + Nk − Nq, so the first query block worth visiting starts at "
        "(start_n − (Nk − Nq)) rounded down to BLOCK_M (at least 0).",
        "Inside `for g in range(group)` and `for start_m in range(lo, N_Q, BLOCK_M)`:\n"
        "  pT = tl.exp(tl.dot(k, tl.trans(q)) * sm_scale - lse[None, :])   # lse = +inf where it was -inf\n"
        "  pT = tl.where((offs_m[None, :] < N_Q) & (offs_n[:, None] <= offs_m[None, :] + N_K - N_Q), pT, 0.0)\n"
        "  dv += tl.dot(pT.to(do.dtype), do)\n"
        "  dsT = pT * (tl.dot(v, tl.trans(do)) - Di[None, :])\n"
        "  dk += tl.dot(dsT.to(q.dtype), q)\n"
        "and after the loops: tl.store(DK + ..., (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_mask).",
    ),
))
register_exercise(Exercise(
    name="ch5_dq_kernel", chapter=5, title="dQ in Triton: the Q-stationary kernel",
    signature=f"attention_dq(q, k, v, o, do, lse, delta, causal=False) -> dq   # {_IO}",
    solution=dq_reference, model_answer=attention_dq, kind="triton",
    make_cases=lambda seed: kernel_cases(seed, tile=True),
    outputs=("dq",), judge_dtype=torch.float64, mistakes=DQ_MISTAKES, structure=(NoQuadraticBuffer(),),
    hint="One program per (query block, batch, query head) keeps Q_i, dO_i, lse_i, delta_i and fp32 dQ_i on chip "
         "and walks the key blocks of its K/V head. hint('ch5_dq_kernel', 1) and on for more.",
    hints=(
        "dQ_i sums over keys: which of the program's operands never change along that loop, and which K/V "
        "head does this query head read? Under the causal mask, is there a key block after which nothing in "
        "this query block can see anything?",
        "Per key tile: P = exp(Q Kᵀ·scale − lse[:, None]), zero where the key is past Nk or masked (and in rows "
        "whose lse is −inf); dP = dO Vᵀ; dS = P ∘ (dP − delta[:, None]); dQ += dS K; dQ is scaled once at the "
        "end. Causal: the block's last row i_last sees keys up to i_last + Nk − Nq, so the loop can stop at "
        "min(start_m + BLOCK_M + Nk − Nq, Nk).",
        "In `for start_n in range(0, hi, BLOCK_N)`:\n"
        "  p = tl.exp(tl.dot(q, tl.trans(k)) * sm_scale - lse[:, None])   # lse = +inf where it was -inf\n"
        "  p = tl.where((offs_n[None, :] < N_K) & (offs_n[None, :] <= offs_m[:, None] + N_K - N_Q), p, 0.0)\n"
        "  ds = p * (tl.dot(do, tl.trans(v)) - Di[:, None])\n"
        "  dq += tl.dot(ds.to(k.dtype), k)\n"
        "with k, v loaded from K/V head (bh // H) * HKV + (bh % H) // (H // HKV); then store dq * sm_scale.",
    ),
))
