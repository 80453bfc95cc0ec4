"""Properties every runnable implementation keeps, on problems hypothesis draws.

``tests/test_attention.py`` walks a fixed grid; here hypothesis draws the problem: batch,
heads and grouped-query ratio, lengths from 1 through tile tails, head dims inside (and
outside) what the implementation claims, every mask including one-sided windows, scales,
every claimed dtype, and q/k/v handed over as strided views (a transposed layout, a head-dim
slice of a wider row, every other row of a longer sequence) whose unused storage is NaN, so
that a kernel reading past its view is caught.  The judge is the float64 reference.

The contract for NaN and inf (DESIGN.md): NaN in gives NaN out.  A query row that sees a
NaN in its own q or in a key or value it attends to must come out NaN; a row that does not
must still match.  A whole-matrix implementation multiplies the zero weight of a masked key
by that key's NaN value (as the float64 reference does), so there, and only there, a NaN is
also accepted.  A row that sees no key gives zeros and lse = -inf.

The examples are derandomized (the "ci" profile in conftest.py): every run draws the same
ones.  Kernels that run in the Numba simulator or the Triton interpreter get tiny problems
and fewer examples, and are marked slow.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st

import fa_lab
from fa_lab.core.masks import mask_kind, visible
from fa_lab.core.reference import expand_kv, reference_attention
from fa_lab.core.spec import FLOAT_DTYPES
from fa_lab.core.testing import assert_close

RUNNABLE = fa_lab.implementations(runnable=True)
KERNEL_MODULES = ("fa_lab.kernels.numba", "fa_lab.kernels.triton")
LAYOUTS = ("contiguous", "transposed", "head_dim_slice", "every_other_row")


def simulated(name: str) -> bool:
    """Whether ``name`` launches Numba CUDA or Triton kernels (simulated or interpreted on the CPU)."""
    impl = RUNNABLE[name]
    return getattr(impl, "backend", None) is not None or impl.fn.__module__.startswith(KERNEL_MODULES)


def _params(launches: bool = True):
    """One pytest param per runnable implementation; those that launch a simulated kernel are slow."""
    return [pytest.param(name, marks=[pytest.mark.slow] if launches and simulated(name) and not fa_lab.ON_GPU else [],
                         id=name) for name in RUNNABLE]


ALL = _params()


def examples(name: str, fast: int, slow: int):
    """Hypothesis settings with ``slow`` examples for a simulated kernel, ``fast`` for the others."""
    return settings(max_examples=slow if simulated(name) else fast)


@dataclass(frozen=True)
class Problem:
    batch: int
    heads: int
    kv_heads: int
    n_q: int
    n_k: int
    head_dim: int
    dtype: torch.dtype
    causal: bool
    window: tuple[int, int]
    scale: float | None
    layouts: tuple[str, str, str]    # of q, k, v
    seed: int

    @property
    def mask(self) -> dict:
        return dict(causal=self.causal, window=self.window)


def _limits(name: str) -> tuple[int, int]:
    """Largest sequence length and head dim drawn: the simulator runs a Python thread per CUDA thread."""
    return (24, 32) if simulated(name) else (40, 64)


@st.composite
def problems(draw, name: str, head_dims=None, dtypes=None) -> Problem:
    impl = RUNNABLE[name]
    n_max, d_max = _limits(name)
    lo, hi = head_dims or impl.head_dims
    head_dim = draw(st.integers(lo, max(lo, min(hi, d_max))), label="head_dim")
    if draw(st.sampled_from([False, True, True, True]), label="whole 16-byte rows") and head_dim % 8:
        # mostly what every kernel launches (a multiple of 8), sometimes what some of them refuse
        head_dim = min(8 * math.ceil(head_dim / 8), hi)
    kv_heads = draw(st.integers(1, 2))
    group = draw(st.sampled_from([1, 2, 3])) if impl.gqa else 1
    lengths = st.sampled_from([1, 2, 7, 16, 17, n_max]) | st.integers(1, n_max)
    kinds = [k for k in ("none", "causal", "window", "causal+window") if k.split("+")[-1] in impl.masks]
    kind = draw(st.sampled_from(kinds))
    side = st.just(-1) | st.integers(0, n_max + 2)
    window = draw(st.tuples(side, side).filter(lambda w: w != (-1, -1))) if "window" in kind else (-1, -1)
    return Problem(
        batch=draw(st.integers(1, 2)), heads=kv_heads * group, kv_heads=kv_heads,
        n_q=draw(lengths), n_k=draw(lengths), head_dim=head_dim,
        dtype=draw(st.sampled_from(dtypes or impl.dtypes)), causal=kind.startswith("causal"), window=window,
        scale=draw(st.none() | st.floats(0.05, 2.0)),
        layouts=tuple(draw(st.sampled_from(LAYOUTS)) for _ in range(3)),
        seed=draw(st.integers(0, 2**31 - 1)))


def _as_view(x: torch.Tensor, layout: str) -> torch.Tensor:
    """``x`` (B, H, N, D), copied into a strided view of a larger NaN-filled buffer."""
    B, H, N, D = x.shape
    nan = dict(dtype=x.dtype, device=x.device)
    if layout == "contiguous":
        return x.clone()
    if layout == "transposed":      # stored (B, N, H, D), as a projection's output is
        view = torch.full((B, N, H, D), float("nan"), **nan).transpose(1, 2)
    elif layout == "head_dim_slice":    # q/k/v packed side by side along the last dim
        view = torch.full((B, H, N, 3 * D), float("nan"), **nan)[..., D:2 * D]
    else:                           # every other row of a longer sequence
        view = torch.full((B, H, 2 * N, D), float("nan"), **nan)[:, :, 1::2]
    view.copy_(x)
    return view


def make_inputs(p: Problem):
    g = torch.Generator().manual_seed(p.seed)
    shapes = [(p.batch, p.heads, p.n_q, p.head_dim)] + [(p.batch, p.kv_heads, p.n_k, p.head_dim)] * 2
    return [_as_view(torch.randn(s, generator=g).to(device=fa_lab.DEVICE, dtype=p.dtype), layout)
            for s, layout in zip(shapes, p.layouts)]


def run(name: str, p: Problem, q, k, v):
    return fa_lab.attention(q, k, v, impl=name, scale=p.scale, return_lse=True, **p.mask)


def _lse_dtype(dtype):
    # lse is float32 by contract, so a float64 run is judged at float32 precision there
    return torch.float32 if dtype == torch.float64 else dtype


@pytest.mark.parametrize("name", ALL)
def test_matches_reference_on_drawn_problems(name):
    @examples(name, fast=40, slow=12)
    @given(p=problems(name))
    def check(p):
        q, k, v = make_inputs(p)
        before = [t.clone() for t in (q, k, v)]
        try:
            o, lse = run(name, p, q, k, v)
        except ValueError as e:
            # the registry's head-dim range is inclusive, but a kernel may need whole 16-byte rows
            if p.head_dim % 8 and "head_dim" in str(e).replace("head dim", "head_dim"):
                note(f"refused: {e}")
                return
            raise
        assert o.shape == q.shape and o.dtype == q.dtype, (o.shape, o.dtype)
        assert lse.shape == (p.batch, p.heads, p.n_q) and lse.dtype == torch.float32, (lse.shape, lse.dtype)
        for t, t0 in zip((q, k, v), before):
            assert torch.equal(t.nan_to_num(), t0.nan_to_num()), f"{name} wrote into its inputs"
        ref_o, ref_lse = reference_attention(q, k, v, fa_lab.make_spec(q, k, v, scale=p.scale, **p.mask))
        assert_close(o, ref_o, p.dtype, what=f"{name} O")
        assert_close(lse, ref_lse, _lse_dtype(p.dtype), what=f"{name} lse")

    check()


@pytest.mark.parametrize("name", _params(launches=False))
def test_unsupported_requests_are_refused_clearly(name):
    impl = RUNNABLE[name]
    lo, hi = impl.head_dims
    dims = ([lo - 1] if lo > 1 else []) + [hi + 1, hi + 8]
    other_dtypes = [d for d in FLOAT_DTYPES if d not in impl.dtypes]

    @examples(name, fast=20, slow=10)   # refused before any launch: cheap everywhere
    @given(data=st.data())
    def check(data):
        what = data.draw(st.sampled_from(["head_dim"] + (["dtype"] if other_dtypes else [])), label="what")
        if what == "head_dim":
            p = data.draw(problems(name, head_dims=(1, 1)), label="problem")
            p = replace(p, head_dim=data.draw(st.sampled_from(dims), label="head_dim"), n_q=2, n_k=3)
            words = "head dims"
        else:
            p = data.draw(problems(name, dtypes=other_dtypes), label="problem")
            words = "dtypes"
        q, k, v = make_inputs(p)
        with pytest.raises(ValueError, match=words):
            run(name, p, q, k, v)

    check()


def visible_only_reference(q, k, v, spec):
    """Float64 attention in which query row i only ever touches the keys it sees.

    Equal to ``reference_attention`` on finite inputs; with a NaN or inf in a key or value,
    only the rows that attend to it are affected (the float64 reference's whole-matrix
    product also multiplies a masked key's zero weight by its NaN).
    """
    q, k, v = (t.detach().double().cpu() for t in (q, k, v))
    k, v = expand_kv(k, spec.group), expand_kv(v, spec.group)
    ok = visible(spec.n_q, spec.n_k, spec.left, spec.right)         # (Nq, Nk)
    seen = ok[None, None, :, :, None]
    k_i = torch.where(seen, k[:, :, None], 0.0)                     # (B, H, Nq, Nk, D): row i's keys
    v_i = torch.where(seen, v[:, :, None], 0.0)
    s = (q[:, :, :, None, :] * k_i).sum(-1) * spec.scale
    s = s.masked_fill(~ok, float("-inf"))
    m_i = s.amax(dim=-1, keepdim=True)
    m_i = torch.where(torch.isinf(m_i), torch.zeros_like(m_i), m_i)
    e = torch.exp(s - m_i)
    l_i = e.sum(dim=-1, keepdim=True)
    empty = l_i == 0
    l_safe = torch.where(empty, torch.ones_like(l_i), l_i)
    p = torch.where(ok[None, None], e / l_safe, 0.0)
    o = (p[..., None] * v_i).sum(-2)
    lse = torch.where(empty, torch.full_like(l_i, float("-inf")), m_i + torch.log(l_safe)).squeeze(-1)
    return o, lse


def assert_nonfinite_contract(got, want, leak, dtype, what, lse=False):
    """``got`` is non-finite where ``want`` is (NaN where ``want`` is NaN), NaN or a match where
    ``leak`` says the whole-matrix reference has a NaN, and within tolerance everywhere else.

    An inf in v makes O inf, which a kernel may round to NaN (0 * inf where P underflows);
    ``lse=True``: -inf is a row with no key, a value to match exactly.
    """
    got, want, leak = got.detach().double().cpu(), want.detach().double().cpu(), leak.cpu()
    must = ~torch.isfinite(want) & ~(torch.isneginf(want) if lse else torch.zeros_like(want, dtype=torch.bool))
    missing = must & torch.isfinite(got) | torch.isnan(want) & ~torch.isnan(got)
    if missing.any():
        idx = tuple(torch.nonzero(missing)[0].tolist())
        raise AssertionError(f"{what}: {int(missing.sum())} elements should be NaN/inf (NaN in gives NaN out); "
                             f"first at {idx}: got {got[idx].item():.6g}, expected {want[idx].item():.6g}")
    judged = ~must & ~(leak & torch.isnan(got))
    assert_close(got.masked_fill(~judged, 0.0), want.masked_fill(~judged, 0.0), dtype, what=what)


def _aligned(p: Problem, name: str) -> Problem:
    """``p`` with a head dim every kernel of ``name`` takes (a multiple of 8), so that it launches."""
    return replace(p, head_dim=8 * math.ceil(p.head_dim / 8)) if p.head_dim % 8 and simulated(name) else p


# NaN inputs are the point here: NumPy, the simulator and the interpreter warn about the arithmetic on them
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")
@pytest.mark.parametrize("name", ALL)
def test_nan_in_gives_nan_out(name):
    @examples(name, fast=30, slow=8)
    @given(p=problems(name), data=st.data())
    def check(p, data):
        p = _aligned(p, name)
        q, k, v = make_inputs(p)
        for _ in range(data.draw(st.integers(1, 2), label="poisoned")):
            which = data.draw(st.sampled_from("qkv"), label="tensor")
            t = dict(q=q, k=k, v=v)[which]
            idx = tuple(data.draw(st.integers(0, n - 1)) for n in t.shape)
            # inf only in v: an inf score makes the row's softmax undefined (inf - inf), not a contract
            value = data.draw(st.sampled_from([math.nan, math.inf, -math.inf]) if which == "v" else st.just(math.nan))
            note(f"{which}{list(idx)} = {value}")
            t[idx] = value
        spec = fa_lab.make_spec(q, k, v, scale=p.scale, **p.mask)
        o, lse = run(name, p, q, k, v)
        ref_o, ref_lse = reference_attention(q, k, v, spec)
        want_o, want_lse = visible_only_reference(q, k, v, spec)
        assert_nonfinite_contract(o, want_o, torch.isnan(ref_o), p.dtype, f"{name} O")
        assert_nonfinite_contract(lse, want_lse, torch.isnan(ref_lse), _lse_dtype(p.dtype), f"{name} lse", lse=True)

    check()


@pytest.mark.parametrize("name", ALL)
def test_rows_that_see_no_key_give_zeros_and_minus_inf(name):
    @examples(name, fast=15, slow=4)
    @given(p=problems(name), n_k=st.integers(1, 8), left=st.just(-1) | st.integers(0, 3))
    def check(p, n_k, left):
        # Nq > Nk under a causal mask: the first Nq - Nk rows sit before every key
        p = replace(_aligned(p, name), n_q=max(p.n_q, n_k + 1), n_k=n_k, causal=True, window=(left, -1))
        if mask_kind(p.causal, p.window) not in RUNNABLE[name].masks:
            return
        q, k, v = make_inputs(p)
        o, lse = run(name, p, q, k, v)
        spec = fa_lab.make_spec(q, k, v, **p.mask)
        empty = ~visible(p.n_q, p.n_k, spec.left, spec.right).any(dim=1)
        assert empty.any()
        assert torch.all(o[:, :, empty.to(o.device)] == 0), f"{name}: a row with no key is not zero"
        assert torch.all(torch.isneginf(lse[:, :, empty.to(lse.device)])), f"{name}: a row with no key has lse != -inf"
        assert torch.isfinite(lse[:, :, ~empty.to(lse.device)]).all(), f"{name}: a row that sees keys has lse -inf"

    check()


def test_visible_only_judge_is_the_reference_on_finite_inputs():
    p = Problem(2, 4, 2, 9, 13, 8, torch.float64, True, (3, 2), 0.7, ("transposed",) * 3, seed=5)
    q, k, v = make_inputs(p)
    spec = fa_lab.make_spec(q, k, v, scale=p.scale, **p.mask)
    for ours, theirs in zip(visible_only_reference(q, k, v, spec), reference_attention(q, k, v, spec)):
        assert torch.allclose(ours, theirs.cpu(), atol=1e-12, equal_nan=False)
