"""Chapter 5: every registered backward against float64 autograd through the reference.

Covered by being registered with ``backward=True``: the cases iterate the registry.  Shapes
are small (in the CPU world the Triton kernels run in the interpreter) but have tails that
are no multiple of any tile, Nq != Nk both ways, grouped-query attention and every mask.
Also: gradcheck of the PyTorch tiles in float64, bit-identical gradients run to run, the
course interface ``Fn.apply(Q, K, V, is_causal)``, and what the forward keeps for the backward.
"""
import itertools

import pytest
import torch

import fa_lab
from fa_lab.autograd import Recompute, saved_for_backward
from fa_lab.core.reference import reference_attention
from fa_lab.core.testing import MASKS, max_error, random_qkv, stable_seed
from fa_lab.kernels import torch_tiled

# (batch, heads, kv_heads, n_q, n_k, head_dim)
SHAPES = [
    (1, 1, 1, 1, 1, 16),
    (1, 2, 2, 17, 17, 16),
    (2, 2, 1, 5, 23, 16),     # Nq < Nk, GQA
    (1, 4, 2, 23, 9, 16),     # Nq > Nk: causal leaves the first rows with no key
    (1, 3, 1, 33, 40, 24),    # GQA group of 3, head dim no power of two
]
#: gradients vs the float64 reference: |err| <= tol · (1 + |ref|), tol relative to the largest gradient
GRAD_TOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 6e-2}


def backward_impls():
    return [n for n, i in fa_lab.implementations(runnable=True).items() if i.backward and n != "reference"]


def loss_and_seeds(o, lse, seed):
    """A scalar whose gradient sends a random dO into o and a random dlse into the finite lse."""
    g = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=g).to(o.device)
    dl = torch.randn(lse.shape, generator=g).to(o.device)
    return (o.double() * do.double()).sum() + (torch.where(torch.isinf(lse), 0, lse).double() * dl.double()).sum()


def grads(impl, q, k, v, mask, seed):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o, lse = fa_lab.attention(q, k, v, impl=impl, return_lse=True, **mask)
    return torch.autograd.grad(loss_and_seeds(o, lse, seed), (q, k, v))


def reference_grads(q, k, v, mask, seed):
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    o, lse = reference_attention(q, k, v, fa_lab.make_spec(q, k, v, **mask))
    return torch.autograd.grad(loss_and_seeds(o, lse, seed), (q, k, v))


def assert_grads_close(got, expected, dtype, what):
    for name, g, e in zip(("dq", "dk", "dv"), got, expected):
        assert g.shape == e.shape and g.dtype == dtype, f"{what} {name}: {g.shape} {g.dtype}"
        g, e = g.detach().double().cpu(), e.detach().double().cpu()
        assert torch.isfinite(g).all(), f"{what} {name}: not finite"
        tol = GRAD_TOL[dtype] * max(1.0, float(e.abs().max()))
        err = max_error(g, e)
        assert err <= tol, f"{what} {name}: max error {err:.3g} > {tol:.3g}"


def _cases():
    for name in backward_impls():
        impl = fa_lab.get_implementation(name)
        for i, (shape, mask) in enumerate(itertools.product(SHAPES, MASKS)):
            if name == "torch_compile_bwd" and fa_lab.ON_GPU and i >= 3:
                break   # on a GPU every new shape and mask is a fresh torch.compile: a few cases only
            dtype = impl.dtypes[i % len(impl.dtypes)]   # every dtype meets several shapes and masks
            yield pytest.param(name, shape, mask, dtype,
                               id=f"{name}-{'x'.join(map(str, shape))}-{mask['causal']}-{mask['window']}-{dtype}")


@pytest.mark.parametrize("name,shape,mask,dtype", list(_cases()))
def test_gradients_match_reference(name, shape, mask, dtype):
    B, H, Hkv, Nq, Nk, D = shape
    seed = stable_seed(name, shape, str(mask))
    q, k, v = random_qkv(B, H, Nq, Nk, D, kv_heads=Hkv, dtype=dtype, seed=seed)
    got = grads(name, q, k, v, mask, seed)
    assert_grads_close(got, reference_grads(q, k, v, mask, seed), dtype, name)


@pytest.mark.parametrize("name", backward_impls())
def test_rows_that_see_no_key_get_zero_gradients(name):
    dtype = fa_lab.get_implementation(name).dtypes[0]
    q, k, v = random_qkv(1, 2, 7, 3, 16, kv_heads=1, dtype=dtype, seed=5)
    dq, dk, dv = grads(name, q, k, v, dict(causal=True), seed=5)
    for g in (dq, dk, dv):
        assert torch.isfinite(g).all()
    assert torch.all(dq[:, :, :4] == 0)       # rows 0..3 sit before the first key


def test_torch_tiled_gradcheck_float64():
    # tiles of 2 x 3 on 5 x 7 scores: partial tiles, skipped tiles and masked tiles all occur
    fwd = lambda *a: torch_tiled.tiled_forward(*a, block_m=2, block_n=3)  # noqa: E731
    bwd = lambda *a: torch_tiled.tiled_backward(*a, block_m=2, block_n=3)  # noqa: E731
    for mask in MASKS:
        q, k, v = random_qkv(1, 2, 5, 7, 4, kv_heads=1, dtype=torch.float64, device="cpu", seed=11,
                             requires_grad=True)
        spec = fa_lab.make_spec(q, k, v, **mask)
        # o and lse together (here every row sees a key, so lse is finite)
        assert torch.autograd.gradcheck(lambda q, k, v: Recompute.apply(q, k, v, spec, fwd, bwd),
                                        (q, k, v), eps=1e-6, atol=1e-7)


def test_torch_tiled_gradcheck_with_empty_rows():
    fwd = lambda *a: torch_tiled.tiled_forward(*a, block_m=2, block_n=2)  # noqa: E731
    bwd = lambda *a: torch_tiled.tiled_backward(*a, block_m=2, block_n=2)  # noqa: E731
    q, k, v = random_qkv(1, 1, 6, 3, 4, dtype=torch.float64, device="cpu", seed=2, requires_grad=True)
    spec = fa_lab.make_spec(q, k, v, causal=True)
    assert torch.autograd.gradcheck(lambda q, k, v: Recompute.apply(q, k, v, spec, fwd, bwd)[0],
                                    (q, k, v), eps=1e-6, atol=1e-7)


def test_dense_backward_matches_tiled():
    q, k, v = random_qkv(2, 4, 13, 21, 8, kv_heads=2, dtype=torch.float64, device="cpu", seed=4)
    spec = fa_lab.make_spec(q, k, v, window=(5, 2))
    o, lse = torch_tiled.tiled_forward(q, k, v, spec, block_m=4, block_n=8)
    do = torch.randn_like(o)
    dense = torch_tiled.dense_backward(q, k, v, o, lse, do, spec.scale, spec.left, spec.right)
    tiled = torch_tiled.tiled_backward(q, k, v, o, lse, do, spec, block_m=4, block_n=8)
    for a, b in zip(dense, tiled):
        assert max_error(a, b) < 1e-12


def test_triton_gradients_are_bit_identical_run_to_run():
    n = fa_lab.pick(cpu=37, gpu=1531)
    q, k, v = random_qkv(2, 4, n, n, 64, kv_heads=2, dtype=torch.float16 if fa_lab.ON_GPU else torch.float32,
                         seed=9)
    first = grads("flash_triton", q, k, v, dict(causal=True), seed=9)
    for _ in range(fa_lab.pick(cpu=1, gpu=5)):
        again = grads("flash_triton", q, k, v, dict(causal=True), seed=9)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


@pytest.mark.parametrize("fn_name", ["FlashAttentionPyTorch", "FlashAttentionTriton"])
@pytest.mark.parametrize("rank", [3, 4])
@pytest.mark.parametrize("is_causal", [False, True])
def test_course_interface(fn_name, rank, is_causal):
    Fn = getattr(fa_lab, fn_name)
    q, k, v = random_qkv(2, 1 if rank == 3 else 3, 19, 19, 16, dtype=torch.float32, seed=rank)
    if rank == 3:
        q, k, v = q[:, 0], k[:, 0], v[:, 0]
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    o = Fn.apply(q, k, v, is_causal)
    assert o.shape == q.shape and o.dtype == q.dtype
    saved = o.grad_fn.saved_tensors
    lse_like = [t for t in saved if t.shape == q.shape[:-1]]
    assert len(lse_like) == 1, [tuple(t.shape) for t in saved]
    assert len(saved) == 5    # Q, K, V, O and the lse: nothing quadratic

    lift = (lambda t: t.unsqueeze(1)) if rank == 3 else (lambda t: t)
    q64, k64, v64 = (lift(t.detach().double()).requires_grad_() for t in (q, k, v))
    ref_o, ref_lse = reference_attention(q64, k64, v64, fa_lab.make_spec(q64, k64, v64, causal=is_causal))
    assert max_error(lift(lse_like[0]), ref_lse) < 1e-4
    do = torch.randn_like(o)
    o.backward(do)
    ref = torch.autograd.grad(ref_o, (q64, k64, v64), lift(do).double())
    got = tuple(lift(t.grad) for t in (q, k, v))
    assert_grads_close(got, ref, torch.float32, fn_name)


def test_course_interface_rejects_bad_ranks():
    q = torch.randn(4, 16, device=fa_lab.DEVICE)
    with pytest.raises(ValueError, match=r"\(batch, seq, d\)"):
        fa_lab.FlashAttentionTriton.apply(q, q, q, False)
    q3, q4 = torch.randn(1, 4, 16, device=fa_lab.DEVICE), torch.randn(1, 1, 4, 16, device=fa_lab.DEVICE)
    with pytest.raises(ValueError, match="all"):
        fa_lab.FlashAttentionPyTorch.apply(q3, q4, q4, False)


def test_flash_attention_contract():
    q, k, v = random_qkv(1, 4, 10, 14, 16, kv_heads=2, dtype=torch.float32, seed=3, requires_grad=True)
    o, lse = fa_lab.flash_attention(q, k, v, causal=True, window=(3, -1), scale=0.3, return_lse=True)
    ref_o, ref_lse = reference_attention(q, k, v, fa_lab.make_spec(q, k, v, causal=True, window=(3, -1), scale=0.3))
    assert max_error(o, ref_o) < 1e-4 and max_error(lse, ref_lse) < 1e-4
    o.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    with pytest.raises(ValueError, match="4 dims"):
        fa_lab.flash_attention(q[0], k[0], v[0])
    with pytest.raises(ValueError, match="supports dtypes"):
        fa_lab.flash_attention(q.double(), k.double(), v.double())
    with pytest.raises(ValueError, match="multiple of"):   # the Triton forward's 16-byte rows
        h = torch.randn(1, 1, 4, 20, device=fa_lab.DEVICE, dtype=torch.float16)
        fa_lab.flash_attention(h, h, h)


def test_only_q_k_v_o_and_lse_are_kept_for_the_backward():
    q, k, v = random_qkv(1, 2, 32, 32, 16, dtype=torch.float32, seed=1, requires_grad=True)
    kept = saved_for_backward(fa_lab.flash_attention, q, k, v, causal=True)
    shapes = sorted(s for s, _, _ in kept)
    assert shapes == sorted([tuple(q.shape)] * 4 + [tuple(q.shape[:-1])])
    linear = sum(b for _, _, b in kept)
    quadratic = sum(b for _, _, b in saved_for_backward(fa_lab.attention, q, k, v, impl="naive_torch", causal=True))
    assert quadratic > linear


GPU_CASES = [  # (B, H, Hkv, Nq, Nk, D), mask, dtype: every dtype, mask and head dim class at least once
    ((2, 4, 4, 1000, 1000, 64), MASKS[0], torch.float16),
    ((2, 4, 4, 1000, 1000, 64), MASKS[1], torch.bfloat16),
    ((1, 8, 2, 777, 1203, 128), MASKS[1], torch.float16),
    ((1, 8, 2, 1203, 777, 128), MASKS[4], torch.bfloat16),
    ((1, 4, 4, 256, 300, 96), MASKS[3], torch.float16),
    ((1, 4, 1, 513, 513, 64), MASKS[2], torch.float32),
    ((1, 2, 2, 200, 200, 256), MASKS[1], torch.bfloat16),
    ((2, 4, 2, 1000, 1000, 256), MASKS[1], torch.float16),   # GQA, and tails of the D = 256 tiles
    ((1, 4, 2, 512, 512, 256), MASKS[1], torch.bfloat16),    # whole tiles: the descriptor-loading dK/dV pass
]


@pytest.mark.gpu
@pytest.mark.parametrize("shape,mask,dtype", GPU_CASES)
def test_flash_triton_at_gpu_sizes(shape, mask, dtype):
    B, H, Hkv, Nq, Nk, D = shape
    q, k, v = random_qkv(B, H, Nq, Nk, D, kv_heads=Hkv, dtype=dtype, seed=Nq)
    got = grads("flash_triton", q, k, v, mask, seed=Nq)
    assert_grads_close(got, reference_grads(q, k, v, mask, seed=Nq), dtype, "flash_triton")
