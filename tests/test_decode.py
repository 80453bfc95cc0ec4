"""Decoding over a KV cache (``fa_lab.kernels.decode``) against the float64 reference.

Each sequence ``b`` attends over its first ``L_b`` keys; the judge runs
``reference_attention`` on exactly those keys (a sequence with ``L_b = 0`` gives zeros and
``lse = -inf``).  Every slot of the cache that holds no valid key is NaN, so a kernel that
reads past a sequence's length, into another sequence's rows or into an unused block is
caught.  Sizes are tiny: in the CPU world the kernels run in Triton's interpreter.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import fa_lab
from fa_lab.core.reference import reference_attention
from fa_lab.core.spec import make_spec
from fa_lab.core.testing import assert_close, random_qkv, stable_seed

pytestmark = pytest.mark.skipif(not fa_lab.HAS_TRITON, reason="Triton is not installed")

from fa_lab.kernels.decode import append_kv, combine_splits, decode_forward, num_splits_heuristic  # noqa: E402

DEVICE = fa_lab.DEVICE
NAN = float("nan")


@dataclass(frozen=True)
class Case:
    lengths: tuple            # L_b per sequence
    n_q: int = 1
    heads: int = 4
    kv_heads: int = 1
    head_dim: int = 16
    dtype: torch.dtype = torch.float16
    page_size: int = 0        # 0: contiguous cache
    batch_idx: bool = False   # contiguous cache rows picked by cache_batch_idx
    splits: int = 0
    left: int = -1
    right: int = -1
    softcap: float = 0.0
    alibi: bool = False
    scale: float | None = None

    @property
    def batch(self) -> int:
        return len(self.lengths)


@dataclass
class Inputs:
    q: torch.Tensor
    keys: torch.Tensor        # (B, cap, Hkv, D): the logical sequences, what the judge reads
    values: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    seqlens: torch.Tensor
    block_table: torch.Tensor | None
    batch_idx: torch.Tensor | None
    slopes: torch.Tensor | None


def slots(case: Case, capacity: int, gen: torch.Generator, reserve: int = 0):
    """Where key j of sequence b lives: ``(cache_shape, {(b, j): (row or block, row in it)}, table, batch_idx)``.

    A paged cache's table maps the pages of the first ``L_b + reserve`` keys; later entries are -1.
    """
    B = case.batch
    if case.page_size == 0:
        rows = torch.randperm(B + 2, generator=gen)[:B] if case.batch_idx else torch.arange(B)
        where = {(b, j): (int(rows[b]), j) for b in range(B) for j in range(capacity)}
        return (B + 2 if case.batch_idx else B, capacity), where, None, rows.to(torch.int32) if case.batch_idx else None
    per_seq = -(-capacity // case.page_size)
    blocks = torch.randperm(B * per_seq + 3, generator=gen)[:B * per_seq].view(B, per_seq)
    table = blocks.clone()
    where = {}
    for b in range(B):
        for j in range(capacity):
            where[b, j] = (int(blocks[b, j // case.page_size]), j % case.page_size)
        used = -(-(case.lengths[b] + reserve) // case.page_size)
        table[b, used:] = -1    # pages past the length: never to be read
    return (B * per_seq + 3, case.page_size), where, table.to(torch.int32), None


def make_inputs(case: Case, seed: int, reserve: int = 0, room: int = 0) -> Inputs:
    """``reserve``: keys past each length whose pages are mapped; ``room``: more capacity past the longest."""
    gen = torch.Generator().manual_seed(seed)
    B, H, Hkv, D = case.batch, case.heads, case.kv_heads, case.head_dim
    capacity = max(case.lengths) + 3 + room
    q = torch.randn(B, case.n_q, H, D, generator=gen)
    keys, values = (torch.randn(B, capacity, Hkv, D, generator=gen) for _ in range(2))
    shape, where, table, batch_idx = slots(case, capacity, gen, reserve)
    k_cache = torch.full((*shape, Hkv, D), NAN)
    v_cache = torch.full((*shape, Hkv, D), NAN)
    for b, L in enumerate(case.lengths):
        for j in range(L):
            k_cache[where[b, j]] = keys[b, j]
            v_cache[where[b, j]] = values[b, j]
    slopes = torch.rand(B, H, generator=gen) * 0.5 if case.alibi else None
    dev = dict(device=DEVICE)
    return Inputs(q.to(case.dtype).to(**dev), keys.to(case.dtype), values.to(case.dtype),
                  k_cache.to(case.dtype).to(**dev), v_cache.to(case.dtype).to(**dev),
                  torch.tensor(case.lengths, dtype=torch.int32, **dev),
                  None if table is None else table.to(**dev), None if batch_idx is None else batch_idx.to(**dev),
                  None if slopes is None else slopes.to(**dev))


def judge(case: Case, x: Inputs, lengths=None):
    """Float64 reference, one sequence at a time on its valid keys: o (B, Nq, H, D), lse (B, H, Nq)."""
    B, Nq, H, D = x.q.shape
    o = torch.zeros(B, Nq, H, D, dtype=torch.float64)
    lse = torch.full((B, H, Nq), float("-inf"), dtype=torch.float64)
    for b, L in enumerate(case.lengths if lengths is None else lengths):
        if L == 0:
            continue
        q_b = x.q[b:b + 1].cpu().transpose(1, 2)
        k_b, v_b = (t[b:b + 1, :L].transpose(1, 2) for t in (x.keys, x.values))
        slopes = None if x.slopes is None else x.slopes[b:b + 1].cpu()
        spec = make_spec(q_b, k_b, v_b, window=(case.left, case.right), scale=case.scale, softcap=case.softcap,
                         alibi_slopes=slopes)
        ref_o, ref_lse = reference_attention(q_b, k_b, v_b, spec)
        o[b], lse[b] = ref_o[0].transpose(0, 1), ref_lse[0]
    return o, lse


def run(case: Case, x: Inputs, **overrides):
    kwargs = dict(cache_seqlens=x.seqlens, block_table=x.block_table, cache_batch_idx=x.batch_idx,
                  scale=case.scale, left=case.left, right=case.right, softcap=case.softcap,
                  alibi_slopes=x.slopes, num_splits=case.splits)
    return decode_forward(x.q, x.k_cache, x.v_cache, **{**kwargs, **overrides})


def check(case: Case, x: Inputs, o, lse, what: str, lengths=None):
    B, Nq, H, D = x.q.shape
    assert o.shape == (B, Nq, H, D) and o.dtype == case.dtype, (o.shape, o.dtype)
    assert lse.shape == (B, H, Nq) and lse.dtype == torch.float32, (lse.shape, lse.dtype)
    ref_o, ref_lse = judge(case, x, lengths)
    assert_close(o, ref_o, case.dtype, what=f"{what} O")
    assert_close(lse, ref_lse, case.dtype, what=f"{what} lse")


CASES = {
    # contiguous caches
    "one-query-gqa4-d128": Case((37, 0, 16, 5), heads=8, kv_heads=2, head_dim=128),
    "nq3-causal-d59-batch-idx": Case((1, 40, 2), n_q=3, heads=2, kv_heads=2, head_dim=59, dtype=torch.float32,
                                     batch_idx=True, splits=3, right=0),
    "nq3-gqa4-window-softcap-d111": Case((30, 3), n_q=3, heads=4, kv_heads=1, head_dim=111, dtype=torch.bfloat16,
                                         splits=8, left=5, right=0, softcap=3.0),
    "alibi-d1": Case((20, 9), heads=4, kv_heads=1, head_dim=1, dtype=torch.float32, splits=2, alibi=True),
    "two-sided-window-d200": Case((25, 6), n_q=3, heads=4, kv_heads=2, head_dim=200, splits=1, left=2, right=3,
                                  softcap=5.0, alibi=True, scale=0.2),
    "d256-bf16": Case((33, 0), heads=1, kv_heads=1, head_dim=256, dtype=torch.bfloat16, splits=5),
    "query-tiles-nq5-gqa4": Case((26, 4), n_q=5, heads=8, kv_heads=2, head_dim=32, splits=2, left=3, right=1),
    "negative-scale-fp32": Case((18,), n_q=3, heads=2, kv_heads=1, dtype=torch.float32, splits=3, scale=-0.7),
    # paged caches: whole tiles from one page (page_size a multiple of BLOCK_N) or a gather per key
    "page1-causal": Case((7, 0, 12), n_q=3, heads=8, kv_heads=2, page_size=1, splits=2, right=0),
    "page16-one-query": Case((40, 16, 1), heads=4, kv_heads=1, head_dim=64, dtype=torch.bfloat16, page_size=16),
    "page256-window-softcap-alibi": Case((20, 3), n_q=3, heads=4, kv_heads=2, head_dim=32, dtype=torch.float32,
                                         page_size=256, splits=4, left=4, right=1, softcap=2.0, alibi=True),
    "page12-gather-causal-alibi": Case((30, 13, 0), n_q=3, heads=4, kv_heads=1, head_dim=48, page_size=12,
                                       splits=3, right=0, alibi=True),
    "page8-gather-d1": Case((17, 9), heads=2, kv_heads=1, head_dim=1, dtype=torch.float32, page_size=8, splits=0),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name):
    case = CASES[name]
    seed = stable_seed("decode", name)
    x = make_inputs(case, seed)
    o, lse = run(case, x)
    check(case, x, o, lse, f"{name} (seed={seed})")


@pytest.mark.parametrize("page_size", [0, 16, 5])
def test_every_split_count_gives_the_same_answer(page_size):
    case = Case((45, 2, 0), n_q=3, heads=4, kv_heads=2, head_dim=32, dtype=torch.float32, page_size=page_size,
                left=20, right=0)
    x = make_inputs(case, stable_seed("splits", page_size))
    for splits in range(0, 9):
        o, lse = run(case, x, num_splits=splits)
        check(case, x, o, lse, f"page_size={page_size} num_splits={splits}")


@pytest.mark.parametrize("page_size", [16, 32])
def test_launch_config_overrides_keep_the_answer(page_size):
    # 32-key tiles: pages of 16 are gathered key by key, pages of 32 give whole tiles; 20 query rows in 2 tiles
    case = Case((50, 7), n_q=5, heads=8, kv_heads=2, head_dim=24, dtype=torch.float16, page_size=page_size,
                splits=3, left=9, right=2)
    x = make_inputs(case, stable_seed("config", page_size))
    o, lse = run(case, x, config=dict(BLOCK_N=32, MAX_BLOCK_M=16))
    check(case, x, o, lse, f"BLOCK_N=32 page_size={page_size}")
    with pytest.raises(ValueError, match="power of two"):
        run(case, x, config=dict(BLOCK_N=24))


def test_no_lengths_means_the_whole_cache_and_strided_caches_are_read_in_place():
    # k and v as views into one packed (B, N, 2, Hkv, D) tensor; q as a view of a wider row
    case = Case((11, 11), n_q=3, heads=4, kv_heads=2, head_dim=16, dtype=torch.float32, splits=2)
    x = make_inputs(case, 3)
    packed = torch.stack([x.keys[:, :11], x.values[:, :11]], dim=2).to(DEVICE)
    wide = torch.full((2, 3, 4, 40), NAN, device=DEVICE)
    wide[..., 8:24] = x.q
    o, lse = decode_forward(wide[..., 8:24], packed[:, :, 0], packed[:, :, 1], scale=None, num_splits=2)
    check(case, x, o, lse, "strided")


@pytest.mark.parametrize("page_size", [0, 8, 5])
def test_k_and_v_caches_with_different_strides(page_size):
    # one set of row offsets serves K and V only when their strides agree: here V is a view of a wider cache
    case = Case((21, 4, 13), n_q=2, heads=4, kv_heads=2, head_dim=16, dtype=torch.float32, page_size=page_size,
                splits=2)
    x = make_inputs(case, stable_seed("kv-strides", page_size))
    wide = torch.full((*x.v_cache.shape[:-1], 24), NAN, device=DEVICE)
    wide[..., 4:20] = x.v_cache
    v_cache = wide[..., 4:20]
    assert v_cache.stride() != x.k_cache.stride()
    o, lse = decode_forward(x.q, x.k_cache, v_cache, cache_seqlens=x.seqlens, block_table=x.block_table,
                            scale=None, num_splits=2)
    check(case, x, o, lse, f"page_size={page_size}, V strides {v_cache.stride()}")


@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_rows_with_nan_give_nan_and_the_others_match():
    case = Case((21, 9), n_q=3, heads=4, kv_heads=2, head_dim=16, dtype=torch.float32, splits=2, right=0)
    x = make_inputs(case, 5)
    x.q[0, 1, 2, 3] = NAN                     # one query row of sequence 0
    key = 4                                   # a key that sequence 1's queries all see
    x.keys[1, key, 0, 0] = NAN
    x.k_cache[1, key, 0, 0] = NAN             # a contiguous cache: row b is sequence b
    o, lse = run(case, x)
    nan_o = torch.zeros(o.shape, dtype=torch.bool)
    nan_o[0, 1, 2] = True
    nan_o[1, :, 0:2] = True                   # kv head 0 serves query heads 0 and 1
    nan_lse = nan_o.any(-1).transpose(1, 2)
    assert torch.isnan(o.cpu()[nan_o]).all() and torch.isnan(lse.cpu()[nan_lse]).all()
    ref_o, ref_lse = judge(case, x)
    assert_close(o.cpu().masked_fill(nan_o, 0), ref_o.masked_fill(nan_o, 0), case.dtype, what="O of the other rows")
    assert_close(lse.cpu().masked_fill(nan_lse, 0), ref_lse.masked_fill(nan_lse, 0), case.dtype,
                 what="lse of the other rows")


def test_rows_that_see_no_key_give_zeros_and_minus_inf():
    # causal with L = 1 < Nq = 3: queries 0 and 1 sit before the only key; L = 0 sees nothing at all
    case = Case((1, 0, 8), n_q=3, heads=2, kv_heads=1, dtype=torch.float16, splits=4, right=0)
    x = make_inputs(case, 9)
    o, lse = run(case, x)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert (o[0, :2] == 0).all() and torch.isneginf(lse[0, :, :2]).all()
    assert (o[1] == 0).all() and torch.isneginf(lse[1]).all()
    check(case, x, o, lse, "empty rows")


@pytest.mark.parametrize("page_size", [0, 4])
def test_append_kv_writes_only_the_new_positions(page_size):
    # lengths 3 and 7 with 3 new tokens cross the page boundaries at 4 and 8
    case = Case((3, 0, 7), n_q=3, heads=4, kv_heads=2, head_dim=16, dtype=torch.float32, page_size=page_size,
                batch_idx=page_size == 0, right=0)
    n_new = 3
    x = make_inputs(case, stable_seed("append", page_size), reserve=n_new)
    gen = torch.Generator().manual_seed(11)
    k_new, v_new = (torch.randn(case.batch, n_new, 2, 16, generator=gen) for _ in range(2))
    k_before, v_before = x.k_cache.clone(), x.v_cache.clone()
    append_kv(x.k_cache, x.v_cache, k_new.to(DEVICE), v_new.to(DEVICE), x.seqlens, block_table=x.block_table,
              cache_batch_idx=x.batch_idx)
    assert x.seqlens.tolist() == list(case.lengths)   # left as it was
    k_want, v_want = k_before.clone(), v_before.clone()
    for b, L in enumerate(case.lengths):
        for t in range(n_new):
            j = L + t
            if page_size:
                slot = (int(x.block_table[b, j // page_size]), j % page_size)
            else:
                slot = (int(x.batch_idx[b]), j)
            k_want[slot], v_want[slot] = k_new[b, t], v_new[b, t]
            x.keys[b, j], x.values[b, j] = k_new[b, t], v_new[b, t]
    assert torch.equal(x.k_cache.nan_to_num(7.0), k_want.nan_to_num(7.0))   # and nothing else changed
    assert torch.equal(x.v_cache.nan_to_num(7.0), v_want.nan_to_num(7.0))
    lengths = [L + n_new for L in case.lengths]
    o, lse = run(case, x, cache_seqlens=x.seqlens + n_new)
    check(case, x, o, lse, "after append_kv", lengths=lengths)


def test_combine_splits_weighs_by_lse_and_skips_empty_splits():
    gen = torch.Generator().manual_seed(2)
    o_parts = torch.randn(3, 4, 5, 24, generator=gen)
    lse_parts = torch.randn(3, 4, 5, generator=gen) * 3
    lse_parts[0, 0, 1:4] = float("-inf")       # empty splits
    lse_parts[1, 2] = float("-inf")             # a row with every split empty
    o_parts[lse_parts == float("-inf")] = 0.0
    o, lse = combine_splits(o_parts.to(DEVICE), lse_parts.to(DEVICE))
    want_lse = torch.logsumexp(lse_parts.double(), dim=-1)
    weights = torch.exp(lse_parts.double() - want_lse[..., None]).nan_to_num(0.0)
    want_o = (weights[..., None] * o_parts.double()).sum(-2)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert (o[1, 2] == 0).all() and torch.isneginf(lse[1, 2])
    assert_close(o, want_o, torch.float32, what="combined O")
    assert_close(lse, want_lse, torch.float32, what="combined lse")


def test_split_heuristic_fills_the_gpu_without_more_splits_than_tiles():
    from fa_lab.kernels.decode.configs import PROGRAMS_PER_SM, wave_efficiency

    slots = PROGRAMS_PER_SM * 132
    # (B, Hkv, Nk) = (1, 8, 8192) on 132 SMs with 64-key tiles: 8 programs need splits, in full waves
    splits = num_splits_heuristic(1 * 8, 8192, 64, 132)
    assert splits > 1 and wave_efficiency(8 * splits, slots) >= 0.85 and splits <= 8192 // 64
    assert num_splits_heuristic(8 * 8, 8192, 64, 132) == 1       # 64 programs already saturate HBM
    assert num_splits_heuristic(64 * 8, 2048, 64, 132) == 1      # 512 programs fill it already
    assert num_splits_heuristic(1, 100, 64, 132) == 2            # no more splits than key tiles
    assert num_splits_heuristic(1, 10, 64, 132) == 1
    for programs in range(3, 2 * slots, 7):    # (fewer than 3 fill less than one wave even at 128 splits)
        splits = num_splits_heuristic(programs, 1 << 20, 64, 132)
        assert 1 <= splits <= 128 and (splits == 1 or wave_efficiency(programs * splits, slots) >= 0.8), programs
        assert splits == 1 or programs < 0.45 * 132, programs


def test_registered_adapter_applies_softcap_and_alibi():
    q, k, v = random_qkv(2, 4, 3, 13, 16, kv_heads=2, dtype=torch.float32, seed=4)
    slopes = torch.rand(4, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    o, lse = fa_lab.attention(q, k, v, impl="triton_decode", causal=True, softcap=4.0, alibi_slopes=slopes,
                              return_lse=True)
    spec = make_spec(q, k, v, causal=True, softcap=4.0, alibi_slopes=slopes)
    ref_o, ref_lse = reference_attention(q, k, v, spec)
    assert_close(o, ref_o, torch.float32, what="adapter O")
    assert_close(lse, ref_lse, torch.float32, what="adapter lse")


def _bad(x: Inputs, case: Case):
    """(description, call, exception, message pattern) for input that must be refused before any launch."""
    i32 = dict(dtype=torch.int32, device=DEVICE)
    base = dict(cache_seqlens=x.seqlens, scale=None)
    yield "int64 lengths", dict(base, cache_seqlens=x.seqlens.long()), TypeError, "cache_seqlens must be an int32"
    if DEVICE.type == "cpu":   # on a GPU the values would cost a device synchronisation to check
        yield "lengths past the cache", dict(base, cache_seqlens=x.seqlens + 100), ValueError, "cache_seqlens must lie"
    yield "lengths of another batch", dict(base, cache_seqlens=x.seqlens[:1]), ValueError, r"shape \(2,\)"
    yield "batch idx with a block table", dict(base, block_table=torch.zeros(2, 3, **i32),
                                               cache_batch_idx=torch.zeros(2, **i32)), ValueError, "not both"
    yield "int64 block table", dict(base, block_table=torch.zeros(2, 3, dtype=torch.int64, device=DEVICE)), \
        TypeError, "block_table must be an int32"
    if DEVICE.type == "cpu":   # values again: checked where that costs no synchronisation
        yield "block past the cache", dict(base, block_table=torch.full((2, 30), 5, **i32)), ValueError, \
            "is not a block of the cache"
        yield "batch idx past the cache", dict(base, cache_batch_idx=torch.tensor([0, 9], **i32)), ValueError, \
            "cache_batch_idx values"
    yield "negative splits", dict(base, num_splits=-1), ValueError, "num_splits"
    yield "window below -1", dict(base, left=-2), ValueError, "left must be >= 0"
    yield "float window", dict(base, right=1.5), TypeError, "right must be an int"
    yield "negative softcap", dict(base, softcap=-1.0), ValueError, "softcap"
    yield "alibi of the wrong shape", dict(base, alibi_slopes=torch.ones(3, device=DEVICE)), ValueError, \
        "alibi_slopes must have shape"


def test_bad_input_is_refused_with_a_clear_error():
    case = Case((5, 9), n_q=1, heads=4, kv_heads=2, dtype=torch.float32)
    x = make_inputs(case, 0)
    for what, kwargs, error, pattern in _bad(x, case):
        with pytest.raises(error, match=pattern):
            decode_forward(x.q, x.k_cache, x.v_cache, **kwargs)
            raise AssertionError(f"{what}: accepted")
    kc, vc, q = x.k_cache, x.v_cache, x.q
    shapes = [
        ((q[0], kc, vc), ValueError, "q must have 4 dims"),
        ((q.double(), kc, vc), TypeError, "q must be float16, bfloat16 or float32"),
        ((q, kc.half(), vc.half()), TypeError, "k_cache must have the dtype of q"),
        ((q, kc, vc[:, :5]), ValueError, "one shape"),
        ((q[..., :8], kc, vc), ValueError, "head dim of q"),
        ((q[:, :, :3], kc, vc), ValueError, "multiple of the cache's key/value heads"),
        ((q[:1], kc, vc), ValueError, "cache_batch_idx"),
        ((torch.zeros(2, 1, 4, 300, device=DEVICE), torch.zeros(2, 4, 2, 300, device=DEVICE),
          torch.zeros(2, 4, 2, 300, device=DEVICE)), ValueError, "head dims 1..256"),
    ]
    for args, error, pattern in shapes:
        with pytest.raises(error, match=pattern):
            decode_forward(*args, scale=None)
    with pytest.raises(ValueError, match="forward only"):
        decode_forward(q.clone().requires_grad_(), kc, vc, scale=None)
    new = torch.zeros(2, 4, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="overflows"):
        append_kv(kc, vc, new, new, x.seqlens + 2)
    with pytest.raises(TypeError, match="cache's dtype"):
        append_kv(kc, vc, new.half(), new.half(), x.seqlens)
    with pytest.raises(ValueError, match="k_new and v_new"):
        append_kv(kc, vc, new[..., :8], new[..., :8], x.seqlens)


def test_empty_cache_gives_zeros():
    case = Case((0, 0), heads=2, kv_heads=1, dtype=torch.float32)
    x = make_inputs(case, 0)
    o, lse = decode_forward(x.q, x.k_cache[:, :0], x.v_cache[:, :0], scale=None)   # no room for a key
    assert (o == 0).all() and torch.isneginf(lse).all()
    o, lse = run(case, x, num_splits=2)                                            # room, but no key yet
    assert (o == 0).all() and torch.isneginf(lse).all()


def test_repeated_calls_reuse_the_plan_and_still_read_the_new_data():
    # a decoding loop: one problem again and again, new data each step; the plan is made once
    from fa_lab.kernels.decode import forward

    case = Case((19, 19), n_q=1, heads=4, kv_heads=2, head_dim=32, dtype=torch.float32, splits=2)
    seqlens_on_gpu = fa_lab.DEVICE.type == "cuda"
    forward._PLANS.clear()
    for step in range(3):
        x = make_inputs(case, stable_seed("plan", step))
        seqlens = x.seqlens if seqlens_on_gpu else None   # CPU lengths are value-checked on every call
        o, lse = decode_forward(x.q, x.k_cache[:, :19], x.v_cache[:, :19], cache_seqlens=seqlens, scale=None,
                                num_splits=2)
        check(case, x, o, lse, f"step {step}")
    assert len(forward._PLANS) == 1
    # another scale is another plan, and its answer follows it
    o, lse = decode_forward(x.q, x.k_cache[:, :19], x.v_cache[:, :19], cache_seqlens=seqlens, scale=0.3,
                            num_splits=2)
    check(Case((19, 19), n_q=1, heads=4, kv_heads=2, head_dim=32, dtype=torch.float32, scale=0.3), x, o, lse,
          "scale 0.3")
    assert len(forward._PLANS) == 2
    # a planned problem is still refused when its inputs require grad
    q = x.q.clone().requires_grad_()
    with pytest.raises(ValueError, match="forward only"):
        decode_forward(q, x.k_cache[:, :19], x.v_cache[:, :19], cache_seqlens=seqlens, scale=None, num_splits=2)


def test_strided_lengths_and_block_table_are_read_as_their_values():
    case = Case((30, 5, 17), n_q=2, heads=4, kv_heads=2, head_dim=16, dtype=torch.float32, page_size=8, splits=2)
    x = make_inputs(case, stable_seed("strided-int"))
    lengths = torch.stack([x.seqlens, torch.full_like(x.seqlens, 999)], dim=1)[:, 0]     # stride 2
    table = torch.stack([x.block_table, torch.full_like(x.block_table, -7)], dim=2)[..., 0]   # stride (.., 2)
    assert lengths.stride() == (2,) and table.stride(1) == 2
    o, lse = run(case, x, cache_seqlens=lengths, block_table=table)
    check(case, x, o, lse, "strided lengths and block table")


def test_gathered_pages_get_more_programs_before_one_split_is_enough():
    from fa_lab.kernels.decode.configs import GATHER_SATURATING_PROGRAMS_PER_SM

    # (B, Hkv) = (8, 8) on 132 SMs: enough programs for a contiguous cache, too few when every key gathers
    assert num_splits_heuristic(64, 8192, 128, 132) == 1
    assert num_splits_heuristic(64, 8192, 128, 132, gather=True) > 1
    many = int(GATHER_SATURATING_PROGRAMS_PER_SM * 132) + 1
    assert num_splits_heuristic(many, 8192, 128, 132, gather=True) == 1


@pytest.mark.parametrize("page_size", [0, 16, 5])
def test_int64_offsets_give_the_same_answer(page_size, monkeypatch):
    # caches past 2^31 elements take int64 offsets; a limit of 0 sends these small ones down that path
    import fa_lab.kernels.decode.forward as forward

    case = Case((37, 3, 20), n_q=2, heads=4, kv_heads=2, head_dim=16, dtype=torch.float32, page_size=page_size,
                splits=2, right=0)
    x = make_inputs(case, stable_seed("offs64", page_size))
    monkeypatch.setattr(forward, "OFFS32_LIMIT", 0)
    monkeypatch.setattr(forward, "_PLANS", {})   # no plan made under the usual limit
    o, lse = run(case, x)
    assert not forward.decode_plan(x.q, x.k_cache, x.v_cache, cache_seqlens=x.seqlens,
                                   block_table=x.block_table).split_kv.meta["OFFS32"]
    check(case, x, o, lse, f"int64 offsets, page_size={page_size}")


def test_append_into_an_unmapped_page_is_refused_before_writing():
    # pages past each sequence's length are -1 in the table: an append that crosses into one must not write
    case = Case((16, 5), heads=2, kv_heads=1, head_dim=16, dtype=torch.float32, page_size=8)
    x = make_inputs(case, stable_seed("append-unmapped"))
    new = torch.ones(2, 3, 1, 16, device=DEVICE)
    before = x.k_cache.clone()
    with pytest.raises(ValueError, match="outside|map to blocks"):
        append_kv(x.k_cache, x.v_cache, new, new, x.seqlens, block_table=x.block_table)
    assert torch.equal(torch.nan_to_num(x.k_cache, nan=7.0), torch.nan_to_num(before, nan=7.0))


# --- pages read in pool order (pool_order.py) -------------------------------------------------------------------

def _tile_keys(dtype=torch.float16) -> int:
    from fa_lab.kernels.decode.configs import decode_config

    return decode_config(16, torch.empty((), dtype=dtype).element_size(), paged=True)["BLOCK_N"]


POOL_ORDER_CASES = {
    # (case, pages per key tile): tails (a partly filled last page), an empty sequence, GQA, several splits
    "quarter-tile-pages-tails-gqa": (dict(lengths=(61, 0, 33, 7), heads=8, kv_heads=2, head_dim=64), 4),
    "half-tile-pages-splits3-bf16": (dict(lengths=(90, 41), heads=4, kv_heads=1, head_dim=59, dtype=torch.bfloat16,
                                          splits=3), 2),
    "causal-one-query-softcap-fp32": (dict(lengths=(50, 17, 64), heads=2, kv_heads=2, head_dim=32,
                                           dtype=torch.float32, splits=2, right=0, softcap=4.0), 4),
}


@pytest.mark.parametrize("name", list(POOL_ORDER_CASES))
def test_pages_read_in_pool_order_match_the_reference(name):
    import fa_lab.kernels.decode.forward as forward

    fields, pages_per_tile = POOL_ORDER_CASES[name]
    case = Case(**fields, page_size=_tile_keys(fields.get("dtype", torch.float16)) // pages_per_tile)
    seed = stable_seed("pool-order", name)
    x = make_inputs(case, seed)
    plan = forward.decode_plan(x.q, x.k_cache, x.v_cache, cache_seqlens=x.seqlens, block_table=x.block_table,
                               num_splits=case.splits, config=dict(POOL_ORDER=True), softcap=case.softcap,
                               right=case.right)
    assert plan.order_rows > 0 and plan.split_kv.meta["POOL_ORDER"]   # the path under test, not key order
    o, lse = run(case, x, config=dict(POOL_ORDER=True))
    check(case, x, o, lse, f"{name} (seed={seed})")


def test_pool_order_is_kept_only_where_key_positions_do_not_matter():
    import fa_lab.kernels.decode.forward as forward

    page = _tile_keys() // 4
    base = dict(lengths=(40, 9), heads=4, kv_heads=1, head_dim=16, page_size=page, n_q=1)
    wanted = {  # fields -> whether the order may change
        (): True, (("right", 0),): True, (("softcap", 2.0),): True,
        (("left", 5),): False, (("alibi", True),): False, (("n_q", 3), ("right", 0)): False,
        (("page_size", 0),): False, (("page_size", _tile_keys()),): False, (("page_size", page - 1),): False,
    }
    for extra, expected in wanted.items():
        case = Case(**{**base, **dict(extra)})
        x = make_inputs(case, stable_seed("pool-order-rules", extra))
        plan = forward.decode_plan(x.q, x.k_cache, x.v_cache, cache_seqlens=x.seqlens, block_table=x.block_table,
                                   left=case.left, right=case.right, softcap=case.softcap, alibi_slopes=x.slopes,
                                   config=dict(POOL_ORDER=True))
        assert bool(plan.order_rows) is expected, extra
        o, lse = run(case, x, config=dict(POOL_ORDER=True))
        check(case, x, o, lse, f"pool order rule {extra}")


def test_pool_order_is_chosen_for_one_wave_of_programs():
    from fa_lab.kernels.decode.configs import MAX_ORDERED_PAGES, pool_order_wanted

    # (B, Hkv) = (8, 8) on 132 SMs: 64 programs, one wave, one split: sorted; (64, 8): 512 programs in four
    # waves, not; one sequence in 15 splits, not
    assert pool_order_wanted(64, 1, 512, 132, None)
    assert not pool_order_wanted(512, 1, 128, 132, None)
    assert not pool_order_wanted(8, 15, 256, 132, None)
    assert pool_order_wanted(512, 1, 128, 132, True) and not pool_order_wanted(64, 1, 512, 132, False)
    assert not pool_order_wanted(64, 1, 2 * MAX_ORDERED_PAGES, 132, True)   # a sort that big does not fit
    # read in pool order, the 64 programs need no split; read in key order they get two
    assert num_splits_heuristic(64, 8192, 128, 132) == 1
    assert num_splits_heuristic(64, 8192, 128, 132, gather=True) == 2


def _share_one_order_buffer(monkeypatch, fill: int) -> dict:
    """Make every plan's pool-order buffer one tensor (as the calls of one plan on one stream share theirs), first
    filled with ``fill``, whatever the memory held; returns ``{"t": tensor}`` once a call has made it."""
    import fa_lab.kernels.decode.forward as forward
    from fa_lab.kernels.decode.pool_order import row_words

    shared = {}

    def one_buffer(rows, max_pages, device):
        if "t" not in shared:
            shared["t"] = torch.full((rows, row_words(max_pages)), fill, dtype=torch.int32, device=device)
        return shared["t"]

    monkeypatch.setattr(forward, "order_buffer", one_buffer)
    return shared


def test_pool_order_rows_are_reused_only_while_table_and_pages_are_the_same(monkeypatch):
    # every call shares one buffer (as the calls of one plan on one stream do), so the rows one call wrote are what
    # the next call finds: it must use them while the table row and its pages are unchanged, and sort again after
    from fa_lab.kernels.decode.pool_order import HEADER, TAG

    page = _tile_keys() // 4
    case = Case((45, 30), heads=2, kv_heads=1, head_dim=16, dtype=torch.float32, page_size=page, splits=1)
    x = make_inputs(case, stable_seed("pool-order-reuse"))
    shared = _share_one_order_buffer(monkeypatch, 12345)   # a pattern that looks like nothing
    o, lse = run(case, x, config=dict(POOL_ORDER=True))
    check(case, x, o, lse, "first call")
    buf = shared["t"].cpu()
    max_pages = (buf.shape[1] - HEADER.value) // 2
    for b, L in enumerate(case.lengths):
        row = buf[b]
        n_pages, n_full = -(-L // page), L // page
        table_row = x.block_table[b, :n_pages].cpu()
        assert int(row[0]) == TAG.value and (int(row[1]), int(row[2])) == (n_full, n_pages)
        assert (int(row[3]), int(row[4])) == (page, max_pages)
        assert torch.equal(row[HEADER.value:HEADER.value + n_pages], table_row)
        ordered = row[HEADER.value + max_pages:HEADER.value + max_pages + n_pages]
        assert torch.equal(ordered[:n_full], table_row[:n_full].sort().values)   # full pages by block number
        assert torch.equal(ordered[n_full:], table_row[n_full:])                 # the partial page last

    # the same table and lengths: the rows are used as they are (spoil one sorted block and the answer moves)
    ordered_0 = HEADER.value + max_pages
    kept = shared["t"][0, ordered_0].clone()
    shared["t"][0, ordered_0] = shared["t"][0, ordered_0 + 1]
    o_spoiled, _ = run(case, x, config=dict(POOL_ORDER=True))
    assert not torch.allclose(o_spoiled[0].float(), o[0].float())
    shared["t"][0, ordered_0] = kept
    o, lse = run(case, x, config=dict(POOL_ORDER=True))
    check(case, x, o, lse, "rows reused")

    # a page moved to another block (table changed in place): sorted again
    b0 = int(x.block_table[0, 0])
    spare = min(set(range(x.k_cache.shape[0])) - set(x.block_table.flatten().tolist()))   # a block no page maps to
    for t in (x.k_cache, x.v_cache):
        t[spare] = t[b0]
        t[b0] = float("nan")
    x.block_table[0, 0] = spare
    o, lse = run(case, x, config=dict(POOL_ORDER=True))
    check(case, x, o, lse, "a page moved")

    # shorter sequences (one loses its partial page, the other a key of it): the length mask still falls right
    shorter = (case.lengths[0] - page + 3, case.lengths[1] - 1)
    x.seqlens.copy_(torch.tensor(shorter, dtype=torch.int32))
    o, lse = run(case, x, config=dict(POOL_ORDER=True))
    check(case, x, o, lse, "shorter", lengths=shorter)

    # a row whose tag or layout words are not this call's is not trusted, however well its blocks match
    for word, value in ((0, 0), (3, page + 1), (4, max_pages * 2)):
        kept = shared["t"][0].clone()
        shared["t"][0, word] = value
        shared["t"][0, ordered_0], shared["t"][0, ordered_0 + 1] = kept[ordered_0 + 1], kept[ordered_0]
        o, lse = run(case, x, config=dict(POOL_ORDER=True))
        check(case, x, o, lse, f"header word {word} changed", lengths=shorter)
        assert torch.equal(shared["t"][0].cpu(), kept.cpu())   # sorted again: the row as it was


def _assert_rows_hold_the_sorted_pages(buf, table, lengths, page):
    from fa_lab.kernels.decode.pool_order import HEADER

    max_pages = (buf.shape[1] - HEADER.value) // 2
    for b, L in enumerate(lengths):
        n_pages, n_full = -(-L // page), L // page
        ordered = buf[b, HEADER.value + max_pages:HEADER.value + max_pages + n_pages].cpu()
        row = table[b, :n_pages].cpu()
        assert torch.equal(ordered[:n_full], row[:n_full].sort().values) and torch.equal(ordered[n_full:], row[n_full:])


def test_pool_order_follows_a_decoding_loop_across_page_boundaries(monkeypatch):
    # one token appended per step, for long enough that every sequence fills pages and starts new ones: each
    # step's answer matches the reference, and the kept rows always hold the full pages sorted (a page that became
    # full is inserted into the kept order; the others are not sorted again)

    page = _tile_keys(torch.float32) // 4
    case = Case((2 * page - 2, 3 * page + 1, 1), heads=4, kv_heads=2, head_dim=16, dtype=torch.float32,
                page_size=page, splits=1)
    steps = page + 3
    x = make_inputs(case, stable_seed("pool-order-loop"), reserve=steps, room=steps)
    shared = _share_one_order_buffer(monkeypatch, -5)
    lengths = list(case.lengths)
    gen = torch.Generator().manual_seed(stable_seed("pool-order-loop-tokens"))
    for step in range(steps):
        q = torch.randn(x.q.shape, generator=gen).to(x.q)
        k_new, v_new = (torch.randn(case.batch, 1, case.kv_heads, case.head_dim, generator=gen) for _ in range(2))
        append_kv(x.k_cache, x.v_cache, k_new.to(x.k_cache), v_new.to(x.v_cache), x.seqlens,
                  block_table=x.block_table)
        for b in range(case.batch):
            x.keys[b, lengths[b]], x.values[b, lengths[b]] = k_new[b, 0].to(x.keys), v_new[b, 0].to(x.values)
            lengths[b] += 1
        x.seqlens.add_(1)
        x.q = q
        o, lse = run(case, x, config=dict(POOL_ORDER=True))
        check(case, x, o, lse, f"step {step}", lengths=lengths)
        _assert_rows_hold_the_sorted_pages(shared["t"].reshape(case.batch, case.kv_heads, -1)[:, 0], x.block_table,
                                           lengths, page)


def test_pool_order_kept_rows_survive_any_sequence_of_table_and_length_changes(monkeypatch):
    # hypothesis draws what happens between calls (tokens appended, lengths jumping or shrinking, a page moved to
    # another block); every call's answer must match the reference and every kept row must hold the sorted pages
    pytest.importorskip("hypothesis")
    from hypothesis import given, note, settings
    from hypothesis import strategies as st


    page = _tile_keys(torch.float32) // 4
    room = 4 * page
    case = Case((2 * page + 1, page - 1), heads=2, kv_heads=1, head_dim=16, dtype=torch.float32, page_size=page,
                splits=1)
    events = st.lists(st.tuples(st.sampled_from(["append", "jump", "shrink", "move"]), st.integers(0, 10 ** 6)),
                      min_size=1, max_size=5)

    @settings(max_examples=12, deadline=None)
    @given(events)
    def run_events(history):
        x = make_inputs(case, stable_seed("pool-order-events"), reserve=room, room=room)
        lengths = list(case.lengths)
        shared = _share_one_order_buffer(monkeypatch, 7)
        capacity = x.keys.shape[1]
        for what, r in [("first call", 0)] + history:
            b = r % case.batch
            if what == "append":      # one token for every sequence, as a decoding step appends it
                gen = torch.Generator().manual_seed(r)
                new = [torch.randn(case.batch, 1, case.kv_heads, case.head_dim, generator=gen) for _ in range(2)]
                if max(lengths) + 1 > capacity:
                    continue
                append_kv(x.k_cache, x.v_cache, new[0].to(x.k_cache), new[1].to(x.v_cache), x.seqlens,
                          block_table=x.block_table)
                for s in range(case.batch):
                    x.keys[s, lengths[s]], x.values[s, lengths[s]] = new[0][s, 0], new[1][s, 0]
                    lengths[s] += 1
            elif what == "jump":      # several tokens at once: their keys written where the table maps them
                new_length = min(lengths[b] + r % (2 * page), capacity - 1)
                for j in range(lengths[b], new_length):
                    slot = (int(x.block_table[b, j // page]), j % page)
                    x.k_cache[slot], x.v_cache[slot] = x.keys[b, j].to(x.k_cache), x.values[b, j].to(x.v_cache)
                lengths[b] = new_length
            elif what == "shrink":    # a shorter sequence (the keys past it stay in the cache, unread)
                lengths[b] = r % (lengths[b] + 1)
            elif what == "move":      # one mapped page of sequence b goes to a block no page uses
                mapped = [i for i, blk in enumerate(x.block_table[b].tolist()) if blk >= 0]
                free = sorted(set(range(x.k_cache.shape[0])) - set(x.block_table.flatten().tolist()))
                if not mapped or not free:
                    continue
                i, dst = mapped[r % len(mapped)], free[r % len(free)]
                src = int(x.block_table[b, i])
                for t in (x.k_cache, x.v_cache):
                    t[dst] = t[src]
                    t[src] = float("nan")
                x.block_table[b, i] = dst
            x.seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
            note(f"{what} {r}: lengths {lengths}")
            o, lse = run(case, x, config=dict(POOL_ORDER=True))
            check(case, x, o, lse, f"after {what} ({r})", lengths=lengths)
            _assert_rows_hold_the_sorted_pages(shared["t"], x.block_table, lengths, page)

    run_events()
