"""The grader cannot be fooled, and never crashes a notebook.

For EVERY registered exercise (chapters add theirs by registering them): the reference
scores full marks; a stub gets clear feedback; code that raises, hangs, or returns the
wrong shape / dtype / device / type is reported.  Then a catalogue of typical wrong answers,
written the way a learner would write them, each fails the very cases (or structure check)
that target it, and the feedback names the mistake.
"""
import base64
import math
import threading
import time

import pytest
import torch

import fa_lab  # noqa: F401  (chooses the world before anything imports numba/triton)
from fa_lab.exercises import (
    DEFAULT_TIMEOUT,
    Case,
    Exercise,
    check,
    describe,
    get,
    max_score,
    names,
    plan,
    reference,
)
from fa_lab.exercises.ch2 import online_attention as _online_solution
from fa_lab.exercises.runner import run_check

NAMES = names()


def _stub(*args, **kwargs):
    raise NotImplementedError


def _rows(result, kind=None, passed=None):
    return [r for r in result.rows if (kind is None or r["kind"] == kind) and (passed is None or r["passed"] == passed)]


def _case_of(ex, label):
    """The (seed, Case) a row label was made from."""
    for seed, case, _ in plan(ex):
        if label == f"{case.label} seed={seed}":
            return seed, case
    raise KeyError(label)


# --------------------------------------------------------------------------- every exercise

def test_exercises_are_registered():
    assert {"ch1_causal_mask", "ch1_safe_softmax", "ch1_naive_attention",
            "ch2_merge_states", "ch2_online_attention"} <= set(NAMES)
    for name in NAMES:
        assert describe(name)


@pytest.mark.parametrize("name", NAMES)
def test_model_answer_scores_full_marks(name):
    result = run_check(get(name), get(name).model_answer)
    assert result.passed, repr(result)
    assert result.score == result.max_score == max_score(get(name)) > 0
    assert "PASSED" in repr(result) and "passed" in result._repr_html_()


@pytest.mark.parametrize("name", NAMES)
def test_stub_gets_clear_feedback(name):
    result = check(name, _stub)
    assert not result.passed and result.score == 0
    assert result.max_score == max_score(get(name)), "max_score must not depend on what the learner wrote"
    assert "not implemented yet" in result.first_failure["message"]
    assert "not implemented yet" in repr(result) and "not implemented yet" in result._repr_html_()


def _first_outputs(ex):
    case = ex.make_cases(0)[0]
    return ex.solution(*case.args, **case.kwargs)


def _map_tensors(x, f):
    if isinstance(x, torch.Tensor):
        return f(x)
    if isinstance(x, (tuple, list)):
        return type(x)(_map_tensors(i, f) for i in x)
    return x


def _other_dtype(t):
    if t.is_floating_point():
        return t.to(torch.float32 if t.dtype == torch.float64 else torch.float64)
    return t.to(torch.float32)


MANGLE = {  # learner output → (wrong output, phrase the feedback must contain)
    "shape": (lambda t: t.unsqueeze(0), "shape"),
    "dtype": (_other_dtype, "dtype"),
    "device": (lambda t: t.to("meta"), "device"),
}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("how", ["raises", "returns None", "shape", "dtype", "device"])
def test_misbehaving_code_is_reported(name, how):
    ex = get(name)
    solution = ex.solution
    if how == "raises":
        def fn(*args, **kwargs):
            raise ValueError("learner bug 1234")
        phrase = "your code raised ValueError: learner bug 1234"
    elif how == "returns None":
        if ex.out_args:
            pytest.skip("kernel-style exercise: the result is in its output arguments")
        fn, phrase = (lambda *args, **kwargs: None), "None"
    else:
        if ex.out_args or not any(isinstance(t, torch.Tensor) for t in
                                  (lambda o: o if isinstance(o, (tuple, list)) else [o])(_first_outputs(ex))):
            pytest.skip("the result holds no tensor to mangle")
        mangle, phrase = MANGLE[how]

        def fn(*args, **kwargs):
            return _map_tensors(solution(*args, **kwargs), mangle)
    result = run_check(ex, fn, seeds=(0,), trusted=True)   # built on the solution: feedback, not cheating
    assert not result.passed
    assert result.max_score == max_score(ex, (0,))
    assert phrase in result.first_failure["message"], result.first_failure["message"]
    repr(result), result._repr_html_()  # displays without raising


@pytest.mark.parametrize("name", NAMES)
def test_hanging_code_is_stopped(name):
    def spin(*args, **kwargs):
        while True:
            try:
                while True:
                    pass
            except Exception:  # a learner's broad except must not keep it alive
                pass
    t0 = time.monotonic()
    result = check(name, spin, timeout=0.5)
    assert time.monotonic() - t0 < 10
    assert not result.passed and "time limit" in result.first_failure["message"]
    assert result.max_score == max_score(get(name))
    deadline = time.monotonic() + 5
    while any(t.name == "fa_lab-check" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(t.name == "fa_lab-check" for t in threading.enumerate()), "the learner's thread was not stopped"


def test_time_limit_default_and_not_callable_and_unknown_name():
    assert DEFAULT_TIMEOUT <= 60
    result = check("ch1_causal_mask", 42)
    assert not result.passed and "check needs the function you wrote" in result.first_failure["message"]
    assert result.max_score == max_score(get("ch1_causal_mask"))
    result = check("no_such_exercise", _stub)
    assert not result.passed and "known exercises" in result.first_failure["message"]


# --------------------------------------------------------------------------- chapter 1 wrong answers

def test_ch1_top_left_mask_fails_only_where_alignment_matters():
    def mask(n_q, n_k):  # top-left: query i sees keys 0..i
        return torch.tril(torch.ones(n_q, n_k, dtype=torch.bool))
    ex, result = get("ch1_causal_mask"), check("ch1_causal_mask", mask)
    assert not result.passed
    for row in _rows(result, "values"):
        _, case = _case_of(ex, row["case"])
        assert row["passed"] == (case.meta["n_q"] == case.meta["n_k"]), row
    assert "top-left" in result.first_failure["diagnosis"]


def test_ch1_unsafe_softmax_fails_overflow_and_masked_rows():
    result = check("ch1_safe_softmax", lambda s: torch.exp(s) / torch.exp(s).sum(-1, keepdim=True))
    failing = {row["case"].rsplit(" seed=", 1)[0] for row in _rows(result, passed=False)}
    assert failing == {"scores up to ±1000 (overflow)", "-inf entries and an all -inf row"}
    assert "NaN" in result.first_failure["message"]
    assert "maximum" in result.first_failure["diagnosis"]


def test_ch1_softmax_nan_on_empty_row():
    def softmax(s):
        e = torch.exp(s - s.amax(-1, keepdim=True))
        return e / e.sum(-1, keepdim=True)
    result = check("ch1_safe_softmax", softmax)
    failing = {row["case"].rsplit(" seed=", 1)[0] for row in _rows(result, passed=False)}
    assert failing == {"-inf entries and an all -inf row"}
    assert "all −inf" in result.first_failure["diagnosis"]


def test_ch1_attention_scale_forgotten():
    def attention(q, k, v, causal=False):
        s = q @ k.T
        if causal:
            n_q, n_k = s.shape
            s = s.masked_fill(torch.arange(n_k)[None] > torch.arange(n_q)[:, None] + n_k - n_q, float("-inf"))
        return torch.nan_to_num(torch.softmax(s, -1)) @ v
    result = check("ch1_naive_attention", attention)
    assert result.score < result.max_score / 2
    assert "scale" in result.first_failure["diagnosis"]


# --------------------------------------------------------------------------- chapter 2 wrong answers

LOG2E = 1.0 / math.log(2.0)


def learner_online(q, k, v, block_n, causal=False, bug=None):
    """online_attention as a learner writes it, with one classic bug switched on."""
    n_q, d = q.shape
    n_k = k.shape[0]
    scale = 1.0 if bug == "scale forgotten" else 1.0 / math.sqrt(d)
    m_i = torch.full((n_q,), -math.inf, dtype=q.dtype)
    l_i = torch.zeros(n_q, dtype=q.dtype)
    acc = torch.zeros(n_q, d, dtype=q.dtype)
    last = n_k - block_n + 1 if bug == "tail tile dropped" else n_k
    for start in range(0, last, block_n):
        end = min(start + block_n, n_k)
        s = (q @ k[start:end].T) * scale
        if causal:
            offset = 0 if bug == "top-left causal" else n_k - n_q
            keys = torch.arange(start, start + block_n if bug == "tail mask off by one" else end)
            s = s.masked_fill(keys[None, :] > torch.arange(n_q)[:, None] + offset, -math.inf)
        if bug == "running max reset per tile":
            m_new = s.max(dim=1).values
        else:
            m_new = torch.maximum(m_i, s.max(dim=1).values)
        m_use = torch.nan_to_num(m_new, neginf=0.0)
        alpha = torch.exp(m_i - m_use)
        p = torch.exp(s - m_use[:, None])
        l_i = alpha * l_i + p.sum(dim=1)
        acc = (acc if bug == "missing rescale of acc" else alpha[:, None] * acc) + p @ v[start:end]
        if bug != "running max never stored":
            m_i = m_new
    if bug == "uninitialised output rows":
        o = torch.empty_like(q)
        lse = torch.empty(n_q, dtype=q.dtype)
        seen = l_i > 0
        o[seen] = acc[seen] / l_i[seen, None]
        lse[seen] = m_i[seen] + torch.log(l_i[seen])
        return o, lse
    empty = l_i == 0
    l_div = torch.where(empty, torch.ones_like(l_i), l_i)
    o = torch.where(empty[:, None], torch.zeros_like(acc), acc / l_div[:, None])
    if bug == "lse in log2":   # the exp2 trick, without converting back
        lse = m_i * LOG2E + torch.log2(l_div)
    else:
        lse = m_i + torch.log(l_div)
    return o, torch.where(empty, torch.full_like(lse, -math.inf), lse)


def _multi_tile(c):
    return c.meta["n_k"] > c.meta["block_n"]


def _has_tail(c):
    return c.meta["tail"] > 0


def _alignment_matters(c):
    return c.meta["causal"] and c.meta["n_q"] != c.meta["n_k"]


def _has_empty_rows(c):
    return c.meta["causal"] and c.meta["n_q"] > c.meta["n_k"]


def _carry_case(c):
    return "carry the running max" in c.label


# bug → (cases it must fail: every failing values row satisfies this, and every seed has one),
#        words the feedback must contain (message + diagnosis), or None
CATALOGUE = {
    "missing rescale of acc": (_multi_tile, "missing rescale of acc"),
    "running max reset per tile": (None, "running max not carried"),   # must fail the ±100 case, below
    "running max never stored": (None, None),
    "top-left causal": (_alignment_matters, "top-left"),
    "tail tile dropped": (_has_tail, "tail tile skipped"),
    "tail mask off by one": (lambda c: _has_tail(c) and c.meta["causal"], "raised"),
    "scale forgotten": (None, "scale"),
    "lse in log2": (None, "ln 2"),
    "uninitialised output rows": (_has_empty_rows, "sees no key"),
}


@pytest.mark.parametrize("bug", list(CATALOGUE))
def test_ch2_wrong_answer_fails_the_cases_that_target_it(bug):
    target, words = CATALOGUE[bug]
    ex = get("ch2_online_attention")
    result = check("ch2_online_attention", lambda *a, **kw: learner_online(*a, **kw, bug=bug))
    assert not result.passed
    failing = _rows(result, "values", passed=False)
    assert failing, f"{bug}: no values row failed"
    per_seed = {}
    for row in _rows(result, "values"):
        seed, case = _case_of(ex, row["case"])
        if not row["passed"]:
            per_seed[seed] = per_seed.get(seed, 0) + 1
            if target is not None:
                assert target(case), f"{bug} failed a case that does not target it: {row['case']}"
    assert set(per_seed) == {0, 1, 2}, f"{bug} slipped through a whole seed: {per_seed}"
    if bug == "running max reset per tile":
        assert all(not r["passed"] for r in failing if _carry_case(_case_of(ex, r["case"])[1]))
        assert any(_carry_case(_case_of(ex, r["case"])[1]) for r in failing)
    if words:
        feedback = " ".join(r["message"] + " " + r.get("diagnosis", "") for r in failing)
        assert words in feedback, f"{bug}: feedback does not say {words!r}: {failing[0]}"


def test_ch2_correct_learner_code_passes():
    result = check("ch2_online_attention", learner_online)
    assert result.passed, repr(result)


def test_ch2_full_score_matrix_fails_only_the_structure_check():
    def full(q, k, v, block_n, causal=False):
        n_q, n_k = q.shape[0], k.shape[0]
        s = q @ k.T / math.sqrt(q.shape[1])
        if causal:
            s = s.masked_fill(torch.arange(n_k)[None] > torch.arange(n_q)[:, None] + n_k - n_q, -math.inf)
        lse = torch.logsumexp(s, dim=1)
        p = torch.exp(s - torch.nan_to_num(lse, neginf=0.0)[:, None])
        return p @ v, lse
    result = check("ch2_online_attention", full)
    assert all(r["passed"] for r in _rows(result, "values"))
    bad = _rows(result, "structure", passed=False)
    assert bad and all("Nq×Nk" in r["case"] and ("(48, 80)" in r["message"] or "(32, 48)" in r["message"])
                       for r in bad)


def test_ch2_two_passes_over_keys_fail_the_read_budget():
    def two_pass(q, k, v, block_n, causal=False):
        m = torch.full((q.shape[0],), -math.inf, dtype=q.dtype)
        for start in range(0, k.shape[0], block_n):     # pass 1: the row maxima (reads K)
            s = q @ k[start:start + block_n].T
            if causal:
                keys = torch.arange(start, min(start + block_n, k.shape[0]))
                s = s.masked_fill(keys[None] > torch.arange(q.shape[0])[:, None] + k.shape[0] - q.shape[0], -math.inf)
            m = torch.maximum(m, s.max(1).values / math.sqrt(q.shape[1]))
        return learner_online(q, k, v, block_n, causal)   # pass 2 (reads K again)
    result = check("ch2_online_attention", two_pass)
    assert all(r["passed"] for r in _rows(result, "values"))
    bad = _rows(result, "structure", passed=False)
    assert bad and all("reads of K, V" in r["case"] and "K 2×" in r["message"] for r in bad)


def test_ch2_merge_without_rescale():
    result = check("ch2_merge_states", lambda m_a, l_a, m_b, l_b: (torch.maximum(m_a, m_b), l_a + l_b))
    assert result.score < result.max_score / 2 and "rescal" in result.first_failure["diagnosis"]


# --------------------------------------------------------------------------- the machinery itself

def _fill_kernel(x, out, block):
    """A 'kernel' in the Triton style: program pid handles elements [pid*block, (pid+1)*block)."""
    for pid in range(-(-x.shape[0] // block)):
        sl = slice(pid * block, min((pid + 1) * block, x.shape[0]))
        out[sl] = 2 * x[sl]


KERNEL = Exercise(
    name="test_fill_kernel", chapter=0, title="double every element, blockwise", signature="fill(x, out, block)",
    solution=_fill_kernel, out_args=(1,), outputs=("out",), tile=(8, None),
    make_cases=lambda seed: [Case(f"n={n}", (torch.randn(n, generator=torch.Generator().manual_seed(seed)),
                                             torch.zeros(n), 8), meta=dict(n_q=n)) for n in (8, 21)],
)


def test_output_arguments_are_poisoned_and_tail_tile_located():
    def skip_tail(x, out, block):   # only whole blocks: the tail tile is never written
        for pid in range(x.shape[0] // block):
            out[pid * block:(pid + 1) * block] = 2 * x[pid * block:(pid + 1) * block]
    result = run_check(KERNEL, skip_tail, seeds=(0,))
    assert [r["passed"] for r in result.rows] == [True, False]
    msg = result.first_failure["message"]
    assert "NaN" in msg and "never" in msg and "pid_m=2" in msg and "tail tile" in msg
    assert "last, partial row tile" in msg
    png = result._heatmap(result.first_failure)
    assert png and base64.b64decode(png)[:4] == b"\x89PNG"
    assert "data:image/png;base64" in result._repr_html_()
    assert run_check(KERNEL, _fill_kernel, seeds=(0, 1)).passed


def test_empty_buffers_are_poisoned():
    def lazy_softmax(s):   # torch.empty rows never written for all -inf rows
        out = torch.empty_like(s)
        ok = torch.isfinite(s).any(-1)
        out[ok] = torch.softmax(s[ok], -1)
        return out
    result = check("ch1_safe_softmax", lazy_softmax)
    failing = {row["case"].rsplit(" seed=", 1)[0] for row in _rows(result, passed=False)}
    assert failing == {"-inf entries and an all -inf row"}
    assert "NaN" in result.first_failure["message"]


def test_learner_cannot_change_the_judges_inputs():
    def vandal(q, k, v, block_n, causal=False):
        out = _online_solution(q, k, v, block_n, causal)
        q.zero_(), k.zero_(), v.zero_()
        return out
    result = run_check(get("ch2_online_attention"), vandal, trusted=True)
    assert not result.passed and "changed its inputs q, k, v in place" in result.first_failure["message"]


def test_passing_result_draws_no_picture():
    html = run_check(get("ch1_causal_mask"), reference("ch1_causal_mask"))._repr_html_()
    assert "<img" not in html and "<table>" in html


@pytest.mark.skipif(fa_lab.ON_GPU, reason="counts loads in the Numba CUDA simulator (CPU world)")
def test_simulator_load_budget():
    global cuda  # the simulator swaps in its fake `cuda` where a kernel finds it as a global
    from numba import cuda

    from fa_lab.exercises import SimLoadBudget

    @cuda.jit
    def once(x, out):
        i = cuda.grid(1)
        if i < x.shape[0]:
            out[i] = 2 * x[i]

    @cuda.jit
    def twice(x, out):
        i = cuda.grid(1)
        if i < x.shape[0]:
            out[i] = x[i] + x[i]

    def launch(kernel):
        def fn(x, out):
            host = out.numpy()                  # shares memory with the tensor: the simulator writes it back
            kernel[(x.shape[0] + 7) // 8, 8](x.numpy(), host)
        return fn

    ex = Exercise(name="test_sim_loads", chapter=0, title="double, one load per element", signature="fn(x, out)",
                  solution=lambda x, out: out.copy_(2 * x), out_args=(1,), outputs=("out",),
                  structure=(SimLoadBudget({0: "x"}, budget=1.0),),
                  make_cases=lambda seed: [Case("n=19", (torch.randn(19, generator=torch.Generator().manual_seed(seed)),
                                                         torch.zeros(19)), meta=dict(structure=True))])
    good = run_check(ex, launch(once), seeds=(0,))
    assert good.passed, repr(good)
    bad = run_check(ex, launch(twice), seeds=(0,))
    assert [r["passed"] for r in bad.rows] == [True, False]
    assert "x 2×" in bad.rows[1]["message"]
    from numba.cuda.simulator.cudadrv.devicearray import FakeWithinKernelCUDAArray
    assert FakeWithinKernelCUDAArray.__getitem__.__name__ == "__getitem__", "the counting patch was not undone"


@pytest.mark.parametrize("name", NAMES)
def test_hints_open_one_tier_at_a_time(name):
    from fa_lab.exercises import hint

    ex = get(name)
    assert len(ex.hints) >= 2, "a gentle first hint, and more on request"
    first, last = hint(name, 1), hint(name, len(ex.hints))
    assert first.startswith(f"Hint 1/{len(ex.hints)}") and f"hint({name!r}, 2)" in first
    assert ex.hints[-1] in last and ex.hints[-1] not in first
    assert "here is the last one" in hint(name, len(ex.hints) + 1)
    with pytest.raises(ValueError):
        hint(name, 0)
    assert f"hint({name!r}, 1)" in describe(name)
