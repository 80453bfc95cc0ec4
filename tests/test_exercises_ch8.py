"""Chapter 8 exercises: the model answers score full marks, typical mistakes do not, and say why.

The wrong kernels below are written the way a learner writes them (a file of their own, not
fa_lab's: the check must see them as the learner's own kernels), so the feedback they get is the
feedback a learner with that mistake gets.  The judges themselves are checked against
independent computations: the block table against the varlen kernels' own schedule, the packed
float64 reference against one dense softmax over the whole packed batch with a block-diagonal mask.
"""
import math
import random
from dataclasses import replace

import pytest
import torch
import triton
import triton.language as tl

import fa_lab  # noqa: F401  (conftest imports it before triton: it picks the world)
from fa_lab.exercises import ch8, ch8_kernels, get, hint, names
from fa_lab.exercises.runner import run_check

NAMES = ["ch8_pack_from_mask", "ch8_block_map", "ch8_varlen_kernel"]


def test_chapter_registers_its_exercises_in_order():
    assert names(8) == NAMES
    assert get("ch8_block_map").kind == get("ch8_varlen_kernel").kind == "triton"


@pytest.mark.parametrize("name", NAMES)
def test_hints_come_in_three_tiers(name):
    ex = get(name)
    assert len(ex.hints) == 3 and ex.hint == ex.hints[0]
    assert hint(name, 1).startswith("Hint 1/3") and "says more" in hint(name, 1)
    assert "tl." not in ex.hints[0] and "torch." not in ex.hints[0] and "//" not in ex.hints[0]


# --------------------------------------------------------------------------- the warm-up

@pytest.mark.parametrize("mistake", ch8.MISTAKES, ids=lambda m: m.name)
def test_pack_from_mask_mistakes_fail_and_are_named(mistake):
    result = run_check(get("ch8_pack_from_mask"), mistake.fn, trusted=True)
    assert not result.passed
    said = " ".join(r.get("diagnosis") or "" for r in result.rows)
    assert mistake.name in said, said


def test_pack_from_mask_matches_unpad_input():
    from fa_lab.flash_attn.bert_padding import unpad_input

    for case in get("ch8_pack_from_mask").make_cases(1):
        mask = case.args[0]
        hidden = torch.randn(*mask.shape, 3, device=mask.device)
        _, indices, cu_seqlens, max_seqlen, _ = unpad_input(hidden, mask)
        got = ch8.pack_from_mask(mask)
        assert torch.equal(got[0], indices) and torch.equal(got[1], cu_seqlens) and got[2] == max_seqlen
        assert got[3] == pytest.approx(mask.numel() / int(mask.bool().sum()))


# --------------------------------------------------------------------------- the block map

def test_block_table_is_the_kernels_schedule():
    from fa_lab.kernels.varlen.schedule import n_programs, sequence_of_block

    rng = random.Random(0)
    for _ in range(30):
        lengths = [rng.choice([0, rng.randint(1, 300)]) for _ in range(rng.randint(1, 12))]
        bm = rng.choice([16, 32, 64, 128])
        cu = ch8_kernels._cu(lengths)
        programs = n_programs(sum(lengths), len(lengths), bm)
        assert programs == ch8_kernels.n_programs(sum(lengths), len(lengths), bm)
        seq, local = sequence_of_block(cu, bm, programs)
        want_seq, want_m0 = ch8_kernels.block_table(cu, bm)
        assert seq.tolist() == want_seq.tolist()
        ok = seq >= 0
        assert (local[ok] * bm).tolist() == want_m0[ok].tolist() and (want_m0[~ok] == -1).all()


@pytest.mark.parametrize("mistake", ch8_kernels.BLOCK_MISTAKES, ids=lambda m: m.name)
def test_block_map_mistakes_fail_and_are_named(mistake):
    result = run_check(get("ch8_block_map"), mistake.fn, seeds=(0,), trusted=True)
    assert not result.passed
    wrong = [r for r in result.rows if r["kind"] == "values" and not r["passed"]]
    assert all(r["message"].startswith("wrong answer: program ") for r in wrong), wrong
    said = " ".join(r.get("diagnosis") or "" for r in wrong)
    assert mistake.name in said, said


@triton.jit
def _vector_map_kernel(CU, SEQ, M0, n_seqs, BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr,
                       EMPTY_GETS_BLOCK: tl.constexpr):
    """One load of every length, a scan for the running total, a count for the search (no binary search)."""
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK_B)
    ok = offs < n_seqs
    starts = tl.load(CU + offs, mask=ok, other=0)
    ends = tl.load(CU + offs + 1, mask=ok, other=0)
    blocks = (ends - starts + BLOCK_M - 1) // BLOCK_M
    if EMPTY_GETS_BLOCK:
        blocks = tl.maximum(blocks, 1)
    blocks = tl.where(ok, blocks, 0)
    block_ends = tl.cumsum(blocks, 0)
    done = ok & (block_ends <= pid)
    b = tl.sum(done.to(tl.int32), 0)
    first = tl.max(tl.where(done, block_ends, 0), 0)
    has = b < n_seqs
    tl.store(SEQ + pid, tl.where(has, b, -1))
    tl.store(M0 + pid, tl.where(has, (pid - first) * BLOCK_M, -1))


def _vector_map(cu_seqlens, block_m, empty_gets_block=False):
    B = cu_seqlens.numel() - 1
    total = int(cu_seqlens[-1])
    programs = (total + B * (block_m - 1)) // block_m
    seq = torch.empty(programs, dtype=torch.int32, device=cu_seqlens.device)
    m0 = torch.empty_like(seq)
    _vector_map_kernel[(programs,)](cu_seqlens, seq, m0, B, BLOCK_M=block_m, BLOCK_B=triton.next_power_of_2(B + 1),
                                    EMPTY_GETS_BLOCK=empty_gets_block)
    return seq, m0


def vector_map(cu_seqlens, block_m):
    return _vector_map(cu_seqlens, block_m)


def vector_map_empty_block(cu_seqlens, block_m):
    return _vector_map(cu_seqlens, block_m, empty_gets_block=True)


def test_a_vectorised_search_scores_full_marks_too():
    ex = get("ch8_block_map")
    result = run_check(ex, vector_map, seeds=(0,))
    assert result.passed and result.score == result.max_score, repr(result)


def test_an_empty_sequence_given_a_block_is_caught_and_named():
    result = run_check(get("ch8_block_map"), vector_map_empty_block, seeds=(0,))
    assert not result.passed
    wrong = [r for r in result.rows if r["kind"] == "values" and not r["passed"]]
    assert {r["label"].split(":")[0] for r in wrong} >= {"an empty sequence in the middle",
                                                         "empty sequences first, last and in a row"}
    said = " ".join(r["message"] + " " + (r.get("diagnosis") or "") for r in wrong)
    assert "known mistake — an empty sequence given a block" in said and "is empty" in said, said


# --------------------------------------------------------------------------- the packed forward

def _dense_packed(q, k, v, cu_q, cu_k, causal):
    """One softmax over the whole packed batch, keys of other sequences (and hidden keys) at -inf."""
    total_q, H, D = q.shape
    group = H // k.shape[1]
    seq_q = torch.repeat_interleave(torch.arange(len(cu_q) - 1), (cu_q[1:] - cu_q[:-1]).long())
    seq_k = torch.repeat_interleave(torch.arange(len(cu_k) - 1), (cu_k[1:] - cu_k[:-1]).long())
    i = torch.arange(total_q) - cu_q[seq_q].long()            # position inside its own sequence
    j = torch.arange(k.shape[0]) - cu_k[seq_k].long()
    ok = seq_q[:, None] == seq_k[None, :]
    if causal:
        n_q, n_k = (cu_q[1:] - cu_q[:-1]).long()[seq_q], (cu_k[1:] - cu_k[:-1]).long()[seq_q]
        ok &= j[None, :] <= (i + n_k - n_q)[:, None]
    kk, vv = (t.double().repeat_interleave(group, 1).transpose(0, 1) for t in (k, v))
    s = (q.double().transpose(0, 1) @ kk.transpose(-1, -2) / math.sqrt(D)).masked_fill(~ok, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.where(torch.isfinite(lse)[..., None], torch.exp(s - lse[..., None]), 0.0)
    return (p @ vv).transpose(0, 1), lse


@pytest.mark.parametrize("seed", [0, 1])
def test_packed_reference_is_one_block_diagonal_softmax(seed):
    for case in ch8_kernels.varlen_cases(seed):
        q, k, v, cu_q, cu_k = (t.cpu() if isinstance(t, torch.Tensor) else t for t in case.args[:5])
        causal = case.kwargs["causal"]
        o, lse = ch8.packed_reference(q, k, v, cu_q, cu_k, causal)
        o_dense, lse_dense = _dense_packed(q, k, v, cu_q, cu_k, causal)
        assert torch.allclose(o, o_dense, atol=1e-12) and torch.equal(torch.isinf(lse), torch.isinf(lse_dense))
        finite = torch.isfinite(lse)
        assert torch.allclose(lse[finite], lse_dense[finite], atol=1e-12)


@pytest.mark.parametrize("mistake", ch8_kernels.VARLEN_MISTAKES, ids=lambda m: m.name)
def test_varlen_mistakes_fail_and_are_named(mistake):
    result = run_check(get("ch8_varlen_kernel"), mistake.fn, seeds=(0,), trusted=True)
    assert not result.passed
    said = " ".join(r.get("diagnosis") or "" for r in result.rows)
    assert mistake.name in said, said


@triton.jit
def _wrong_varlen_kernel(Q, K, V, O, LSE, CU_Q, CU_K, SEQ, M0, total_q, total_k,
                         stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                         group, head_dim, qk_scale, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, KEY_MASK: tl.constexpr,
                         TOP_LEFT: tl.constexpr):
    """A learner's kernel reading a host-built table (seq, m0), with one mistake switched on."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.load(SEQ + pid)
    if b < 0:
        return
    m0 = tl.load(M0 + pid)
    q_start = tl.load(CU_Q + b)
    n_q = tl.load(CU_Q + b + 1) - q_start
    k_start = tl.load(CU_K + b)
    n_k = tl.load(CU_K + b + 1) - k_start
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < head_dim
    q = tl.load(Q + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=(offs_m[:, None] < n_q) & d_ok, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(0, n_k, BLOCK_N):
        cols = start_n + offs_n
        # the packed tensor's end is masked either way: the mistake is to stop there, not at the sequence's end
        rows_ok = (k_start + cols)[:, None] < total_k
        if KEY_MASK:
            rows_ok = rows_ok & (cols[:, None] < n_k)
        k = tl.load(K + (k_start + cols)[:, None] * stride_kt + (h // group) * stride_kh + offs_d[None, :],
                    mask=rows_ok & d_ok, other=0.0)
        v = tl.load(V + (k_start + cols)[:, None] * stride_vt + (h // group) * stride_vh + offs_d[None, :],
                    mask=rows_ok & d_ok, other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        keep = (k_start + cols)[None, :] < total_k
        if KEY_MASK:
            keep = keep & (cols[None, :] < n_k)
        if CAUSAL:
            if TOP_LEFT:
                keep = keep & (cols[None, :] <= offs_m[:, None])
            else:
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
    tl.store(O + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             (acc / l_safe[:, None]).to(O.dtype.element_ty), mask=(offs_m[:, None] < n_q) & d_ok)
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    tl.store(LSE + h * total_q + q_start + offs_m, lse, mask=offs_m < n_q)


def _launch_wrong(q, k, v, cu_q, cu_k, causal, key_mask=True, top_left=False):
    total_q, H, D = q.shape
    bm, bn = ch8_kernels.BLOCK_M, ch8_kernels.BLOCK_N
    # the table on the host, in plain PyTorch: the learner's own, not fa_lab's
    lengths = (cu_q[1:] - cu_q[:-1]).long()
    blocks = (lengths + bm - 1) // bm
    programs = (total_q + lengths.numel() * (bm - 1)) // bm
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=q.device), blocks)
    first = torch.cumsum(blocks, 0) - blocks
    m0 = (torch.arange(seq.numel(), device=q.device) - first[seq]) * bm
    seq = torch.nn.functional.pad(seq, (0, programs - seq.numel()), value=-1).to(torch.int32)
    m0 = torch.nn.functional.pad(m0, (0, programs - m0.numel()), value=-1).to(torch.int32)
    o = torch.empty_like(q)
    lse = torch.empty((H, total_q), dtype=torch.float32, device=q.device)
    _wrong_varlen_kernel[(programs, H)](q, k, v, o, lse, cu_q, cu_k, seq, m0, total_q, k.shape[0], q.stride(0),
                                        q.stride(1),
                                        k.stride(0), k.stride(1), v.stride(0), v.stride(1), o.stride(0), o.stride(1),
                                        H // k.shape[1], D, 1.4426950408889634 / math.sqrt(D), CAUSAL=causal,
                                        BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=max(16, triton.next_power_of_2(D)),
                                        KEY_MASK=key_mask, TOP_LEFT=top_left)
    return o, lse


def host_table_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False):
    return _launch_wrong(q, k, v, cu_seqlens_q, cu_seqlens_k, causal)


def no_key_mask(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False):
    return _launch_wrong(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, key_mask=False)


def top_left(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False):
    return _launch_wrong(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, top_left=True)


def _first_cases(n):
    ex = get("ch8_varlen_kernel")
    return replace(ex, make_cases=lambda seed: ex.make_cases(seed)[:n])


def test_a_host_built_table_scores_full_marks():
    result = run_check(_first_cases(5), host_table_varlen, seeds=(0,))
    assert result.passed, repr(result)


@pytest.mark.parametrize("fn,name,words", [
    (no_key_mask, "keys of the next sequence seen (cross-contamination)", "no sequence attends to another"),
    (top_left, "a top-left causal mask", "bottom-right"),
], ids=["cross-contamination", "top-left"])
def test_wrong_kernels_fail_and_the_mistake_is_named(fn, name, words):
    result = run_check(_first_cases(4), fn, seeds=(0,))
    assert not result.passed
    wrong = [r for r in result.rows if r["kind"] == "values" and not r["passed"]]
    assert wrong and all(r["message"].startswith("wrong answer") for r in wrong), wrong
    said = " ".join(r["message"] + " " + (r.get("diagnosis") or "") for r in wrong)
    assert f"known mistake — {name}" in said and words in said, said
