"""Chapter 5 exercises: the model answers score full marks; each classic mistake fails and is named.

The two kernel exercises are also fed real wrong Triton kernels: mutants of the model answer,
each with one classic mistake written into its source, loaded from a file of their own (so
the grader sees them as a learner's kernels).  Each must fail, with the diagnosis a learner
should read.
"""
import importlib.util
import inspect
import math

import pytest
import torch

import fa_lab  # noqa: F401  (first: picks the world)
from fa_lab.exercises import ch5_kernels, ch5_split, get, hint, names, structure
from fa_lab.exercises.runner import run_check

KERNEL_EXERCISES = ("ch5_dkdv_kernel", "ch5_dq_kernel", "ch5_dkdv_split")


def _diagnoses(result) -> str:
    return " ".join(str(r.get("diagnosis", "")) for r in result.rows if not r["passed"])


@pytest.mark.parametrize("name", names(5))
def test_model_answer_scores_full_marks(name):
    ex = get(name)
    result = run_check(ex, ex.model_answer)
    assert result.passed and result.score == result.max_score, result.first_failure


def test_kernel_exercises_are_triton_with_tiered_hints():
    for name in KERNEL_EXERCISES:
        ex = get(name)
        assert ex.kind == "triton" and ex.model_answer is not ex.solution
        assert len(ex.hints) == 3 and hint(name, 1).startswith("Hint 1/3")
        assert "tl.dot" not in ex.hints[0] and "tl.dot" in ex.hints[2], "tier 1 points, tier 3 spells it out"
        # every case is one the interpreter can run; the structure row is planned on at least one of them
        cases = ex.make_cases(0)
        assert any(c.meta["structure"] for c in cases)
        assert any(c.kwargs["causal"] and c.meta["n_q"] > c.meta["n_k"] for c in cases), "rows that see no key"
        assert any(c.args[0].shape[1] > c.args[1].shape[1] for c in cases), "GQA"
        if name == "ch5_dkdv_split":   # descriptors copy whole tiles: lengths multiples of 16, D a power of two
            assert all(c.meta["n_q"] % 16 == 0 and c.meta["n_k"] % 16 == 0 for c in cases)
            assert {c.args[0].shape[-1] for c in cases} <= {16, 32, 64, 128}
            continue
        assert any(c.args[0].shape[-1] % 8 for c in cases), "a head dim that needs BLOCK_D padding"
        assert any(c.meta["n_k"] > 100 for c in cases)


def test_judge_is_autograd_and_the_formulas_agree_with_it():
    """The mistakes are the formulas with one switch flipped: without it they must be the judge."""
    for case in ch5_kernels.kernel_cases(3):
        q, k, v, o, do, lse, delta = case.args
        causal = case.kwargs["causal"]
        expected = ch5_kernels._autograd_grads(q, k, v, do, causal)
        for got, want in zip(ch5_kernels._grads(q, k, v, do, lse, delta, causal), expected):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        dq = ch5_kernels.dq_reference(*case.args, causal=causal)
        assert dq.dtype == q.dtype and torch.isfinite(dq).all()


@pytest.mark.parametrize("name,mistake", [(n, m) for n in names(5) for m in get(n).mistakes],
                         ids=lambda x: getattr(x, "name", x))
def test_each_mistake_fails_with_its_diagnosis(name, mistake):
    # trusted: these wrong answers are fa_lab's own functions (what is tested is the diagnosis)
    seeds = (0,) if get(name).kind == "triton" else (0, 1)     # a kernel exercise has more cases
    result = run_check(get(name), mistake.fn, seeds=seeds, trusted=True)
    assert not result.passed
    assert mistake.name in _diagnoses(result), _diagnoses(result)[:500]


# --------------------------------------------------------------------------- wrong Triton kernels

#: exercise -> (kernel, launcher) of the model answer, and the mutants: (mistake it makes, [(old, new), ...])
MUTANTS = {
    "ch5_dkdv_kernel": (ch5_kernels.dkdv_kernel, ch5_kernels.attention_dkdv, [
        ("D (delta) left out of dS", [("dsT = pT * (dpT - Di[None, :])", "dsT = pT * dpT")]),
        ("the scale left out of dK", [("(dk * sm_scale).to(", "dk.to(")]),
        ("GQA: only the group's first query head", [("for g in range(group):", "for g in range(1):")]),
        ("a top-left causal mask", [("diag = N_K - N_Q", "diag = 0")]),
    ]),
    "ch5_dkdv_split": (ch5_split.dkdv_split_kernel, ch5_split.attention_dkdv_split, [
        ("D (delta) left out of dS", [("(tl.dot(v, tl.trans(do)) - Di[None, :])", "tl.dot(v, tl.trans(do))")]),
        ("the scale left out of dK", [("(dk * sm_scale).to(", "dk.to(")]),
        ("GQA: only the group's first query head", [("tl.range(0, group * n_blocks,", "tl.range(0, n_blocks,")]),
        ("a top-left causal mask", [("diag = N_K - N_Q", "diag = 0")]),
    ]),
    "ch5_dq_kernel": (ch5_kernels.dq_kernel, ch5_kernels.attention_dq, [
        ("D (delta) left out of dS", [("ds = p * (dp - Di[:, None])", "ds = p * dp")]),
        ("the scale left out of dQ", [("(dq * sm_scale).to(", "dq.to(")]),
        ("a top-left causal mask", [("diag = N_K - N_Q", "diag = 0")]),
        ("GQA: the wrong K/V head", [("(bh % H) // (H // HKV)", "(bh % H) % HKV")]),
    ]),
}


def _load_mutant(tmp_path, kernel, launcher, edits, tag):
    """The model answer's kernel and launcher with ``edits`` applied, imported from a file of their own."""
    source = inspect.getsource(kernel.fn) + "\n\n" + inspect.getsource(launcher)
    for old, new in edits:
        assert source.count(old) == 1, f"the model answer no longer contains {old!r}: update the mutant"
        source = source.replace(old, new)
    path = tmp_path / f"mutant_{tag}.py"
    path.write_text("import math\n\nimport torch\nimport triton\nimport triton.language as tl\n\nimport fa_lab\n"
                    "\n\ndef descriptor_scratch(size, alignment, stream):   # the learner's own, as in the notebook\n"
                    "    return torch.empty(size, dtype=torch.int8, device=fa_lab.DEVICE)\n\n\n" + source,
                    encoding="utf-8")
    spec = importlib.util.spec_from_file_location(f"mutant_{tag}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, launcher.__name__)


@pytest.mark.parametrize("name,mistake,edits", [(n, m, e) for n, (_, _, ms) in MUTANTS.items() for m, e in ms],
                         ids=lambda x: x if isinstance(x, str) else "")
def test_wrong_kernel_fails_and_is_named(tmp_path, name, mistake, edits):
    kernel, launcher, _ = MUTANTS[name]
    wrong = _load_mutant(tmp_path, kernel, launcher, edits, abs(hash((name, mistake))))
    result = run_check(get(name), wrong, seeds=(0,))
    assert not result.passed
    wrong_values = [r for r in result.rows if r["kind"] == "values" and not r["passed"]]
    assert wrong_values and all(r["message"].startswith("wrong answer") for r in wrong_values)
    assert f"known mistake — {mistake}" in _diagnoses(result), _diagnoses(result)[:800]
    # it is the learner's own Triton kernel: that row passes wherever the values are right
    own = [r for r in result.rows if r["case"].endswith("your own Triton kernel")]
    assert own and all(r["passed"] or r["message"].startswith("not judged: the values") for r in own)


def test_unchanged_model_answer_from_a_file_passes(tmp_path):
    """The mutants' loader itself is sound: with no edit, the copy is a learner's correct kernel."""
    kernel, launcher, _ = MUTANTS["ch5_dq_kernel"]
    result = run_check(get("ch5_dq_kernel"), _load_mutant(tmp_path, kernel, launcher, [], "same"), seeds=(0,))
    assert result.passed, result.first_failure


def test_dense_pytorch_fails_the_kernel_and_structure_rows():
    """Right numbers from whole-matrix PyTorch: no Triton kernel launched, an Nq×Nk buffer built."""
    def attention_dq(q, k, v, o, do, lse, delta, causal=False):
        group = q.shape[1] // k.shape[1]
        kx, vx = (t.repeat_interleave(group, dim=1).float() for t in (k, v))
        s = q.float() @ kx.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if causal:
            n_q, n_k = q.shape[2], k.shape[2]
            hidden = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).triu(n_k - n_q + 1)
            s = s.masked_fill(hidden, float("-inf"))
        p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
        ds = p * (do.float() @ vx.transpose(-1, -2) - delta[..., None])
        return (ds @ kx / math.sqrt(q.shape[-1])).to(q.dtype)

    result = run_check(get("ch5_dq_kernel"), attention_dq, seeds=(0,))
    assert not result.passed
    values = [r for r in result.rows if r["kind"] == "values"]
    assert all(r["passed"] for r in values), [r["message"][:200] for r in values if not r["passed"]]
    structure = [r for r in result.rows if r["kind"] == "structure"]
    assert any("Nq×Nk" in r["message"] for r in structure if r["case"].endswith("no Nq×Nk buffer"))
    assert not any(r["passed"] for r in structure if r["case"].endswith("your own Triton kernel"))


def test_pointer_loads_fail_the_split_exercise_with_its_reason(tmp_path):
    """5.5's kernel (pointers) gives the right gradients on 5.7's cases, and only the descriptor row fails:
    counted in the interpreter on a CPU, read from the compiled code on a GPU."""
    kernel, launcher, _ = MUTANTS["ch5_dkdv_kernel"]
    pointers = _load_mutant(tmp_path, kernel, launcher, [], "pointers")
    result = run_check(get("ch5_dkdv_split"), pointers, seeds=(0,))
    assert not result.passed
    assert all(r["passed"] for r in result.rows if r["kind"] == "values")
    failed = [r for r in result.rows if not r["passed"]]
    assert failed and all("through pointers" in r["message"] for r in failed), [r["message"] for r in failed]
    where = "in its compiled code" if fa_lab.ON_GPU else "in the Triton interpreter"
    assert all(where in r["message"] for r in failed)


def test_compiled_memory_ops_counts_the_ir_of_each_kernel_once():
    """The GPU world's counter reads Triton IR: ``tt.load``/``tt.store`` are pointer accesses, the
    ``tt.descriptor_*`` ops are not, and a kernel launched twice is counted once."""
    class Kernel:   # what JITFunction.run returns: the compiled kernel, its IR under asm["ttir"]
        def __init__(self, ttir):
            self.asm = {"ttir": ttir}

    ptr = Kernel("%a = tt.load %p, %m : tensor<64x64x!tt.ptr<f16>>\ntt.store %p, %a : tensor<64x64x!tt.ptr<f16>>\n"
                 "%c = tt.load %s : !tt.ptr<f32>")
    desc = Kernel("%d = tt.make_tensor_descriptor %K, [%n, %c64], [%c64, %c1] : <f16>, <64x64xf16>\n"
                  "%x = tt.descriptor_load %d[%r, %c0] : !tt.tensordesc<64x64xf16> -> tensor<64x64xf16>\n"
                  "tt.descriptor_store %d[%r, %c0], %x : !tt.tensordesc<64x64xf16>, tensor<64x64xf16>")
    ops = structure.CompiledMemoryOps()
    for kernel in (ptr, desc, desc, Kernel(None), object()):
        ops.add(kernel)
    assert (ops.pointer, ops.descriptor) == (3, 2)


def test_split_report_reads_the_compiled_kernel(tmp_path):
    """The model answer compiles for sm_90 into a producer and two consumers; a plain range() loop does not."""
    assert "split into 12 warps" in ch5_split.split_report(ch5_split.dkdv_split_kernel)
    kernel, launcher, _ = MUTANTS["ch5_dkdv_split"]
    plain = _load_mutant(tmp_path, kernel, launcher, [("tl.range(0, group * n_blocks, warp_specialize=WARP_SPECIALIZE)",
                                                       "range(0, group * n_blocks)")], "plain_loop")
    assert "not split" in ch5_split.split_report(plain.__globals__["dkdv_split_kernel"])
