"""Chapter 6's exercise: the solution agrees with fa_lab.perf, and typical wrong counts are named."""
import pytest

from fa_lab.exercises import check, get, reference
from fa_lab.exercises.ch6 import _exact_keys, _kv_once, _no_lse, _no_skipping
from fa_lab.exercises.runner import run_check
from fa_lab.perf.model import Problem, flash_forward_counts

DTYPES = {2: "fp16", 4: "fp32"}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_solution_matches_the_model(seed):
    ex = get("ch6_tiled_forward_bytes")
    for case in ex.make_cases(seed):
        B, H, n_q, n_k, D, bm, bn = case.args
        causal, itemsize = case.kwargs.get("causal", False), case.kwargs.get("itemsize", 2)
        p = Problem(B, H, n_q, n_k, head_dim=D, mask="causal" if causal else "full", dtype=DTYPES[itemsize])
        assert reference("ch6_tiled_forward_bytes")(*case.args, **case.kwargs) == \
            flash_forward_counts(p, block_m=bm, block_n=bn).hbm_bytes, case.label


def test_solution_scores_full_marks():
    res = run_check(get("ch6_tiled_forward_bytes"), get("ch6_tiled_forward_bytes").model_answer)
    assert res.score == res.max_score > 0


@pytest.mark.parametrize("wrong,words", [(_kv_once, "re-read"), (_no_lse, "log-sum-exp"),
                                         (_no_skipping, "never loaded"), (_exact_keys, "whole")])
def test_typical_mistakes_fail_with_a_named_reason(wrong, words):
    res = run_check(get("ch6_tiled_forward_bytes"), wrong, trusted=True)   # built from the solution's module
    assert res.score < res.max_score
    assert any(words in str(row.get("diagnosis", "")) for row in res.rows)


def test_stub_gets_feedback_not_an_exception():
    def stub(*args, **kwargs):
        raise NotImplementedError

    res = check("ch6_tiled_forward_bytes", stub)
    assert res.score == 0 and res.max_score > 0
