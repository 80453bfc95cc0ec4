"""Chapter 11's Gluon kernels (``flash_gluon``) against the float64 reference.

Gluon has no interpreter, so the kernels run only on a Hopper GPU: there these tests compare O, the
lse and the gradients with the float64 reference on fresh random inputs, both masks, GQA, several
lengths, head dims 64, 128 and 256, fp16 and bf16, and check that the gradients are deterministic.
In every world the registry's refusals are checked: what the kernels do not do is a ValueError that
names it, never a launch.
"""
import pytest
import torch

import fa_lab
from fa_lab.core.reference import reference_attention
from fa_lab.core.testing import assert_close, random_qkv, stable_seed
from fa_lab.core.world import ON_GPU
from fa_lab.kernels.gluon import GLUON_MISSING, gluon_forward

HOPPER = ON_GPU and torch.cuda.get_device_capability() == (9, 0)
on_hopper = pytest.mark.skipif(not HOPPER, reason="the Gluon forward runs on a Hopper GPU only")

#: (B, H, Hkv, N): one program, several programs and key blocks, GQA with groups of 2 and of 3
SHAPES = [(1, 2, 2, 128), (2, 4, 2, 384), (1, 3, 1, 1024)]


def reference_gradients(q, k, v, do, causal):
    """dQ, dK, dV of the float64 reference."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_o, _ = reference_attention(q64, k64, v64, fa_lab.make_spec(q64, k64, v64, causal=causal))
    return torch.autograd.grad(ref_o, (q64, k64, v64), do.double())


@on_hopper
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_forward_matches_the_float64_reference(head_dim, shape, causal, dtype):
    B, H, Hkv, N = shape
    q, k, v = random_qkv(B, H, N, N, head_dim, kv_heads=Hkv, dtype=dtype,
                         seed=stable_seed(head_dim, shape, causal, dtype))
    spec = fa_lab.make_spec(q, k, v, causal=causal)
    ref_o, ref_lse = reference_attention(q, k, v, spec)
    o, lse = fa_lab.attention(q, k, v, impl="flash_gluon", causal=causal, return_lse=True)
    assert o.dtype == q.dtype and o.shape == q.shape and lse.shape == q.shape[:3]
    assert_close(o, ref_o, dtype, what="flash_gluon O")
    assert_close(lse, ref_lse, dtype, what="flash_gluon lse")
    # the Gluon kernel itself, also at the head dims where flash_gluon runs chapter 4's forward
    o, lse = gluon_forward(q, k, v, spec)
    assert_close(o, ref_o, dtype, what="gluon_forward O")
    assert_close(lse, ref_lse, dtype, what="gluon_forward lse")


@on_hopper
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_persistent_programs_walk_several_tiles(head_dim, causal):
    # 1,024 tiles of 128 query rows: at D <= 128 each program of a one-per-multiprocessor grid runs several,
    # its ring and its Q and O buffers carried from one tile to the next, across heads of a GQA group
    B, H, Hkv, N = 2, 32, 8, 2048
    assert B * H * N // 128 >= 3 * torch.cuda.get_device_properties(0).multi_processor_count
    q, k, v = random_qkv(B, H, N, N, head_dim, kv_heads=Hkv, dtype=torch.bfloat16,
                         seed=stable_seed("persistent", head_dim, causal))
    spec = fa_lab.make_spec(q, k, v, causal=causal)
    o, lse = gluon_forward(q, k, v, spec)
    ref_o, ref_lse = reference_attention(q, k, v, spec)
    assert_close(o, ref_o, torch.bfloat16, what="gluon_forward O")
    assert_close(lse, ref_lse, torch.bfloat16, what="gluon_forward lse")


@on_hopper
@pytest.mark.parametrize("head_dim", [64, 128, 256])   # 256: the Triton backward after the Gluon forward
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 4, 2, 256), (1, 6, 2, 640)], ids=str)   # GQA groups of 2 and of 3
def test_gradients_match_the_float64_reference(head_dim, causal, shape):
    B, H, Hkv, N = shape
    q, k, v = random_qkv(B, H, N, N, head_dim, kv_heads=Hkv, dtype=torch.bfloat16,
                         seed=stable_seed("grad", head_dim, causal, shape), requires_grad=True)
    do = torch.randn_like(q)
    got = torch.autograd.grad(fa_lab.attention(q, k, v, impl="flash_gluon", causal=causal), (q, k, v), do)
    expected = reference_gradients(q, k, v, do, causal)
    for name, g, e in zip("QKV", got, expected):
        assert_close(g, e, torch.bfloat16, what=f"d{name}")


#: the backward's tile tables (bwd.py) set to each tiling its passes can take; the shipped tables pick one per head dim,
#: the others stay correct for the next measurement.  "pairs": two slices with interleaved products
TILINGS = {"dQ 64-key": dict(KEY_TILE=64, KEY_SLICES=1), "dQ 64-key pairs": dict(KEY_TILE=64, KEY_SLICES=2),
           "dQ 128-key": dict(KEY_TILE=128, KEY_SLICES=1), "dKdV 64-query": dict(QUERY_TILE=64),
           "dKdV 64-query pairs": dict(QUERY_TILE=128)}


@on_hopper
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("tiling", list(TILINGS))
def test_every_tiling_of_the_backward_matches_the_float64_reference(head_dim, causal, tiling, monkeypatch):
    from fa_lab.kernels.gluon import bwd

    if head_dim == 128 and tiling == "dKdV 64-query pairs":
        pytest.skip("dK/dV pairs need 256 registers a thread at D = 128")
    B, H, Hkv, N = 1, 6, 2, 640
    q, k, v = random_qkv(B, H, N, N, head_dim, kv_heads=Hkv, dtype=torch.bfloat16,
                         seed=stable_seed("tiling", head_dim, causal, tiling))
    do = torch.randn_like(q)
    spec = fa_lab.make_spec(q, k, v, causal=causal)
    o, lse = gluon_forward(q, k, v, spec)
    for table, value in TILINGS[tiling].items():
        monkeypatch.setitem(getattr(bwd, table), head_dim, value)
    got = bwd.gluon_backward(q, k, v, o, lse, do, spec)
    expected = reference_gradients(q, k, v, do, causal)
    for name, g, e in zip("QKV", got, expected):
        assert_close(g, e, torch.bfloat16, what=f"d{name} with {tiling} tiles")


@on_hopper
@pytest.mark.parametrize("head_dim", [64, 128])   # the shipped tilings: pairs in the dK/dV pass (64), the dQ pass (128)
@pytest.mark.parametrize("causal", [False, True])
def test_gradients_are_deterministic(head_dim, causal):
    q, k, v = random_qkv(1, 4, 512, 512, head_dim, kv_heads=2, dtype=torch.bfloat16, seed=5, requires_grad=True)
    do = torch.randn_like(q)
    first, second = (torch.autograd.grad(fa_lab.attention(q, k, v, impl="flash_gluon", causal=causal), (q, k, v), do)
                     for _ in range(2))
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@on_hopper
def test_repeated_calls_through_the_compiled_kernels_match_the_jit(monkeypatch):
    # the second call of a shape launches the compiled kernels directly (fast_launch); both paths agree bit for bit
    from fa_lab.kernels.gluon import bwd, fwd
    from fa_lab.kernels.triton import fast_launch

    q, k, v = random_qkv(2, 4, 384, 384, 128, kv_heads=2, dtype=torch.float16, seed=9, requires_grad=True)
    do = torch.randn_like(q)

    def run():
        o = fa_lab.attention(q, k, v, impl="flash_gluon", causal=True)
        return (o.detach(), *torch.autograd.grad(o, (q, k, v), do))

    fast_launch.reset()
    try:
        first, direct = run(), run()
        assert fast_launch._SUPPORTED is True, "this Triton's compiled Gluon kernels changed their calling convention"
        assert {key[0] for key in fast_launch._COMPILED} == {fwd.attn_fwd_ws, bwd.bwd_dq_ws, bwd.bwd_dkdv_ws}
        fast_launch.reset()
        monkeypatch.setattr(fast_launch, "direct_launch_supported", lambda compiled, kernel: False)
        run()
        jit = run()
    finally:
        fast_launch.reset()
    for a, b, c in zip(first, direct, jit):
        assert torch.equal(a, b) and torch.equal(a, c)


@on_hopper
def test_scale_and_non_contiguous_inputs():
    q, k, v = random_qkv(1, 2, 256, 256, 128, dtype=torch.float16, seed=3)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)   # (B, N, H, D) memory, (B, H, N, D) view
    o = fa_lab.attention(q, k, v, impl="flash_gluon", scale=0.05)
    ref_o, _ = reference_attention(q, k, v, fa_lab.make_spec(q, k, v, scale=0.05))
    assert_close(o, ref_o, torch.float16, what="O with scale 0.05")


@on_hopper
def test_nan_in_gives_nan_out_in_its_rows_only():
    q, k, v = random_qkv(1, 2, 256, 256, 128, dtype=torch.bfloat16, seed=4)
    q[0, 1, 7, 3] = float("nan")
    o = fa_lab.attention(q, k, v, impl="flash_gluon")
    assert torch.isnan(o[0, 1, 7]).all()
    assert not torch.isnan(o[0, 0]).any() and not torch.isnan(o[0, 1, 8:]).any()


@pytest.mark.parametrize("head_dim, n_q, n_k, mask, words", [
    (96, 256, 256, dict(), "head dims 64, 128, 256"),
    (128, 256, 384, dict(), "Nq = Nk"),
    (128, 200, 200, dict(), "multiple of 128"),
])
def test_what_it_cannot_do_is_a_clear_value_error(head_dim, n_q, n_k, mask, words):
    from fa_lab.kernels.gluon.problems import gluon_limits

    q, k, v = random_qkv(1, 2, n_q, n_k, head_dim, dtype=torch.bfloat16, device="cpu")
    assert words in gluon_limits(fa_lab.make_spec(q, k, v, **mask))
    with pytest.raises(ValueError, match="flash_gluon"):
        fa_lab.attention(q.to(fa_lab.DEVICE), k.to(fa_lab.DEVICE), v.to(fa_lab.DEVICE), impl="flash_gluon", **mask)


def test_windows_and_fp32_are_refused_by_name():
    impl = fa_lab.get_implementation("flash_gluon")
    q, k, v = random_qkv(1, 2, 256, 256, 128, dtype=torch.bfloat16)
    assert "masks" in impl.unsupported(fa_lab.make_spec(q, k, v, window=(16, 0)), "gpu")
    assert "dtypes" in impl.unsupported(fa_lab.make_spec(q.float(), k.float(), v.float()), "gpu")


@pytest.mark.skipif(ON_GPU, reason="the CPU world's refusal")
def test_the_cpu_world_refuses_it_by_name():
    q, k, v = random_qkv(1, 2, 256, 256, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="runs only on gpu"):
        fa_lab.attention(q, k, v, impl="flash_gluon")


@pytest.mark.skipif(GLUON_MISSING is not None, reason="this Triton has no Gluon")
def test_the_gluon_backward_refuses_head_dims_it_is_not_built_for():
    # flash_gluon sends D = 256 to the Triton backward; called directly, the Gluon passes say why they cannot
    from fa_lab.kernels.gluon import gluon_backward

    q, k, v = random_qkv(1, 2, 128, 128, 256, dtype=torch.bfloat16, device="cpu")
    spec = fa_lab.make_spec(q, k, v)
    lse = torch.zeros(1, 2, 128)
    with pytest.raises(ValueError, match="head dims 64, 128, got 256"):
        gluon_backward(q, k, v, q, lse, q, spec)
