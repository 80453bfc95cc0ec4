"""The grader as a security boundary: every way a learner's notebook could forge its score, and what it sees.

Two levels.  ``check(...)`` as a notebook calls it (the learner's function is importable by name,
so it runs in a fresh process, as a notebook's top-level function does), and ``fa-lab grade`` on
notebooks that try to forge their grade while they run.
"""
import argparse
import json
import sys
import textwrap
import time
from pathlib import Path

import nbformat
import pytest

import fa_lab  # noqa: F401  (chooses the world before anything imports numba/triton)
from fa_lab.exercises import check, get, max_score, reference
from fa_lab.exercises import grade as cli_grade
from fa_lab.exercises.isolate import MARGIN

ROOT = Path(__file__).resolve().parents[1]

LEARNER = '''
import math

import numba
import torch

import fa_lab
from fa_lab.exercises import reference


def naive(q, k, v, causal=False):
    s = q @ k.T / math.sqrt(q.shape[-1])
    if causal:
        n_q, n_k = s.shape
        keep = torch.arange(n_k)[None, :] <= torch.arange(n_q)[:, None] + (n_k - n_q)
        s = s.masked_fill(~keep, float("-inf"))
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - torch.where(torch.isinf(m), torch.zeros_like(m), m))
    l = p.sum(-1, keepdim=True)
    return (p / torch.where(l == 0, torch.ones_like(l), l)) @ v


def calls_fa_lab(q, k, v, causal=False):
    return fa_lab.attention(q[None, None], k[None, None], v[None, None], causal=causal)[0, 0]


def calls_reference(q, k, v, causal=False):
    return reference("ch1_naive_attention")(q, k, v, causal)


def calls_sdpa(q, k, v, causal=False):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


the_reference = reference("ch1_naive_attention")


def patches_the_judge(q, k, v, causal=False):
    import fa_lab.exercises.judge as judge
    import fa_lab.exercises.result as result
    judge.judge = lambda *a, **kw: None
    result.CheckResult.passed = property(lambda self: True)
    return torch.zeros(q.shape[0], v.shape[1], dtype=q.dtype)


@numba.njit
def _spin(n):
    i = 0
    while i >= 0:          # never ends, and holds the GIL: no thread of this process can stop it
        i = (i + n) % 1000
    return i


def hangs_in_compiled_code(q, k, v, causal=False):
    _spin(1)


class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no message for you")


def raises_unprintable(q, k, v, causal=False):
    raise Unprintable()


def raises_keyboard_interrupt(q, k, v, causal=False):
    raise KeyboardInterrupt


def mutates_inputs(q, k, v, causal=False):
    out = naive(q, k, v, causal)
    q.zero_()
    return out


def wrong_unless_d_multiple_of_8(q, k, v, causal=False):
    d8 = q.shape[-1] // 8 * 8 or q.shape[-1]
    return naive(q[:, :d8], k[:, :d8], v, causal)


def wrong_past_96_keys(q, k, v, causal=False):
    n = min(k.shape[0], 96)
    if causal and k.shape[0] > 96:
        return naive(q, k[:n], v[:n], False)
    return naive(q, k[:n], v[:n], causal)


def causal_mask_numpy(n_q, n_k):
    import numpy as np
    return np.tril(np.ones((n_q, n_k), dtype=bool), n_k - n_q)
'''


@pytest.fixture(scope="module")
def learner(tmp_path_factory):
    folder = tmp_path_factory.mktemp("learner")
    (folder / "learner_forgeries.py").write_text(LEARNER)
    sys.path.insert(0, str(folder))
    import learner_forgeries
    yield learner_forgeries
    sys.path.remove(str(folder))


ATTENTION = "ch1_naive_attention"


def _check(fn, **kwargs):
    result = check(ATTENTION, fn, seeds=(0,), **kwargs)
    assert result.max_score == max_score(get(ATTENTION), (0,))
    repr(result), result._repr_html_()      # displays without raising
    return result


def test_an_honest_solution_passes_in_a_fresh_process(learner):
    result = _check(learner.naive)
    assert result.passed, repr(result)


@pytest.mark.parametrize("fn,words", [
    ("calls_fa_lab", "fa_lab's finished implementation (api.attention)"),
    ("calls_reference", "not accepted: your function called"),
    ("calls_sdpa", "scaled_dot_product_attention"),
    ("the_reference", "the exercise's own solution (exercises.reference)"),
])
def test_someone_elses_answer_is_named(learner, fn, words):
    result = _check(getattr(learner, fn))
    assert result.score == 0, repr(result)
    assert words in result.first_failure["message"], result.first_failure["message"]


def test_the_reference_itself_is_not_a_solution():
    result = check(ATTENTION, reference(ATTENTION), seeds=(0,))
    assert result.score == 0 and "own solution" in result.first_failure["message"]


def test_patching_the_judge_from_inside_the_function_changes_nothing(learner):
    result = _check(learner.patches_the_judge)
    assert result.score == 0 and "wrong answer" in result.first_failure["message"]
    assert check(ATTENTION, learner.naive, seeds=(0,)).passed     # this process's grader is untouched


def test_a_compiled_infinite_loop_is_killed(learner):
    t0 = time.monotonic()
    result = _check(learner.hangs_in_compiled_code, timeout=3)
    assert time.monotonic() - t0 < 3 + MARGIN + 15
    assert result.score == 0 and "time limit" in result.first_failure["message"]
    assert check(ATTENTION, learner.naive, seeds=(0,)).passed     # the next check starts afresh


@pytest.mark.parametrize("fn,words", [
    ("raises_unprintable", "your code raised Unprintable"),
    ("raises_keyboard_interrupt", "KeyboardInterrupt (raised by your code itself"),
    ("mutates_inputs", "changed its input q in place"),
])
def test_misbehaviour_is_reported_never_raised(learner, fn, words):
    result = _check(getattr(learner, fn))
    assert result.score == 0 and words in result.first_failure["message"], result.first_failure["message"]


@pytest.mark.parametrize("fn,label", [("wrong_unless_d_multiple_of_8", "D=12"),
                                      ("wrong_past_96_keys", "n_k=130")])
def test_shape_bugs_are_caught(learner, fn, label):
    result = check(ATTENTION, getattr(learner, fn))          # every default seed
    failing = [r for r in result.rows if not r["passed"]]
    assert failing and not result.passed
    assert any(label in r["case"] for r in failing), [r["case"] for r in failing]


def test_right_values_in_the_wrong_type_get_the_right_diagnosis(learner):
    result = check("ch1_causal_mask", learner.causal_mask_numpy, seeds=(0,))
    assert not result.passed
    diagnosis = result.first_failure.get("diagnosis", "")
    assert "NumPy array" in diagnosis and "known mistake" not in diagnosis, diagnosis


# --------------------------------------------------------------------------- fa-lab grade

FORGED_CELLS = [
    # 1. an honest causal mask: must get full marks despite everything below
    '''def causal_mask(n_q, n_k):
    return torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q)''',
    # 2. a softmax that returns zeros, with every trick to make it pass
    '''def softmax_rows(s):
    return torch.zeros_like(s)''',
    '''import json, os
for name, top in (("ch1_safe_softmax", 21), ("ch1_naive_attention", 24), ("ch1_causal_mask", 24)):
    with open(os.environ.get("FA_LAB_GRADE_LOG", "forged_log.jsonl"), "a") as f:
        f.write(json.dumps(dict(name=name, score=top, max_score=top, passed=True)) + "\\n")''',
    '''import fa_lab.exercises.judge, fa_lab.exercises.result
fa_lab.exercises.judge.judge = lambda *a, **kw: None
fa_lab.exercises.result.CheckResult.passed = property(lambda self: True)
fa_lab.exercises.result.CheckResult.score = property(lambda self: self.max_score)''',
    # 3. naive attention that never returns (compiled, holding the GIL)
    '''import numba

@numba.njit
def _spin(n):
    i = 0
    while i >= 0:
        i = (i + n) % 1000
    return i

def naive_attention(q, k, v, causal=False):
    return _spin(1)''',
    # 4. the last cell: the reference checked under the learner's names
    '''from fa_lab.exercises import reference
check("ch1_safe_softmax", reference("ch1_safe_softmax"))
check("ch1_naive_attention", reference("ch1_naive_attention"))''',
]


def _grade(capsys, *argv):
    parser = argparse.ArgumentParser()
    cli_grade.configure(parser)
    rc = cli_grade.run(parser.parse_args([*argv, "--json"]))
    return rc, json.loads(capsys.readouterr().out)


def test_grade_cannot_be_forged(tmp_path, capsys):
    book = nbformat.read(ROOT / "exercises" / "01_naive_attention.ipynb", as_version=4)
    for source in FORGED_CELLS:
        book.cells.append(nbformat.v4.new_code_cell(textwrap.dedent(source)))
    path = tmp_path / "forged.ipynb"
    nbformat.write(book, path)
    rc, graded = _grade(capsys, str(path), "--timeout", "5")
    (entry,) = graded["notebooks"]
    scores = {e["name"]: e for e in entry["exercises"]}
    assert scores["ch1_causal_mask"]["passed"], scores["ch1_causal_mask"]
    assert scores["ch1_safe_softmax"]["score"] == 0
    assert "wrong answer" in scores["ch1_safe_softmax"]["feedback"]
    assert scores["ch1_naive_attention"]["score"] == 0
    assert "time limit" in scores["ch1_naive_attention"]["feedback"]
    assert entry["score"] == scores["ch1_causal_mask"]["max_score"]


def test_a_failing_demo_line_costs_nothing():
    from fa_lab.exercises.program import extract, load

    program = extract(["import torch\nx = undefined_thing + 1\nBLOCK = 16",
                       "def softmax_rows(s):\n    return torch.softmax(s, -1) * BLOCK / 16",
                       "for i in range(3):\n    softmax_rows = None\ncheck('ch1_safe_softmax', softmax_rows)"])
    assert "for i" not in program and "check(" not in program
    namespace, _ = load(program)
    assert namespace["BLOCK"] == 16 and callable(namespace["softmax_rows"])


MISBEHAVING_CH1 = [
    '''class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no")

def causal_mask(n_q, n_k):
    raise Unprintable()''',
    '''def softmax_rows(s):
    s -= s.amax(-1, keepdim=True).clamp_min(-1e30)     # in place: the caller's scores change
    e = torch.exp(s)
    return e / e.sum(-1, keepdim=True).clamp_min(1e-30)''',
    '''import fa_lab

def naive_attention(q, k, v, causal=False):
    return fa_lab.attention(q[None, None], k[None, None], v[None, None], causal=causal)[0, 0]''',
]

MISBEHAVING_CH2 = [
    '''def merge_states(m_a, l_a, m_b, l_b):
    raise KeyboardInterrupt''',
    '''import math

def online_attention(q, k, v, block_n, causal=False):
    k, v = k[:96], v[:96]                    # a bug: keys past 96 are never visited
    n_q, n_k = q.shape[0], k.shape[0]
    m = torch.full((n_q,), -math.inf, dtype=torch.float64)
    l = torch.zeros(n_q, dtype=torch.float64)
    acc = torch.zeros(n_q, v.shape[1], dtype=torch.float64)
    for j0 in range(0, n_k, block_n):
        s = q.double() @ k[j0:j0 + block_n].double().T / math.sqrt(q.shape[1])
        if causal:
            i = torch.arange(n_q)[:, None]
            j = torch.arange(j0, min(j0 + block_n, n_k))[None, :]
            s = s.masked_fill(j > i + (n_k - n_q), -math.inf)
        m_new = torch.maximum(m, s.amax(1))
        m_use = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(s - m_use[:, None])
        alpha = torch.exp(m - m_use)
        l = l * alpha + p.sum(1)
        acc = acc * alpha[:, None] + p @ v[j0:j0 + block_n].double()
        m = m_new
    seen = l > 0
    o = torch.where(seen[:, None], acc / torch.where(seen, l, torch.ones_like(l))[:, None], torch.zeros_like(acc))
    lse = torch.where(seen, m + torch.log(torch.where(seen, l, torch.ones_like(l))), torch.full_like(l, -math.inf))
    return o.to(q.dtype), lse.to(q.dtype)''',
]


@pytest.mark.parametrize("notebook,cells,expected", [
    ("01_naive_attention.ipynb", MISBEHAVING_CH1,
     {"ch1_causal_mask": "your code raised Unprintable", "ch1_safe_softmax": "changed its input s in place",
      "ch1_naive_attention": "not accepted: your function called fa_lab's finished implementation"}),
    ("02_online_softmax.ipynb", MISBEHAVING_CH2,
     {"ch2_merge_states": "KeyboardInterrupt (raised by your code itself", "ch2_online_attention": "n_k=130"}),
])
def test_grade_names_every_misbehaviour(tmp_path, capsys, notebook, cells, expected):
    book = nbformat.read(ROOT / "exercises" / notebook, as_version=4)
    for source in cells:
        book.cells.append(nbformat.v4.new_code_cell(source))
    path = tmp_path / notebook
    nbformat.write(book, path)
    rc, graded = _grade(capsys, str(path), "--timeout", "30")
    (entry,) = graded["notebooks"]
    for e in entry["exercises"]:
        assert not e["passed"], e
        assert expected[e["name"]] in e["feedback"], (e["name"], e["feedback"])
