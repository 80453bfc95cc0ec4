"""Chapter 4 exercises: the model answers score full marks, typical mistakes do not, and say why.

The wrong kernels below are the model answer's kernel with one mistake each (a learner's file, not
fa_lab's: the check must see them as the learner's own kernels), so the feedback they get is the
feedback a learner with that mistake gets.
"""
import math
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
import triton
import triton.language as tl

import fa_lab  # noqa: F401  (conftest imports it before triton: it picks the world)
from fa_lab.exercises import ch4, ch4_kernels, check, get, hint
from fa_lab.exercises.runner import run_check
from fa_lab.exercises.structure import TritonDotCount

# trusted: the solution and the mistakes are fa_lab's own functions (what is tested is the judging)

def test_key_block_ranges_solution_passes():
    assert run_check(get("ch4_key_block_ranges"), ch4.key_block_ranges, trusted=True).passed


@pytest.mark.parametrize("mistake", ch4.RANGE_MISTAKES, ids=lambda m: m.name)
def test_key_block_ranges_mistakes_fail(mistake):
    result = run_check(get("ch4_key_block_ranges"), mistake.fn, trusted=True)
    assert not result.passed
    assert result.first_failure["message"].startswith("wrong answer")


def test_key_block_ranges_rejects_overlapping_ranges():
    def overlapping(m_start, block_m, block_n, n_q, n_k, left=-1, right=-1):
        lo, mid_lo, mid_hi, hi = ch4.key_block_ranges(m_start, block_m, block_n, n_q, n_k, left, right)
        return lo, mid_lo, mid_hi, hi + block_n  # one block past the end: visits nothing visible
    assert not run_check(get("ch4_key_block_ranges"), overlapping, trusted=True).passed


@pytest.mark.parametrize("name", ["ch4_flash_forward", "ch4_flash_kernel", "ch4_skip_masked"])
def test_model_answers_score_full_marks(name):
    ex = get(name)
    assert ex.kind == "triton" and ex.model_answer is not ex.solution
    result = run_check(ex, ex.model_answer)
    assert result.passed and result.score == result.max_score > 0, repr(result)


@pytest.mark.parametrize("mistake", ch4.FLASH_MISTAKES, ids=lambda m: m.name)
def test_flash_forward_mistakes_are_named(mistake):
    result = run_check(get("ch4_flash_forward"), mistake.fn, trusted=True)
    assert not result.passed
    assert mistake.name in " ".join(r.get("diagnosis", "") for r in result.rows)


@pytest.mark.parametrize("name", ["ch4_key_block_ranges", "ch4_flash_forward", "ch4_flash_kernel", "ch4_skip_masked"])
def test_stubs_get_feedback_not_an_exception(name):
    def stub(*args, **kwargs):
        raise NotImplementedError
    result = check(name, stub)
    assert not result.passed and "not implemented" in result.first_failure["message"]


@pytest.mark.parametrize("name", ["ch4_key_block_ranges", "ch4_flash_forward", "ch4_flash_kernel", "ch4_skip_masked"])
def test_hints_come_in_three_tiers(name):
    ex = get(name)
    assert len(ex.hints) == 3 and ex.hint == ex.hints[0]
    assert hint(name, 1).startswith("Hint 1/3") and "says more" in hint(name, 1)
    assert "tl.math.exp2" not in ex.hints[0] and "//" not in ex.hints[0]   # the first tier gives no code


# --------------------------------------------------------------------------- wrong kernels, as a learner writes them

@triton.jit
def _wrong_kernel(Q, K, V, O, LSE,
                  stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
                  stride_vb, stride_vh, stride_vn, stride_vd, stride_ob, stride_oh, stride_om, stride_od,
                  n_q, n_k, heads, group, head_dim, qk_scale,
                  CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  TOP_LEFT: tl.constexpr, TAIL_MASK: tl.constexpr, LSE_LOG2: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // heads
    h = pid_bh % heads
    h_kv = h // group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < head_dim
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=(offs_m[:, None] < n_q) & d_ok, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(0, n_k, BLOCK_N):
        cols = start_n + offs_n
        kv_ok = (cols[:, None] < n_k) & d_ok
        k = tl.load(K + b * stride_kb + h_kv * stride_kh + cols[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                    mask=kv_ok, other=0.0)
        v = tl.load(V + b * stride_vb + h_kv * stride_vh + cols[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                    mask=kv_ok, other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        keep = offs_m[:, None] >= 0
        if TAIL_MASK:
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
    tl.store(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
             (acc / l_safe[:, None]).to(O.dtype.element_ty), mask=(offs_m[:, None] < n_q) & d_ok)
    lse = m_i + tl.math.log2(l_safe)
    if not LSE_LOG2:
        lse = lse * 0.6931471805599453
    tl.store(LSE + pid_bh * n_q + offs_m, tl.where(seen, lse, float("-inf")), mask=offs_m < n_q)


def _launch_wrong(q, k, v, causal, top_left=False, tail_mask=True, lse_log2=False):
    B, H, n_q, D = q.shape
    o = torch.empty_like(q)
    lse = torch.empty((B, H, n_q), dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(n_q, ch4_kernels.BLOCK_M), B * H)
    _wrong_kernel[grid](q, k, v, o, lse, *q.stride(), *k.stride(), *v.stride(), *o.stride(),
                        n_q, k.shape[2], H, H // k.shape[1], D, 1.4426950408889634 / math.sqrt(D),
                        CAUSAL=causal, BLOCK_M=ch4_kernels.BLOCK_M, BLOCK_N=ch4_kernels.BLOCK_N,
                        BLOCK_D=max(16, triton.next_power_of_2(D)),
                        TOP_LEFT=top_left, TAIL_MASK=tail_mask, LSE_LOG2=lse_log2)
    return o, lse


def top_left_mask(q, k, v, causal=False):
    return _launch_wrong(q, k, v, causal, top_left=True)


def no_tail_mask(q, k, v, causal=False):
    return _launch_wrong(q, k, v, causal, tail_mask=False)


def lse_in_log2(q, k, v, causal=False):
    return _launch_wrong(q, k, v, causal, lse_log2=True)


def every_tile_causal(q, k, v):
    """Right values, but the loop of 4.3: every key tile computed, every one masked."""
    return _launch_wrong(q, k, v, True)


@pytest.mark.parametrize("fn,name,words", [
    (top_left_mask, "a top-left causal mask", "bottom-right"),
    (no_tail_mask, "keys past Nk not masked", "load as 0"),
    (lse_in_log2, "lse left in log2 units", "divided by ln 2"),
], ids=["top-left", "no-tail-mask", "lse-log2"])
def test_wrong_kernels_fail_and_the_mistake_is_named(fn, name, words):
    ex = get("ch4_flash_kernel")
    # the first cases hold every mistake's target: causal with Nq != Nk, a tail tile without the mask
    first = replace(ex, make_cases=lambda seed: ex.make_cases(seed)[:4])
    result = run_check(first, fn, seeds=(0,))
    assert not result.passed
    wrong = [r for r in result.rows if r["kind"] == "values" and not r["passed"]]
    assert wrong and all(r["message"].startswith("wrong answer") for r in wrong), wrong
    said = " ".join(r["message"] + " " + (r.get("diagnosis") or "") for r in wrong)
    assert f"known mistake — {name}" in said and words in said, said


@pytest.mark.skipif(fa_lab.ON_GPU, reason="the work is counted in the Triton interpreter; a GPU times it instead")
def test_unskipped_causal_loop_fails_on_work_alone():
    ex = get("ch4_skip_masked")
    counted = replace(ex, make_cases=lambda seed: [c for c in ex.make_cases(seed) if c.meta["structure"]])
    result = run_check(counted, every_tile_causal, seeds=(0,))
    assert not result.passed
    assert all(r["passed"] for r in result.rows if r["kind"] == "values")
    work = [r for r in result.rows if "key tiles computed" in r["case"]]
    assert work and not any(r["passed"] for r in work)
    message = work[0]["message"]
    assert "key tiles" in message and "Stop each query block's key loop" in message, message


@pytest.mark.skipif(fa_lab.ON_GPU, reason="counts tl.dot calls in the Triton interpreter")
@pytest.mark.parametrize("n_q,n_k", [(192, 192), (128, 160), (50, 21), (1, 1)])
def test_the_skipping_kernel_computes_exactly_the_needed_tiles(n_q, n_k):
    check_ = ch4_kernels.KeyBlocksComputed()
    q, k, v = (torch.randn(1, 2, n, 16, dtype=torch.float16) for n in (n_q, n_k, n_k))
    case = get("ch4_skip_masked").make_cases(0)[0]
    case.meta.update(n_q=n_q, n_k=n_k, bh=2)
    monitor = check_.monitor(case, (q, k, v), {})
    try:
        ch4_kernels.flash_attention_causal_triton(q, k, v)
    finally:
        monitor.finish()
    needed, every = ch4_kernels.causal_key_blocks(n_q, n_k, ch4_kernels.BLOCK_M, ch4_kernels.BLOCK_N)
    assert monitor.dots.count == 2 * 2 * needed
    assert monitor.verdict() is None
    if n_q == n_k == 192:
        assert needed < 0.6 * every     # about half: 21 of 36 tiles with 32 × 32 tiles


@pytest.mark.skipif(fa_lab.ON_GPU, reason="counts tl.dot calls in the Triton interpreter")
def test_dot_counter_counts_every_dot_and_puts_the_interpreter_back():
    from triton.runtime.interpreter import InterpreterBuilder

    original = InterpreterBuilder.create_dot
    n_q, n_k = 40, 70                   # 2 query blocks × 3 key tiles of 32, two tl.dot each
    q, k, v = (torch.randn(1, 1, n, 16, dtype=torch.float16) for n in (n_q, n_k, n_k))
    with TritonDotCount() as dots:
        _launch_wrong(q, k, v, False)
    assert InterpreterBuilder.create_dot is original
    blocks = triton.cdiv(n_q, ch4_kernels.BLOCK_M) * triton.cdiv(n_k, ch4_kernels.BLOCK_N)
    assert dots.count == 2 * blocks
    assert dots.first == ((ch4_kernels.BLOCK_M, 16), (16, ch4_kernels.BLOCK_N))   # q @ kᵀ: the tile sizes
    _launch_wrong(q, k, v, False)
    assert dots.count == 2 * blocks     # stopped: counts nothing more


def test_chapter_modules_register_in_the_book_order():
    """Each chapter's warm-ups, then its kernels; chapter after chapter (a fresh process: nothing imported yet)."""
    code = "import fa_lab\nfrom fa_lab.exercises import names\nprint(repr(names()))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    order = eval(done.stdout.strip().splitlines()[-1])
    chapters = [int(n[2:n.index("_")]) for n in order]
    assert chapters == sorted(chapters)
    assert [n for n in order if n.startswith(("ch3", "ch4", "ch5"))] == [
        "ch3_tile_mask", "ch3_key_tiles", "ch3_tile_update", "ch3_tiled_kernel", "ch3_causal_skip",
        "ch3_blocks_per_sm",
        "ch4_key_block_ranges", "ch4_flash_forward", "ch4_flash_kernel", "ch4_skip_masked",
        "ch5_recompute_p", "ch5_dv_and_delta", "ch5_ds_from_dp", "ch5_attention_backward",
        "ch5_dkdv_kernel", "ch5_dq_kernel", "ch5_dkdv_split"]
