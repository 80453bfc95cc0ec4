"""Chapter 10 exercises: the model answers score full marks, the notebook's skeleton filled in does too, and
typical mistakes fail with their name.

The wrong kernels are the notebook's own cell with one mistake typed into it, written to a file of the test's
(a learner's file, not fa_lab's: the check must see them as the learner's own kernels), so the feedback they get
is the feedback a learner with that mistake gets.
"""
import importlib.util
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import fa_lab  # noqa: F401  (conftest imports it before triton: it picks the world)
from fa_lab.exercises import ch10, ch10_kernels, get, hint
from fa_lab.exercises.runner import run_check

ROOT = Path(__file__).resolve().parents[1]
NAMES = ["ch10_alibi_slopes", "ch10_softcap_backward", "ch10_score_mod_kernel"]


def test_the_kernel_exercise_is_a_triton_kernel_judged_in_float64():
    ex = get("ch10_score_mod_kernel")
    assert ex.kind == "triton" and ex.model_answer is not ex.solution and ex.judge_dtype == torch.float64
    cases = ex.make_cases(0)
    assert any(c.meta["causal"] for c in cases) and any(not c.meta["causal"] for c in cases)
    assert any(c.meta["softcap"] for c in cases) and any(not c.meta["softcap"] for c in cases)
    slopes = [c.kwargs["alibi_slopes"] for c in cases if c.kwargs["alibi_slopes"] is not None]
    assert {s.dim() for s in slopes} == {1, 2}                       # (H,) and (B, H)
    assert any(c.args[0].shape[1] != c.args[1].shape[1] for c in cases)   # GQA
    assert any(c.meta["n_q"] < c.meta["n_k"] for c in cases) and any(c.meta["n_q"] > c.meta["n_k"] for c in cases)


@pytest.mark.parametrize("name", ["ch10_alibi_slopes", "ch10_softcap_backward"])
def test_warm_up_mistakes_are_named(name):
    ex = get(name)
    for mistake in ex.mistakes:
        result = run_check(ex, mistake.fn, trusted=True, seeds=(0,))
        assert not result.passed, mistake.name
        assert mistake.name in " ".join(r.get("diagnosis", "") or "" for r in result.rows), mistake.name


def test_kernel_mistakes_are_named():
    ex = get("ch10_score_mod_kernel")
    for mistake in ex.mistakes:
        result = run_check(ex, mistake.fn, trusted=True, seeds=(0,))
        assert not result.passed, mistake.name
        assert mistake.name in " ".join(r.get("diagnosis", "") or "" for r in result.rows), mistake.name


@pytest.mark.parametrize("name", NAMES)
def test_hints_come_in_three_tiers(name):
    ex = get(name)
    assert len(ex.hints) == 3 and ex.hint == ex.hints[0]
    assert hint(name, 1).startswith("Hint 1/3") and "says more" in hint(name, 1)
    assert "tl." not in ex.hints[0] and "torch." not in ex.hints[0] and "=" not in ex.hints[0]


# --------------------------------------------------------------------------- the warm-ups against closed forms

def test_slopes_are_press_et_al():
    assert ch10.alibi_slopes(8).tolist() == [2.0 ** -h for h in range(1, 9)]
    twelve = ch10.alibi_slopes(12).cpu()
    assert torch.equal(twelve[:8], ch10.alibi_slopes(8).cpu())               # the 8 of the power of two below
    assert torch.allclose(torch.log2(twelve[8:]), torch.tensor([-0.5, -1.5, -2.5, -3.5]))   # then 16's odd ones
    assert ch10.alibi_slopes(1).tolist() == [2.0 ** -8]
    assert ch10.alibi_slopes(6).dtype == torch.float32 and ch10.alibi_slopes(6).shape == (6,)


def test_softcap_backward_is_autograd_of_the_cap():
    s = (torch.randn(4, 5, 7, dtype=torch.float64) * 40).requires_grad_(True)
    for cap in (50.0, 5.0):
        c = cap * torch.tanh(s / cap)
        dc = torch.randn_like(c)
        (ds,) = torch.autograd.grad(c, s, dc)
        assert torch.allclose(ch10.softcap_backward(c.detach(), dc, cap), ds, atol=1e-12, rtol=1e-12)
    dc = torch.randn(3, 3, dtype=torch.float64)
    assert torch.equal(ch10.softcap_backward(torch.randn(3, 3, dtype=torch.float64), dc, 0.0), dc)


# --------------------------------------------------------------------------- the notebook's skeleton

def _kernel_cell() -> str:
    nb = json.loads((ROOT / "exercises" / "10_score_mods.ipynb").read_text(encoding="utf-8"))
    cells = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    (cell,) = [c for c in cells if "def flash_attention_mods" in c]
    return cell


SCORE_MOD_STUB = "    s = qk\n    return s\n"
SLOPE_STUB = "    # TODO 4. if ALIBI: load this program's slope (batch b, query head h)\n"
STOP = "    raise NotImplementedError  # remove this line once score_mod and the slope are written\n"

RIGHT_SCORE_MOD = """    s = qk * scale
    if SOFTCAP:
        s = softcap * (2.0 * tl.sigmoid(2.0 * (s / softcap)) - 1.0)
    if ALIBI:
        s = s - slope * tl.abs(q_idx + (n_k - n_q) - kv_idx).to(tl.float32)
    return s
"""
RIGHT_SLOPE = """    if ALIBI:
        slope = tl.load(SLOPES + b * stride_sb + h * stride_sh)
"""


def _learner_module(tmp_path, name, score_mod=RIGHT_SCORE_MOD, slope=RIGHT_SLOPE):
    """The notebook's cell with its TODOs filled in, as a file of the learner's, imported."""
    cell = _kernel_cell()
    for stub in (SCORE_MOD_STUB, SLOPE_STUB, STOP):
        assert cell.count(stub) == 1, f"the notebook's skeleton changed: {stub!r} not found once"
    code = cell.replace(SCORE_MOD_STUB, score_mod).replace(SLOPE_STUB, slope).replace(STOP, "")
    header = "import math\n\nimport torch\n\nimport fa_lab\nimport triton\nimport triton.language as tl\n\n"
    path = tmp_path / f"{name}.py"
    path.write_text(header + code, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_skeleton_filled_in_scores_full_marks(tmp_path):
    learner = _learner_module(tmp_path, "learner_right")
    result = run_check(get("ch10_score_mod_kernel"), learner.flash_attention_mods)
    assert result.passed and result.score == result.max_score > 0, repr(result)


def _code_lines(text: str) -> list[str]:
    """Lines of code without comments, docstrings or blank lines."""
    import ast

    tree = ast.parse(text)
    for node in ast.walk(tree):   # docstrings out
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
    return [line.strip() for line in ast.unparse(tree).splitlines() if line.strip()]


def test_the_skeleton_is_the_model_answer_with_its_todos(tmp_path):
    """The model answer is the notebook's cell filled in: the same kernel, helper and launcher, line by line."""
    import inspect

    filled = _kernel_cell().replace(SCORE_MOD_STUB, RIGHT_SCORE_MOD).replace(SLOPE_STUB, RIGHT_SLOPE).replace(STOP, "")
    cell = set(_code_lines(filled))
    for fn in (ch10_kernels.score_mod.fn, ch10_kernels.flash_mods_kernel.fn, ch10_kernels.flash_attention_mods_triton):
        missing = [line for line in _code_lines(inspect.getsource(fn)) if line not in cell
                   and not line.startswith(("@triton.jit", "def "))]
        assert not missing, f"{fn.__name__}: the notebook lacks {missing}"
    learner = _learner_module(tmp_path, "learner_tiles")
    assert (learner.BLOCK_M, learner.BLOCK_N) == (ch10_kernels.BLOCK_M, ch10_kernels.BLOCK_N)


WRONG = {
    "softcap applied before the scale": dict(score_mod=RIGHT_SCORE_MOD.replace(
        "    s = qk * scale\n    if SOFTCAP:\n        s = softcap * (2.0 * tl.sigmoid(2.0 * (s / softcap)) - 1.0)\n",
        "    s = qk\n    if SOFTCAP:\n        s = softcap * (2.0 * tl.sigmoid(2.0 * (s / softcap)) - 1.0)\n"
        "    s = s * scale\n")),
    "ALiBi distance measured top-left": dict(score_mod=RIGHT_SCORE_MOD.replace("q_idx + (n_k - n_q) - kv_idx",
                                                                                "q_idx - kv_idx")),
    "ALiBi added with the wrong sign": dict(score_mod=RIGHT_SCORE_MOD.replace("s = s - slope", "s = s + slope")),
    "the slope of the K/V head": dict(slope=RIGHT_SLOPE.replace("h * stride_sh", "h_kv * stride_sh")),
}


@pytest.mark.parametrize("mistake", sorted(WRONG))
def test_wrong_kernels_fail_and_the_mistake_is_named(tmp_path, mistake):
    learner = _learner_module(tmp_path, "learner_" + "".join(c for c in mistake if c.isalnum()), **WRONG[mistake])
    ex = get("ch10_score_mod_kernel")
    first = replace(ex, make_cases=lambda seed: ex.make_cases(seed)[:7])   # every mistake's target is in these
    result = run_check(first, learner.flash_attention_mods, seeds=(0,))
    assert not result.passed
    wrong = [r for r in result.rows if r["kind"] == "values" and not r["passed"]]
    assert wrong and all(r["message"].startswith("wrong answer") for r in wrong), wrong
    said = " ".join(r["message"] + " " + (r.get("diagnosis") or "") for r in wrong)
    assert f"known mistake — {mistake}" in said, said


def test_the_model_kernel_agrees_with_the_varlen_kernel():
    """Two kernels of the book, one definition: the exercise's and chapter 8's, on the same call."""
    g = torch.Generator().manual_seed(7)
    q = (torch.randn(2, 4, 19, 32, generator=g) * 3).to(fa_lab.DEVICE, torch.float16)
    k, v = (torch.randn(2, 2, 45, 32, generator=g).to(fa_lab.DEVICE, torch.float16) for _ in range(2))
    slopes = ch10.alibi_slopes(4)
    o, lse = ch10_kernels.flash_attention_mods_triton(q, k, v, causal=True, softcap=4.0, alibi_slopes=slopes)
    o_ref, lse_ref = fa_lab.attention(q, k, v, impl="triton_varlen", causal=True, softcap=4.0, alibi_slopes=slopes,
                                      return_lse=True)
    assert (o.float() - o_ref.float()).abs().max() < 4e-3
    assert (lse - lse_ref).abs().max() < 1e-4 * math.sqrt(32)
