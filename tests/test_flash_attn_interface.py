"""``fa_lab.flash_attn``: flash-attn 2.x's Python interface on fa_lab's kernels, against the float64 reference.

Every attention function is judged by ``reference_attention`` run per sequence: outputs, lse, the
attention probabilities of ``return_attn_probs`` and the gradients.  The packed variants must agree
with the unpacked ones and send their gradients into the packed tensor.  Varlen batches have empty
sequences and lengths that are no multiple of any tile.  ``flash_attn_with_kvcache`` appends into
contiguous and paged caches (pages of 16 and 256, appends that cross a page), with ``cache_batch_idx``,
1..8 splits, rotary embeddings checked against a float64 rotation, GQA, head dims 1..256, ALiBi,
softcap and windows; cache slots that hold no key are NaN, so a read past a sequence shows.  The
signatures are flash-attn 2.7's, written out here: they are the compatibility contract.
"""
from __future__ import annotations

import inspect
import math

import pytest
import torch

import fa_lab
import fa_lab.flash_attn_interface as alias
from fa_lab.core.masks import visible
from fa_lab.core.reference import modified_scores, reference_attention
from fa_lab.core.spec import make_spec
from fa_lab.core.testing import assert_close, max_error
from fa_lab.flash_attn import (
    engine,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)
from fa_lab.flash_attn.bert_padding import (
    index_first_axis,
    index_put_first_axis,
    pad_input,
    unpad_input,
    unpad_input_for_concatenated_sequences,
)
from fa_lab.flash_attn.checks import score_args
from fa_lab.flash_attn.layers.rotary import apply_rotary_emb

pytestmark = pytest.mark.skipif(not fa_lab.HAS_TRITON, reason="Triton is not installed")

DEVICE = fa_lab.DEVICE
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
#: gradients: |err| <= tol · max(1, max |reference gradient|)
GRAD_TOL = {F32: 1e-4, F16: 1e-2, BF16: 6e-2}


def randn(g, *shape, dtype=F32):
    return torch.randn(*shape, generator=g).to(DEVICE, dtype)


def i32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def cumulative(lengths):
    return i32([0] + [sum(lengths[:i + 1]) for i in range(len(lengths))])


# ---- the judge, per sequence, in flash-attn's layout --------------------------------------------------------

def reference_sequence(q, k, v, slopes=None, **mask):
    """q ``(Nq, H, D)``, k and v ``(Nk, Hkv, D)``, float64 -> o ``(Nq, H, D)``, lse ``(H, Nq)``, P ``(H, Nq, Nk)``."""
    n_q, heads, _ = q.shape
    n_k = k.shape[0]
    if n_q == 0 or n_k == 0:   # no query, or no key: zeros and lse = -inf (q·0 keeps q in the graph)
        lse = torch.full((heads, n_q), -math.inf, dtype=torch.float64, device=q.device)
        return q * 0, lse, q.new_zeros(heads, n_q, n_k)
    qt, kt, vt = (t.transpose(0, 1)[None] for t in (q, k, v))
    spec = make_spec(qt, kt, vt, alibi_slopes=slopes, **mask)
    o, lse = reference_attention(qt, kt, vt, spec)
    s = modified_scores(torch.matmul(qt, kt.repeat_interleave(spec.group, 1).transpose(-1, -2)) * spec.scale, spec)
    ok = visible(n_q, n_k, spec.left, spec.right, device=q.device)
    p = torch.where(ok, torch.exp(s - lse[..., None]), 0.0)
    return o[0].transpose(0, 1), lse[0], p[0]


def reference_varlen(q, k, v, lengths_q, lengths_k, alibi=None, **mask):
    """Packed q, k, v (float64) -> o ``(total_q, H, D)``, lse ``(H, total_q)``, P per sequence."""
    outs, lses, probs = [], [], []
    sq = sk = 0
    for b, (n_q, n_k) in enumerate(zip(lengths_q, lengths_k)):
        o, lse, p = reference_sequence(q[sq:sq + n_q], k[sk:sk + n_k], v[sk:sk + n_k],
                                       None if alibi is None else alibi[b], **mask)
        outs.append(o), lses.append(lse), probs.append(p)
        sq, sk = sq + n_q, sk + n_k
    return torch.cat(outs), torch.cat(lses, dim=1), probs


def assert_grads_close(got, expected, dtype, what):
    for name, g, e in zip(("dq", "dk", "dv"), got, expected):
        assert g.shape == e.shape, f"{what} {name}: shape {tuple(g.shape)}, expected {tuple(e.shape)}"
        tol = GRAD_TOL[dtype] * max(1.0, float(e.detach().abs().max()) if e.numel() else 1.0)
        err = max_error(g, e)
        assert err <= tol, f"{what} {name}: max error {err:.3g} > {tol:.3g}"


def run_and_grads(fn, inputs, do):
    """``fn(*inputs)``'s (out, lse, probs) and the gradients of ``<out, do>`` for every input."""
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    out, lse, p = fn(*inputs)
    return out, lse, p, torch.autograd.grad(out, inputs, do)


# ---- fixed length ------------------------------------------------------------------------------------------

#: (B, Nq, Nk, H, Hkv, D, dtype, mask, softcap, alibi, softmax_scale, the engine that runs it)
FIXED = [
    (2, 9, 9, 2, 2, 16, F32, dict(causal=True), 0.0, False, None, "flash_triton"),
    (1, 5, 13, 4, 2, 32, F16, dict(window=(3, 1)), 0.0, False, 0.3, "flash_triton"),
    (2, 13, 6, 2, 1, 59, F32, dict(causal=True), 0.0, False, None, "varlen"),      # Nq > Nk: rows with no key
    (1, 7, 11, 2, 2, 24, BF16, dict(), 5.0, True, None, "varlen"),
    (2, 8, 8, 3, 1, 16, F32, dict(causal=True, window=(2, -1)), 0.0, True, None, "varlen"),
    (1, 3, 20, 2, 1, 8, F32, dict(window=(-1, 2)), 0.0, False, None, "varlen"),      # D = 8: too small for Part I
]


def case_id(case) -> str:
    """``D59-fp32-causal-softcap``-like ids for the tables of cases."""
    D, dtype, mask, softcap, alibi = (case[5], case[6], case[7], case[8], case[9]) if len(case) == 12 else case[4:]
    mods = [f"{k}{v if v is not True else ''}" for k, v in mask.items()] + (["softcap"] if softcap else []) + \
        (["alibi"] if alibi else [])
    return "-".join([f"D{D}", str(dtype).removeprefix("torch.")] + mods).replace(" ", "")


@pytest.mark.parametrize("B,n_q,n_k,H,Hkv,D,dtype,mask,softcap,alibi,scale,expected_engine", FIXED,
                         ids=[case_id(c) for c in FIXED])
def test_flash_attn_func_matches_reference(B, n_q, n_k, H, Hkv, D, dtype, mask, softcap, alibi, scale,
                                           expected_engine, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = randn(g, B, n_q, H, D, dtype=dtype), randn(g, B, n_k, Hkv, D, dtype=dtype), randn(g, B, n_k, Hkv, D,
                                                                                                 dtype=dtype)
    do = randn(g, B, n_q, H, D, dtype=dtype)
    slopes = (torch.rand(B, H, generator=g) * 0.5).to(DEVICE) if alibi else None
    causal, window = mask.get("causal", False), mask.get("window", (-1, -1))
    args = score_args(q.transpose(1, 2), Hkv, softmax_scale=scale, causal=causal, window_size=window,
                             softcap=softcap, alibi_slopes=slopes)
    assert engine._fixed_length_engine(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), args) \
        == expected_engine

    def fa(q, k, v):
        return flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, window_size=window, softcap=softcap,
                               alibi_slopes=slopes, deterministic=True, return_attn_probs=True)

    out, lse, p, grads = run_and_grads(fa, (q, k, v), do)
    assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
    assert lse.shape == (B, H, n_q) and lse.dtype == torch.float32 and p.shape == (B, H, n_q, n_k)

    def judge(q, k, v):
        ref = [reference_sequence(q[b], k[b], v[b], None if slopes is None else slopes[b], scale=scale,
                                  softcap=softcap, **mask) for b in range(B)]
        return tuple(torch.stack([r[i] for r in ref]) for i in range(3))

    ref_out, ref_lse, ref_p, ref_grads = run_and_grads(judge, [t.double() for t in (q, k, v)], do.double())
    assert_close(out, ref_out, dtype, "out")
    assert_close(lse, ref_lse, dtype, "softmax_lse")
    assert_close(p, ref_p, dtype, "S_dmask")
    assert_grads_close(grads, ref_grads, dtype, "flash_attn_func")


def test_packed_variants_agree_and_send_gradients_into_the_packed_tensor(seed):
    g = torch.Generator().manual_seed(seed)
    for D, softcap in ((16, 0.0), (20, 3.0)):   # Part I's kernel, then the varlen one
        qkv = randn(g, 2, 11, 3, 2, D)
        do = randn(g, 2, 11, 2, D)
        packed = qkv.clone().requires_grad_()
        out = flash_attn_qkvpacked_func(packed, causal=True, softcap=softcap)
        out.backward(do)
        q, k, v = (t.clone().requires_grad_() for t in qkv.unbind(2))
        expected = flash_attn_func(q, k, v, causal=True, softcap=softcap)
        expected.backward(do)
        assert_close(out, expected, F32, "qkvpacked out")
        assert_close(packed.grad, torch.stack([q.grad, k.grad, v.grad], dim=2), F32, "dqkv")

        q = randn(g, 2, 5, 4, D).requires_grad_()
        kv = randn(g, 2, 9, 2, 2, D).requires_grad_()
        out = flash_attn_kvpacked_func(q, kv, window_size=(2, 2), softcap=softcap)
        out.backward(do[:, :5].repeat(1, 1, 2, 1))
        k, v = (t.detach().clone().requires_grad_() for t in kv.unbind(2))
        q2 = q.detach().clone().requires_grad_()
        expected = flash_attn_func(q2, k, v, window_size=(2, 2), softcap=softcap)
        expected.backward(do[:, :5].repeat(1, 1, 2, 1))
        assert_close(out, expected, F32, "kvpacked out")
        assert_close(q.grad, q2.grad, F32, "dq")
        assert_close(kv.grad, torch.stack([k.grad, v.grad], dim=2), F32, "dkv")


# ---- variable length ---------------------------------------------------------------------------------------

#: (lengths_q, lengths_k, H, Hkv, D, dtype, mask, softcap, alibi)
VARLEN = [
    ([3, 0, 17], [5, 4, 17], 2, 1, 32, F32, dict(causal=True), 0.0, False),    # a sequence with no query
    ([4, 9], [0, 20], 2, 2, 59, F32, dict(), 0.0, True),                       # a sequence with no key
    ([1, 16, 7], [1, 16, 30], 4, 2, 16, F16, dict(window=(4, 2)), 2.0, False),
    ([12, 5], [6, 5], 2, 1, 40, BF16, dict(causal=True, window=(3, -1)), 0.0, True),
]


@pytest.mark.parametrize("lengths_q,lengths_k,H,Hkv,D,dtype,mask,softcap,alibi", VARLEN,
                         ids=[case_id(c) for c in VARLEN])
def test_flash_attn_varlen_func_matches_reference(lengths_q, lengths_k, H, Hkv, D, dtype, mask, softcap, alibi,
                                                  seed):
    g = torch.Generator().manual_seed(seed)
    B, total_q, total_k = len(lengths_q), sum(lengths_q), sum(lengths_k)
    q, k, v = randn(g, total_q, H, D, dtype=dtype), randn(g, total_k, Hkv, D, dtype=dtype), randn(g, total_k, Hkv, D,
                                                                                                  dtype=dtype)
    do = randn(g, total_q, H, D, dtype=dtype)
    slopes = (torch.rand(H, generator=g) * 0.5).to(DEVICE) if alibi else None   # (H,): every sequence's
    cu_q, cu_k = cumulative(lengths_q), cumulative(lengths_k)
    max_q, max_k = max(lengths_q), max(lengths_k)

    def fa(q, k, v):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softcap=softcap, alibi_slopes=slopes,
                                      return_attn_probs=True, causal=mask.get("causal", False),
                                      window_size=mask.get("window", (-1, -1)))

    out, lse, p, grads = run_and_grads(fa, (q, k, v), do)
    assert out.shape == q.shape and lse.shape == (H, total_q) and p.shape == (B, H, max_q, max_k)
    rows = None if slopes is None else slopes.expand(B, H)

    def judge(q, k, v):
        return reference_varlen(q, k, v, lengths_q, lengths_k, rows, softcap=softcap, **mask)

    ref_out, ref_lse, ref_p, ref_grads = run_and_grads(judge, [t.double() for t in (q, k, v)], do.double())
    assert_close(out, ref_out, dtype, "out")
    assert_close(lse, ref_lse, dtype, "softmax_lse")
    for b, (n_q, n_k) in enumerate(zip(lengths_q, lengths_k)):
        assert_close(p[b, :, :n_q, :n_k], ref_p[b], dtype, f"S_dmask of sequence {b}")
        assert not p[b, :, n_q:].any() and not p[b, :, :, n_k:].any(), "S_dmask past a sequence's length"
    assert_grads_close(grads, ref_grads, dtype, "flash_attn_varlen_func")


def test_varlen_packed_variants_agree_and_send_gradients_into_the_packed_tensor(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = [7, 0, 12]
    cu, total = cumulative(lengths), sum(lengths)
    qkv = randn(g, total, 3, 2, 24)
    do = randn(g, total, 2, 24)
    packed = qkv.clone().requires_grad_()
    out = flash_attn_varlen_qkvpacked_func(packed, cu, 12, causal=True)
    out.backward(do)
    q, k, v = (t.clone().requires_grad_() for t in qkv.unbind(1))
    expected = flash_attn_varlen_func(q, k, v, cu, cu, 12, 12, causal=True)
    expected.backward(do)
    assert_close(out, expected, F32, "varlen qkvpacked out")
    assert_close(packed.grad, torch.stack([q.grad, k.grad, v.grad], dim=1), F32, "dqkv")

    lengths_k = [3, 5, 9]
    cu_k = cumulative(lengths_k)
    q = randn(g, total, 4, 24).requires_grad_()
    kv = randn(g, sum(lengths_k), 2, 2, 24).requires_grad_()
    do = randn(g, total, 4, 24)
    out = flash_attn_varlen_kvpacked_func(q, kv, cu, cu_k, 12, 9, softcap=2.5)
    out.backward(do)
    k, v = (t.detach().clone().requires_grad_() for t in kv.unbind(1))
    q2 = q.detach().clone().requires_grad_()
    expected = flash_attn_varlen_func(q2, k, v, cu, cu_k, 12, 9, softcap=2.5)
    expected.backward(do)
    assert_close(out, expected, F32, "varlen kvpacked out")
    assert_close(q.grad, q2.grad, F32, "dq")
    assert_close(kv.grad, torch.stack([k.grad, v.grad], dim=1), F32, "dkv")


def test_unpad_attend_pad_is_the_padded_batch(seed):
    """The flash-attn recipe: unpad q, k, v by their masks, varlen attention, pad the output back."""
    g = torch.Generator().manual_seed(seed)
    B, S, H, D = 3, 10, 2, 16
    q, k, v = (randn(g, B, S, H, D) for _ in range(3))
    lengths = [10, 4, 7]
    mask = torch.arange(S, device=DEVICE)[None, :] < torch.tensor(lengths, device=DEVICE)[:, None]
    (q_u, idx, cu, max_s, used), (k_u, *_), (v_u, *_) = (unpad_input(t, mask) for t in (q, k, v))
    assert cu.tolist() == [0, 10, 14, 21] and max_s == 10 and used.tolist() == lengths
    out = pad_input(flash_attn_varlen_func(q_u, k_u, v_u, cu, cu, max_s, max_s, causal=True), idx, B, S)
    for b, n in enumerate(lengths):
        expected = flash_attn_func(q[b:b + 1, :n], k[b:b + 1, :n], v[b:b + 1, :n], causal=True)
        assert_close(out[b, :n], expected[0], F32, f"sequence {b}")
        assert not out[b, n:].any(), "padding rows must be zero"


def test_strided_inputs_and_gradients(seed):
    """Features at a stride (a transposed view) in q or in the output's gradient: the same answers."""
    g = torch.Generator().manual_seed(seed)
    for D, softcap in ((16, 0.0), (16, 2.0)):   # Part I's kernel, then the varlen one
        q, k, v = (randn(g, 2, 6, 2, D) for _ in range(3))
        do = randn(g, 2, 6, 2, D)
        strided = [t.transpose(-1, -2).contiguous().transpose(-1, -2) for t in (q, k, v, do)]
        assert strided[0].stride(-1) != 1

        def grads(q, k, v, do):
            q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
            out = flash_attn_func(q, k, v, causal=True, softcap=softcap)
            return (out, *torch.autograd.grad(out, (q, k, v), do))

        for got, expected in zip(grads(*strided), grads(q, k, v, do)):
            assert_close(got, expected, F32, f"strided, softcap={softcap}")


def test_window_size_may_be_a_tensor(seed):
    """flash-attn's own tests pass ``window_size=torch.randint(0, seqlen_k, (2,))``."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (randn(g, 1, 7, 2, 16) for _ in range(3))
    expected = flash_attn_func(q, k, v, window_size=(3, 1))
    assert torch.equal(flash_attn_func(q, k, v, window_size=torch.tensor([3, 1])), expected)
    assert torch.equal(flash_attn_func(q, k, v, window_size=(torch.tensor(3), 1)), expected)
    kc, vc = k.clone(), v.clone()
    out = flash_attn_with_kvcache(q, kc, vc, window_size=torch.tensor([3, 1]), cache_seqlens=7)
    assert_close(out, expected, F32, "kvcache, window as a tensor")


def test_varlen_with_no_query_at_all(seed):
    g = torch.Generator().manual_seed(seed)
    q = randn(g, 0, 2, 16).requires_grad_()
    k, v = (randn(g, 5, 1, 16).requires_grad_() for _ in "kv")
    out, lse, p = flash_attn_varlen_func(q, k, v, i32([0, 0]), i32([0, 5]), 0, 5, return_attn_probs=True)
    assert out.shape == (0, 2, 16) and lse.shape == (2, 0) and p.shape == (1, 2, 0, 5)


# ---- decoding with a KV cache ------------------------------------------------------------------------------

def rope64(x, cos, sin, positions, interleaved):
    """The rotation in float64 through complex numbers: x ``(B, N, H, D)``, positions ``(B, N)``."""
    x = x.double()
    half = cos.shape[1]
    turn = torch.complex(cos.double()[positions], sin.double()[positions])[:, :, None, :]
    head = x[..., :2 * half]
    if interleaved:
        z = torch.view_as_complex(head.reshape(*head.shape[:-1], half, 2).contiguous()) * turn
        head = torch.view_as_real(z).flatten(-2)
    else:
        z = torch.complex(head[..., :half], head[..., half:]) * turn
        head = torch.cat([z.real, z.imag], dim=-1)
    return torch.cat([head, x[..., 2 * half:]], dim=-1)


def kvcache_case(seed, *, lengths, n_q=2, n_new=2, H=4, Hkv=2, D=16, capacity=24, page=0, batch_idx=False,
                 dtype=F32, rotary=None, rotary_dim=None, causal=False, window=(-1, -1), softcap=0.0,
                 alibi=False, num_splits=0, int_seqlens=False):
    """Run ``flash_attn_with_kvcache`` and judge it: the cache written in place, out and lse."""
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    keys, values = randn(g, B, capacity, Hkv, D, dtype=dtype), randn(g, B, capacity, Hkv, D, dtype=dtype)
    for b, n in enumerate(lengths):   # a slot with no key is NaN: a read past a sequence shows
        keys[b, n:], values[b, n:] = math.nan, math.nan
    q = randn(g, B, n_q, H, D, dtype=dtype)
    k, v = (randn(g, B, n_new, Hkv, D, dtype=dtype) for _ in "kv") if n_new else (None, None)
    slopes = (torch.rand(B, H, generator=g) * 0.5).to(DEVICE) if alibi else None
    block_table = idx = None
    if page:   # the blocks of the sequences, shuffled among more blocks than they need
        per_seq = capacity // page
        order = torch.randperm(B * per_seq + 2, generator=g)
        block_table = order[:B * per_seq].view(B, per_seq).to(device=DEVICE, dtype=torch.int32)
        k_cache = torch.full((B * per_seq + 2, page, Hkv, D), math.nan, dtype=dtype, device=DEVICE)
        v_cache = k_cache.clone()
        k_cache[block_table.long()] = keys.view(B, per_seq, page, Hkv, D)
        v_cache[block_table.long()] = values.view(B, per_seq, page, Hkv, D)
    elif batch_idx:   # each sequence at some row of a larger cache
        idx = torch.randperm(B + 2, generator=g)[:B].to(device=DEVICE, dtype=torch.int32)
        k_cache = torch.full((B + 2, capacity, Hkv, D), math.nan, dtype=dtype, device=DEVICE)
        v_cache = k_cache.clone()
        k_cache[idx.long()], v_cache[idx.long()] = keys, values
    else:
        k_cache, v_cache = keys.clone(), values.clone()
    cos = sin = None
    if rotary:
        angle = torch.rand(capacity, (rotary_dim or D) // 2, generator=g).to(DEVICE) * 2 * math.pi
        cos, sin = torch.cos(angle).to(dtype), torch.sin(angle).to(dtype)
    seqlens = lengths[0] if int_seqlens else i32(lengths)
    with torch.no_grad():
        out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cos, sin, seqlens, idx, None, block_table,
                                           causal=causal, window_size=window, softcap=softcap,
                                           rotary_interleaved=rotary == "interleaved", alibi_slopes=slopes,
                                           num_splits=num_splits, return_softmax_lse=True)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (B, H, n_q)

    # the judge: rotate in float64, append, attend over cache_seqlens[b] + n_new keys
    lens = torch.tensor(lengths, device=DEVICE)
    q64, keys64, values64 = q.double(), keys.double(), values.double()
    if n_new:
        new_pos = lens[:, None] + torch.arange(n_new, device=DEVICE)
        k64 = rope64(k, cos, sin, new_pos, rotary == "interleaved") if rotary else k.double()
        per_row = causal or window != (-1, -1)
        q_pos = lens[:, None] + (torch.arange(n_q, device=DEVICE) if per_row else torch.zeros(n_q, device=DEVICE,
                                                                                             dtype=torch.long))
        q64 = rope64(q, cos, sin, q_pos, rotary == "interleaved") if rotary else q64
        for b, n in enumerate(lengths):
            keys64[b, n:n + n_new], values64[b, n:n + n_new] = k64[b], v[b].double()
    # the cache, read back through its layout, holds the new keys (rounded to the cache's dtype)
    if page:
        stored_k = k_cache[block_table.long()].view(B, capacity, Hkv, D)
    else:
        stored_k = k_cache[idx.long()] if batch_idx else k_cache
    for b, n in enumerate(lengths):
        seen = n + n_new
        assert_close(stored_k[b, :seen], keys64[b, :seen], dtype, f"cache of sequence {b}")
        assert stored_k[b, seen:].isnan().all(), f"the cache of sequence {b} was written past its new keys"
    for b, n in enumerate(lengths):
        seen = n + n_new
        ref_o, ref_lse, _ = reference_sequence(q64[b], keys64[b, :seen], values64[b, :seen],
                                               None if slopes is None else slopes[b], causal=causal, window=window,
                                               softcap=softcap)
        assert_close(out[b], ref_o, dtype, f"out of sequence {b}")
        assert_close(lse[b], ref_lse, dtype, f"lse of sequence {b}")
    return out


KVCACHE = {
    "contiguous-gqa-causal": dict(lengths=[5, 17], n_q=3, n_new=3, causal=True),
    "int-cache-seqlens": dict(lengths=[6, 6], int_seqlens=True, causal=True),
    "no-new-keys": dict(lengths=[7, 12], n_new=0, n_q=1),
    "paged-16-appends-cross-pages": dict(lengths=[14, 29], n_q=1, n_new=5, H=2, Hkv=1, capacity=48, page=16,
                                         causal=True),
    "paged-256": dict(lengths=[3, 254], n_new=4, H=2, Hkv=2, capacity=512, page=256),
    "paged-5-many-pages": dict(lengths=[0, 11], n_new=6, capacity=20, page=5, causal=True),
    "cache-batch-idx": dict(lengths=[9, 2], n_new=3, batch_idx=True, causal=True),
    "rotary-interleaved-causal": dict(lengths=[4, 10], n_q=3, n_new=3, rotary="interleaved", causal=True),
    "rotary-neox-not-causal": dict(lengths=[4, 10], n_q=3, n_new=2, rotary="neox", rotary_dim=8),
    "rotary-neox-local": dict(lengths=[8, 3], n_q=2, n_new=2, rotary="neox", window=(4, 0)),
    "rotary-interleaved-paged": dict(lengths=[12, 1], n_new=6, page=8, capacity=24, rotary="interleaved",
                                     rotary_dim=10, causal=True),
    "alibi-softcap-window": dict(lengths=[11, 3], n_q=2, n_new=2, alibi=True, softcap=4.0, window=(6, 2)),
    "fp16": dict(lengths=[5, 9], n_new=1, n_q=1, dtype=F16, causal=True, rotary="neox"),
    "bf16-paged": dict(lengths=[13, 2], n_new=2, page=16, capacity=32, dtype=BF16, alibi=True),
}


@pytest.mark.parametrize("case", list(KVCACHE), ids=list(KVCACHE))
def test_flash_attn_with_kvcache_matches_reference(case, seed):
    kvcache_case(seed, **KVCACHE[case])


@pytest.mark.parametrize("D", [1, 59, 111, 200, 256])
def test_kvcache_head_dims(D, seed):
    rotary = dict(rotary="interleaved" if D % 4 else "neox", rotary_dim=D - D % 2) if D > 1 else {}
    kvcache_case(seed, lengths=[3, 8], n_new=2, D=D, causal=True, **rotary)


def test_kvcache_splits_give_one_answer(seed):
    outs = [kvcache_case(seed, lengths=[19, 33], n_new=2, capacity=40, num_splits=n, causal=True)
            for n in range(1, 9)]
    for n, out in enumerate(outs[1:], start=2):
        assert max_error(out, outs[0]) < 1e-5, f"num_splits={n} differs from num_splits=1"


def test_kvcache_cache_with_spare_rows(seed):
    """Without cache_batch_idx, sequence b uses row b of a cache with more rows than the batch."""
    g = torch.Generator().manual_seed(seed)
    q, kc, vc = randn(g, 2, 1, 2, 16), randn(g, 3, 8, 1, 16), randn(g, 3, 8, 1, 16)
    lengths = i32([3, 8])
    out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lengths)
    assert_close(out, flash_attn_with_kvcache(q, kc[:2].clone(), vc[:2].clone(), cache_seqlens=lengths), F32,
                 "spare rows")


def test_kvcache_whole_cache_when_no_lengths(seed):
    g = torch.Generator().manual_seed(seed)
    q, kc, vc = randn(g, 2, 1, 2, 16), randn(g, 2, 9, 1, 16), randn(g, 2, 9, 1, 16)
    out = flash_attn_with_kvcache(q, kc, vc)   # cache_seqlens=None: every key of the cache
    assert_close(out, flash_attn_func(q, kc, vc), F32, "whole cache")


# ---- padding and rotary helpers ----------------------------------------------------------------------------

def test_unpad_pad_round_trip_and_gradients(seed):
    g = torch.Generator().manual_seed(seed)
    x = randn(g, 3, 6, 2, 4).requires_grad_()
    mask = torch.tensor([[1, 1, 0, 1, 0, 0], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]], device=DEVICE).bool()
    unused = torch.tensor([[0, 0, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0], [0] * 6], device=DEVICE).bool()
    packed, indices, cu, max_s, used = unpad_input(x, mask, unused)
    assert indices.tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 16, 17]
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 4, 4, 10] and max_s == 6 and used.tolist() == [3, 0, 6]
    back = pad_input(packed, indices, 3, 6)
    kept = (mask | unused)[..., None, None]
    assert torch.equal(back, torch.where(kept, x, 0.0))
    weights = randn(g, *back.shape)
    (grad,) = torch.autograd.grad((back * weights).sum(), x)
    assert torch.equal(grad, torch.where(kept, weights, 0.0))

    # a row gathered twice gets both gradients; index_put's backward gathers
    rows = randn(g, 5, 3).requires_grad_()
    twice = torch.tensor([1, 1, 4], device=DEVICE)
    (grad,) = torch.autograd.grad(index_first_axis(rows, twice).sum(), rows)
    assert grad[:, 0].tolist() == [0.0, 2.0, 0.0, 0.0, 1.0]
    values = randn(g, 2, 3).requires_grad_()
    put = index_put_first_axis(values, torch.tensor([3, 0], device=DEVICE), 5)
    assert torch.equal(put[3], values[0]) and torch.equal(put[0], values[1]) and not put[[1, 2, 4]].any()
    (grad,) = torch.autograd.grad((put * torch.arange(5.0, device=DEVICE)[:, None]).sum(), values)
    assert grad[:, 0].tolist() == [3.0, 0.0]


def test_unpad_concatenated_sequences(seed):
    g = torch.Generator().manual_seed(seed)
    x = randn(g, 2, 6, 3)
    lengths = torch.tensor([[2, 3, 0, 0, 0, 0], [6, 0, 0, 0, 0, 0]], device=DEVICE)
    packed, indices, cu, max_s = unpad_input_for_concatenated_sequences(x, lengths)
    assert cu.tolist() == [0, 2, 5, 11] and max_s == 6 and indices.tolist() == [0, 1, 2, 3, 4] + list(range(6, 12))
    assert torch.equal(packed, x.reshape(12, 3)[indices])


@pytest.mark.parametrize("interleaved", [False, True])
def test_apply_rotary_emb_against_float64(interleaved, seed):
    g = torch.Generator().manual_seed(seed)
    B, N, H, D, ro = 2, 5, 3, 12, 8
    angle = torch.rand(16, ro // 2, generator=g).to(DEVICE) * 2 * math.pi
    cos, sin = torch.cos(angle), torch.sin(angle)
    x = randn(g, B, N, H, D).requires_grad_()
    dy = randn(g, B, N, H, D)
    for offsets in (0, 3, i32([2, 13])):   # 13: the last positions are past the table
        pos = torch.arange(N, device=DEVICE)[None, :] + (offsets[:, None] if torch.is_tensor(offsets) else offsets)
        pos = pos.expand(B, N)
        y = apply_rotary_emb(x, cos, sin, interleaved, seqlen_offsets=offsets)
        x64 = x.detach().double().requires_grad_()
        y64 = rope64(x64, cos, sin, pos.clamp(max=15), interleaved)
        beyond = (pos >= 16)[..., None, None]   # past the table: left as it is
        y64 = torch.where(beyond, x64, y64)
        assert_close(y, y64, F32, f"rotary offsets={offsets}")
        (dx,) = torch.autograd.grad(y, x, dy)
        (dx64,) = torch.autograd.grad(y64, x64, dy.double())
        assert_close(dx, dx64, F32, "rotary gradient")
    # packed sequences (cu_seqlens) and in place
    lengths = [3, 5]
    flat = randn(g, 8, H, D)
    y = apply_rotary_emb(flat.clone(), cos, sin, interleaved, inplace=True, seqlen_offsets=i32([1, 4]),
                         cu_seqlens=cumulative(lengths), max_seqlen=5)
    pos = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8], device=DEVICE)[None]
    assert_close(y, rope64(flat[None], cos, sin, pos, interleaved)[0], F32, "rotary, packed")


# ---- the contract: signatures and refusals -----------------------------------------------------------------

E = inspect.Parameter.empty
MASK_DEFAULTS = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
                 ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False), ("return_attn_probs", False)]
VARLEN_HEAD = [("cu_seqlens_q", E), ("cu_seqlens_k", E), ("max_seqlen_q", E), ("max_seqlen_k", E)]
#: flash-attn 2.7.4's parameters, in order, with their defaults
SIGNATURES = {
    flash_attn_func: [("q", E), ("k", E), ("v", E)] + MASK_DEFAULTS,
    flash_attn_kvpacked_func: [("q", E), ("kv", E)] + MASK_DEFAULTS,
    flash_attn_qkvpacked_func: [("qkv", E)] + MASK_DEFAULTS,
    flash_attn_varlen_func: [("q", E), ("k", E), ("v", E)] + VARLEN_HEAD + MASK_DEFAULTS + [("block_table", None)],
    flash_attn_varlen_kvpacked_func: [("q", E), ("kv", E)] + VARLEN_HEAD + MASK_DEFAULTS,
    flash_attn_varlen_qkvpacked_func: [("qkv", E), ("cu_seqlens", E), ("max_seqlen", E)] + MASK_DEFAULTS,
    flash_attn_with_kvcache: [
        ("q", E), ("k_cache", E), ("v_cache", E), ("k", None), ("v", None), ("rotary_cos", None),
        ("rotary_sin", None), ("cache_seqlens", None), ("cache_batch_idx", None), ("cache_leftpad", None),
        ("block_table", None), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
        ("softcap", 0.0), ("rotary_interleaved", True), ("alibi_slopes", None), ("num_splits", 0),
        ("return_softmax_lse", False)],
    unpad_input: [("hidden_states", E), ("attention_mask", E), ("unused_mask", None)],
    pad_input: [("hidden_states", E), ("indices", E), ("batch", E), ("seqlen", E)],
    unpad_input_for_concatenated_sequences: [("hidden_states", E), ("attention_mask_in_length", E)],
    apply_rotary_emb: [("x", E), ("cos", E), ("sin", E), ("interleaved", False), ("inplace", False),
                       ("seqlen_offsets", 0), ("cu_seqlens", None), ("max_seqlen", None)],
}


@pytest.mark.parametrize("fn", list(SIGNATURES), ids=lambda fn: fn.__name__)
def test_signature_is_flash_attns(fn):
    params = list(inspect.signature(fn).parameters.values())
    assert [(p.name, p.default) for p in params] == SIGNATURES[fn]
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params)
    if fn.__module__.endswith("flash_attn_interface"):
        assert getattr(alias, fn.__name__) is fn and getattr(fa_lab.flash_attn, fn.__name__) is fn


def test_what_is_not_implemented_says_so(seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = randn(g, 1, 4, 2, 16), randn(g, 1, 4, 2, 16), randn(g, 1, 4, 2, 16)
    with pytest.raises(NotImplementedError, match="dropout is not implemented"):
        flash_attn_func(q, k, v, dropout_p=0.1)
    with pytest.raises(NotImplementedError, match="dropout"):
        flash_attn_qkvpacked_func(torch.stack([q, k, v], 2), 0.5)
    cu = i32([0, 4])
    with pytest.raises(NotImplementedError, match="dropout"):
        flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 4, 4, dropout_p=0.2)
    with pytest.raises(NotImplementedError, match="block_table"):
        flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 4, 4, block_table=i32([[0]]))
    with pytest.raises(NotImplementedError, match="cache_leftpad"):
        flash_attn_with_kvcache(q, k, v, cache_seqlens=2, cache_leftpad=i32([1]))
    # deterministic is accepted: the backward always is
    assert torch.equal(flash_attn_func(q, k, v, deterministic=True), flash_attn_func(q, k, v))


def test_bad_input_is_a_clear_error(seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = randn(g, 1, 4, 2, 16), randn(g, 1, 4, 2, 16), randn(g, 1, 4, 2, 16)
    cu = i32([0, 4])
    bad = [
        (ValueError, "q must have 4 dims", lambda: flash_attn_func(q[0], k, v)),
        (TypeError, "float16, bfloat16 or float32", lambda: flash_attn_func(q.double(), k.double(), v.double())),
        (ValueError, "multiple", lambda: flash_attn_func(randn(g, 1, 4, 3, 16), k, v)),
        (ValueError, "one head dim", lambda: flash_attn_func(q, k, v[..., :8])),
        (TypeError, "window", lambda: flash_attn_func(q, k, v, window_size=4)),
        (TypeError, "causal", lambda: flash_attn_func(q, k, v, causal="yes")),
        (TypeError, "return_attn_probs", lambda: flash_attn_func(q, k, v, return_attn_probs=1)),
        (ValueError, "alibi_slopes must have shape", lambda: flash_attn_func(q, k, v, alibi_slopes=torch.ones(3))),
        (ValueError, r"qkv must have shape .* 3 at dim 2", lambda: flash_attn_qkvpacked_func(torch.stack([q, k], 2))),
        (TypeError, "cu_seqlens_q must be int32",
         lambda: flash_attn_varlen_func(q[0], k[0], v[0], cu.long(), cu, 4, 4)),
        (ValueError, "same number of sequences",
         lambda: flash_attn_varlen_func(q[0], k[0], v[0], cu, i32([0, 2, 4]), 4, 4)),
        (TypeError, "max_seqlen_q must be an int", lambda: flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 4.0, 4)),
        (ValueError, "cache_seqlens must be given", lambda: flash_attn_with_kvcache(q, k, v, k[:, :1], v[:, :1])),
        (ValueError, "k and v must be given together", lambda: flash_attn_with_kvcache(q, k, v, k[:, :1], None, None,
                                                                                     None, 1)),
        (ValueError, "need k and v", lambda: flash_attn_with_kvcache(q, k, v, rotary_cos=k[0, :, 0, :8],
                                                                     rotary_sin=k[0, :, 0, :8], cache_seqlens=2)),
        (ValueError, "no backward", lambda: flash_attn_with_kvcache(q.clone().requires_grad_(), k, v)),
        (ValueError, "num_splits", lambda: flash_attn_with_kvcache(q, k, v, num_splits=-1)),
    ]
    for error, message, call in bad:
        with pytest.raises(error, match=message):
            call()
