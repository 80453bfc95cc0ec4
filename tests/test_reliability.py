"""The ways an attention call could be silently wrong, each pinned down against the float64 reference.

Second derivatives, large logits in 16-bit inputs, gradients asked of a forward-only kernel,
tensors on another device than the world's, NaN inputs, rows that see no key, loosely typed
arguments, numba/triton imported before fa_lab, and head dims an implementation refuses.
Sizes stay tiny: in the CPU world the Numba and Triton kernels run in the simulator/interpreter.
"""
import json
import pathlib
import re
import subprocess
import sys

import pytest
import torch

import fa_lab
from fa_lab.core.reference import reference_attention
from fa_lab.core.registry import checked_spec
from fa_lab.core.testing import assert_close, random_qkv

ROOT = pathlib.Path(__file__).resolve().parent.parent
IMPLS = fa_lab.implementations()
RUNNABLE = [name for name in fa_lab.implementations(runnable=True)]


def reference_grads(q, k, v, loss, **mask):
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    o, _ = reference_attention(q, k, v, fa_lab.make_spec(q, k, v, **mask))
    return torch.autograd.grad(loss(o), (q, k, v))


# --- second derivatives -------------------------------------------------------------------------

def _course_pytorch(q, k, v):
    return fa_lab.FlashAttentionPyTorch.apply(q, k, v, True)


def _course_triton(q, k, v):
    return fa_lab.FlashAttentionTriton.apply(q, k, v, True)


def _flash(q, k, v):
    return fa_lab.flash_attention(q, k, v, causal=True)


def _tiles(q, k, v):
    return fa_lab.attention(q, k, v, impl="torch_tiled", causal=True)


@pytest.mark.parametrize("call", [_course_pytorch, _course_triton, _flash, _tiles],
                         ids=["FlashAttentionPyTorch", "FlashAttentionTriton", "flash_attention", "torch_tiled"])
def test_second_derivative_raises_while_first_order_grads_match(call):
    q, k, v = random_qkv(1, 1, 8, 8, 16, seed=11, requires_grad=True)
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(12)).to(q.device)

    def loss(o):   # not linear in o: dL/do depends on o, as in any real loss
        return (w.to(o.dtype) * o ** 2).sum()

    dq, dk, dv = torch.autograd.grad(loss(call(q, k, v)), (q, k, v), create_graph=True)
    for got, want, name in zip((dq, dk, dv), reference_grads(q, k, v, loss, causal=True), ("dq", "dk", "dv")):
        assert_close(got, want, torch.float32, name)
    with pytest.raises(RuntimeError, match="marked with @once_differentiable"):
        (dq ** 2).sum().backward()
    # with a loss linear in o, dq has no graph at all: asking for its derivative raises too
    dq, = torch.autograd.grad((w * call(q, k, v)).sum(), (q,), create_graph=True)
    with pytest.raises(RuntimeError):
        (dq ** 2).sum().backward()


# --- naive_torch with large logits in 16-bit inputs ----------------------------------------------

@pytest.mark.parametrize("dtype,mult", [(torch.float16, 100.0), (torch.float16, 20.0), (torch.bfloat16, 10.0)])
def test_naive_torch_keeps_large_16bit_logits_accurate(dtype, mult):
    q, k, v = random_qkv(1, 2, 16, 16, 16, seed=3)
    q, k, v = (q * mult).to(dtype), (k * mult).to(dtype), v.to(dtype)   # |logits| in the hundreds to 10^4
    o, lse = fa_lab.attention(q, k, v, impl="naive_torch", return_lse=True)
    ref_o, ref_lse = reference_attention(q, k, v, fa_lab.make_spec(q, k, v))
    assert_close(o, ref_o, dtype, f"naive_torch o ({dtype}, x{mult})")
    assert torch.allclose(lse.double().cpu(), ref_lse.cpu(), rtol=1e-5, atol=1e-3)


# --- gradients asked of an implementation without a backward ------------------------------------

def test_requires_grad_with_a_forward_only_implementation_is_refused():
    forward_only = [n for n in RUNNABLE if not (IMPLS[n].backward or IMPLS[n].autograd)]
    assert "naive_numpy" in forward_only and "numba_tiled" in forward_only
    q, k, v = random_qkv(1, 1, 4, 4, 16, requires_grad=True)
    for name in ("naive_numpy", "numba_tiled"):
        with pytest.raises(ValueError, match=r"no backward.*torch_tiled"):
            fa_lab.attention(q, k, v, impl=name)
        with torch.no_grad():   # a forward-only call is what it is for
            fa_lab.attention(q, k, v, impl=name)
        fa_lab.attention(q.detach(), k.detach(), v.detach(), impl=name)
    for name in ("torch_tiled", "naive_torch"):   # its own backward / autograd through its ops
        assert fa_lab.attention(q, k, v, impl=name).grad_fn is not None


# --- devices -----------------------------------------------------------------------------------

def test_pure_pytorch_runs_on_any_device_and_world_kernels_name_the_device():
    spec = fa_lab.make_spec(*random_qkv(1, 1, 4, 4, 16, device="cpu"))
    for name in ("reference", "naive_torch", "torch_tiled"):
        assert IMPLS[name].unsupported(spec, "gpu") is None, name      # CPU tensors on a GPU machine
    for name in ("numba_naive", "numba_tiled", "triton", "flash_triton"):
        why = IMPLS[name].unsupported(spec, "gpu")
        assert why and "cpu" in why and "cuda" in why, (name, why)


def test_course_function_runs_on_cpu_tensors():
    Q, K, V = (t[:, 0] for t in random_qkv(2, 1, 6, 6, 16, device="cpu", seed=4))   # (batch, seq, d)
    O = fa_lab.FlashAttentionPyTorch.apply(Q, K, V, False)
    q, k, v = Q[:, None], K[:, None], V[:, None]
    ref, _ = reference_attention(q, k, v, fa_lab.make_spec(q, k, v))
    assert_close(O, ref[:, 0], torch.float32)


# --- NaN in, NaN out; rows that see no key ------------------------------------------------------

def _nan_inputs(seed):
    q, k, v = random_qkv(1, 1, 8, 8, 16, seed=seed)
    q, k = q.clone(), k.clone()
    q[0, 0, 2, 3] = float("nan")   # one query row
    k[0, 0, 5, 1] = float("nan")   # one key: under the causal mask only rows 5.. see it
    return q, k, v


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", RUNNABLE)
def test_nan_in_gives_nan_out_where_the_reference_has_nan(name, causal):
    q, k, v = _nan_inputs(seed=21)
    spec = fa_lab.make_spec(q, k, v, causal=causal)
    if IMPLS[name].unsupported(spec, fa_lab.WORLD):
        pytest.skip(IMPLS[name].unsupported(spec, fa_lab.WORLD))
    ref_o = reference_attention(q, k, v, spec)[0].cpu()
    with torch.no_grad():
        o = fa_lab.attention(q, k, v, impl=name, causal=causal)
    want = torch.isnan(ref_o).any(-1)
    assert want.any() and (not causal or not want.all())   # causal: rows before key 5 stay clean
    assert torch.equal(torch.isnan(o.cpu()).any(-1), want), f"{name}: NaN rows differ from the reference's"
    fine = ~want[..., None].expand_as(ref_o)
    assert_close(o.cpu()[fine], ref_o[fine], torch.float32, f"{name} rows without NaN")


@pytest.mark.parametrize("name", RUNNABLE)
def test_nan_in_gives_nan_lse_where_the_reference_has_nan(name):
    q, k, v = _nan_inputs(seed=22)
    spec = fa_lab.make_spec(q, k, v, causal=True)
    if IMPLS[name].unsupported(spec, fa_lab.WORLD):
        pytest.skip(IMPLS[name].unsupported(spec, fa_lab.WORLD))
    _, ref_lse = reference_attention(q, k, v, spec)
    with torch.no_grad():
        _, lse = fa_lab.attention(q, k, v, impl=name, causal=True, return_lse=True)
    assert torch.equal(torch.isnan(lse.cpu()), torch.isnan(ref_lse.cpu())), f"{name}: NaN lse rows differ"


@pytest.mark.parametrize("name", RUNNABLE)
def test_rows_that_see_no_key_give_zeros_and_minus_inf_lse(name):
    q, k, v = random_qkv(1, 2, 12, 5, 16, seed=23)      # Nq > Nk: causal hides every key from rows 0..6
    spec = fa_lab.make_spec(q, k, v, causal=True)
    if IMPLS[name].unsupported(spec, fa_lab.WORLD):
        pytest.skip(IMPLS[name].unsupported(spec, fa_lab.WORLD))
    with torch.no_grad():
        o, lse = fa_lab.attention(q, k, v, impl=name, causal=True, return_lse=True)
    ref_o, ref_lse = reference_attention(q, k, v, spec)
    empty = torch.isneginf(ref_lse).cpu()
    assert empty.sum() == 2 * 7
    assert torch.equal(o.cpu()[empty], torch.zeros_like(o.cpu()[empty]))
    assert torch.isneginf(lse.cpu()[empty]).all()
    assert_close(o, ref_o, torch.float32, name)


# --- strict validation ---------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,exc,words", [
    (dict(window=(2.7, 3.9)), TypeError, "window"),
    (dict(window="12"), TypeError, "window"),
    (dict(window=(True, 1)), TypeError, "window"),
    (dict(scale="0.5"), TypeError, "scale"),
    (dict(scale=True), TypeError, "scale"),
    (dict(scale=float("nan")), ValueError, "scale"),
    (dict(scale=float("inf")), ValueError, "scale"),
    (dict(scale=1e39), ValueError, "float32"),
    (dict(causal="no"), TypeError, "causal"),
    (dict(causal=1), TypeError, "causal"),
])
def test_loosely_typed_arguments_are_refused(kwargs, exc, words):
    q, k, v = random_qkv(1, 1, 4, 4, 16)
    with pytest.raises(exc, match=words):
        fa_lab.make_spec(q, k, v, **kwargs)
    with pytest.raises(exc, match=words):
        fa_lab.attention(q, k, v, **kwargs)


def test_is_causal_of_the_course_functions_must_be_a_bool():
    Q, K, V = (t[:, 0] for t in random_qkv(1, 1, 4, 4, 16, seed=5))
    with pytest.raises(TypeError, match="causal"):
        fa_lab.FlashAttentionPyTorch.apply(Q, K, V, "no")


def test_meta_tensors_are_refused_clearly():
    q, k, v = (t.to("meta") for t in random_qkv(1, 1, 4, 4, 16, device="cpu"))
    with pytest.raises(ValueError, match="meta tensors"):
        fa_lab.attention(q, k, v, impl="naive_torch")


def test_one_check_path_returns_the_implementation_and_spec():
    q, k, v = random_qkv(1, 2, 4, 6, 16, kv_heads=1)
    impl, spec = checked_spec("reference", q, k, v, causal=True)
    assert impl is IMPLS["reference"] and (spec.group, spec.causal, spec.n_k) == (2, True, 6)


# --- head dims an implementation does not support ----------------------------------------------

@pytest.mark.parametrize("head_dim", [1, 3, 20, 130])
@pytest.mark.parametrize("name", RUNNABLE)
def test_head_dims_run_or_are_refused_before_any_kernel(name, head_dim):
    dtype = IMPLS[name].dtypes[-1] if torch.float32 not in IMPLS[name].dtypes else torch.float32
    q, k, v = random_qkv(1, 1, 3, 3, head_dim, dtype=dtype, seed=head_dim)
    spec = fa_lab.make_spec(q, k, v)
    why = IMPLS[name].unsupported(spec, fa_lab.WORLD)
    if why:
        with pytest.raises(ValueError, match=re.escape(name)):
            fa_lab.attention(q, k, v, impl=name)
        return
    with torch.no_grad():   # what the one check lets through must run
        o = fa_lab.attention(q, k, v, impl=name)
    assert_close(o, reference_attention(q, k, v, spec)[0], dtype, f"{name} D={head_dim}")


# --- numba / triton imported before fa_lab -------------------------------------------------------

@pytest.mark.skipif(fa_lab.ON_GPU, reason="the CPU world's switches only matter without a GPU")
@pytest.mark.parametrize("first,impl", [("triton", "triton"), ("numba", "numba_naive")])
def test_numba_or_triton_imported_first_gives_a_plain_error(first, impl):
    code = (f"import {first}\n"
            "import warnings; warnings.simplefilter('ignore')\n"
            "import fa_lab\n"
            "from fa_lab.core.testing import random_qkv\n"
            "q, k, v = random_qkv(1, 1, 4, 4, 16)\n"
            "print(fa_lab.attention(q, k, v, impl='torch_tiled').shape)\n"
            f"fa_lab.attention(q, k, v, impl={impl!r})\n")
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "TRITON_INTERPRET")}
    env["FA_LAB_WORLD"] = "cpu"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode != 0, run.stdout
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError:") and f"{first} was imported before fa_lab" in last, run.stderr[-2000:]
    assert "import fa_lab before numba/triton" in last and "restart the kernel" in last
    assert "torch.Size([1, 1, 4, 16])" in run.stdout   # what does not need them still runs


# --- public API layering ------------------------------------------------------------------------

def test_flash_attention_is_the_public_api_function():
    from fa_lab import api

    assert fa_lab.flash_attention is api.flash_attention
    assert fa_lab.attention is api.attention


def test_chapter_2_shows_the_online_kernel_by_its_public_name():
    nb = json.loads((ROOT / "book" / "02_online_softmax.ipynb").read_text())
    code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    assert "online.online_attention_kernel" in code
    assert not re.search(r"\b(online|fa_lab(\.\w+)*)\._\w", code), "a private fa_lab name in a book cell"
