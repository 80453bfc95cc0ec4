"""Bad input raises a clear ValueError/TypeError naming what was expected."""
import dataclasses

import pytest
import torch

import fa_lab
from fa_lab.core.testing import random_qkv


def qkv(**kw):
    return random_qkv(1, 4, 8, 8, 16, kv_heads=2, device="cpu", **kw)


@pytest.mark.parametrize("make,exc,words", [
    (lambda q, k, v: (q[0], k, v), ValueError, "4 dims"),
    (lambda q, k, v: (q, k[..., :8], v), ValueError, "same head dim"),
    (lambda q, k, v: (q, k, v[..., :8]), ValueError, "head dim"),
    (lambda q, k, v: (q, k, v[:, :, :5]), ValueError, "same sequence length"),
    (lambda q, k, v: (q, k[:, :1].expand(1, 3, 8, 16), v[:, :1].expand(1, 3, 8, 16)), ValueError,
     "multiple of key/value heads"),
    (lambda q, k, v: (q, k[:, :1], v), ValueError, "same number of heads"),
    (lambda q, k, v: (q.long(), k.long(), v.long()), TypeError, "floating"),
    (lambda q, k, v: (q, k.double(), v), TypeError, "one dtype"),
    (lambda q, k, v: (q.numpy(), k, v), TypeError, "torch.Tensor"),
    (lambda q, k, v: (q.to("meta"), k, v), ValueError, "one device"),
    (lambda q, k, v: (q[:, :, :0], k, v), ValueError, "empty"),
])
def test_bad_shapes_and_types(make, exc, words):
    q, k, v = make(*qkv())
    with pytest.raises(exc, match=words):
        fa_lab.attention(q, k, v)


def test_unknown_impl_lists_the_known_ones():
    with pytest.raises(ValueError, match="known implementations: reference"):
        fa_lab.attention(*qkv(), impl="flash9000")


@pytest.mark.parametrize("window,exc", [((-2, 0), ValueError), ((1,), TypeError), ("ab", TypeError)])
def test_bad_window(window, exc):
    with pytest.raises(exc, match="window"):
        fa_lab.attention(*qkv(), window=window)


def test_unsupported_dtype_is_refused_not_ignored():
    q, k, v = random_qkv(1, 1, 4, 4, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match="supports dtypes"):
        fa_lab.attention(q, k, v, impl="numba_naive")


def test_masks_an_implementation_lacks_are_refused():
    fake = fa_lab.core.registry.Implementation(name="nomask", fn=None, chapter=1, description="x", masks=("none",))
    spec = fa_lab.make_spec(*qkv(), causal=True)
    assert "supports masks" in fake.unsupported(spec, fa_lab.WORLD)


def test_wrong_device_for_the_world_is_refused():
    # an implementation that launches the world's kernels (not host code, not plain PyTorch ops)
    name = next(n for n, i in fa_lab.implementations().items()
                if not i.host_only and not getattr(i, "any_device", False) and n != "reference")
    if fa_lab.ON_GPU:
        q, k, v = random_qkv(1, 1, 4, 4, 16, device="cpu")
        with pytest.raises(ValueError, match="expects cuda tensors"):
            fa_lab.attention(q, k, v, impl=name)
    else:
        spec = fa_lab.make_spec(*qkv())
        assert "expects cuda" in (fa_lab.get_implementation(name).unsupported(spec, "gpu") or "")


def test_a_checked_spec_is_reused_but_never_lets_bad_input_through():
    """The spec cache of the host path: a repeated call reuses the spec; anything that differs is checked."""
    from fa_lab.core import registry

    q, k, v = random_qkv(1, 2, 8, 8, 16, seed=5)
    impl = registry.get("naive_torch")
    first = registry.check(impl, q, k, v, causal=False)
    assert registry.check(impl, q.clone(), k.clone(), v.clone(), causal=False) is first
    with pytest.raises(TypeError, match="causal"):
        registry.check(impl, q, k, v, causal=1)           # 1 == True, but not a bool
    with pytest.raises(TypeError, match="share one dtype"):
        registry.check(impl, q, k.double(), v, causal=False)
    with pytest.raises(ValueError, match="window"):
        registry.check(impl, q, k, v, window=(-2, 0))
    # a value of another type than the cached one is checked again, never answered from the cache
    registry.check(impl, q, k, v, window=(2, 0))
    with pytest.raises(TypeError):
        registry.check(impl, q, k, v, window=(2.0, 0))
    with pytest.raises(TypeError, match="causal"):
        registry.check(impl, q, k, v, causal="yes")
    # another implementation object under the same name (a benchmark peer) gets its own answer
    other = dataclasses.replace(impl, dtypes=(torch.float64,))
    with pytest.raises(ValueError, match="dtypes"):
        registry.check(other, q, k, v, causal=False)
    no_backward = registry.get("naive_numpy")
    registry.check(no_backward, q, k, v, causal=False)
    with pytest.raises(ValueError, match="no backward"):
        registry.check(no_backward, q.requires_grad_(), k, v, causal=False)
