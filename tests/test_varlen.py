"""Packed variable-length attention (``fa_lab.kernels.varlen``) against the float64 reference.

Each sequence ``b`` of a packed batch is judged on its own: ``reference_attention`` on its
``(1, H, Lq, D)`` slice of q and ``(1, Hkv, Lk, D)`` slices of k and v, with the same mask and
score modifications (ALiBi slopes ``alibi_slopes[b:b+1]``).  Gradients are float64 autograd
through those references, with a random dO and a random gradient on the finite lse.

The packed batches have tails (lengths no multiple of any tile), empty sequences (Lq = 0 and/or
Lk = 0), Lq != Lk both ways and grouped-query attention; a sequence full of NaN must not leak
into its neighbours.  Sizes are tiny: in the CPU world the kernels run in Triton's interpreter.
"""
from __future__ import annotations

import math

import pytest
import torch

import fa_lab
from fa_lab.core.reference import reference_attention
from fa_lab.core.spec import make_spec
from fa_lab.core.testing import assert_close, max_error

pytestmark = pytest.mark.skipif(not fa_lab.HAS_TRITON, reason="Triton is not installed")

from fa_lab.kernels.varlen import VarlenAttention, varlen_backward, varlen_forward  # noqa: E402
from fa_lab.kernels.varlen.schedule import block_schedule, cached_schedule, n_programs, schedule_table  # noqa: E402

DEVICE = fa_lab.DEVICE
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: gradients vs the float64 reference: |err| <= tol · max(1, max |ref|)
GRAD_TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 6e-2}
#: (left, right) windows: none, causal, a sliding window, a two-sided window, causal with a window
WINDOWS = {"none": (-1, -1), "causal": (-1, 0), "window": (4, 0), "two-sided": (2, 3), "causal+window": (3, 0)}
#: (Lq, Lk) per sequence: tails, an empty query side, an empty key side, Lq > Lk and Lq < Lk
LENGTHS = [(5, 9), (0, 4), (17, 17), (3, 0), (20, 6), (1, 1)]


def cu(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


def packed(lengths=LENGTHS, heads=4, kv_heads=2, head_dim=16, dtype=torch.float32, seed=0):
    """Random packed q, k, v and cu_seqlens for ``lengths`` = [(Lq, Lk), ...]; fp32 draws, then cast."""
    g = torch.Generator().manual_seed(seed)
    lq, lk = [a for a, _ in lengths], [b for _, b in lengths]

    def draw(n, h):
        return torch.randn(n, h, head_dim, generator=g).to(device=DEVICE, dtype=dtype)

    return (draw(sum(lq), heads), draw(sum(lk), kv_heads), draw(sum(lk), kv_heads), cu(lq), cu(lk),
            max(lq), max(lk))


def slopes_for(kind, batch, heads, seed):
    if kind is None:
        return None
    g = torch.Generator().manual_seed(seed + 1)
    shape = (heads,) if kind == "per-head" else (batch, heads)
    return torch.rand(shape, generator=g).to(DEVICE)


def sequences(cu_q, cu_k):
    cq, ck = cu_q.tolist(), cu_k.tolist()
    return [(slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])) for b in range(len(cq) - 1)]


def reference(q, k, v, cu_q, cu_k, *, scale, left=-1, right=-1, softcap=0.0, alibi_slopes=None):
    """Float64 ``(o, lse)`` in the packed layout, one ``reference_attention`` per sequence."""
    H = q.shape[1]
    o = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    lse = torch.full((H, q.shape[0]), float("-inf"), dtype=torch.float64, device=q.device)
    slopes = None if alibi_slopes is None else alibi_slopes.expand(len(cu_q) - 1, H)
    outs, lses = [], []
    for b, (rq, rk) in enumerate(sequences(cu_q, cu_k)):
        if rq.stop == rq.start or rk.stop == rk.start:   # no query, or no key: zeros and -inf
            outs.append(o[rq])
            lses.append(lse[:, rq])
            continue
        qs, ks, vs = (t[r].transpose(0, 1)[None].double() for t, r in ((q, rq), (k, rk), (v, rk)))
        spec = make_spec(qs, ks, vs, window=(left, right), scale=scale, softcap=softcap,
                         alibi_slopes=None if slopes is None else slopes[b:b + 1])
        ro, rl = reference_attention(qs, ks, vs, spec)
        outs.append(ro[0].transpose(0, 1))
        lses.append(rl[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


def loss_of(o, lse, seed):
    """A scalar whose gradient sends a random dO into o and a random dlse into the finite lse."""
    g = torch.Generator().manual_seed(seed + 2)
    do = torch.randn(o.shape, generator=g).to(o.device)
    dl = torch.randn(lse.shape, generator=g).to(o.device)
    return (o.double() * do.double()).sum() + (torch.where(torch.isinf(lse), 0, lse).double() * dl.double()).sum()


def assert_grads_close(got, expected, dtype, what):
    for name, g, e in zip(("dq", "dk", "dv"), got, expected):
        assert g.shape == e.shape and g.dtype == dtype, f"{what} {name}: {tuple(g.shape)} {g.dtype}"
        assert torch.isfinite(g).all(), f"{what} {name}: not finite"
        tol = GRAD_TOL[dtype] * max(1.0, float(e.abs().max()) if e.numel() else 0.0)
        err = max_error(g, e)
        assert err <= tol, f"{what} {name}: max error {err:.3g} > {tol:.3g}"


def check_forward(q, k, v, cu_q, cu_k, max_q, max_k, dtype, what, **kw):
    o, lse = varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, **kw)
    assert o.shape == q.shape and o.dtype == q.dtype and lse.shape == (q.shape[1], q.shape[0])
    assert lse.dtype == torch.float32
    ref_o, ref_lse = reference(q, k, v, cu_q, cu_k, **kw)
    assert_close(o, ref_o, dtype, what=f"{what} O")
    assert_close(lse, ref_lse, dtype, what=f"{what} lse")
    return o, lse


def check_backward(q, k, v, cu_q, cu_k, max_q, max_k, dtype, seed, what, **kw):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o, lse = VarlenAttention.apply(q, k, v, cu_q, cu_k, max_q, max_k, kw["scale"], kw.get("left", -1),
                                   kw.get("right", -1), kw.get("softcap", 0.0), kw.get("alibi_slopes"))
    got = torch.autograd.grad(loss_of(o, lse, seed), (q, k, v))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_o, ref_lse = reference(q64, k64, v64, cu_q, cu_k, **kw)
    want = torch.autograd.grad(loss_of(ref_o, ref_lse, seed), (q64, k64, v64), allow_unused=True,
                               materialize_grads=True)
    assert_grads_close(got, want, dtype, what)


# ---------------------------------------------------------------------------- forward and backward

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mask", list(WINDOWS))
def test_forward_and_backward_match_reference(mask, dtype, seed):
    left, right = WINDOWS[mask]
    args = packed(dtype=dtype, seed=seed)
    kw = dict(scale=0.3, left=left, right=right)
    check_forward(*args, dtype, f"{mask} {dtype} (seed={seed})", **kw)
    check_backward(*args, dtype, seed, f"{mask} {dtype} (seed={seed})", **kw)


@pytest.mark.parametrize("softcap,alibi", [(2.5, None), (0.0, "per-head"), (0.0, "per-batch"), (2.5, "per-head"),
                                           (2.5, "per-batch")])
@pytest.mark.parametrize("mask", ["none", "causal", "two-sided"])
def test_score_modifications(mask, softcap, alibi, seed):
    dtype = torch.float32
    left, right = WINDOWS[mask]
    args = packed(dtype=dtype, seed=seed)
    q = args[0] * 2.0   # larger scores, so that the cap bends them
    kw = dict(scale=0.5, left=left, right=right, softcap=softcap,
              alibi_slopes=slopes_for(alibi, len(LENGTHS), q.shape[1], seed))
    what = f"{mask} softcap={softcap} alibi={alibi} (seed={seed})"
    check_forward(q, *args[1:], dtype, what, **kw)
    check_backward(q, *args[1:], dtype, seed, what, **kw)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_score_modifications_in_16_bit(dtype, seed):
    args = packed(dtype=dtype, seed=seed)
    kw = dict(scale=0.4, left=-1, right=0, softcap=3.0, alibi_slopes=slopes_for("per-batch", len(LENGTHS), 4, seed))
    check_forward(*args, dtype, f"{dtype} (seed={seed})", **kw)
    check_backward(*args, dtype, seed, f"{dtype} (seed={seed})", **kw)


@pytest.mark.parametrize("head_dim", [1, 59, 111, 200, 256])
def test_any_head_dim(head_dim, seed):
    lengths = [(3, 5), (0, 2), (18, 17)] if head_dim < 200 else [(3, 5), (17, 2)]
    dtype = torch.float16 if head_dim % 2 else torch.float32
    args = packed(lengths, heads=2, kv_heads=1, head_dim=head_dim, dtype=dtype, seed=seed)
    kw = dict(scale=1 / math.sqrt(head_dim), left=-1, right=0)
    check_forward(*args, dtype, f"D={head_dim} (seed={seed})", **kw)
    check_backward(*args, dtype, seed, f"D={head_dim} (seed={seed})", **kw)


def test_gqa_groups_and_negative_scale(seed):
    args = packed([(7, 19), (16, 16), (2, 33)], heads=6, kv_heads=2, seed=seed)
    kw = dict(scale=-0.25, left=5, right=-1)
    check_forward(*args, torch.float32, f"GQA 6/2, negative scale (seed={seed})", **kw)
    check_backward(*args, torch.float32, seed, f"GQA 6/2, negative scale (seed={seed})", **kw)


def test_strided_inputs_read_only_their_view(seed):
    # q, k, v as slices of packed qkv projections: (total, H, 3·D) buffers whose other columns are NaN
    q, k, v, *rest = packed(seed=seed)

    def view(t):
        buf = torch.full((t.shape[0], t.shape[1], 3 * t.shape[2]), float("nan"), device=DEVICE)
        buf[..., t.shape[2]:2 * t.shape[2]] = t
        return buf[..., t.shape[2]:2 * t.shape[2]]

    args = (view(q), view(k), view(v), *rest)
    assert not args[0].is_contiguous()
    check_forward(*args, torch.float32, f"strided (seed={seed})", scale=0.3, right=0)
    check_backward(*args, torch.float32, seed, f"strided (seed={seed})", scale=0.3, right=0)


def test_gradients_are_bit_identical_run_to_run(seed):
    q, k, v, cu_q, cu_k, mq, mk = packed(seed=seed)
    o, lse = varlen_forward(q, k, v, cu_q, cu_k, mq, mk, scale=0.3, right=0)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    first = varlen_backward(do, q, k, v, o, lse, cu_q, cu_k, mq, mk, scale=0.3, right=0)
    again = varlen_backward(do, q, k, v, o, lse, cu_q, cu_k, mq, mk, scale=0.3, right=0)
    assert all(torch.equal(a, b) for a, b in zip(first, again))


# ---------------------------------------------------------------------------- special rows and NaN

def test_rows_that_see_no_key_give_zeros_minus_inf_and_zero_gradients(seed):
    lengths = [(6, 3), (4, 0), (5, 5)]   # causal: rows 0..2 of sequence 0 sit before every key
    q, k, v, cu_q, cu_k, mq, mk = packed(lengths, seed=seed)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o, lse = VarlenAttention.apply(q, k, v, cu_q, cu_k, mq, mk, 0.3, -1, 0, 0.0, None)
    empty = torch.tensor([1, 1, 1, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0], dtype=torch.bool, device=DEVICE)
    assert torch.all(o[empty] == 0) and torch.all(torch.isneginf(lse[:, empty]))
    assert torch.isfinite(lse[:, ~empty]).all() and not torch.isnan(o).any()
    dq, dk, dv = torch.autograd.grad(loss_of(o, lse, seed), (q, k, v))
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    assert torch.all(dq[empty] == 0)


def test_empty_batches():
    for lengths in ([(0, 0), (0, 0)], [(3, 0), (2, 0)], [(0, 3), (0, 1)]):
        q, k, v, cu_q, cu_k, mq, mk = packed(lengths, head_dim=8)
        o, lse = varlen_forward(q, k, v, cu_q, cu_k, mq, mk, scale=1.0)
        assert torch.all(o == 0) and torch.all(torch.isneginf(lse))
        do = torch.ones_like(o)
        for g, t in zip(varlen_backward(do, q, k, v, o, lse, cu_q, cu_k, mq, mk, scale=1.0), (q, k, v)):
            assert g.shape == t.shape and torch.all(g == 0)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_nan_in_gives_nan_out_and_stays_in_its_sequence(seed):
    lengths = [(9, 9), (7, 18), (17, 5)]
    q, k, v, cu_q, cu_k, mq, mk = packed(lengths, seed=seed)
    k[9 + 3, 0, 2] = float("nan")      # sequence 1, key 3, kv head 0 (query heads 0 and 1)
    v[9:27, 1] = float("nan")          # sequence 1, every value of kv head 1 (query heads 2 and 3)
    q[16 + 14, 3, 0] = float("nan")    # sequence 2, query 14 (it sees keys 0..2), head 3
    o, lse = varlen_forward(q, k, v, cu_q, cu_k, mq, mk, scale=0.3, left=-1, right=0)
    ref_o, ref_lse = reference(q, k, v, cu_q, cu_k, scale=0.3, right=0)
    # sequence 1, heads 0-1: the rows that see key 3 (causal: query i sees keys <= i + 11, so all of them)
    assert torch.isnan(o[9:16, :2]).all() and torch.isnan(lse[:2, 9:16]).all()
    assert torch.isnan(o[9:16, 2:]).all()                                # every value of kv head 1 is NaN
    assert torch.isnan(o[16 + 14, 3]).all() and torch.isnan(lse[3, 16 + 14])
    # everything else is finite and right: sequence 0, and sequence 2 but for its NaN query
    keep = torch.ones(o.shape[:2], dtype=torch.bool, device=DEVICE)
    keep[9:16] = False
    keep[16 + 14, 3] = False
    assert torch.isfinite(o[keep]).all()
    assert_close(o[keep], ref_o[keep], torch.float32, what="rows without NaN")
    assert_close(lse.T[keep], ref_lse.T[keep], torch.float32, what="lse without NaN")


# ---------------------------------------------------------------------------- the work table

@pytest.mark.parametrize("block", [1, 4, 16])
def test_schedule_covers_every_real_block_once(block):
    lengths = [5, 0, 17, 16, 1, 0, 33]
    cu_rows = cu(lengths)
    programs = n_programs(sum(lengths), len(lengths), block)
    want = schedule_table(lengths, block)
    assert programs >= len(want) and programs - len(want) <= len(lengths)
    for heaviest_first in (False, True):
        table = block_schedule(cu_rows, cu_rows, block, programs, right=0, heaviest_first=heaviest_first)
        assert table.dtype == torch.int32 and table.shape == (2, programs)
        pairs = [tuple(p) for p in table.T.tolist()]
        real = [p for p in pairs if p[0] >= 0]
        assert (real == want) if not heaviest_first else sorted(real) == sorted(want)
        assert all(p[0] == -1 for p in pairs[len(real):])            # the spare programs come last


def test_cached_schedule_is_rebuilt_when_cu_seqlens_change():
    cu_rows = cu([5, 17])
    first = cached_schedule(cu_rows, cu_rows, 4, n_programs(22, 2, 4))
    assert cached_schedule(cu_rows, cu_rows, 4, n_programs(22, 2, 4)) is first      # the same tensors: reused
    cu_rows[1:] = torch.tensor([17, 22], dtype=torch.int32)                        # in place: a new version
    again = cached_schedule(cu_rows, cu_rows, 4, n_programs(22, 2, 4))
    assert again is not first
    assert sorted(tuple(p) for p in again.T.tolist() if p[0] >= 0) == schedule_table([17, 5], 4)
    copy = cu_rows.clone()                                                         # equal values, another tensor
    assert cached_schedule(copy, copy, 4, n_programs(22, 2, 4)) is not again


def test_heaviest_blocks_first_under_a_causal_mask():
    table = block_schedule(cu([16, 40]), cu([16, 40]), 8, n_programs(56, 2, 8), right=0)
    seq, block = table.tolist()
    assert (seq[0], block[0]) == (1, 4)     # the last block of the long sequence sees the most keys


# ---------------------------------------------------------------------------- the autograd Function

def test_only_q_k_v_o_and_lse_are_saved():
    q, k, v, cu_q, cu_k, mq, mk = packed()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        VarlenAttention.apply(q, k, v, cu_q, cu_k, mq, mk, 0.3, -1, -1, 0.0, None)
    assert sorted(saved) == sorted([tuple(q.shape)] * 2 + [tuple(k.shape)] * 2 + [(q.shape[1], q.shape[0])])


def test_second_derivative_raises():
    q, k, v, cu_q, cu_k, mq, mk = packed([(5, 5)])
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o, _ = VarlenAttention.apply(q, k, v, cu_q, cu_k, mq, mk, 0.3, -1, 0, 0.0, None)
    dq, = torch.autograd.grad((o ** 2).sum(), (q,), create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        (dq ** 2).sum().backward()


def test_registered_adapter_with_score_modifications(seed):
    # the fixed-length interface: softcap and per-batch ALiBi through fa_lab.attention, gradients included
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, h, n, 16, generator=g).to(DEVICE).requires_grad_() for h, n in ((4, 11), (2, 7), (2, 7)))
    slopes = torch.rand(2, 4, generator=g).to(DEVICE)
    kw = dict(causal=True, scale=0.5, softcap=1.5, alibi_slopes=slopes)
    o, lse = fa_lab.attention(q, k, v, impl="triton_varlen", return_lse=True, **kw)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_o, ref_lse = reference_attention(q64, k64, v64, make_spec(q64, k64, v64, **kw))
    assert_close(o, ref_o, torch.float32, "adapter O")
    assert_close(lse, ref_lse, torch.float32, "adapter lse")
    got = torch.autograd.grad(loss_of(o, lse, seed), (q, k, v))
    assert_grads_close(got, torch.autograd.grad(loss_of(ref_o, ref_lse, seed), (q64, k64, v64)), torch.float32,
                       "adapter")


# ---------------------------------------------------------------------------- bad input

def _bad(name):
    q, k, v, cu_q, cu_k, mq, mk = packed([(3, 4), (2, 2)], head_dim=8)
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=mq, max_seqlen_k=mk)
    kw = dict(scale=1.0)
    change = {
        "q rank": lambda: args.update(q=q[0]),
        "q type": lambda: args.update(q=q.cpu().numpy()),
        "dtype": lambda: args.update(q=q.double(), k=k.double(), v=v.double()),
        "mixed dtypes": lambda: args.update(k=k.half()),
        "k/v shapes": lambda: args.update(v=v[:, :1]),
        "head dims": lambda: args.update(k=k[..., :4], v=v[..., :4]),
        "head dim range": lambda: args.update(q=torch.zeros(5, 4, 257, device=DEVICE),
                                              k=torch.zeros(6, 2, 257, device=DEVICE),
                                              v=torch.zeros(6, 2, 257, device=DEVICE)),
        "gqa": lambda: args.update(k=torch.zeros(6, 3, 8, device=DEVICE), v=torch.zeros(6, 3, 8, device=DEVICE)),
        "last dim": lambda: args.update(q=q.transpose(1, 2).contiguous().transpose(1, 2)),
        "cu dtype": lambda: args.update(cu_seqlens_q=cu_q.long()),
        "cu type": lambda: args.update(cu_seqlens_q=cu_q.tolist()),
        "cu shape": lambda: args.update(cu_seqlens_q=cu_q[None]),
        "cu batch": lambda: args.update(cu_seqlens_k=cu_k[:2]),
        "cu values": lambda: args.update(cu_seqlens_q=cu_q.flip(0)),
        "cu total": lambda: args.update(cu_seqlens_k=cu_k - 1),
        "max_seqlen": lambda: args.update(max_seqlen_q=3.0),
        "max_seqlen sign": lambda: args.update(max_seqlen_k=-1),
        "scale": lambda: kw.update(scale=float("inf")),
        "window": lambda: kw.update(left=-2),
        "window type": lambda: kw.update(right=0.5),
        "softcap": lambda: kw.update(softcap=-1.0),
        "alibi dtype": lambda: kw.update(alibi_slopes=torch.ones(4, dtype=torch.float64, device=DEVICE)),
        "alibi shape": lambda: kw.update(alibi_slopes=torch.ones(3, 4, device=DEVICE)),
    }[name]
    change()
    return args, kw


@pytest.mark.parametrize("name,exc,words", [
    ("q rank", ValueError, "3 dims"), ("q type", TypeError, "torch.Tensor"), ("dtype", TypeError, "float16"),
    ("mixed dtypes", TypeError, "one dtype"), ("k/v shapes", ValueError, "same shape"),
    ("head dims", ValueError, "same head dim"), ("head dim range", ValueError, "head dims 1..256"),
    ("gqa", ValueError, "multiple of key/value heads"), ("last dim", ValueError, "contiguous"),
    ("cu dtype", TypeError, "int32"), ("cu type", TypeError, "torch.Tensor"),
    ("cu shape", ValueError, r"\(batch \+ 1,\)"),
    ("cu batch", ValueError, "same number of sequences"), ("cu values", ValueError, "never decrease"),
    ("cu total", ValueError, "start at 0"), ("max_seqlen", TypeError, "max_seqlen_q must be an int"),
    ("max_seqlen sign", ValueError, ">= 0"), ("scale", ValueError, "scale"), ("window", ValueError, "left"),
    ("window type", TypeError, "right"), ("softcap", ValueError, "softcap"), ("alibi dtype", TypeError, "float32"),
    ("alibi shape", ValueError, "alibi_slopes"),
])
def test_bad_input_is_refused_clearly(name, exc, words):
    args, kw = _bad(name)
    if name.startswith("cu ") and name.split()[1] in ("values", "total") and DEVICE.type != "cpu":
        pytest.skip("cu_seqlens values are read only on the CPU (on a GPU that would synchronise)")
    with pytest.raises(exc, match=words):
        varlen_forward(*args.values(), **kw)


def test_backward_checks_its_extra_inputs():
    q, k, v, cu_q, cu_k, mq, mk = packed([(3, 4)], head_dim=8)
    o, lse = varlen_forward(q, k, v, cu_q, cu_k, mq, mk, scale=1.0)
    with pytest.raises(ValueError, match="do must match q"):
        varlen_backward(o[:2], q, k, v, o, lse, cu_q, cu_k, mq, mk, scale=1.0)
    with pytest.raises(ValueError, match="lse must be float32"):
        varlen_backward(o, q, k, v, o, lse.T, cu_q, cu_k, mq, mk, scale=1.0)

