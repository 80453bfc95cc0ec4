"""Chapter 9 exercises: the model answers score full marks, typical mistakes do not, and say why.

The wrong kernels below are the model answer's kernel with one mistake each, written here (a learner's
file, not fa_lab's: the check must see them as the learner's own kernels), so the feedback they get is
the feedback a learner with that mistake gets.  The judge itself is checked against the float64
attention reference: partials made by attending over disjoint key splits merge into attention over
all the keys.
"""
import math
from dataclasses import replace

import pytest
import torch
import triton
import triton.language as tl

import fa_lab  # noqa: F401  (conftest imports it before triton: it picks the world)
from fa_lab.core.reference import reference_attention
from fa_lab.core.spec import make_spec
from fa_lab.core.testing import TOLERANCE
from fa_lab.exercises import ch9, ch9_kernels, get, hint
from fa_lab.exercises.runner import run_check

NAMES = ["ch9_merge_partials", "ch9_combine_kernel"]


# --------------------------------------------------------------------------- the judge

def partials_by_splits(q, k, v, cuts, causal=False):
    """``(o_parts (rows, S, D), lse_parts (rows, S), o, lse)`` from the float64 reference: each split is
    attention over keys ``cuts[s] .. cuts[s + 1] - 1`` alone (keys a row cannot see excluded by a
    mask built for the whole row), and o, lse are attention over all the keys."""
    n_q, n_k = q.shape[2], k.shape[2]
    o_all, lse_all = reference_attention(q, k, v, make_spec(q, k, v, causal=causal))
    visible = torch.ones(n_q, n_k, dtype=torch.bool)
    if causal:
        visible = torch.arange(n_k)[None, :] <= torch.arange(n_q)[:, None] + n_k - n_q
    o_parts, lse_parts = [], []
    scale = 1 / math.sqrt(q.shape[-1])
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        s = (q @ k[:, :, lo:hi].transpose(-1, -2)) * scale
        s = s.masked_fill(~visible[:, lo:hi], float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
        o_parts.append((p @ v[:, :, lo:hi]).flatten(0, 2))
        lse_parts.append(lse.flatten())
    return torch.stack(o_parts, 1), torch.stack(lse_parts, 1), o_all.flatten(0, 2), lse_all.flatten()


@pytest.mark.parametrize("cuts,causal", [([0, 7, 19, 40], False), ([0, 1, 2, 40], False), ([0, 30, 31, 40], True),
                                         ([0, 40], True), ([0, 5, 10, 15, 20, 25, 30, 35, 40], True)],
                         ids=["uneven", "tiny-splits", "causal-empty-splits", "one-split", "eight-splits"])
def test_merging_split_partials_is_attention_over_all_keys(cuts, causal, seed):
    """The judge, and the model kernel, give the float64 reference over all keys, empty splits and
    rows that see no key included (causal with Nq > Nk: the first rows see nothing)."""
    g = torch.Generator().manual_seed(seed)
    n_q = 45 if causal else 6
    q, k, v = (torch.randn(2, 3, n, 24, generator=g, dtype=torch.float64) * 2 for n in (n_q, 40, 40))
    o_parts, lse_parts, o, lse = partials_by_splits(q, k, v, cuts, causal)
    if causal and len(cuts) > 2:
        assert (lse_parts == float("-inf")).any(), "the case has empty splits"
    if causal:
        assert (lse == float("-inf")).any(), "... and rows that see no key"
    got_o, got_lse = ch9.merge_partials(o_parts, lse_parts)
    torch.testing.assert_close(got_o, o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_lse, lse, rtol=1e-12, atol=1e-12)
    atol, rtol = TOLERANCE[torch.float32]
    dev = fa_lab.DEVICE
    k_o, k_lse = ch9_kernels.combine_splits_triton(o_parts.float().to(dev), lse_parts.float().to(dev))
    torch.testing.assert_close(k_o.cpu().double(), o, rtol=rtol, atol=atol)
    torch.testing.assert_close(k_lse.cpu().double(), lse, rtol=rtol, atol=atol)


def test_cases_cover_the_contract():
    cases = get("ch9_merge_partials").make_cases(0)
    assert cases == [] or get("ch9_combine_kernel").make_cases is get("ch9_merge_partials").make_cases
    splits = {c.meta["splits"] for c in cases}
    assert set(range(1, 9)) & splits >= {1, 3, 4, 5, 6, 7, 8}
    assert any(c.meta["head_dim"] & (c.meta["head_dim"] - 1) for c in cases), "a head dim that is no power of two"
    lses = torch.cat([c.args[1].flatten().cpu() for c in cases])
    finite = lses[torch.isfinite(lses)]
    assert finite.max() > 88.8 and finite.min() < -103.3, "exp(lse) overflows and underflows float32"
    assert any(bool((c.args[1] == float("-inf")).all(1).any()) for c in cases), "a row whose splits are all empty"
    assert any(bool(torch.isnan(c.args[0]).any() or torch.isnan(c.args[1]).any()) for c in cases), "NaN in"
    for c in cases:   # an empty split writes zeros, as the decode kernel does
        empty = c.args[1] == float("-inf")
        assert bool((c.args[0][empty] == 0).all())


# --------------------------------------------------------------------------- full marks, feedback, hints

def test_the_kernel_exercise_is_a_triton_kernel():
    ex = get("ch9_combine_kernel")
    assert ex.kind == "triton" and ex.model_answer is not ex.solution
    assert get("ch9_merge_partials").kind == "python"


@pytest.mark.parametrize("mistake", ch9.MISTAKES, ids=lambda m: m.name)
def test_merge_mistakes_are_named(mistake):
    result = run_check(get("ch9_merge_partials"), mistake.fn, trusted=True)
    assert not result.passed
    assert mistake.name in " ".join(r.get("diagnosis") or "" for r in result.rows)


@pytest.mark.parametrize("name", NAMES)
def test_hints_come_in_three_tiers(name):
    ex = get(name)
    assert len(ex.hints) == 3 and ex.hint == ex.hints[0]
    assert hint(name, 1).startswith("Hint 1/3") and "says more" in hint(name, 1)
    assert "torch." not in ex.hints[0] and "tl." not in ex.hints[0]   # the first tier gives no code
    assert "=" in ex.hints[2]                                           # the last spells it out


# --------------------------------------------------------------------------- wrong kernels, as a learner writes them

@triton.jit
def _wrong_kernel(O_PART, LSE_PART, O, LSE, n_splits, head_dim, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                  PAD_LSE_ZERO: tl.constexpr, NO_MAX: tl.constexpr, NO_MAX_GUARD: tl.constexpr,
                  NO_SUM_GUARD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < n_splits
    d_ok = offs_d < head_dim
    if PAD_LSE_ZERO:
        lse_s = tl.load(LSE_PART + row * n_splits + offs_s, mask=s_ok, other=0.0)
    else:
        lse_s = tl.load(LSE_PART + row * n_splits + offs_s, mask=s_ok, other=float("-inf"))
    o_s = tl.load(O_PART + (row * n_splits + offs_s)[:, None] * head_dim + offs_d[None, :],
                  mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    m = tl.max(lse_s, 0)
    if NO_MAX:
        m = m * 0.0
    elif not NO_MAX_GUARD:
        m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_s - m)
    l = tl.sum(w, 0)
    acc = tl.sum(w[:, None] * o_s, 0)
    seen = l != 0.0
    l_safe = tl.where(seen, l, 1.0)
    if NO_SUM_GUARD:
        o = acc / l
    else:
        o = acc / l_safe
    tl.store(O + row * head_dim + offs_d, o, mask=d_ok)
    tl.store(LSE + row, tl.where(seen, m + tl.log(l_safe), float("-inf")))


def _launch_wrong(o_parts, lse_parts, **mistake):
    rows, n_splits, head_dim = o_parts.shape
    o = torch.empty((rows, head_dim), dtype=torch.float32, device=o_parts.device)
    lse = torch.empty(rows, dtype=torch.float32, device=o_parts.device)
    flags = dict(PAD_LSE_ZERO=False, NO_MAX=False, NO_MAX_GUARD=False, NO_SUM_GUARD=False) | mistake
    _wrong_kernel[(rows,)](o_parts, lse_parts, o, lse, n_splits, head_dim, BLOCK_S=triton.next_power_of_2(n_splits),
                           BLOCK_D=triton.next_power_of_2(head_dim), **flags)
    return o, lse


def padding_weighed(o_parts, lse_parts):
    return _launch_wrong(o_parts, lse_parts, PAD_LSE_ZERO=True)


def no_max(o_parts, lse_parts):
    return _launch_wrong(o_parts, lse_parts, NO_MAX=True)


def nan_when_empty(o_parts, lse_parts):
    return _launch_wrong(o_parts, lse_parts, NO_MAX_GUARD=True)


def zero_over_zero(o_parts, lse_parts):
    return _launch_wrong(o_parts, lse_parts, NO_SUM_GUARD=True)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # the interpreter's NumPy says where the mistakes overflow
@pytest.mark.parametrize("fn,name", [
    (padding_weighed, "padding splits loaded with lse = 0"),
    (no_max, "no max subtraction"),
    (nan_when_empty, "NaN where every split is empty"),
    (zero_over_zero, "0 / 0 where every split is empty"),
], ids=["padding", "no-max", "nan-empty", "zero-over-zero"])
def test_wrong_kernels_fail_and_the_mistake_is_named(fn, name):
    ex = get("ch9_combine_kernel")
    result = run_check(replace(ex, make_cases=lambda seed: ex.make_cases(seed)[:6]), fn, seeds=(0,))
    assert not result.passed
    wrong = [r for r in result.rows if r["kind"] == "values" and not r["passed"]]
    assert wrong and all(r["message"].startswith("wrong answer") for r in wrong), wrong
    said = " ".join(r["message"] + " " + (r.get("diagnosis") or "") for r in wrong)
    assert f"known mistake — {name}" in said, said
    own = [r for r in result.rows if "your own Triton kernel" in r["case"]]
    assert any(r["passed"] for r in own)   # on the cases it gets right, the kernel counts as the learner's


def test_calling_fa_labs_combine_kernel_does_not_count():
    from fa_lab.kernels.decode import combine_splits as finished

    def borrowed(o_parts, lse_parts):
        return finished(o_parts, lse_parts)

    ex = get("ch9_combine_kernel")
    result = run_check(replace(ex, make_cases=lambda seed: ex.make_cases(seed)[:2]), borrowed, seeds=(0,))
    assert not result.passed
    assert "fa_lab" in " ".join(r["message"] for r in result.rows if not r["passed"])
