"""Chapter 8 kernel exercises: the varlen schedule, then a packed forward that uses it, in Triton.

1. ``ch8_block_map`` — one program per query block of a packed batch, no program for padding:
   the learner's kernel maps each program id ``p`` of a 1-D grid to ``(sequence, first row of its
   block)``.  The grid is the bound the host knows without reading the lengths,
   ``(total + B·(BLOCK_M − 1)) // BLOCK_M`` programs; the ones past the last real block get
   ``(-1, -1)``.  Judged exactly against the plain-PyTorch table (``block_table``) on random length
   sets: empty sequences (first, last, in a row), one huge sequence among short ones, lengths
   that are no multiple of ``BLOCK_M``, every sequence empty.
2. ``ch8_varlen_kernel`` — the packed forward ``(o, lse)`` of flash-attn's varlen layout, from a
   skeleton whose online softmax is given: the learner locates the program's sequence and
   block (1.'s search), the sequence's rows in q, k and v, and masks at the sequence's edges and
   under its own bottom-right causal mask.  Judged by the float64 reference per sequence
   (``ch8.packed_reference``).

The model answers (kernels a learner would write, with their launchers) are ``block_map_triton``
and ``varlen_attention_triton``; fa_lab's own schedule is ``fa_lab.kernels.varlen.schedule``.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fa_lab.core.world import DEVICE, pick
from fa_lab.exercises.ch8 import packed_reference
from fa_lab.exercises.registry import Case, Exercise, Mistake, register_exercise

LOG2E = 1.4426950408889634


def n_programs(total: int, batch: int, block_m: int) -> int:
    """The grid: an upper bound of ``sum cdiv(L_b, block_m)`` that needs only the total and the batch."""
    return (total + batch * (block_m - 1)) // block_m


def log_steps(batch: int) -> int:
    """Halving steps a binary search over ``batch`` sequences needs: ``ceil(log2(batch))``."""
    return max(batch - 1, 1).bit_length()


# --------------------------------------------------------------------------- 1. the block map

def block_table(cu_seqlens, block_m, *, leading_zero=True, empty_gets_block=False, packed_blocks=False,
                index_not_row=False, leftovers_clamped=False):
    """``(seq, m0)`` int32 ``(n_programs,)``: program ``p`` works on rows ``m0[p] .. m0[p] + block_m - 1``
    of sequence ``seq[p]`` (``-1, -1`` past the last block).  Sequence by sequence, block by block.

    Each keyword set away from its default makes one classic mistake (``BLOCK_MISTAKES``).
    """
    cu = [int(x) for x in cu_seqlens.tolist()]
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    batch, total = len(lengths), cu[-1]
    programs = n_programs(total, batch, block_m)
    if packed_blocks:   # the packed tensor cut into blocks, blind to where sequences start
        pairs = []
        for p in range(math.ceil(total / block_m)):
            row = p * block_m
            b = max(i for i in range(batch) if cu[i] <= row and (lengths[i] > 0 or i == batch - 1))
            pairs.append((b, row - cu[b]))
    else:
        blocks = [max(1, -(-n // block_m)) if empty_gets_block else -(-n // block_m) for n in lengths]
        pairs = [(b, i * block_m) for b, n in enumerate(blocks) for i in range(n)]
        if not leading_zero:   # the running total alone: ends taken for starts, every label one sequence early
            ends = [sum(blocks[:b + 1]) for b in range(batch)]
            pairs = []
            for p in range(sum(blocks)):
                b = max([i for i in range(batch) if ends[i] <= p], default=-1)
                pairs.append((b, (p - ends[b]) * block_m) if b >= 0 else (-1, -1))
    if index_not_row:
        pairs = [(b, m // block_m) for b, m in pairs]
    pairs = pairs[:programs]
    fill = pairs[-1] if leftovers_clamped and pairs else (-1, -1)
    pairs += [fill] * (programs - len(pairs))
    seq = torch.tensor([b for b, _ in pairs], dtype=torch.int32).reshape(-1)
    m0 = torch.tensor([m for _, m in pairs], dtype=torch.int32).reshape(-1)
    return seq.to(cu_seqlens.device), m0.to(cu_seqlens.device)


def block_map(cu_seqlens, block_m):
    """``(seq, m0)`` of every program of the 1-D grid over a packed batch's query blocks (see the module).

    The judge (plain PyTorch); the learner writes it as a Triton kernel and its launcher.
    """
    return block_table(cu_seqlens, block_m)


@triton.jit
def find_sequence(CU_BLOCKS, pid, n_seqs, LOG_B: tl.constexpr):
    """The sequence ``b`` whose blocks hold program ``pid``, ``CU_BLOCKS[b] <= pid < CU_BLOCKS[b + 1]``; -1 past
    the last block.  A binary search for the last ``b`` with ``CU_BLOCKS[b] <= pid``: an empty sequence has
    ``CU_BLOCKS[b] == CU_BLOCKS[b + 1]``, so the one after it is always later, and never chosen over it."""
    lo = tl.full([], 0, tl.int32)
    hi = lo + n_seqs - 1
    for _ in tl.static_range(LOG_B):
        mid = (lo + hi + 1) // 2
        go = tl.load(CU_BLOCKS + mid) <= pid
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid - 1)
    return tl.where(pid < tl.load(CU_BLOCKS + n_seqs), lo, -1)


@triton.jit
def block_map_kernel(CU_BLOCKS, SEQ, M0, n_seqs, LOG_B: tl.constexpr, BLOCK_M: tl.constexpr):
    """The notebook's skeleton of ``ch8_block_map``, filled in: one program per entry of the table."""
    pid = tl.program_id(0)
    b = find_sequence(CU_BLOCKS, pid, n_seqs, LOG_B)
    first = tl.load(CU_BLOCKS + tl.maximum(b, 0))          # the program id of the sequence's first block
    tl.store(SEQ + pid, b)
    tl.store(M0 + pid, tl.where(b >= 0, (pid - first) * BLOCK_M, -1))


def block_map_triton(cu_seqlens, block_m):
    """The model answer of ``ch8_block_map``: the notebook's launcher, filled in."""
    B = cu_seqlens.numel() - 1
    total = int(cu_seqlens[-1])
    programs = (total + B * (block_m - 1)) // block_m
    seq = torch.empty(programs, dtype=torch.int32, device=cu_seqlens.device)
    m0 = torch.empty_like(seq)
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    blocks = (lengths + block_m - 1) // block_m
    cu_blocks = torch.nn.functional.pad(torch.cumsum(blocks, 0), (1, 0)).to(torch.int32)
    if programs:
        block_map_kernel[(programs,)](cu_blocks, seq, m0, B, LOG_B=max(B - 1, 1).bit_length(), BLOCK_M=block_m)
    return seq, m0


def _cu(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()],
                        dtype=torch.int32, device=DEVICE)


def block_map_cases(seed):
    import random

    rng = random.Random(seed)
    specs = [  # label, lengths, BLOCK_M
        ("lengths that are no multiple of BLOCK_M", [20, 5, 33, 16], 16),
        ("an empty sequence in the middle", [40, 0, 17], 16),
        ("empty sequences first, last and in a row", [0, 9, 0, 0, 31, 0], 16),
        ("one huge sequence among short ones", [3, 700, 1, 64, 2], 64),
        ("one sequence", [100], 32),
        ("every sequence empty", [0, 0, 0], 16),
        ("a sequence of exactly one block, BLOCK_M = 128", [128, 129, 1], 128),
    ]
    b = rng.randint(3, 24)
    lengths = [0 if rng.random() < 0.25 else rng.randint(1, 300) for _ in range(b)]
    specs.append(("random", lengths, rng.choice([16, 32, 64, 128])))
    for lengths, bm in pick(cpu=[], gpu=[([rng.choice([0, rng.randint(1, 8192)]) for _ in range(512)], 128)]):
        specs.append(("full size", lengths, bm))
    cases = []
    for label, lengths, bm in specs:
        shown = lengths if len(lengths) <= 10 else f"{len(lengths)} sequences"
        cases.append(Case(f"{label}: lengths={shown} BLOCK_M={bm}", (_cu(lengths), bm),
                          meta=dict(lengths=lengths, block_m=bm)))
    return cases


def compare_maps(got, expected, case):
    """Exact: the first program mapped wrong, in words."""
    lengths, bm = case.meta["lengths"], case.meta["block_m"]
    seq_g, m0_g = (t.detach().cpu().tolist() for t in got)
    seq_e, m0_e = (t.detach().cpu().tolist() for t in expected)
    blocks = sum(-(-n // bm) for n in lengths)
    for p, (sg, mg, se, me) in enumerate(zip(seq_g, m0_g, seq_e, m0_e)):
        if (sg, mg) == (se, me):
            continue
        want = ("no block: it is past the last real block (there are "
                f"{blocks} of them; its entry is -1, -1)") if se < 0 else \
            f"sequence {se} (length {lengths[se]}), its rows {me}..{min(me + bm, lengths[se]) - 1}: m0 = {me}"
        said = f"you mapped it to (seq, m0) = ({sg}, {mg})"
        if 0 <= sg < len(lengths) and lengths[sg] == 0:
            said += f" — sequence {sg} is empty: no program may work on it"
        elif 0 <= sg < len(lengths) and sg == se and mg >= 0 and mg % bm == 0 and me != mg:
            said += f" — m0 is the block's first row in its sequence, block index × BLOCK_M = {me}"
        raise AssertionError(f"program {p} of {len(seq_e)} should work on {want}; {said}")


def _mistaken(**mistake):
    def fn(cu_seqlens, block_m):
        return block_table(cu_seqlens, block_m, **mistake)
    fn.__name__ = "block_table_" + "_".join(mistake)
    return fn


BLOCK_MISTAKES = (
    Mistake("an empty sequence given a block", _mistaken(empty_gets_block=True),
            "a sequence of length 0 has cdiv(0, BLOCK_M) = 0 blocks. (L − 1) // BLOCK_M + 1 gives it 1 where "
            "integer division truncates (C, Triton), and every later program lands one sequence early."),
    Mistake("the prefix sum without its leading 0 (an off-by-one)", _mistaken(leading_zero=False),
            "cu_blocks needs B + 1 entries, 0 first: sequence b's blocks are programs cu_blocks[b] .. "
            "cu_blocks[b + 1] − 1. The running total alone says where each sequence's blocks end, not start."),
    Mistake("blocks of the packed tensor, not of each sequence", _mistaken(packed_blocks=True),
            "cutting the packed rows into blocks of BLOCK_M lets a block straddle two sequences; each sequence "
            "is cut on its own (cdiv(L_b, BLOCK_M) blocks), its last block partly empty."),
    Mistake("m0 as the block's index, not its first row", _mistaken(index_not_row=True),
            "m0 is the first row of the block inside its sequence: (pid − cu_blocks[b]) · BLOCK_M."),
    Mistake("the programs past the last block given work", _mistaken(leftovers_clamped=True),
            "the grid is an upper bound: programs past cu_blocks[B] have no block and must say so with -1, -1."),
)

BLOCK_HINTS = (
    "Count blocks, not rows: how many blocks of BLOCK_M rows does sequence b need (an empty one included)? With "
    "those counts written as a running total that starts at 0, program p belongs to the sequence whose range of "
    "program ids holds p. Which sequence is that when several ranges are empty?",
    "Host: blocks = cdiv(L_b, BLOCK_M) from cu_seqlens' differences, cu_blocks = 0 then torch.cumsum(blocks) "
    "(int32, B + 1 entries). Kernel: b = the LAST index in 0..B−1 with cu_blocks[b] <= pid (an empty sequence "
    "has cu_blocks[b] == cu_blocks[b + 1], so the last such index skips it); a binary search needs "
    "ceil(log2 B) halvings, each one tl.load. pid >= cu_blocks[B]: no block, store -1, -1. Otherwise "
    "m0 = (pid − cu_blocks[b]) · BLOCK_M.",
    "lo = tl.full([], 0, tl.int32); hi = lo + n_seqs - 1; for _ in tl.static_range(LOG_B): mid = (lo + hi + 1) // 2; "
    "go = tl.load(CU_BLOCKS + mid) <= pid; lo = tl.where(go, mid, lo); hi = tl.where(go, hi, mid - 1). Then "
    "b = tl.where(pid < tl.load(CU_BLOCKS + n_seqs), lo, -1); tl.store(SEQ + pid, b); tl.store(M0 + pid, "
    "tl.where(b >= 0, (pid - tl.load(CU_BLOCKS + tl.maximum(b, 0))) * BLOCK_M, -1)). "
    "(Or load all of CU_BLOCKS[1:] as one vector ends: b = tl.sum(ends <= pid).)",
)

register_exercise(Exercise(
    name="ch8_block_map", chapter=8, title="The varlen schedule: which sequence and block each program owns",
    signature="block_map(cu_seqlens, block_m) -> (seq, m0)   # int32 (n_programs,) each; launches your Triton "
              "kernel",
    solution=block_map, make_cases=block_map_cases, compare=compare_maps, outputs=("seq", "m0"),
    mistakes=BLOCK_MISTAKES, kind="triton", model_answer=block_map_triton, hint=BLOCK_HINTS[0], hints=BLOCK_HINTS,
))


# --------------------------------------------------------------------------- 2. the packed forward

BLOCK_M = pick(cpu=16, gpu=64)   # query rows per program
BLOCK_N = pick(cpu=16, gpu=64)   # keys per K/V tile


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False):
    """``(o (total_q, H, D) in q's dtype, lse (H, total_q) float32)`` of a packed batch (flash-attn's varlen layout).

    The judge runs ``ch8.packed_reference`` (float64, each sequence alone); the learner writes the kernel.
    """
    o, lse = packed_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, causal)
    return o.to(q.dtype), lse.to(torch.float32)


@triton.jit
def varlen_kernel(Q, K, V, O, LSE, CU_Q, CU_K, CU_BLOCKS, n_seqs, total_q,
                  stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                  group, head_dim, qk_scale,
                  CAUSAL: tl.constexpr, LOG_B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    """The notebook's skeleton of ``ch8_varlen_kernel``, filled in.  Grid ``(programs, H)``."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    # 1. which sequence, which block
    b = find_sequence(CU_BLOCKS, pid, n_seqs, LOG_B)
    if b < 0:
        return
    m0 = (pid - tl.load(CU_BLOCKS + b)) * BLOCK_M
    # 2. the sequence's rows in the packed tensors
    q_start = tl.load(CU_Q + b)
    n_q = tl.load(CU_Q + b + 1) - q_start
    k_start = tl.load(CU_K + b)
    n_k = tl.load(CU_K + b + 1) - k_start
    # 3. the q tile: rows m0.. of this sequence, never a row of the next one
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < head_dim
    row_ok = offs_m[:, None] < n_q
    q = tl.load(Q + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=row_ok & d_ok, other=0.0)
    k_head = K + k_start * stride_kt + (h // group) * stride_kh
    v_head = V + k_start * stride_vt + (h // group) * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(0, n_k, BLOCK_N):
        # 4. this sequence's keys, masked at its end (the next sequence's keys are never seen)
        cols = start_n + offs_n
        kv_ok = (cols[:, None] < n_k) & d_ok
        k = tl.load(k_head + cols[:, None] * stride_kt + offs_d[None, :], mask=kv_ok, other=0.0)
        v = tl.load(v_head + cols[:, None] * stride_vt + offs_d[None, :], mask=kv_ok, other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        keep = cols[None, :] < n_k
        if CAUSAL:   # bottom-right, per sequence: query i sits at key i + n_k - n_q
            keep = keep & (cols[None, :] <= offs_m[:, None] + (n_k - n_q))
        s = tl.where(keep, s, float("-inf"))
        # the online softmax (given)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    # 5. the stores: this sequence's rows only
    tl.store(O + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             (acc / l_safe[:, None]).to(O.dtype.element_ty), mask=row_ok & d_ok)
    tl.store(LSE + h * total_q + q_start + offs_m, lse, mask=offs_m < n_q)


def varlen_attention_triton(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False):
    """The model answer of ``ch8_varlen_kernel``: the notebook's launcher, unchanged."""
    total_q, H, D = q.shape
    B = cu_seqlens_q.numel() - 1
    o = torch.empty_like(q)
    lse = torch.empty((H, total_q), dtype=torch.float32, device=q.device)
    lengths = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    cu_blocks = torch.nn.functional.pad(torch.cumsum((lengths + BLOCK_M - 1) // BLOCK_M, 0), (1, 0)).to(torch.int32)
    programs = (total_q + B * (BLOCK_M - 1)) // BLOCK_M
    if programs:
        varlen_kernel[(programs, H)](q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, cu_blocks, B, total_q,
                                     q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                     o.stride(0), o.stride(1), H // k.shape[1], D, LOG2E / math.sqrt(D),
                                     CAUSAL=causal, LOG_B=max(B - 1, 1).bit_length(), BLOCK_M=BLOCK_M,
                                     BLOCK_N=BLOCK_N, BLOCK_D=max(16, triton.next_power_of_2(D)))
    return o, lse


#: bf16 cases run in fp16 in the CPU world: the interpreter's tl.dot cannot multiply bf16
HALF = pick(cpu=torch.float16, gpu=torch.bfloat16)

#: (label, [(Lq, Lk), ...], H, Hkv, D, causal, dtype)
_VARLEN_SPECS = [
    ("tails, self-attention", [(5, 5), (20, 20), (1, 1)], 2, 2, 16, False, torch.float16),
    ("tails, causal", [(5, 5), (20, 20), (13, 13)], 2, 2, 16, True, HALF),
    ("an empty sequence (Lq = Lk = 0), causal", [(7, 7), (0, 0), (18, 18)], 2, 2, 16, True, torch.float16),
    ("Lq != Lk both ways, causal: bottom-right per sequence", [(9, 25), (22, 6), (4, 4)], 2, 2, 32, True,
     torch.float16),
    ("a sequence without keys (Lk = 0): zeros, lse = -inf", [(6, 10), (5, 0), (3, 12)], 2, 2, 16, False,
     torch.float16),
    ("GQA: 4 query heads on 2 K/V heads, D = 24", [(17, 17), (3, 3)], 4, 2, 24, True, HALF),
    ("no mask, keys past a sequence's end", [(3, 5), (2, 30), (1, 3)], 1, 1, 16, False, torch.float16),
] + pick(cpu=[], gpu=[
    ("full size", [(1000, 1000), (0, 0), (3000, 3000), (77, 77), (2048, 2048)], 8, 2, 128, True, torch.bfloat16),
    ("full size, Lq != Lk", [(512, 2000), (1500, 700)], 8, 8, 64, False, torch.float16),
])


def varlen_cases(seed):
    import random

    rng = random.Random(seed)
    specs = list(_VARLEN_SPECS)
    pairs = []
    for _ in range(rng.randint(2, 5)):
        lq = rng.choice([0, rng.randint(1, 40)])
        pairs.append((lq, lq if rng.random() < 0.6 else rng.randint(0, 40)))
    specs.append(("random", pairs, 2, rng.choice([1, 2]), rng.choice([16, 40]), rng.random() < 0.5, torch.float16))
    cases = []
    for index, (label, pairs, h, h_kv, d, causal, dtype) in enumerate(specs):
        g = torch.Generator().manual_seed(seed * 1000 + index)
        lq, lk = [a for a, _ in pairs], [b for _, b in pairs]
        q = torch.randn(sum(lq), h, d, generator=g).to(device=DEVICE, dtype=dtype)
        k = torch.randn(sum(lk), h_kv, d, generator=g).to(device=DEVICE, dtype=dtype)
        v = torch.randn(sum(lk), h_kv, d, generator=g).to(device=DEVICE, dtype=dtype)
        shown = pairs if len(pairs) <= 6 else f"{len(pairs)} sequences"
        words = f"(Lq, Lk)={shown} H={h}" + (f" Hkv={h_kv}" if h_kv != h else "") + f" D={d}"
        words += (" causal" if causal else "") + f" {str(dtype).replace('torch.', '')}"
        cases.append(Case(f"{label}: {words}", (q, k, v, _cu(lq), _cu(lk), max(lq), max(lk)),
                          dict(causal=causal), dtype=dtype, meta=dict(pairs=pairs)))
    return cases


def _contaminated(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False):
    """Each sequence's last key tile read whole: past its end lie the next sequence's keys, seen (no mask)."""
    total_k = k.shape[0]
    ck = cu_seqlens_k.tolist()
    out_o = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    out_lse = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=torch.float64, device=q.device)
    cq = cu_seqlens_q.tolist()
    for b in range(len(cq) - 1):
        n_k = ck[b + 1] - ck[b]
        stop = min(ck[b] + -(-n_k // BLOCK_N) * BLOCK_N, total_k)
        cu_q = torch.tensor([0, cq[b + 1] - cq[b]], dtype=torch.int32)
        cu_k = torch.tensor([0, stop - ck[b]], dtype=torch.int32)
        o, lse = packed_reference(q[cq[b]:cq[b + 1]], k[ck[b]:stop], v[ck[b]:stop], cu_q, cu_k, causal)
        out_o[cq[b]:cq[b + 1]] = o
        out_lse[:, cq[b]:cq[b + 1]] = lse
    return out_o.to(q.dtype), out_lse.float()


def _top_left(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False):
    """Causal from each sequence's top-left corner: query i sees keys j <= i."""
    if not causal:
        return varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    o = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=torch.float64, device=q.device)
    group = q.shape[1] // k.shape[1]
    for b in range(len(cq) - 1):
        n_q, n_k = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        if n_q == 0 or n_k == 0:
            continue
        qs = q[cq[b]:cq[b + 1]].double().transpose(0, 1)
        ks, vs = (t[ck[b]:ck[b + 1]].double().transpose(0, 1).repeat_interleave(group, 0) for t in (k, v))
        s = qs @ ks.transpose(-1, -2) / math.sqrt(q.shape[-1])
        hidden = torch.arange(n_k, device=q.device)[None, :] > torch.arange(n_q, device=q.device)[:, None]
        s = s.masked_fill(hidden, -math.inf)
        lse_b = torch.logsumexp(s, -1)
        p = torch.where(torch.isfinite(lse_b)[..., None], torch.exp(s - lse_b[..., None]), 0.0)
        o[cq[b]:cq[b + 1]] = (p @ vs).transpose(0, 1)
        lse[:, cq[b]:cq[b + 1]] = lse_b
    return o.to(q.dtype), lse.float()


def _lse_log2(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False):
    o, lse = varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal)
    return o, lse / math.log(2)


VARLEN_MISTAKES = (
    Mistake("keys of the next sequence seen (cross-contamination)", _contaminated,
            "a sequence's last key tile runs past its n_k keys into the next sequence's, which are real values, "
            "not zeros: mask the loads and the scores at k_start + n_k, so that no sequence attends to another."),
    Mistake("a top-left causal mask", _top_left,
            "each sequence is aligned bottom-right on its own: query i of the sequence sits at its key "
            "i + n_k − n_q, so keep key j when j <= i + n_k − n_q."),
    Mistake("lse left in log2 units", _lse_log2,
            "with m_i and l_i in base 2, lse = (m_i + log2(l_i)) · ln 2 (natural log, as the backward expects)."),
)

VARLEN_HINTS = (
    "Follow one program of the grid (programs, H): which sequence and which of its query blocks is it (your "
    "search of 8.2), where do that sequence's queries and keys start in the packed tensors, and how many are "
    "there? Every load and store that could reach past the sequence's end would touch another sequence.",
    "b = find_sequence(CU_BLOCKS, pid, n_seqs, LOG_B), return when b < 0; m0 = (pid − CU_BLOCKS[b])·BLOCK_M; "
    "q_start = CU_Q[b], n_q = CU_Q[b + 1] − q_start, likewise k_start, n_k from CU_K. Row r of the sequence, "
    "head h, column d of q is at Q + (q_start + r)·stride_qt + h·stride_qh + d; K/V head h // group. Mask rows "
    "r >= n_q, keys j >= n_k (loads and scores), and, causal, keys j > i + n_k − n_q.",
    "offs_m = m0 + tl.arange(0, BLOCK_M); q = tl.load(Q + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh "
    "+ offs_d[None, :], mask=(offs_m[:, None] < n_q) & d_ok, other=0.0); k_head = K + k_start * stride_kt + "
    "(h // group) * stride_kh; in the loop cols = start_n + offs_n, k = tl.load(k_head + cols[:, None] * stride_kt "
    "+ offs_d[None, :], mask=(cols[:, None] < n_k) & d_ok, other=0.0); keep = cols[None, :] < n_k, and if CAUSAL "
    "keep &= cols[None, :] <= offs_m[:, None] + n_k − n_q. Store O at the same rows as q (mask offs_m < n_q) and "
    "lse at LSE + h·total_q + q_start + offs_m.",
)

register_exercise(Exercise(
    name="ch8_varlen_kernel", chapter=8, title="A packed variable-length forward kernel",
    signature="varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False) "
              "-> (o, lse)   # q (total_q, H, D), k/v (total_k, Hkv, D); launches your Triton kernel",
    solution=varlen_attention, make_cases=varlen_cases, outputs=("o", "lse"), mistakes=VARLEN_MISTAKES,
    tile=(BLOCK_M, BLOCK_N), judge_dtype=torch.float64, kind="triton", model_answer=varlen_attention_triton,
    hint=VARLEN_HINTS[0], hints=VARLEN_HINTS,
))
