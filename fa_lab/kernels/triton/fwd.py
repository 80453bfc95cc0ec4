"""Chapter 4: the FlashAttention-2 forward pass on Tensor Cores, in Triton.

One program computes one ``BLOCK_M × D`` tile of the output for one (batch, head).  Its
query tile stays on chip; tiles of ``BLOCK_N`` keys and values stream past it.  Both
matrix products (``S = Q Kᵀ`` and ``acc += P V``) are ``tl.dot``, which Triton lowers to
Tensor Core instructions (``mma.sync`` on Ampere, warpgroup ``wgmma`` on Hopper).  The
softmax runs online (chapter 2): per row a running max ``m_i``, a running sum ``l_i`` and
the unnormalised ``acc``.

What the final kernel adds to the textbook loop (each step is measured in chapter 4):

* **Tensor descriptors** (TMA on Hopper): tiles are fetched by the copy engine, and a tile
  that hangs over the end of the sequence or past ``D`` comes back zero-filled, so any
  ``Nq``, ``Nk`` and head dims such as 40, 80 or 96 (padded to ``D_PAD``, the next power of
  two) need no special code.
* **The scale folded into exp2**: ``exp(s·scale - m) = exp2(s·scale·log2e - m')``; one
  fused multiply-add per score instead of a multiply and an ``exp``.
* **Masked blocks skipped**: for each query block the key loop runs over three ranges —
  the blocks on a window's left edge (masked), the blocks every row sees in full (no mask
  at all), the blocks on the diagonal / right edge / the sequence tail (masked).  Blocks no
  row can see are never loaded, and the masked ranges are walked in tiles no wider than
  ``BLOCK_M`` (``BLOCK_N_EDGE``): a 64-row query block on the diagonal does not compute a
  128-key tile of which half lies above the diagonal.
* **Autotuning** of tile sizes, warps and software-pipelining depth per
  (head dim, sequence-length bucket, dtype, mask), with the winners kept in a JSON cache;
  for causal masks the tuner also tries pairing query blocks ``i`` and ``last - i`` in one
  program (equal work per program).
* **Warp specialization** on Hopper, where the compiler can do it (one unmasked key loop, whole key
  tiles, descriptors built in the kernel): a producer warpgroup issues the copies and two consumer
  warpgroups share a 128-row tile; O and lse then go out through tensor descriptors.

Conventions (DESIGN.md): bottom-right causal, ``window=(left, right)``, grouped-query
attention by head arithmetic (``kv_head = head // group``; K and V are never copied per
query head), rows that see no key return zeros and ``lse = -inf``.

``triton_forward(q, k, v, spec) -> (o, lse)`` is the stable entry point (the backward
pass of chapter 5 calls it for ``lse``).
"""
from __future__ import annotations

import functools
import inspect
import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from fa_lab.core.data import DATA_DIR
from fa_lab.core.registry import register
from fa_lab.core.world import ON_GPU

LOG2E = 1.4426950408889634  # 1 / ln 2: exp(x) = exp2(x * LOG2E)
LN2 = tl.constexpr(0.6931471805599453)  # ln 2: lse = (m + log2 l) * LN2
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HEAD_DIMS = (16, 256)


@triton.jit
def _exp(x, EXP2: tl.constexpr):
    if EXP2:
        return tl.math.exp2(x)
    else:
        return tl.exp(x)


@triton.jit
def _exp2_fma(x):
    """2**x for x <= 0 without the special-function unit: FMA/ALU instructions only.

    Split x = n + f with n an integer (the 1.5·2**23 trick rounds to nearest in one add) and
    f in [-1/2, 1/2]; 2**f is a cubic (minimax, relative error 7.5e-5, far below fp16/bf16
    rounding of P); 2**n is added straight into the exponent bits.
    """
    x = tl.maximum(x, -126.0)                   # 2**-126 is the smallest normal: ~0 here
    j = x + 12582912.0                          # 1.5·2**23: the low mantissa bits of j hold round(x)
    f = x - (j - 12582912.0)
    p = 0.05517132 * f + 0.24261054
    p = p * f + 0.69326099
    p = p * f + 0.99992811
    bits = p.to(tl.int32, bitcast=True) + (j.to(tl.int32, bitcast=True) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _exp2_split(x, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """exp2 of a score tile, every second column on the FMA units (FlashAttention-4's trick).

    At head dim 64 a Tensor Core finishes a tile's two products about as fast as the
    special-function unit finishes its exponentials (16 per clock per SM), so exp2 can
    become the bottleneck; half of them move to ``_exp2_fma``.
    """
    even, odd = tl.split(tl.reshape(x, [BLOCK_M, BLOCK_N // 2, 2]))
    return tl.reshape(tl.join(tl.math.exp2(even), _exp2_fma(odd)), [BLOCK_M, BLOCK_N])


@triton.jit
def _attn_fwd_inner(acc, l_i, m_i, q, desc_k, desc_v, kv_row, start, stop,
                    offs_m, n_k, diag, left, right, qk_scale,
                    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, HAS_LEFT: tl.constexpr,
                    HAS_RIGHT: tl.constexpr, EXP2: tl.constexpr, PRECISION: tl.constexpr,
                    WARP_SPECIALIZE: tl.constexpr, BLOCK_M: tl.constexpr = 0, EMU: tl.constexpr = False):
    """Stream key blocks ``[start, stop)`` past the query tile, updating (acc, l_i, m_i)."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in tl.range(start, stop, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = desc_k.load([kv_row + start_n, 0])
        qk = tl.dot(q, k.T, input_precision=PRECISION)
        if MASKED:
            # Boundary block: some (row, key) pairs are invisible.  -inf, and a row that has
            # seen no key yet subtracts 0 instead of -inf (exp2(-inf) = 0, never NaN).
            cols = start_n + offs_n
            keep = cols[None, :] < n_k
            if HAS_LEFT:
                keep = keep & (cols[None, :] >= offs_m[:, None] + (diag - left))
            if HAS_RIGHT:
                keep = keep & (cols[None, :] <= offs_m[:, None] + (diag + right))
            s = tl.where(keep, qk * qk_scale, float("-inf"))
            m_ij = tl.maximum(m_i, tl.max(s, 1))
            m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij)
            p = _exp(s - m_sub[:, None], EXP2)
            alpha = _exp(m_i - m_sub, EXP2)
        else:
            # Every row sees every key of this block: no mask, and the scale rides on the
            # max and the subtraction (one FMA per score).
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            if EMU:
                p = _exp2_split(qk * qk_scale - m_ij[:, None], BLOCK_M, BLOCK_N)
            else:
                p = _exp(qk * qk_scale - m_ij[:, None], EXP2)
            alpha = _exp(m_i - m_ij, EXP2)
        l_ij = tl.sum(p, 1)
        if WARP_SPECIALIZE:
            # here, not after the second dot: under warp specialization this order (with the
            # literal loop bounds) measured 556 TFLOP/s against 524 without both, at
            # (1, 16, 16384, 128) fp16 (.notes/probe_ws_2026-11-23c)
            l_i = l_i * alpha + l_ij
        acc = acc * alpha[:, None]
        v = desc_v.load([kv_row + start_n, 0])
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
        if not WARP_SPECIALIZE:
            # updated last: fewer values live across the two dots
            l_i = l_i * alpha + l_ij
        m_i = m_ij
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_block(desc_q, desc_k, desc_v, desc_k_edge, desc_v_edge, q_row, kv_row, O, LSE, pid_m, n_q, n_k,
                    left, right, qk_scale,
                    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_N_EDGE: tl.constexpr,
                    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, EXP2: tl.constexpr,
                    SKIP_MASKED: tl.constexpr, EDGES: tl.constexpr, PRECISION: tl.constexpr,
                    WARP_SPECIALIZE: tl.constexpr, EMU: tl.constexpr):
    """One BLOCK_M × D tile of the output of one (batch, head)."""
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    diag = n_k - n_q  # bottom-right alignment: query i sits at key i + diag

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    q = desc_q.load([q_row + m0, 0])  # stays on chip for the whole loop

    if SKIP_MASKED and not EDGES:
        # no mask and whole key tiles: one loop over every key, with literal bounds (the loop
        # that Triton's Hopper warp specialization splits between warpgroups; no masked range)
        mid_lo = 0
        mid_hi = n_k
    elif SKIP_MASKED:
        # keys [lo, hi) that some row of this block sees; [full_lo, full_hi) that all rows see
        lo = 0
        hi = n_k
        full_lo = 0
        full_hi = n_k
        if HAS_LEFT:
            lo = tl.maximum(m0 + diag - left, 0)
            full_lo = tl.maximum(m0 + BLOCK_M - 1 + diag - left, 0)
        if HAS_RIGHT:
            hi = tl.minimum(m0 + BLOCK_M + diag + right, n_k)
            full_hi = tl.maximum(tl.minimum(m0 + diag + right + 1, n_k), 0)
        hi = tl.maximum(hi, lo)  # a block that sees no key at all: every range empty
        lo = lo // BLOCK_N * BLOCK_N
        mid_lo = tl.minimum(tl.maximum((full_lo + BLOCK_N - 1) // BLOCK_N * BLOCK_N, lo), hi)
        mid_hi = tl.maximum(full_hi // BLOCK_N * BLOCK_N, mid_lo)
    else:
        # the plain loop: every key block, every one masked
        lo = 0
        mid_lo = n_k
        mid_hi = n_k
        hi = n_k

    # The two masked ranges step by BLOCK_N_EDGE (<= BLOCK_N, a divisor of it): on an edge,
    # narrower tiles compute fewer scores that the mask then throws away.
    if HAS_LEFT or not SKIP_MASKED:  # 1. the window's left edge
        acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, desc_k_edge, desc_v_edge, kv_row, lo, mid_lo,
                                        offs_m, n_k, diag, left, right, qk_scale,
                                        BLOCK_N_EDGE, True, HAS_LEFT, HAS_RIGHT, EXP2, PRECISION, False)
    if SKIP_MASKED:
        # 2. blocks every row sees in full: the hot loop, no mask
        acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, desc_k, desc_v, kv_row, mid_lo, mid_hi,
                                        offs_m, n_k, diag, left, right, qk_scale,
                                        BLOCK_N, False, HAS_LEFT, HAS_RIGHT, EXP2, PRECISION, WARP_SPECIALIZE,
                                        BLOCK_M, EMU)
        # 3. the diagonal, the window's right edge and the ragged end of the keys
        if EDGES:
            acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, desc_k_edge, desc_v_edge, kv_row, mid_hi, hi,
                                            offs_m, n_k, diag, left, right, qk_scale,
                                            BLOCK_N_EDGE, True, HAS_LEFT, HAS_RIGHT, EXP2, PRECISION, False)

    # epilogue: normalise once; a row that saw no key gives zeros and lse = -inf
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    if EXP2:
        lse = (m_i + tl.math.log2(l_safe)) * LN2  # m_i is in log2 units
    else:
        lse = m_i + tl.log(l_safe)
    lse = tl.where(seen, lse, float("-inf"))
    if WARP_SPECIALIZE:
        # Under warp specialization two warpgroups share the tile; masked pointer stores came
        # out wrong there (Triton 3.6, H100), the copy engine's stores are right.  Per-head
        # descriptors, built here, clip rows past n_q and columns past D (the lse rows need
        # n_q % 4 == 0: a descriptor's base is 16-byte aligned; the launcher checks).
        desc_lse = tl.make_tensor_descriptor(LSE, [n_q], [1], [BLOCK_M])
        desc_lse.store([m0], lse)
        desc_o = tl.make_tensor_descriptor(O, [n_q, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_M, D_PAD])
        desc_o.store([m0, 0], out.to(O.dtype.element_ty))
    else:
        row_ok = offs_m < n_q
        tl.store(LSE + offs_m, lse, mask=row_ok)
        offs_d = tl.arange(0, D_PAD)
        o_ptrs = O + offs_m.to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def _attn_fwd(Q, K, V, K_EDGE, V_EDGE, O, LSE, qk_scale, n_q, n_k, heads, kv_heads, left, right,
              HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_N_EDGE: tl.constexpr,
              HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, EXP2: tl.constexpr,
              SKIP_MASKED: tl.constexpr, EDGES: tl.constexpr, PAIRED: tl.constexpr, HOST_DESC: tl.constexpr,
              PRECISION: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, EMU: tl.constexpr):
    pid_bh = tl.program_id(1)
    b = pid_bh // heads
    h = pid_bh % heads
    kv_bh = b * kv_heads + h // (heads // kv_heads)  # GQA: the K/V head this head shares, no copy
    if HOST_DESC:
        # descriptors built on the host over the rows of all heads, (B·H·N, D): one set shared
        # by every program (cheap for the copy engine); this head's rows start at q_row / kv_row.
        # A key tile hanging past n_k reads the next head's rows: the mask gives them p = 0.
        desc_q, desc_k, desc_v, desc_k_edge, desc_v_edge = Q, K, V, K_EDGE, V_EDGE
        q_row = pid_bh * n_q
        kv_row = kv_bh * n_k
    else:
        # descriptors built here, per (batch, head), shape [n, D]: the copy engine zero-fills what
        # a tile reads past the sequence or past D.  No host work per launch (small problems).
        desc_q = tl.make_tensor_descriptor(Q + pid_bh.to(tl.int64) * n_q * HEAD_DIM, [n_q, HEAD_DIM],
                                           [HEAD_DIM, 1], [BLOCK_M, D_PAD])
        k_head = K + kv_bh.to(tl.int64) * n_k * HEAD_DIM
        v_head = V + kv_bh.to(tl.int64) * n_k * HEAD_DIM
        desc_k = tl.make_tensor_descriptor(k_head, [n_k, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_N, D_PAD])
        desc_v = tl.make_tensor_descriptor(v_head, [n_k, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_N, D_PAD])
        if BLOCK_N_EDGE == BLOCK_N:
            desc_k_edge, desc_v_edge = desc_k, desc_v
        else:
            desc_k_edge = tl.make_tensor_descriptor(k_head, [n_k, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_N_EDGE, D_PAD])
            desc_v_edge = tl.make_tensor_descriptor(v_head, [n_k, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_N_EDGE, D_PAD])
        q_row = 0
        kv_row = 0
    o_bh = O + pid_bh.to(tl.int64) * n_q * HEAD_DIM
    lse_bh = LSE + pid_bh.to(tl.int64) * n_q

    pid_m = tl.program_id(0)
    if PAIRED:
        # causal: query block i sees ~i key blocks.  Pair block i with block last - i, so that
        # every program does the same amount of work (and there are half as many programs).
        last = tl.cdiv(n_q, BLOCK_M) - 1
        _attn_fwd_block(desc_q, desc_k, desc_v, desc_k_edge, desc_v_edge, q_row, kv_row, o_bh, lse_bh,
                        last - pid_m, n_q, n_k, left, right, qk_scale, HEAD_DIM, D_PAD, BLOCK_M, BLOCK_N,
                        BLOCK_N_EDGE, HAS_LEFT, HAS_RIGHT, EXP2, SKIP_MASKED, EDGES, PRECISION, WARP_SPECIALIZE,
                        EMU)
        if pid_m < last - pid_m:
            _attn_fwd_block(desc_q, desc_k, desc_v, desc_k_edge, desc_v_edge, q_row, kv_row, o_bh, lse_bh,
                            pid_m, n_q, n_k, left, right, qk_scale, HEAD_DIM, D_PAD, BLOCK_M, BLOCK_N,
                            BLOCK_N_EDGE, HAS_LEFT, HAS_RIGHT, EXP2, SKIP_MASKED, EDGES, PRECISION,
                            WARP_SPECIALIZE, EMU)
    else:
        if HAS_RIGHT:
            # causal-like: the last query blocks see the most keys; launch them first so the
            # short ones fill the gaps at the end (less idle time in the last wave)
            pid_m = tl.num_programs(0) - 1 - pid_m
        _attn_fwd_block(desc_q, desc_k, desc_v, desc_k_edge, desc_v_edge, q_row, kv_row, o_bh, lse_bh,
                        pid_m, n_q, n_k, left, right, qk_scale, HEAD_DIM, D_PAD, BLOCK_M, BLOCK_N,
                        BLOCK_N_EDGE, HAS_LEFT, HAS_RIGHT, EXP2, SKIP_MASKED, EDGES, PRECISION, WARP_SPECIALIZE,
                        EMU)


def _scratch(size: int, alignment: int, stream):
    """Global memory for the tensor descriptors the kernel builds (128 bytes each, per program)."""
    return torch.empty(size, device="cuda", dtype=torch.int8)


def key_block_ranges(m_start, block_m, block_n, n_q, n_k, left=-1, right=-1):
    """The kernel's loop bounds for one query block, in Python (for figures, tests and exercises).

    Returns ``(lo, mid_lo, mid_hi, hi)``: keys ``[lo, mid_lo)`` and ``[mid_hi, hi)`` run with a
    mask, key blocks ``range(mid_lo, mid_hi, block_n)`` without one; every other key is never
    loaded.  The kernel walks the two masked ranges in tiles of ``min(block_n, block_m)`` keys
    (``BLOCK_N_EDGE``).  Same arithmetic as ``_attn_fwd_block``.
    """
    diag = n_k - n_q
    lo, hi, full_lo, full_hi = 0, n_k, 0, n_k
    if left >= 0:
        lo = max(m_start + diag - left, 0)                       # the first row's first key
        full_lo = max(m_start + block_m - 1 + diag - left, 0)    # the last row's first key
    if right >= 0:
        hi = min(m_start + block_m + diag + right, n_k)          # past the last row's last key
        full_hi = max(min(m_start + diag + right + 1, n_k), 0)   # past the first row's last key
    hi = max(hi, lo)
    lo = lo // block_n * block_n
    mid_lo = min(max(-(-full_lo // block_n) * block_n, lo), hi)
    mid_hi = max(full_hi // block_n * block_n, mid_lo)
    return lo, mid_lo, mid_hi, hi


# ----------------------------------------------------------------------------------------
# Variants (the chapter's steps) and launch configurations
# ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Variant:
    """Which of the chapter's ideas a launch uses (the final kernel uses all of them)."""

    name: str = "triton"
    exp2: bool = True          # scale folded into exp2
    skip_masked: bool = True   # loop bounds per query block, masks only on boundary blocks
    space: str = "pipelined"   # 'fixed' | 'tuned' (tiles, warps) | 'pipelined' (+ num_stages)


FINAL = Variant()

#: Where the tensor descriptors are built.  On the host (one set, passed as kernel parameters,
#: shared by all programs) the copy engine's descriptor cache always hits, which pays on long
#: loops (+20% measured at one pipeline stage); but encoding them costs ~40 µs of Python per
#: launch.  Built in the kernel (per head) costs no host time: better for small problems.
HOST_DESC_MIN_FLOPS = 2 ** 33
#: what a launch configuration holds (``paired``: causal blocks i and last-i share a program;
#: ``emu``: 1 computes half of the exponentials on the FMA units; ``edge``: the width of the
#: masked edge tiles, default min(BLOCK_N, BLOCK_M))
CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "ws", "paired", "emu", "edge")
#: the one configuration of the untuned steps (no software pipelining: one stage)
FIXED_CONFIG = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=1, ws=False)
#: the interpreter runs one numpy op per tile operation: small tiles keep it quick
CPU_CONFIG = dict(BLOCK_M=16, BLOCK_N=16, num_warps=1, num_stages=1, ws=False)


def head_dim_pad(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _smem_limit() -> int:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return int(getattr(props, "shared_memory_per_block_optin", 0) or 99 * 1024)


def candidate_configs(space: str, d_pad: int, itemsize: int, n_q: int | None = None) -> list[dict]:
    """The pruned search space of the tuner (tutorial-style rules, plus a shared-memory budget)."""
    if space == "fixed":
        return [dict(FIXED_CONFIG)]
    # 'pipelined' keeps num_stages=1 in the race: one stage frees shared memory for a second
    # resident program per SM, which overlaps the two programs' loads and math instead
    stages = (1,) if space == "tuned" else (1, 2, 3, 4)
    block_ms = (64, 128, 256) if d_pad <= 64 else (64, 128)
    smem = _smem_limit() if ON_GPU else 228 * 1024
    out = []
    for bm in block_ms:
        for bn in (32, 64, 128):
            for w in (4, 8):
                for s in stages:
                    if w == 8 and (bm < 128 or (bm * bn < 128 * 128 and d_pad > 64)):
                        continue                          # too little work per warp(group)
                    if bm * d_pad // (32 * w) > 128:      # acc alone would spill registers
                        continue
                    if (bm * d_pad + max(s, 1) * 2 * bn * d_pad) * itemsize > smem - 8 * 1024:
                        continue
                    if n_q is not None and bm > 64 and bm >= 2 * triton.next_power_of_2(n_q):
                        continue                          # mostly padding rows
                    out.append(dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s, ws=False))
    return out


def default_config(space: str, d_pad: int, n_q: int, mask: str = "none") -> dict:
    """What runs when a key was never tuned and tuning is off (FA_LAB_TRITON_AUTOTUNE=0), and for exact fp32.

    The H100 winners of the recorded tuning (fa_lab/data/gpu_ch4.json), generalised by head dim.
    """
    if space == "fixed":
        return dict(FIXED_CONFIG)
    if d_pad >= 256:
        cfg = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2, ws=False)
    elif d_pad == 128:
        cfg = dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=1, ws=False)
    else:
        cfg = dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=2, ws=False, paired=mask == "causal")
    if space == "tuned":
        cfg.update(num_stages=1, paired=False)
    return cfg


def _bucket(n: int) -> int:
    """Sequence lengths share a tuned config within a power of two (64 .. 65536)."""
    return min(max(1 << (n - 1).bit_length(), 64), 65536)


def config_key(spec, dtype: torch.dtype, space: str) -> str:
    """(dtype, head dim, sequence-length buckets, mask, variant space): one tuned config each."""
    name = str(dtype).replace("torch.", "")
    return (f"{name}|d{head_dim_pad(spec.head_dim)}|q{_bucket(spec.n_q)}|k{_bucket(spec.n_k)}"
            f"|{spec.mask}|{space}")


class ConfigCache:
    """Winning launch configs per device and key, from two JSON files.

    ``fa_lab/data/triton_fwd_configs.json`` ships with the package (tuned on the GPUs the
    book was recorded on); the user file (``$FA_LAB_CACHE_DIR`` or ``~/.cache/fa_lab``)
    collects what this machine tuned, so a notebook re-run does not tune again.
    """

    SHIPPED = DATA_DIR / "triton_fwd_configs.json"

    def __init__(self):
        cache_dir = os.environ.get("FA_LAB_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "fa_lab")
        self.user_path = Path(cache_dir) / "triton_fwd_configs.json"
        self._lock = threading.Lock()
        self._shipped = self._read(self.SHIPPED)
        self._user = self._read(self.user_path)

    @staticmethod
    def _read(path: Path) -> dict:
        try:
            return json.loads(path.read_text()).get("configs", {})
        except (OSError, ValueError):
            return {}

    def get(self, device: str, key: str) -> dict | None:
        for table in (self._user, self._shipped):
            cfg = table.get(device, {}).get(key)
            if cfg is not None:
                return {k: cfg[k] for k in CONFIG_KEYS if k in cfg}
        return None

    def put(self, device: str, key: str, cfg: dict) -> None:
        with self._lock:
            self._user.setdefault(device, {})[key] = cfg
            try:
                self.user_path.parent.mkdir(parents=True, exist_ok=True)
                tmp = self.user_path.with_suffix(".tmp")
                tmp.write_text(json.dumps({"configs": self._user}, indent=1, sort_keys=True))
                tmp.replace(self.user_path)
            except OSError:
                pass  # a read-only home: the result still lives for this process

    def user_entries(self) -> dict:
        return self._user


CACHE = ConfigCache()
#: (key, config, median ms) of every candidate the tuner timed in this process
TUNING_LOG: list[dict] = []


def _autotune_enabled() -> bool:
    return os.environ.get("FA_LAB_TRITON_AUTOTUNE", "1").strip() not in ("0", "false", "no")


def _precompile(launch, candidates: list[dict]) -> None:
    """Compile the candidates side by side (most of a compile is ptxas, a separate process).

    Through Triton's ``AsyncCompileMode``: the launches (argument binding, cache keys) stay
    on this thread and only the compile jobs go to the pool.  Calling ``warmup`` from several
    threads at once is not something Triton's JIT supports.
    """
    from concurrent.futures import ThreadPoolExecutor

    if not hasattr(triton, "AsyncCompileMode"):  # older Triton: compile one by one when timed
        return
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool, \
            triton.AsyncCompileMode(pool, ignore_errors=True):
        for cfg in candidates:
            try:
                launch(cfg, warmup=True)
            except Exception:  # reported when the candidate is timed
                pass


def _tune(launch, candidates: list[dict], key: str, *, refine: tuple = ()) -> dict:
    """Time every candidate on the real inputs and keep the fastest.

    Candidates that fail to compile (out of shared memory or registers) are skipped.  Each
    dict in ``refine`` is tried on top of the three fastest (e.g. ``{"paired": True}``).
    The three best are then timed again, longer, and the fastest of that run wins.
    """
    from triton.testing import do_bench

    def time_all(cfgs):
        _precompile(launch, cfgs)
        for cfg in cfgs:
            try:
                launch(cfg)
                ms = do_bench(lambda: launch(cfg), warmup=5, rep=25)
            except Exception as exc:
                TUNING_LOG.append(dict(key=key, **cfg, ms=None, error=f"{type(exc).__name__}: {str(exc)[:160]}"))
                continue
            TUNING_LOG.append(dict(key=key, **cfg, ms=ms))
            timed.append((ms, cfg))

    timed = []
    time_all(candidates)
    for extra in refine:
        # not on top of a warp-specialized config: Triton's pass fails on those combinations
        time_all([dict(cfg, **extra) for _, cfg in sorted(timed, key=lambda t: t[0])[:3] if not cfg.get("ws")])
    if not timed:
        raise RuntimeError(f"no launch configuration compiled for {key}")
    # The top three again, in interleaved rounds: a 25 ms sample of one candidate can be off
    # by 5%, and under sustained load the clock drifts down, which would favour whichever
    # finalist happened to be timed first.  The median of each one's rounds decides.
    from fa_lab.bench.timer import time_interleaved

    finalists = [cfg for _, cfg in sorted(timed, key=lambda t: t[0])[:3]]
    rounds = time_interleaved({i: functools.partial(launch, cfg) for i, cfg in enumerate(finalists)},
                              rounds=6, gpu_ms=(5, 40))
    ms, best = min(((rounds[i]["ms"], cfg) for i, cfg in enumerate(finalists)), key=lambda t: t[0])
    TUNING_LOG.append(dict(key=key, **best, ms=ms, final=True))
    return dict(best, ms=ms)


# ----------------------------------------------------------------------------------------
# The wrapper
# ----------------------------------------------------------------------------------------

def check_supported(spec, dtype: torch.dtype) -> None:
    """ValueError for what the Triton kernels cannot do (the registry checks dtype and D range)."""
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"triton kernels support float16, bfloat16 and float32, got {dtype}")
    if spec.head_dim_v != spec.head_dim:
        raise ValueError(f"triton kernels need v's head dim equal to q's ({spec.head_dim}), got {spec.head_dim_v}")
    lo, hi = HEAD_DIMS
    if not lo <= spec.head_dim <= hi:
        raise ValueError(f"triton kernels support head dims {lo}..{hi}, got {spec.head_dim}")
    align = 16 // dtype.itemsize
    if spec.head_dim % align:
        raise ValueError(f"triton kernels need head_dim to be a multiple of {align} for {dtype} "
                         f"(rows of 16 bytes for the tensor-descriptor copies), got {spec.head_dim}")


@dataclass(frozen=True, eq=False)  # eq=False: hashed by identity, one object per problem (lru_cache)
class _Problem:
    """What a launch depends on apart from the tensors, worked out once per distinct problem."""

    qk_scale: float
    host_desc: bool
    constexprs: tuple   # (name, value) of the problem's tl.constexpr arguments
    ws_ok: bool         # whether a warp-specialized configuration can run it (ws_fits_problem)
    #: (config as a tuple) -> (grid, constexpr values by name): a repeated launch looks them up
    launches: dict = field(default_factory=dict)

    def launch_meta(self, cfg: dict, n_q: int, n_k: int, batch_heads: int):
        """Grid and constexpr arguments of one launch configuration (cached per config)."""
        cfg_key = tuple(cfg.get(name) for name in CONFIG_KEYS)
        found = self.launches.get(cfg_key)
        if found is None:
            statics = dict(self.constexprs)
            bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
            paired = bool(cfg.get("paired", False))
            n_blocks = triton.cdiv(n_q, bm)
            grid = ((n_blocks + 1) // 2 if paired else n_blocks, batch_heads)
            edge = cfg.get("edge") or min(bn, bm)
            if bn % edge:
                raise ValueError(f"config 'edge' ({edge}) must divide BLOCK_N ({bn})")
            # no mask and whole key tiles: the masked ranges are empty, and compiling the hot
            # loop alone leaves the compiler free to warp-specialize it
            edges = statics["HAS_LEFT"] or statics["HAS_RIGHT"] or n_k % bn != 0
            ws = bool(cfg.get("ws", False))
            if ws:
                if not self.ws_ok:
                    raise ValueError("config ws=True cannot run this problem: warp specialization needs n_q % 4 "
                                     f"== 0 (lse goes out through a 16-byte aligned tensor descriptor; n_q={n_q}) "
                                     "and, on Hopper, an unmasked 16-bit problem with D_PAD = 128 whose keys fill "
                                     "whole 128-key tiles")
                # warp specialization needs the descriptors built in the kernel (with host
                # descriptors Triton 3.6 hung on an H100), and stores O and lse through them
                statics["HOST_DESC"] = False
            meta = dict(statics, BLOCK_M=bm, BLOCK_N=bn, BLOCK_N_EDGE=edge, EDGES=edges, PAIRED=paired,
                        WARP_SPECIALIZE=ws,
                        EMU=bool(cfg.get("emu", False)) and statics["EXP2"])
            found = self.launches[cfg_key] = (grid, meta, cfg_key)
        return found


@functools.lru_cache(maxsize=1024)
def _problem(spec, dtype: torch.dtype, variant: Variant, precision: str, host_desc: bool | None) -> _Problem:
    """Checks and launch constants of one problem: a repeated call (a decode loop, a benchmark)
    costs a dictionary lookup here instead of the whole check (per-call host time is what
    small problems are made of)."""
    check_supported(spec, dtype)
    if precision not in ("ieee", "tf32"):
        raise ValueError(f"precision must be 'ieee' or 'tf32', got {precision!r}")
    work = torch.float32 if (not ON_GPU and dtype == torch.bfloat16) else dtype
    scale = abs(spec.scale)
    if host_desc is None:
        host_desc = ON_GPU and 4 * spec.batch * spec.heads * spec.n_q * spec.n_k * spec.head_dim >= HOST_DESC_MIN_FLOPS
    constexprs = (("HEAD_DIM", spec.head_dim), ("D_PAD", head_dim_pad(spec.head_dim)),
                  ("HAS_LEFT", spec.left >= 0), ("HAS_RIGHT", spec.right >= 0), ("EXP2", variant.exp2),
                  ("SKIP_MASKED", variant.skip_masked), ("HOST_DESC", host_desc),
                  ("PRECISION", precision if work == torch.float32 else None))
    major = _device_facts(_device_index(spec))[1] if ON_GPU else 0
    return _Problem(scale * LOG2E if variant.exp2 else scale, host_desc, constexprs,
                    ws_fits_problem(spec, work, major))


def prepare_inputs(q, k, v, spec):
    """Contiguous, 16-byte aligned inputs in the dtype the kernel computes in, and the scale.

    The Triton interpreter (CPU world) cannot do bfloat16 arithmetic (``tl.dot`` on bf16
    returns garbage there), so on the CPU, and only there, bf16 inputs are upcast to fp32.
    A negative scale is moved onto q: the kernel's max trick assumes ``scale >= 0``.
    """
    work = torch.float32 if (not ON_GPU and q.dtype == torch.bfloat16) else q.dtype
    scale = spec.scale
    if scale < 0:
        q, scale = -q, -scale

    def prep(t):
        if t.dtype != work or not t.is_contiguous():
            t = t.to(work).contiguous()
        return t if t.data_ptr() % 16 == 0 else t.clone()  # TMA needs a 16-byte aligned base

    return prep(q), prep(k), prep(v), scale, work


#: (problem, launch config, device) -> the compiled kernel bound to its grid.  On a GPU a
#: repeated launch calls it directly: Triton's JIT entry point re-derives the specialisation
#: key from every argument on every call, which costs more host time than the launch itself
#: at small sizes.  Every argument the key depends on is fixed by the problem (shapes, masks)
#: or by ``prepare_inputs`` (16-byte aligned pointers), so the cached kernel is the one the
#: JIT would pick.
_COMPILED: dict[tuple, object] = {}
#: the names of ``_attn_fwd``'s constexpr arguments, in signature order (all after ``right``)
_PARAMS = tuple(inspect.signature(getattr(_attn_fwd, "fn", _attn_fwd)).parameters)
_CONSTEXPR_ORDER = _PARAMS[_PARAMS.index("right") + 1:]


def make_launcher(q, k, v, spec, *, variant: Variant = FINAL, precision: str = "ieee", host_desc: bool | None = None):
    """Check and prepare the inputs once; return ``(launch, o, lse, work_dtype)``.

    ``launch(cfg)`` runs the kernel with one launch configuration (a dict with BLOCK_M,
    BLOCK_N, num_warps, num_stages and optionally ``paired``), writing into ``o`` and ``lse``;
    the tuner calls it once per candidate.  ``host_desc`` picks where the tensor descriptors
    are built (default: on the host for problems of at least ``HOST_DESC_MIN_FLOPS``).
    """
    problem = _problem(spec, q.dtype, variant, precision, host_desc)
    q_, k_, v_, _, work = prepare_inputs(q, k, v, spec)
    B, H, Hkv, Nq, Nk, D = spec.batch, spec.heads, spec.kv_heads, spec.n_q, spec.n_k, spec.head_dim
    o = torch.empty((B, H, Nq, D), dtype=work, device=q.device)
    lse = torch.empty((B, H, Nq), dtype=torch.float32, device=q.device)
    rest = (o, lse, problem.qk_scale, Nq, Nk, H, Hkv, spec.left, spec.right)

    def launch(cfg, warmup=False):
        grid, meta, cfg_key = problem.launch_meta(cfg, Nq, Nk, B * H)
        bm, bn, bn_edge, d_pad = meta["BLOCK_M"], meta["BLOCK_N"], meta["BLOCK_N_EDGE"], meta["D_PAD"]
        if meta["HOST_DESC"]:  # over the rows of all heads, (B·H·N, D)
            def rows(t, n, block):
                return TensorDescriptor(t.view(n, D), [n, D], [D, 1], [block, d_pad])
            desc_k, desc_v = rows(k_, B * Hkv * Nk, bn), rows(v_, B * Hkv * Nk, bn)
            tensors = (rows(q_, B * H * Nq, bm), desc_k, desc_v,
                       *((desc_k, desc_v) if bn_edge == bn else
                         (rows(k_, B * Hkv * Nk, bn_edge), rows(v_, B * Hkv * Nk, bn_edge))))
        else:
            tensors = (q_, k_, v_, k_, v_)  # the kernel builds its descriptors (edge tiles too)
            if ON_GPU:
                triton.set_allocator(_scratch)  # a context variable: set it where the launch happens
        if warmup or not ON_GPU:
            kernel = _attn_fwd.warmup if warmup else _attn_fwd[grid]
            return kernel(*tensors, *rest, **meta, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                          **(dict(grid=grid) if warmup else {}))
        key = (problem, cfg_key, q.device.index)  # the problem fixes shapes, masks and dtype
        run = _COMPILED.get(key)
        if run is None:  # first launch: through the JIT (compiles or finds the kernel), then keep it
            compiled = _attn_fwd[grid](*tensors, *rest, **meta, num_warps=cfg["num_warps"],
                                       num_stages=cfg["num_stages"])
            # the compiled kernel's grid has all three dims; it takes every argument in
            # signature order, constexprs included
            _COMPILED[key] = (compiled[(*grid, 1)], tuple(meta[name] for name in _CONSTEXPR_ORDER))
            return compiled
        run, constexprs = run
        return run(*tensors, *rest, *constexprs)

    return launch, o, lse, work


def triton_forward(q, k, v, spec, *, variant: Variant = FINAL, config: dict | None = None,
                   precision: str = "ieee", candidates: list[dict] | None = None, retune: bool = False,
                   host_desc: bool | None = None):
    """FlashAttention-2 forward: ``(o, lse)``, o in q's dtype, lse float32 ``(B, H, Nq)`` (natural log).

    ``precision`` matters for float32 inputs only: ``'ieee'`` (exact fp32 products, the
    default) or ``'tf32'`` (Tensor Cores with a 10-bit mantissa: faster, ~1e-3 relative error).
    ``config`` forces a launch configuration (dict with BLOCK_M, BLOCK_N, num_warps, num_stages);
    ``retune=True`` tunes this key again (over ``candidates`` if given) and caches the winner.
    """
    launch, o, lse, work = make_launcher(q, k, v, spec, variant=variant, precision=precision, host_desc=host_desc)
    if config is None:
        config = choose_config(launch, spec, work, variant, precision, candidates=candidates, retune=retune)
    launch(config)
    return (o if o.dtype == q.dtype else o.to(q.dtype)), lse


#: (device, dtype, D, buckets, mask, space) -> config resolved in this process: the per-call fast path
_RESOLVED: dict[tuple, dict] = {}


def _device_index(spec) -> int:
    return spec.device.index if spec.device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _device_facts(index: int) -> tuple[str, int]:
    return torch.cuda.get_device_name(index), torch.cuda.get_device_capability(index)[0]


def choose_config(launch, spec, work: torch.dtype, variant: Variant, precision: str = "ieee", *,
                  candidates: list[dict] | None = None, retune: bool = False) -> dict:
    """CPU world: small fixed tiles.  GPU: the cached winner for this key, else tune (or a default)."""
    if not ON_GPU:
        return CPU_CONFIG
    if variant.space == "fixed":
        return FIXED_CONFIG
    space = variant.space + ("-tf32" if work == torch.float32 and precision == "tf32" else "")
    index = _device_index(spec)
    device, major = _device_facts(index)
    ws_fits = ws_fits_problem(spec, work, major)
    memo = (index, work, spec.head_dim, _bucket(spec.n_q), _bucket(spec.n_k), spec.mask, space, ws_fits)
    cfg = None if retune else _RESOLVED.get(memo)
    if cfg is not None:
        return cfg
    key = config_key(spec, work, space)
    cfg = None if retune else CACHE.get(device, key)
    if cfg is None:
        d_pad = head_dim_pad(spec.head_dim)
        # exact fp32 products run on the CUDA cores, not the Tensor Cores this chapter tunes for
        # (and their compiles are slow): they get the default unless asked to retune
        tensor_cores = work != torch.float32 or precision == "tf32"
        if retune or (_autotune_enabled() and tensor_cores):
            cands = list(candidates or candidate_configs(variant.space, d_pad, work.itemsize, spec.n_q))
            refine = []
            if candidates is None and variant.space == "pipelined":
                if major == 9 and ws_fits:
                    # Hopper, one unmasked key loop: Triton's warp specialization (a producer
                    # warpgroup issuing the copies, two consumer warpgroups splitting a 128-row
                    # tile, FlashAttention-3's layout) is correct in this case and can pay (at
                    # (1, 16, 16384, 128) +2% fp16 and +6% bf16 over the best 64-row tiles in the
                    # recorded tuning; .notes/probe_ws_*); with 64-key tiles or deeper pipelines it
                    # returned wrong rows, so only this configuration is tried.
                    cands.append(dict(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=2, ws=True))
                if spec.mask == "causal":
                    refine.append({"paired": True})
                if work.itemsize == 2:  # exponentials partly on the FMA units (P is 16-bit anyway)
                    refine.append({"emu": 1})
                if major >= 10:
                    # Triton's automatic warp specialization pays on Blackwell; on Hopper
                    # (Triton 3.6) it leaves this kernel unchanged, so it is not tried there.
                    refine.append({"ws": True})
            cfg = _tune(launch, cands, key, refine=tuple(refine))
            CACHE.put(device, key, cfg)
        else:
            cfg = default_config(variant.space, d_pad, spec.n_q, spec.mask)
    if cfg.get("ws") and not ws_fits:
        # a winner tuned on another problem of the same key (same length buckets) that this one
        # cannot run warp-specialized: the untuned default instead of a compile error
        cfg = default_config(variant.space, head_dim_pad(spec.head_dim), spec.n_q, spec.mask)
    _RESOLVED[memo] = cfg
    return cfg


def ws_fits_problem(spec, work: torch.dtype, major: int) -> bool:
    """Whether a warp-specialized configuration can run this problem: lse goes out through a
    tensor descriptor (n_q % 4 == 0), and on Hopper Triton 3.6 specializes only a single unmasked
    loop over whole key tiles (at D_PAD = 128 in 16 bits: the one case measured correct)."""
    if spec.n_q % 4:
        return False
    if major == 9:
        return (work.itemsize == 2 and head_dim_pad(spec.head_dim) == 128 and spec.mask == "none"
                and spec.n_k % 128 == 0)
    return True


def flash_attention(q, k, v, *, causal: bool = False, window=(-1, -1), scale=None,
                    precision: str = "ieee", return_lse: bool = False):
    """The Triton kernel as a function, with the fp32 precision choice exposed.

    Same contract as ``fa_lab.attention(..., impl="triton")``; ``precision='tf32'`` lets
    float32 inputs use the Tensor Cores (TF32) instead of exact fp32 products.
    """
    from fa_lab.core.registry import get
    from fa_lab.core.spec import make_spec
    from fa_lab.core.world import WORLD

    spec = make_spec(q, k, v, causal=causal, window=window, scale=scale)
    why = get("triton").unsupported(spec, WORLD)
    if why:
        raise ValueError(why)
    o, lse = triton_forward(q, k, v, spec, precision=precision)
    return (o, lse) if return_lse else o


register(
    "triton", chapter=4,
    description="FlashAttention-2 forward on Tensor Cores (Triton): TMA descriptors, exp2, masked blocks "
                "skipped, autotuned tiles and pipelining; fp32 runs exact (IEEE) products",
    dtypes=SUPPORTED_DTYPES, head_dims=HEAD_DIMS,
    extra_memory=lambda s: 4 * s.batch * s.heads * s.n_q,  # lse
    notes="fp32 uses IEEE products; fa_lab.kernels.triton.fwd.flash_attention(..., precision='tf32') for TF32. "
          "head_dim must be a multiple of 8 (fp16/bf16) or 4 (fp32).",
    tags=("triton", "tensor-cores"),
)(triton_forward)
