"""Every registered implementation against the float64 reference, on fresh random inputs.

New kernels are covered by being registered: the cases below iterate the registry.
Shapes are small (the CPU world runs kernels in the Numba simulator and the Triton
interpreter) but include N = 1, lengths that are not multiples of any tile, Nq != Nk
both ways, grouped-query attention and every mask.

A chapter's intermediate steps (``step_of`` set) and names whose forward is another
entry's kernel run one shape that has all of that at once, under every mask and dtype;
the final implementations run every shape (in the CPU world, the other shapes of a
simulated or interpreted kernel, and a step's dtypes after its first, are marked slow).
``tests/test_properties.py`` draws many more problems.
"""
import itertools

import pytest
import torch

import fa_lab
from fa_lab.core.masks import mask_kind
from fa_lab.core.reference import reference_attention
from fa_lab.core.testing import MASKS, assert_close, random_qkv

#: The one shape a step runs, and the fast tier's shape for kernels in the simulator or
#: interpreter: batch > 1, GQA, both lengths past a tile boundary (4, 16, 64), and Nq > Nk
#: so that causal and window masks leave the first rows with no key.
STEP_SHAPE = (2, 2, 1, 23, 9)

# (batch, heads, kv_heads, n_q, n_k)
SHAPES = [
    (1, 1, 1, 1, 1),
    (1, 2, 2, 17, 17),
    (2, 2, 1, 5, 23),    # Nq < Nk (decoding-like), GQA
    STEP_SHAPE,
]

#: Registered names whose forward launches another entry's kernel (the full grid runs there).
SAME_FORWARD = {"flash_triton": "triton"}


def _launches_kernels(impl) -> bool:
    """Numba CUDA or Triton: the simulator or interpreter in the CPU world, seconds per grid."""
    return getattr(impl, "backend", None) is not None or impl.fn.__module__.startswith(
        ("fa_lab.kernels.numba", "fa_lab.kernels.triton"))


def _is_step(name, impl) -> bool:
    return bool(impl.step_of) or name in SAME_FORWARD


def _cases():
    for name, impl in fa_lab.implementations(runnable=True).items():
        if name == "reference":
            continue
        head_dim = min(max(16, impl.head_dims[0]), impl.head_dims[1])
        shapes = [STEP_SHAPE] if _is_step(name, impl) else SHAPES
        for shape, mask, dtype in itertools.product(shapes, MASKS, impl.dtypes):
            if mask_kind(**mask) not in impl.masks or (shape[1] != shape[2] and not impl.gqa):
                continue
            # the fast tier: a simulated kernel on STEP_SHAPE only, and a step in its first dtype only
            slow = _launches_kernels(impl) and not fa_lab.ON_GPU and (
                shape != STEP_SHAPE or (_is_step(name, impl) and dtype != impl.dtypes[0]))
            yield pytest.param(name, shape, head_dim, mask, dtype, marks=[pytest.mark.slow] if slow else [],
                               id=f"{name}-{'x'.join(map(str, shape))}-{mask['causal']}-{mask['window']}-{dtype}")


@pytest.mark.parametrize("name,shape,head_dim,mask,dtype", list(_cases()))
def test_matches_reference(name, shape, head_dim, mask, dtype, seed):
    B, H, Hkv, Nq, Nk = shape
    q, k, v = random_qkv(B, H, Nq, Nk, head_dim, kv_heads=Hkv, dtype=dtype, seed=seed)
    o, lse = fa_lab.attention(q, k, v, impl=name, return_lse=True, **mask)
    assert o.dtype == q.dtype and o.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (B, H, Nq)
    spec = fa_lab.make_spec(q, k, v, **mask)
    ref_o, ref_lse = reference_attention(q, k, v, spec)
    assert_close(o, ref_o, dtype, what=f"{name} O (seed={seed})")
    # lse is float32 by contract, so a float64 run is judged at float32 precision there
    assert_close(lse, ref_lse, torch.float32 if dtype == torch.float64 else dtype, what=f"{name} lse (seed={seed})")


def test_every_step_names_a_final_implementation_that_runs_the_full_grid():
    impls = fa_lab.implementations()
    for name, impl in impls.items():
        final = impl.step_of or SAME_FORWARD.get(name)
        if final is not None:
            assert final in impls and impls[final].step_of is None, f"{name} -> {final}"


@pytest.mark.parametrize("name", list(fa_lab.implementations(runnable=True)))
def test_row_with_no_key_gives_zeros_not_nan(name):
    impl = fa_lab.get_implementation(name)
    if "causal" not in impl.masks:
        pytest.skip("no causal mask")
    q, k, v = random_qkv(1, 1, 6, 3, min(max(16, impl.head_dims[0]), impl.head_dims[1]), dtype=impl.dtypes[0], seed=7)
    o, lse = fa_lab.attention(q, k, v, impl=name, causal=True, return_lse=True)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert torch.all(o[0, 0, :3] == 0)          # rows 0..2 sit before the first key
    assert torch.all(torch.isneginf(lse[0, 0, :3]))
    assert torch.isfinite(lse[0, 0, 3:]).all()


def test_reference_agrees_with_torch_sdpa():
    # An independent check of the judge itself (bottom-right causal == top-left when Nq == Nk).
    q, k, v = random_qkv(2, 3, 19, 19, 8, dtype=torch.float64, seed=1, device="cpu")
    for causal in (False, True):
        ours = fa_lab.attention(q, k, v, causal=causal)
        theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        assert torch.allclose(ours, theirs, atol=1e-12)


def test_reference_bottom_right_causal_and_window_by_hand():
    # Nq=2, Nk=4: query 0 sits at key 2, so it sees keys 0..2; query 1 sees 0..3.
    ok = fa_lab.visible(2, 4, -1, 0)
    assert ok.tolist() == [[True, True, True, False], [True, True, True, True]]
    ok = fa_lab.visible(3, 3, 1, 1)
    assert ok.tolist() == [[True, True, False], [True, True, True], [False, True, True]]


def test_reference_gradients_are_finite_for_rows_with_no_key():
    q, k, v = random_qkv(1, 1, 5, 2, 4, dtype=torch.float64, seed=3, device="cpu", requires_grad=True)
    o = fa_lab.attention(q, k, v, causal=True)
    o.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.all(q.grad[0, 0, :3] == 0)


def test_registry_entries_describe_themselves():
    for name, impl in fa_lab.implementations().items():
        assert impl.name == name and impl.description and impl.chapter >= 1
        assert set(impl.masks) <= {"none", "causal", "window"}
        assert set(impl.worlds) <= {"cpu", "gpu"} and impl.dtypes
