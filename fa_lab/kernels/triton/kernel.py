"""Chapter 4: the FlashAttention-2 forward kernel on Tensor Cores, in Triton (the @triton.jit code only).

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
* **Warp specialization** on Hopper, where the compiler can do it (one unmasked key loop, whole key
  tiles, descriptors built in the kernel): a producer warpgroup issues the copies and two consumer
  warpgroups share a 128-row tile; O and lse then go out through tensor descriptors.

Conventions (DESIGN.md): bottom-right causal, ``window=(left, right)``, grouped-query
attention by head arithmetic (``kv_head = head // group``; K and V are never copied per
query head), rows that see no key return zeros and ``lse = -inf``.

The regions marked ``# region: NAME`` are the excerpts chapter 4 prints
(``fa_lab.core.source.show``).  Launching, tuning and checking live in the sibling modules.
"""
from __future__ import annotations

import triton
import triton.language as tl

from fa_lab.kernels.triton.key_ranges import visible_range

LOG2E = 1.4426950408889634  # 1 / ln 2: exp(x) = exp2(x * LOG2E)
LN2 = tl.constexpr(0.6931471805599453)  # ln 2: lse = (m + log2 l) * LN2


@triton.jit
def exp_or_exp2(x, EXP2: tl.constexpr):
    """``exp2(x)`` when the scores are in log2 units (``EXP2``), else ``exp(x)``."""
    if EXP2:
        return tl.math.exp2(x)
    else:
        return tl.exp(x)


@triton.jit
def exp2_fma(x):
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
def exp2_split(x, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """exp2 of a score tile, every second column on the FMA units (FlashAttention-4's trick).

    At head dim 64 a Tensor Core finishes a tile's two products about as fast as the
    special-function unit finishes its exponentials (16 per clock per SM), so exp2 can
    become the bottleneck; half of them move to ``exp2_fma``.
    """
    even, odd = tl.split(tl.reshape(x, [BLOCK_M, BLOCK_N // 2, 2]))
    return tl.reshape(tl.join(tl.math.exp2(even), exp2_fma(odd)), [BLOCK_M, BLOCK_N])


@triton.jit
def attn_fwd_inner(acc, l_i, m_i, q, desc_k, desc_v, kv_row, start, stop,
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
            p = exp_or_exp2(s - m_sub[:, None], EXP2=EXP2)
            alpha = exp_or_exp2(m_i - m_sub, EXP2=EXP2)
        else:
            # Every row sees every key of this block: no mask, and the scale rides on the
            # max and the subtraction (one FMA per score).
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            if EMU:
                p = exp2_split(qk * qk_scale - m_ij[:, None], BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
            else:
                p = exp_or_exp2(qk * qk_scale - m_ij[:, None], EXP2=EXP2)
            alpha = exp_or_exp2(m_i - m_ij, EXP2=EXP2)
        l_ij = tl.sum(p, 1)
        if WARP_SPECIALIZE:
            # here, not after the second dot: under warp specialization this order (with the
            # literal loop bounds) measured 556 TFLOP/s against 524 without both, at
            # (1, 16, 16384, 128) fp16
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
def attn_fwd_block(desc_q, desc_k, desc_v, desc_k_edge, desc_v_edge, q_row, kv_row, O, LSE, pid_m, n_q, n_k,
                   left, right, qk_scale,
                   HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_N_EDGE: tl.constexpr,
                   HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, EXP2: tl.constexpr,
                   SKIP_MASKED: tl.constexpr, EDGES: tl.constexpr, PRECISION: tl.constexpr,
                   WARP_SPECIALIZE: tl.constexpr, EMU: tl.constexpr):
    """One BLOCK_M × D tile of the output of one (batch, head)."""
    # region: key-ranges
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
        lo, hi, full_lo, full_hi = visible_range(start=m0, n_rows=n_q, n_cols=n_k, left=left, right=right,
                                                 BLOCK=BLOCK_M, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT)
        hi = tl.maximum(hi, lo)  # a block that sees no key at all: every range empty
        # in whole BLOCK_N tiles: [lo, mid_lo) masked, [mid_lo, mid_hi) without a mask, [mid_hi, hi) masked
        lo = lo // BLOCK_N * BLOCK_N
        mid_lo = tl.minimum(tl.maximum((full_lo + BLOCK_N - 1) // BLOCK_N * BLOCK_N, lo), hi)
        mid_hi = tl.maximum(full_hi // BLOCK_N * BLOCK_N, mid_lo)
    else:
        # the plain loop: every key block, every one masked
        lo = 0
        mid_lo = n_k
        mid_hi = n_k
        hi = n_k
    # endregion: key-ranges

    # region: key-loops
    # The two masked ranges step by BLOCK_N_EDGE (<= BLOCK_N, a divisor of it): on an edge,
    # narrower tiles compute fewer scores that the mask then throws away.
    if HAS_LEFT or not SKIP_MASKED:  # 1. the window's left edge
        acc, l_i, m_i = attn_fwd_inner(
            acc=acc, l_i=l_i, m_i=m_i, q=q, desc_k=desc_k_edge, desc_v=desc_v_edge, kv_row=kv_row,
            start=lo, stop=mid_lo, offs_m=offs_m, n_k=n_k, diag=diag, left=left, right=right, qk_scale=qk_scale,
            BLOCK_N=BLOCK_N_EDGE, MASKED=True, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT, EXP2=EXP2,
            PRECISION=PRECISION, WARP_SPECIALIZE=False)
    if SKIP_MASKED:
        # 2. blocks every row sees in full: the hot loop, no mask
        acc, l_i, m_i = attn_fwd_inner(
            acc=acc, l_i=l_i, m_i=m_i, q=q, desc_k=desc_k, desc_v=desc_v, kv_row=kv_row,
            start=mid_lo, stop=mid_hi, offs_m=offs_m, n_k=n_k, diag=diag, left=left, right=right, qk_scale=qk_scale,
            BLOCK_N=BLOCK_N, MASKED=False, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT, EXP2=EXP2,
            PRECISION=PRECISION, WARP_SPECIALIZE=WARP_SPECIALIZE, BLOCK_M=BLOCK_M, EMU=EMU)
        # 3. the diagonal, the window's right edge and the ragged end of the keys
        if EDGES:
            acc, l_i, m_i = attn_fwd_inner(
                acc=acc, l_i=l_i, m_i=m_i, q=q, desc_k=desc_k_edge, desc_v=desc_v_edge, kv_row=kv_row,
                start=mid_hi, stop=hi, offs_m=offs_m, n_k=n_k, diag=diag, left=left, right=right, qk_scale=qk_scale,
                BLOCK_N=BLOCK_N_EDGE, MASKED=True, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT, EXP2=EXP2,
                PRECISION=PRECISION, WARP_SPECIALIZE=False)
    # endregion: key-loops

    # region: epilogue
    # normalise once; a row that saw no key gives zeros and lse = -inf
    # l_i != 0 rather than > 0: a NaN row stays NaN (NaN in, NaN out) instead of reading as empty
    seen = l_i != 0.0
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
    # endregion: epilogue


@triton.jit
def attn_fwd(Q, K, V, K_EDGE, V_EDGE, O, LSE, qk_scale, n_q, n_k, heads, kv_heads, left, right,
             HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_N_EDGE: tl.constexpr,
             HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, EXP2: tl.constexpr,
             SKIP_MASKED: tl.constexpr, EDGES: tl.constexpr, PAIRED: tl.constexpr, HOST_DESC: tl.constexpr,
             PRECISION: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, EMU: tl.constexpr):
    """The forward kernel: grid (query blocks, or pairs of them; batch · heads)."""
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
        first = last - pid_m
    elif HAS_RIGHT:
        # causal-like: the last query blocks see the most keys; launch them first so the
        # short ones fill the gaps at the end (less idle time in the last wave)
        first = tl.num_programs(0) - 1 - pid_m
    else:
        first = pid_m
    # one block, or a pair: a pair's second block is pid_m, unless that is `first` itself (the middle
    # one of an odd count).  A loop at run time, not unrolled: unrolled, the block's code (three key
    # loops) is compiled twice, and at D = 256 that doubled the first call's compile time for the
    # same speed (docs/decisions/paired-blocks-loop.md)
    n_blocks = 1
    if PAIRED:
        n_blocks += (pid_m < first).to(tl.int32)
    for t in range(n_blocks):
        attn_fwd_block(desc_q=desc_q, desc_k=desc_k, desc_v=desc_v, desc_k_edge=desc_k_edge,
                       desc_v_edge=desc_v_edge, q_row=q_row, kv_row=kv_row, O=o_bh, LSE=lse_bh,
                       pid_m=tl.where(t == 0, first, pid_m), n_q=n_q, n_k=n_k, left=left, right=right,
                       qk_scale=qk_scale, HEAD_DIM=HEAD_DIM, D_PAD=D_PAD, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                       BLOCK_N_EDGE=BLOCK_N_EDGE, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT, EXP2=EXP2,
                       SKIP_MASKED=SKIP_MASKED, EDGES=EDGES, PRECISION=PRECISION,
                       WARP_SPECIALIZE=WARP_SPECIALIZE, EMU=EMU)
