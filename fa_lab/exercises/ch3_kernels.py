"""Chapter 3 kernel exercises, in Numba CUDA (the simulator in the CPU world, a GPU in the other).

4. ``ch3_tiled_kernel`` one thread per query row, a block of BLOCK_M rows stages each K/V tile in
                        shared memory; graded on the values and, in the simulator, on K and V being
                        loaded from global memory once per query block (``sim_counts.KVLoads``);
5. ``ch3_causal_skip``  the same kernel looping only over the key tiles its rows can see under the
                        causal mask; graded on the K/V loads of exactly those tiles.

They put together the warm-ups of ``ch3`` (one tile's mask, the key tiles a block visits, one
tile's online-softmax update).  The kernel exercises are judged by the float64 reference; their
model answers (a kernel a learner would write, and its launchers) are ``tiled_attention_numba``
and ``causal_skip_numba`` below.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from numba import cuda, float32

import fa_lab.exercises.ch3  # noqa: F401  (the chapter's warm-ups register first: names() keeps the book's order)
from fa_lab.core.reference import reference_attention
from fa_lab.core.spec import make_spec
from fa_lab.core.world import DEVICE, pick
from fa_lab.core.reference import attention_from_scores
from fa_lab.exercises.registry import Case, Exercise, Mistake, register_exercise
from fa_lab.exercises.sim_counts import KVLoads


def attention_heads(q, k, v, causal=False):
    """The judge of the kernels: ``(o, lse)`` of q ``(H, Nq, D)`` against k, v ``(Hkv, Nk, D)``.

    Query head h reads K/V head h // (H // Hkv); bottom-right causal; lse in natural log; a row
    that sees no key gets o = 0 and lse = -inf.
    """
    q4, k4, v4 = q[None], k[None], v[None]
    o, lse = reference_attention(q4, k4, v4, make_spec(q4, k4, v4, causal=causal))
    return o[0].to(q.dtype), lse[0].to(q.dtype)


# --------------------------------------------------------------------------- the model answer, as a learner writes it

BLOCK_M = pick(cpu=4, gpu=64)   # query rows per block: one thread per row
BLOCK_N = pick(cpu=4, gpu=32)   # keys per K/V tile in shared memory
D_MAX = 64                      # shared and local arrays are sized when the kernel compiles


@cuda.jit
def _tiled_kernel(Q, K, V, O, LSE, group, scale, causal, skip):
    # grid = (query blocks, heads); thread tid of block x owns query row i = x * BLOCK_M + tid
    h = cuda.blockIdx.y
    hk = h // group                       # grouped-query attention: the K/V head of query head h
    tid = cuda.threadIdx.x
    m_start = cuda.blockIdx.x * BLOCK_M
    i = m_start + tid
    n_q, n_k, d_head = Q.shape[1], K.shape[1], Q.shape[2]
    shift = n_k - n_q                     # bottom-right: query i sits at key i + n_k - n_q

    k_tile = cuda.shared.array((BLOCK_N, D_MAX), float32)
    v_tile = cuda.shared.array((BLOCK_N, D_MAX), float32)
    q_i = cuda.local.array(D_MAX, float32)
    acc = cuda.local.array(D_MAX, float32)
    s = cuda.local.array(BLOCK_N, float32)

    for d in range(d_head):
        q_i[d] = Q[h, i, d] * scale if i < n_q else float32(0.0)
        acc[d] = float32(0.0)
    m_i = float32(-math.inf)
    l_i = float32(0.0)

    stop = n_k
    if skip and causal:                   # the block's last row sees the furthest; one stop for every thread
        m_end = min(m_start + BLOCK_M, n_q)
        stop = min(n_k, m_end + shift)

    for n_start in range(0, stop, BLOCK_N):
        cuda.syncthreads()                # nobody still reads the previous tile
        for e in range(tid, BLOCK_N * d_head, BLOCK_M):    # the block copies the tile together
            c, d = e // d_head, e % d_head
            if n_start + c < n_k:
                k_tile[c, d] = K[hk, n_start + c, d]
                v_tile[c, d] = V[hk, n_start + c, d]
        cuda.syncthreads()                # the whole tile is in shared memory
        if i < n_q:
            n_valid = min(BLOCK_N, n_k - n_start)
            m_new = m_i
            for c in range(n_valid):
                x = float32(-math.inf)
                if not causal or n_start + c <= i + shift:
                    x = float32(0.0)
                    for d in range(d_head):
                        x += q_i[d] * k_tile[c, d]
                s[c] = x
                m_new = max(m_new, x)
            m_use = m_new if m_new > float32(-math.inf) else float32(0.0)   # nothing visible yet: no NaN
            alpha = math.exp(m_i - m_use)
            l_i *= alpha
            for d in range(d_head):
                acc[d] *= alpha
            for c in range(n_valid):
                p = math.exp(s[c] - m_use)
                l_i += p
                for d in range(d_head):
                    acc[d] += p * v_tile[c, d]
            m_i = m_new

    if i < n_q:
        sees = l_i > float32(0.0)
        inv = float32(1.0) / l_i if sees else float32(0.0)
        for d in range(d_head):
            O[h, i, d] = acc[d] * inv
        LSE[h, i] = m_i + math.log(l_i) if sees else float32(-math.inf)


def _numba_array(t):
    # a view the kernel can write through: the GPU buffer itself, or the CPU tensor's memory for the simulator
    return cuda.as_cuda_array(t) if t.is_cuda else t.numpy()


def _launch(q, k, v, causal, skip):
    heads, n_q, d_head = q.shape
    if d_head > D_MAX:
        raise ValueError(f"head dim {d_head} is larger than D_MAX = {D_MAX}")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = torch.empty_like(q)
    lse = torch.empty(heads, n_q, dtype=torch.float32, device=q.device)
    grid = (math.ceil(n_q / BLOCK_M), heads)
    _tiled_kernel[grid, BLOCK_M](_numba_array(q), _numba_array(k), _numba_array(v), _numba_array(o),
                                 _numba_array(lse), heads // k.shape[0], np.float32(1.0 / math.sqrt(d_head)),
                                 bool(causal), skip)
    return o, lse


def tiled_attention_numba(q, k, v, causal=False):
    """A model answer of ``ch3_tiled_kernel``: every key tile, masked element by element."""
    return _launch(q, k, v, causal, skip=False)


def causal_skip_numba(q, k, v, causal=False):
    """A model answer of ``ch3_causal_skip``: the same kernel, stopping at the block's last visible tile."""
    return _launch(q, k, v, causal, skip=True)


# --------------------------------------------------------------------------- cases

def _kernel_case(g, heads, kv_heads, n_q, n_k, d, causal, structure, note):
    q = torch.randn(heads, n_q, d, generator=g).to(DEVICE)
    k, v = (torch.randn(kv_heads, n_k, d, generator=g).to(DEVICE) for _ in range(2))
    gqa = f"/{kv_heads}" if kv_heads != heads else ""
    label = f"H={heads}{gqa} Nq={n_q} Nk={n_k} D={d} causal={causal} — {note}"
    return Case(label, (q, k, v), dict(causal=causal),
                meta=dict(n_q=n_q, n_k=n_k, causal=causal, block_m=BLOCK_M, block_n=BLOCK_N, structure=structure))


def _tiled_cases(seed):
    g = torch.Generator().manual_seed(seed)
    long_k = pick(cpu=101, gpu=4097) + int(torch.randint(0, 8, (1,), generator=g))
    specs = pick(  # heads, kv_heads, n_q, n_k, d, causal, structure, note
        cpu=[(1, 1, 8, 8, 8, False, True, "no mask, two query blocks"),
             (2, 2, 13, 13, 12, True, True, "causal, tails: 13 = 3 tiles + 1; D = 12"),
             (1, 1, 5, 19, 8, True, False, "causal, Nq < Nk: bottom-right, the last query sees every key"),
             (2, 2, 11, 6, 8, True, False, "causal, Nq > Nk: queries 0-4 see no key"),
             (4, 2, 6, 9, 8, True, True, "GQA: 4 query heads share 2 K/V heads"),
             (1, 1, 6, long_k, 4, False, False, "many key tiles"),
             (1, 1, 1, 1, 8, True, False, "N = 1")],
        gpu=[(8, 8, 1024, 1024, 64, False, False, "no mask"),
             (8, 8, 1037, 1037, 12, True, False, "causal, tails; D = 12"),
             (8, 8, 700, 2300, 64, True, False, "causal, Nq < Nk: bottom-right"),
             (8, 8, 1500, 900, 64, True, False, "causal, Nq > Nk: queries 0-599 see no key"),
             (8, 2, 4096, 4096, 64, True, False, "GQA: 8 query heads share 2 K/V heads"),
             (4, 4, 3, long_k, 64, False, False, "many key tiles"),
             (8, 8, 1, 1, 64, True, False, "N = 1")])
    return [_kernel_case(g, *spec) for spec in specs]


def _skip_cases(seed):
    g = torch.Generator().manual_seed(seed)
    specs = pick(
        cpu=[(1, 1, 16, 16, 8, True, True, "causal, Nq = Nk: query block b needs key tiles 0..b"),
             (2, 2, 13, 13, 12, True, True, "causal, tails; D = 12"),
             (1, 1, 8, 20, 8, True, True, "causal, Nq < Nk: bottom-right, each block sees 12 keys further"),
             (4, 2, 11, 6, 8, True, True, "causal, Nq > Nk, GQA: block 0 sees no key, so loads no tile"),
             (1, 1, 9, 9, 8, False, False, "no mask: every tile"),
             (1, 1, 1, 1, 8, True, False, "N = 1")],
        gpu=[(8, 8, 2048, 2048, 64, True, False, "causal, Nq = Nk"),
             (8, 8, 1037, 1037, 12, True, False, "causal, tails; D = 12"),
             (8, 8, 700, 2300, 64, True, False, "causal, Nq < Nk: bottom-right"),
             (8, 2, 1500, 900, 64, True, False, "causal, Nq > Nk, GQA: the first blocks see no key"),
             (8, 8, 1000, 1000, 64, False, False, "no mask: every tile, the last one a tail"),
             (8, 8, 1, 1, 64, True, False, "N = 1")])
    return [_kernel_case(g, *spec) for spec in specs]


# --------------------------------------------------------------------------- typical mistakes, in PyTorch

def _attention_variant(q, k, v, causal, *, top_left=False, scale=None, tail_visible=False, kv_mod=False,
                       stop_row=None):
    """Attention with one mistake built in (float64 inside, the inputs' dtype out)."""
    heads, n_q, d = q.shape
    kv_heads, n_k = k.shape[0], k.shape[1]
    kv = torch.arange(heads, device=q.device)
    kv = kv % kv_heads if kv_mod else kv // (heads // kv_heads)
    k64, v64 = k.double()[kv], v.double()[kv]
    n_cols = n_k
    if tail_visible:                      # the tail tile's zero padding scored like real keys
        n_cols = -(-n_k // BLOCK_N) * BLOCK_N
        pad = torch.zeros(heads, n_cols - n_k, d, dtype=torch.float64, device=q.device)
        k64, v64 = torch.cat([k64, pad], 1), torch.cat([v64, pad], 1)
    s = q.double() @ k64.transpose(1, 2) * (1.0 / math.sqrt(d) if scale is None else scale)
    i = torch.arange(n_q, device=q.device)[:, None]
    j = torch.arange(n_cols, device=q.device)[None, :]
    ok = torch.ones(n_q, n_cols, dtype=torch.bool, device=q.device)
    if causal:
        ok &= j <= i + (0 if top_left else n_k - n_q)
        if stop_row is not None:          # the tile loop stops early: keys past the last tile visited are never seen
            stop = stop_row(i // BLOCK_M * BLOCK_M, n_q, n_k)
            ok &= j < torch.where(stop > 0, (stop + BLOCK_N - 1) // BLOCK_N * BLOCK_N, 0)
    o, lse = attention_from_scores(s.masked_fill(~ok, float("-inf")), v64)
    return o.to(q.dtype), lse.to(q.dtype)


def _top_left(q, k, v, causal=False):
    return _attention_variant(q, k, v, causal, top_left=True)


def _no_scale(q, k, v, causal=False):
    return _attention_variant(q, k, v, causal, scale=1.0)


def _tail_visible(q, k, v, causal=False):
    return _attention_variant(q, k, v, causal, tail_visible=True)


def _kv_mod(q, k, v, causal=False):
    return _attention_variant(q, k, v, causal, kv_mod=True)


def _stop_first_row(q, k, v, causal=False):
    return _attention_variant(q, k, v, causal, stop_row=lambda m0, n_q, n_k: (m0 + n_k - n_q + 1).clamp(max=n_k))


def _stop_top_left(q, k, v, causal=False):
    return _attention_variant(q, k, v, causal,
                              stop_row=lambda m0, n_q, n_k: (m0 + BLOCK_M).clamp(max=min(n_q, n_k)))


KERNEL_MISTAKES = (
    Mistake("a top-left causal mask", _top_left,
            "query i sits at key i + Nk − Nq (bottom-right alignment): key j is visible when j <= i + Nk − Nq."),
    Mistake("the keys past Nk scored", _tail_visible,
            "the last tile runs past the end of the keys: score only its keys c < Nk − n_start (the padding "
            "must get no softmax weight)."),
    Mistake("the wrong K/V head", _kv_mod,
            "query head h reads K/V head h // (H // Hkv): consecutive query heads share a K/V head."),
    Mistake("the softmax scale left out", _no_scale, "the scores are q·k / sqrt(D)."),
)
SKIP_MISTAKES = (
    Mistake("the tile loop stops at the block's first row", _stop_first_row,
            "the last row of the block sees the furthest: stop at min(Nk, m_end + Nk − Nq) with "
            "m_end = min(m_start + BLOCK_M, Nq)."),
    Mistake("the tile loop's stop without the Nk − Nq shift", _stop_top_left,
            "bottom-right alignment: the block's last row m_end − 1 sees keys up to m_end − 1 + Nk − Nq."),
) + KERNEL_MISTAKES

TILED_HINTS = (
    "Picture a block as a team of BLOCK_M threads walking over the keys one tile at a time. Before anyone uses "
    "a tile, all of it must be in shared memory; before anyone overwrites it with the next tile, every thread "
    "must be done with it; and the last tile may run past the end of the keys. Which lines of your kernel "
    "guarantee each of these — for every thread of the block, including those whose row is past Nq?",
    "Thread tid copies elements e = tid, tid + BLOCK_M, … of the tile's BLOCK_N·D elements (c = e // D, "
    "d = e % D), only where n_start + c < Nk. cuda.syncthreads() after the copy, and one before the next "
    "copy, outside any `if` on the thread's row. Then the thread scores the tile's keys c < min(BLOCK_N, "
    "Nk − n_start) for its row i — key j = n_start + c is visible when j <= i + Nk − Nq under the causal "
    "mask — and folds them into (m_i, l_i, acc) as in ch3_tile_update. K/V head: h // (H // Hkv).",
    "for n_start in range(0, n_k, BLOCK_N):\n"
    "    cuda.syncthreads()\n"
    "    for e in range(tid, BLOCK_N * d_head, BLOCK_M):\n"
    "        c, d = e // d_head, e % d_head\n"
    "        if n_start + c < n_k:\n"
    "            k_tile[c, d] = K[hk, n_start + c, d]; v_tile[c, d] = V[hk, n_start + c, d]\n"
    "    cuda.syncthreads()\n"
    "    if i < n_q:\n"
    "        m_new = m_i\n"
    "        for c in range(min(BLOCK_N, n_k - n_start)):\n"
    "            x = -inf if causal and n_start + c > i + n_k - n_q else sum(q_i[d] * k_tile[c, d])  # q_i pre-scaled\n"
    "            s[c] = x; m_new = max(m_new, x)\n"
    "        m_use = m_new if m_new > -inf else 0;  alpha = exp(m_i - m_use);  l_i *= alpha;  acc[d] *= alpha\n"
    "        for c in range(min(BLOCK_N, n_k - n_start)):\n"
    "            p = exp(s[c] - m_use); l_i += p; acc[d] += p * v_tile[c, d]   # for every d\n"
    "        m_i = m_new\n"
    "Epilogue (i < n_q): if l_i > 0: O = acc / l_i, lse = m_i + log(l_i); else O = 0, lse = -inf.",
)
SKIP_HINTS = (
    "Under the causal mask, which is the furthest key any row of this block can see, and which row of the block "
    "sees it? And since the loop body holds cuda.syncthreads(), who must agree on how many tiles the loop runs?",
    "The block's rows are m_start … m_end − 1 with m_end = min(m_start + BLOCK_M, Nq); the last one sees keys "
    "j <= m_end − 1 + Nk − Nq. Loop over range(0, stop, BLOCK_N) with one stop for the whole block, computed "
    "from blockIdx.x (never from the thread's own row); keep the element-wise mask for the tile on the diagonal.",
    "m_end = min(m_start + BLOCK_M, n_q)\n"
    "stop = min(n_k, m_end + n_k - n_q) if causal else n_k\n"
    "for n_start in range(0, stop, BLOCK_N):\n"
    "    ...  # 3.4's loop body, unchanged\n"
    "A block whose rows see no key has stop <= 0 and runs no iteration: l_i stays 0, and the epilogue writes "
    "O = 0 and lse = -inf.",
)

register_exercise(Exercise(
    name="ch3_tiled_kernel", chapter=3, title="The tiled kernel: K/V tiles through shared memory (Numba CUDA)",
    signature="tiled_attention(q, k, v, causal=False) -> (o, lse)   # q (H, Nq, D), k/v (Hkv, Nk, D) float32; "
              "launches your @cuda.jit kernel",
    solution=attention_heads, model_answer=tiled_attention_numba, make_cases=_tiled_cases, kind="numba",
    outputs=("o", "lse"), judge_dtype=torch.float64, mistakes=KERNEL_MISTAKES, structure=(KVLoads(skip=False),),
    tile=(BLOCK_M, BLOCK_N), hint=TILED_HINTS[0], hints=TILED_HINTS,
))
register_exercise(Exercise(
    name="ch3_causal_skip", chapter=3, title="Skip the key tiles the causal mask hides (Numba CUDA)",
    signature="tiled_attention_skip(q, k, v, causal=False) -> (o, lse)   # as ch3_tiled_kernel; under causal, "
              "each block loads only the key tiles its rows can see",
    solution=attention_heads, model_answer=causal_skip_numba, make_cases=_skip_cases, kind="numba",
    outputs=("o", "lse"), judge_dtype=torch.float64, mistakes=SKIP_MISTAKES, structure=(KVLoads(skip=True),),
    tile=(BLOCK_M, BLOCK_N), hint=SKIP_HINTS[0], hints=SKIP_HINTS,
))
