"""Chapter 4's Triton forward against the float64 reference.

In the CPU world these run in the Triton interpreter with 16×16 tiles, so shapes stay small
but span several tiles: tails (lengths that are not multiples of 16), Nq != Nk both ways,
every mask, GQA, head dims 16..256 including 40 and 80, fp16, bf16 and fp32.
(tests/test_attention.py already runs every registered step on the generic cases.)
"""
import math

import pytest
import torch

import fa_lab
from fa_lab.core.reference import reference_attention
from fa_lab.core.testing import assert_close, random_qkv
from fa_lab.kernels.triton import (
    CPU_CONFIG,
    FIXED_CONFIG,
    ConfigCache,
    Variant,
    candidate_configs,
    config_key,
    fast_launch,
    kernel,
    key_block_ranges,
    key_ranges,
    triton_forward,
    ws_fits_problem,
)

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
MASKS = [
    dict(),
    dict(causal=True),
    dict(window=(5, 0)),
    dict(window=(0, 0)),
    dict(window=(7, 20)),
    dict(window=(-1, 3)),
    dict(window=(20, -1)),
    dict(causal=True, window=(11, -1)),
]


def check(q, k, v, impl="triton", **mask):
    o, lse = fa_lab.attention(q, k, v, impl=impl, return_lse=True, **mask)
    spec = fa_lab.make_spec(q, k, v, **mask)
    ref_o, ref_lse = reference_attention(q, k, v, spec)
    assert o.dtype == q.dtype and o.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    assert_close(o, ref_o, q.dtype, what=f"{impl} O")
    assert_close(lse, ref_lse, q.dtype, what=f"{impl} lse")
    return o, lse


def _forward_with(q, k, v, cfg, host_desc=None, **mask):
    """triton_forward with a forced launch configuration, against the float64 reference."""
    spec = fa_lab.make_spec(q, k, v, **mask)
    o, lse = triton_forward(q, k, v, spec, config=cfg, host_desc=host_desc)
    ref_o, ref_lse = reference_attention(q, k, v, spec)
    assert_close(o, ref_o, q.dtype, what=f"O with {cfg}")
    assert_close(lse, ref_lse, q.dtype, what=f"lse with {cfg}")


@pytest.mark.parametrize("head_dim", [16, 40, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_head_dims_and_dtypes(head_dim, dtype):
    q, k, v = random_qkv(1, 2, 19, 37, head_dim, kv_heads=1, dtype=dtype, seed=head_dim)
    check(q, k, v, causal=True)


@pytest.mark.parametrize("mask", MASKS, ids=str)
@pytest.mark.parametrize("n_q,n_k", [(45, 45), (33, 70), (70, 33), (1, 50), (50, 1), (64, 64)])
def test_masks_tails_and_lengths(mask, n_q, n_k):
    q, k, v = random_qkv(1, 4, n_q, n_k, 32, kv_heads=2, dtype=torch.float16, seed=n_q * 100 + n_k)
    check(q, k, v, **mask)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mask", [dict(), dict(causal=True), dict(window=(6, 2))], ids=str)
def test_gqa_and_batches(dtype, mask):
    q, k, v = random_qkv(2, 6, 21, 29, 16, kv_heads=2, dtype=dtype, seed=5)
    check(q, k, v, **mask)


@pytest.mark.parametrize("impl", ["triton_minimal", "triton_desc", "triton_exp2", "triton_skip",
                                  "triton_autotuned", "triton"])
def test_every_step_on_a_multi_block_case(impl):
    q, k, v = random_qkv(1, 4, 40, 53, 40, kv_heads=2, dtype=torch.bfloat16, seed=9)
    for mask in (dict(causal=True), dict(window=(9, 4))):
        check(q, k, v, impl=impl, **mask)


def test_rows_without_keys_are_zero_with_lse_minus_inf():
    q, k, v = random_qkv(1, 2, 40, 10, 16, dtype=torch.float16, seed=3)
    o, lse = check(q, k, v, causal=True)           # rows 0..29 sit before the first key
    assert torch.all(o[:, :, :30] == 0) and torch.all(torch.isneginf(lse[:, :, :30]))
    o, lse = check(q, k, v, window=(0, 0))          # a zero-width window: one key per row, or none
    assert torch.isfinite(o).all()


def test_masked_blocks_are_never_read():
    # NaN in the keys/values of the last key tile: the causal kernel must not even load that
    # tile for query tiles that cannot see it (0 * NaN would poison them), while the plain
    # loop that visits every block does.
    if fa_lab.ON_GPU:
        pytest.skip("tile sizes differ on the GPU; the CPU interpreter uses 16x16 tiles")
    q, k, v = random_qkv(1, 1, 64, 64, 16, dtype=torch.float16, seed=4)
    v = v.clone()
    v[:, :, 48:] = float("nan")
    spec = fa_lab.make_spec(q, k, v, causal=True)
    o, _ = triton_forward(q, k, v, spec)
    assert torch.isfinite(o[:, :, :48]).all() and torch.isnan(o[:, :, 48:]).any()
    o, _ = triton_forward(q, k, v, spec, variant=Variant("plain", skip_masked=False, space="fixed"))
    assert torch.isnan(o[:, :, :48]).any()


@pytest.mark.parametrize("host_desc", [True, False])
@pytest.mark.parametrize("mask", [dict(), dict(causal=True), dict(window=(9, 4))], ids=str)
def test_descriptors_built_on_the_host_or_in_the_kernel(host_desc, mask):
    # host: one (B·H·N, D) descriptor per tensor, tiles may run into the next head's rows;
    # kernel: one per head, zero-filled past the sequence
    q, k, v = random_qkv(2, 4, 37, 45, 40, kv_heads=2, dtype=torch.float16, seed=11)
    spec = fa_lab.make_spec(q, k, v, **mask)
    o, lse = triton_forward(q, k, v, spec, host_desc=host_desc)
    ref_o, ref_lse = reference_attention(q, k, v, spec)
    assert_close(o, ref_o, torch.float16)
    assert_close(lse, ref_lse, torch.float16)


@pytest.mark.parametrize("n_q,n_k", [(70, 70), (45, 80), (80, 45), (16, 16), (1, 30)])
def test_paired_causal_blocks(n_q, n_k):
    # config 'paired': query blocks i and last-i share one program (balanced causal work)
    q, k, v = random_qkv(1, 2, n_q, n_k, 32, kv_heads=1, dtype=torch.float16, seed=n_q + n_k)
    for mask in (dict(causal=True), dict(causal=True, window=(20, -1))):
        cfg = dict(CPU_CONFIG if not fa_lab.ON_GPU else FIXED_CONFIG, paired=True)
        _forward_with(q, k, v, cfg, **mask)


@pytest.mark.parametrize("host_desc", [True, False])
@pytest.mark.parametrize("paired", [False, True])
@pytest.mark.parametrize("mask", [dict(), dict(causal=True), dict(window=(9, 4)), dict(window=(20, -1)),
                                  dict(causal=True, window=(30, -1))], ids=str)
def test_edge_tiles_narrower_than_the_key_tiles(mask, paired, host_desc):
    # BLOCK_N = 4 * BLOCK_M: the masked ranges (window edges, diagonal, ragged end) are walked
    # in BLOCK_M-wide tiles (BLOCK_N_EDGE), the unmasked middle in BLOCK_N-wide ones
    q, k, v = random_qkv(1, 2, 45, 150, 32, kv_heads=1, dtype=torch.float16, seed=17)
    spec = fa_lab.make_spec(q, k, v, **mask)
    base = CPU_CONFIG if not fa_lab.ON_GPU else FIXED_CONFIG
    cfg = dict(base, BLOCK_N=4 * base["BLOCK_M"], paired=paired and spec.mask == "causal")
    _forward_with(q, k, v, cfg, host_desc=host_desc, **mask)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mask", [dict(), dict(causal=True), dict(window=(9, 4))], ids=str)
def test_exponentials_on_the_fma_units(dtype, mask):
    # config 'emu': half of the unmasked blocks' exp2 computed by a cubic on the FMA units
    q, k, v = random_qkv(2, 4, 45, 70, 64, kv_heads=2, dtype=dtype, seed=3)
    cfg = dict(CPU_CONFIG if not fa_lab.ON_GPU else FIXED_CONFIG, emu=True)
    _forward_with(q, k, v, cfg, **mask)


def test_exp2_fma_matches_exp2():
    import triton
    import triton.language as tl

    @triton.jit
    def exp2_fma(X, Y, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(Y + i, kernel.exp2_fma(tl.load(X + i)))

    x = torch.cat([torch.linspace(-140.0, 0.0, 1000), -torch.rand(24) * 1e-3, torch.zeros(1)])
    x = torch.nn.functional.pad(x, (0, 1024 - x.numel())).to(fa_lab.DEVICE)
    y = torch.empty_like(x)
    exp2_fma[(1,)](x, y, N=1024)
    ref = torch.exp2(x.double())
    normal = x >= -126
    rel = ((y.double() - ref).abs() / ref)[normal]
    assert rel.max() < 1e-4, f"relative error {rel.max():.2e} of the cubic (expected < 1e-4)"
    assert y[~normal].abs().max() < 1e-37  # below the normal range: (nearly) zero, never garbage


def test_repeated_calls_reuse_the_launch_and_see_new_inputs():
    # the second call takes the cached launch path (on a GPU, the compiled kernel directly):
    # it must read this call's tensors, not the first call's
    for seed in (1, 2, 3):
        q, k, v = random_qkv(1, 2, 40, 52, 32, dtype=torch.float16, seed=seed)
        spec = fa_lab.make_spec(q, k, v, causal=True)
        o, lse = triton_forward(q, k, v, spec)
        ref_o, ref_lse = reference_attention(q, k, v, spec)
        assert_close(o, ref_o, torch.float16)
        assert_close(lse, ref_lse, torch.float16)


def test_a_repeated_call_runs_its_plan_on_this_calls_tensors(monkeypatch):
    # fa_lab.attention hands a repeated call the same spec: the second and later calls run the kept
    # plan (no checks, no choice of configuration) and must still read this call's tensors
    from fa_lab.kernels.triton import fwd

    fwd.forget_plans()
    for seed in (4, 5, 6):
        q, k, v = random_qkv(1, 4, 24, 40, 16, kv_heads=2, dtype=torch.float16, seed=seed)
        o, lse = fa_lab.attention(q, k, v, impl="triton", window=(9, 3), return_lse=True)
        spec = fa_lab.make_spec(q, k, v, window=(9, 3))
        ref_o, ref_lse = reference_attention(q, k, v, spec)
        assert_close(o, ref_o, torch.float16)
        assert_close(lse, ref_lse, torch.float16)
    assert len(fwd._PLANS) == 1   # one problem, one plan
    plan = next(iter(fwd._PLANS.values()))
    assert plan.spec.window == (9, 3) and plan.spec.kv_heads == 2
    # options other than the defaults never take or leave a plan
    q, k, v = random_qkv(1, 2, 24, 24, 16, dtype=torch.float32, seed=7)
    spec = fa_lab.make_spec(q, k, v)
    o, _ = triton_forward(q, k, v, spec, precision="tf32")
    assert id(spec) not in fwd._PLANS
    assert_close(o, reference_attention(q, k, v, spec)[0], torch.float16)
    # a retune changes the winner of a key every spec of that key shares: no plan outlives it
    q, k, v = random_qkv(1, 2, 24, 24, 16, dtype=torch.float16, seed=8)
    spec = fa_lab.make_spec(q, k, v)
    triton_forward(q, k, v, spec)
    assert fwd._PLANS[id(spec)].spec is spec
    # (the choice itself as without a retune: a real retune would write the shared config cache)
    choose = fwd.choose_config
    monkeypatch.setattr(fwd, "choose_config", lambda launch, spec, work, variant, precision, **kw:
                        choose(launch, spec, work, variant, precision))
    o, _ = triton_forward(q, k, v, spec, retune=True)
    assert fwd._PLANS == {}
    assert_close(o, reference_attention(q, k, v, spec)[0], torch.float16)


@pytest.mark.parametrize("scale", [0.0, -0.3, 2.5])
def test_any_scale(scale):
    q, k, v = random_qkv(1, 2, 20, 31, 16, dtype=torch.float32, seed=6)
    o, lse = fa_lab.attention(q, k, v, impl="triton", causal=True, scale=scale, return_lse=True)
    ref_o, ref_lse = reference_attention(q, k, v, fa_lab.make_spec(q, k, v, causal=True, scale=scale))
    assert_close(o, ref_o, torch.float32)
    assert_close(lse, ref_lse, torch.float32)


def test_non_contiguous_inputs():
    q, k, v = random_qkv(2, 3, 17, 17, 32, dtype=torch.float16, seed=8)
    # a (batch, seq, heads, dim) layout viewed as (batch, heads, seq, dim)
    q2, k2, v2 = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    assert not q2.is_contiguous()
    check(q2, k2, v2, causal=True)


def test_fp32_precision_knob():
    # triton_forward's precision: 'ieee' exact fp32 products, 'tf32' the Tensor Cores' 10-bit mantissa
    q, k, v = random_qkv(1, 2, 18, 18, 16, dtype=torch.float32, seed=2)
    spec = fa_lab.make_spec(q, k, v, causal=True)
    ref = reference_attention(q, k, v, spec)[0]
    o, _ = triton_forward(q, k, v, spec, precision="ieee")
    assert_close(o, ref, torch.float32)
    o32, _ = triton_forward(q, k, v, spec, precision="tf32")
    assert (o32.double() - ref).abs().max() < 5e-3  # TF32: 10-bit mantissa on the GPU
    with pytest.raises(ValueError, match="precision"):
        triton_forward(q, k, v, spec, precision="fp64")


@pytest.mark.parametrize("head_dim,dtype,words", [
    (20, torch.float16, "multiple of 8"),
    (8, torch.float16, "head dims 16..256"),
    (320, torch.float16, "head dims 16..256"),
    (16, torch.float64, "supports dtypes"),
])
def test_what_it_cannot_do_is_a_clear_value_error(head_dim, dtype, words):
    q, k, v = random_qkv(1, 1, 4, 4, head_dim, dtype=dtype)
    with pytest.raises(ValueError, match=words):
        fa_lab.attention(q, k, v, impl="triton")


def test_triton_forward_contract_for_the_backward():
    # chapter 5 calls triton_forward(q, k, v, spec) -> (o, lse): lse float32, natural log
    q, k, v = random_qkv(1, 2, 9, 12, 16, dtype=torch.float16, seed=1)
    spec = fa_lab.make_spec(q, k, v, causal=True)
    o, lse = triton_forward(q, k, v, spec)
    assert o.dtype == torch.float16 and lse.dtype == torch.float32 and lse.shape == (1, 2, 9)
    s = (q.double() @ k.double().transpose(-1, -2)) * spec.scale
    s = s.masked_fill(~fa_lab.visible(9, 12, -1, 0).to(s.device), float("-inf"))
    assert torch.allclose(lse.double(), torch.logsumexp(s, -1), atol=1e-2)


def test_config_keys_bucket_lengths_and_separate_what_matters():
    q, k, v = random_qkv(1, 1, 3000, 3000, 40, dtype=torch.float16, device="cpu")
    key = config_key(fa_lab.make_spec(q, k, v, causal=True), torch.float16, "pipelined")
    assert key == "float16|d64|q4096|k4096|causal|pipelined"
    key2 = config_key(fa_lab.make_spec(q, k, v), torch.bfloat16, "pipelined")
    assert key2 != key


@pytest.mark.parametrize("space", ["tuned", "pipelined"])
@pytest.mark.parametrize("d_pad", [16, 64, 128, 256])
def test_candidate_configs_are_pruned(space, d_pad):
    cands = candidate_configs(space, d_pad, 2)
    assert cands
    for c in cands:
        if c["num_warps"] == 8:  # two warpgroups need 128 rows, and at D > 64 a 128x128 tile
            assert c["BLOCK_M"] >= 128 and (d_pad <= 64 or c["BLOCK_M"] * c["BLOCK_N"] >= 128 * 128)
        assert c["num_stages"] == 1 or space == "pipelined"
    assert any(c["num_stages"] > 1 for c in cands) == (space == "pipelined")


def test_shipped_configs_file_is_valid():
    path = ConfigCache.SHIPPED
    if not path.exists():
        pytest.skip("no shipped configs yet")
    import json

    for device, table in json.loads(path.read_text())["configs"].items():
        for key, cfg in table.items():
            assert len(key.split("|")) == 6, key
            assert {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"} <= set(cfg), (device, key)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape,mask", [
    ((2, 8, 2, 1000, 1000, 128), dict(causal=True)),
    ((1, 4, 4, 333, 1021, 80), dict(window=(100, 50))),
    ((1, 4, 1, 1021, 333, 64), dict(causal=True)),
    ((2, 2, 2, 1, 4096, 256), dict()),
    ((1, 2, 2, 300, 300, 40), dict(causal=True, window=(64, -1))),
    # the key of (1, 16, 16384, 128), whose shipped H100 config is warp-specialized, on a problem
    # that cannot run it (n_q % 4, a ragged key tile): the default config instead
    ((1, 2, 2, 9002, 9001, 128), dict()),
])
def test_gpu_real_sizes(dtype, shape, mask, monkeypatch):
    monkeypatch.setenv("FA_LAB_TRITON_AUTOTUNE", "0")  # nothing timed on a miss; tuning is the benchmark's job
    B, H, Hkv, Nq, Nk, D = shape
    q, k, v = random_qkv(B, H, Nq, Nk, D, kv_heads=Hkv, dtype=dtype, seed=math.prod(shape))
    for impl in ("triton", "triton_minimal"):
        check(q, k, v, impl=impl, **mask)


@pytest.mark.parametrize("mask", [dict(), dict(causal=True), dict(window=(7, 20))], ids=str)
@pytest.mark.parametrize("n_q,n_k,d", [(44, 64, 40), (64, 32, 32), (4, 48, 16), (36, 70, 32)])
def test_warp_specialized_config(mask, n_q, n_k, d):
    # ws=True: O goes out through an in-kernel tensor descriptor (rows past n_q and columns
    # past D clipped by the copy engine), the descriptors are built in the kernel, and an
    # unmasked problem with whole key tiles compiles the hot loop alone (n_k % 16 == 0 here)
    if fa_lab.ON_GPU:
        pytest.skip("on a GPU: test_gpu_hopper_warp_specialized_tile (Triton's pass fails on masked loops)")
    q, k, v = random_qkv(1, 4, n_q, n_k, d, kv_heads=2, dtype=torch.float16, seed=n_q + n_k + d)
    _forward_with(q, k, v, dict(CPU_CONFIG, ws=True), **mask)
    q, k, v = random_qkv(1, 2, 45, n_k, d, dtype=torch.float16)
    with pytest.raises(ValueError, match="n_q % 4"):
        _forward_with(q, k, v, dict(CPU_CONFIG, ws=True), **mask)


def test_ws_fits_problem():
    def spec(n_q, n_k, d=128, **mask):
        q, k, v = random_qkv(1, 2, n_q, n_k, d, dtype=torch.float16, device="cpu")
        return fa_lab.make_spec(q, k, v, **mask)

    f16 = torch.float16
    assert ws_fits_problem(spec(16384, 16384), f16, 9)
    assert ws_fits_problem(spec(1000, 1024, 80), f16, 9)        # D_PAD 128, tails in n_q
    assert not ws_fits_problem(spec(9002, 9216), f16, 9)        # n_q % 4: lse descriptor
    assert not ws_fits_problem(spec(9000, 9001), f16, 9)        # a ragged last key tile
    assert not ws_fits_problem(spec(4096, 4096, causal=True), f16, 9)
    assert not ws_fits_problem(spec(4096, 4096, 64), f16, 9)
    assert not ws_fits_problem(spec(4096, 4096), torch.float32, 9)
    assert ws_fits_problem(spec(4096, 4096, causal=True), f16, 10)  # Blackwell: any mask
    assert not ws_fits_problem(spec(4097, 4096), f16, 10)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1, 4, 1000, 1024, 128), (2, 2, 4096, 4096, 128), (1, 3, 332, 2048, 80)])
def test_gpu_hopper_warp_specialized_tile(dtype, shape):
    # the configuration the tuner adds on Hopper for unmasked problems with whole 128-key tiles
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the tuner tries it on Hopper only")
    B, H, Nq, Nk, D = shape
    q, k, v = random_qkv(B, H, Nq, Nk, D, dtype=dtype, seed=Nq + D)
    _forward_with(q, k, v, dict(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=2, ws=True))


def test_key_block_ranges_cover_every_visible_key_once_and_skip_the_rest():
    # the Python mirror of the kernel's loop bounds, on random shapes, masks and tiles
    import random

    rng = random.Random(0)
    for _ in range(300):
        bm, bn = rng.choice([16, 64, 128]), rng.choice([16, 32, 64, 128])
        n_q, n_k = rng.randint(1, 300), rng.randint(1, 300)
        left, right = rng.choice([-1, rng.randint(0, 200)]), rng.choice([-1, 0, rng.randint(0, 200)])
        ok = fa_lab.visible(n_q, n_k, left, right)
        for m0 in range(0, n_q, bm):
            lo, mid_lo, mid_hi, hi = key_block_ranges(m0, bm, bn, n_q, n_k, left, right)
            rows = ok[m0:m0 + bm]
            blocks = {s: True for s in range(lo, mid_lo, bn)}
            blocks.update({s: False for s in range(mid_lo, mid_hi, bn)})
            blocks.update({s: True for s in range(mid_hi, hi, bn)})
            ranges = (range(lo, mid_lo, bn), range(mid_lo, mid_hi, bn), range(mid_hi, hi, bn))
            assert len(blocks) == sum(len(r) for r in ranges)
            seen = torch.zeros(n_k, dtype=torch.bool)
            for s, masked in blocks.items():
                assert s % bn == 0
                tile = rows[:, s:s + bn]
                assert tile.any(), "a block no row sees is visited"
                assert masked or (tile.all() and s + bn <= n_k), "a mask-free block hides a key"
                seen[s:s + bn] = True
            assert not (rows.any(0) & ~seen).any(), "a visible key is never visited"


def test_kernel_visible_range_is_exact_and_agrees_with_key_block_ranges():
    # the @triton.jit arithmetic that the forward and both backward kernels share, run as a kernel,
    # against brute force over the block's rows; key_block_ranges (its Python twin) must agree
    import random

    import triton
    import triton.language as tl

    @triton.jit
    def ranges(OUT, n_rows, n_cols, left, right, BLOCK: tl.constexpr, HAS_LEFT: tl.constexpr,
               HAS_RIGHT: tl.constexpr):
        pid = tl.program_id(0)
        lo, hi, full_lo, full_hi = key_ranges.visible_range(start=pid * BLOCK, n_rows=n_rows, n_cols=n_cols,
                                                            left=left, right=right, BLOCK=BLOCK,
                                                            HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT)
        tl.store(OUT + pid * 4, lo)
        tl.store(OUT + pid * 4 + 1, hi)
        tl.store(OUT + pid * 4 + 2, full_lo)
        tl.store(OUT + pid * 4 + 3, full_hi)

    rng = random.Random(1)
    for _ in range(40):
        block, block_n = rng.choice([16, 32]), rng.choice([16, 32, 64])
        n_rows, n_cols = rng.randint(1, 120), rng.randint(1, 120)
        left, right = rng.choice([-1, 0, rng.randint(0, 90)]), rng.choice([-1, 0, rng.randint(0, 90)])
        n_blocks = triton.cdiv(n_rows, block)
        out = torch.full((n_blocks * 4,), -99, dtype=torch.int32, device=fa_lab.DEVICE)
        ranges[(n_blocks,)](out, n_rows, n_cols, max(left, 0), max(right, 0), BLOCK=block,
                            HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0)
        case = dict(n_rows=n_rows, n_cols=n_cols, left=left, right=right, block=block)
        cols = torch.arange(n_cols)
        for b, (lo, hi, full_lo, full_hi) in enumerate(out.view(-1, 4).tolist()):
            # every row of the block, also those past n_rows (the kernels' tiles have them too)
            rows = torch.arange(b * block, (b + 1) * block)[:, None] + (n_cols - n_rows)
            sees = torch.ones(block, n_cols, dtype=torch.bool)
            if left >= 0:
                sees &= cols >= rows - left
            if right >= 0:
                sees &= cols <= rows + right
            some, every = cols[sees.any(0)].tolist(), cols[sees.all(0)].tolist()
            if some:
                assert (lo, hi) == (some[0], some[-1] + 1), case
            else:
                assert hi <= lo, case
            assert list(range(full_lo, full_hi)) == every, case
            # the forward's split of the same keys into tiles: the Python twin
            py_lo, mid_lo, mid_hi, py_hi = key_block_ranges(b * block, block, block_n, n_rows, n_cols, left, right)
            assert (py_lo, py_hi) == (lo // block_n * block_n, max(hi, lo)), case
            whole = [s for s in range(0, n_cols, block_n) if full_lo <= s and s + block_n <= full_hi]
            assert list(range(mid_lo, mid_hi, block_n)) == whole, case


# ---- repeated launches straight through the compiled kernel (fast_launch) and its guard ----

def _fake_fn(X, n, A: "tl.constexpr", B: "tl.constexpr"):  # noqa: F821 (read as text, as Triton does)
    """A stand-in kernel signature: two runtime arguments, then two constexprs."""


class _FakeCompiled:
    def __init__(self, kernel, signature):
        self.kernel, self.src = kernel, type("Src", (), {"signature": signature})()

    def __getitem__(self, grid):
        return lambda *args: self.kernel.direct.append((grid, args))


class _FakeKernel:
    """Records how it was launched: through the JIT (``kernel[grid](...)``) or directly."""

    fn = staticmethod(_fake_fn)

    def __init__(self, signature):
        self.signature, self.jit, self.direct = signature, [], []

    def __getitem__(self, grid):
        def run(*args, num_warps, num_stages, **meta):
            self.jit.append((grid, args, meta))
            return _FakeCompiled(self, self.signature)
        return run


GOOD_SIGNATURE = {"X": "*fp32", "n": "i32", "A": "constexpr", "B": "constexpr"}


@pytest.mark.parametrize("signature,ok", [
    (GOOD_SIGNATURE, True),
    ({"n": "i32", "X": "*fp32", "A": "constexpr", "B": "constexpr"}, False),   # another order
    ({"X": "*fp32", "n": "i32", "A": "constexpr", "B": "i32"}, False),         # B not a constexpr
    ({"X": "*fp32", "n": "i32"}, False),                                       # constexprs left out
    (None, False),                                                             # no signature at all
])
def test_direct_launch_guard_checks_the_compiled_signature(signature, ok):
    kernel = _FakeKernel(signature)
    assert fast_launch.direct_launch_supported(_FakeCompiled(kernel, signature), kernel) is ok


def test_the_real_kernel_passes_its_constexprs_last():
    # the fast path passes the runtime arguments, then the constexprs: the kernel must list them so
    params = fast_launch.kernel_parameters(kernel.attn_fwd)
    constexprs = fast_launch.constexpr_parameters(kernel.attn_fwd)
    assert constexprs and params[-len(constexprs):] == constexprs
    assert params.index("right") == len(params) - len(constexprs) - 1


@pytest.mark.parametrize("supported", [True, False])
def test_fast_launch_goes_direct_only_when_the_guard_allows(supported, monkeypatch):
    fast_launch.reset()
    monkeypatch.setattr(fast_launch, "direct_launch_supported", lambda compiled, kern: supported)
    fake = _FakeKernel(GOOD_SIGNATURE)
    try:
        for x in ("x1", "x2", "x3"):
            fast_launch.launch(fake, ("problem", "config"), (4, 2), (x, 7), dict(B=False, A=16), 4, 1)
    finally:
        fast_launch.reset()
    if supported:   # first through the JIT, then the compiled kernel with the constexprs in signature order
        assert len(fake.jit) == 1
        assert fake.direct == [((4, 2, 1), ("x2", 7, 16, False)), ((4, 2, 1), ("x3", 7, 16, False))]
    else:           # every launch through the JIT
        assert [args for _, args, _ in fake.jit] == [("x1", 7), ("x2", 7), ("x3", 7)]
        assert not fake.direct


@pytest.mark.gpu
def test_gpu_fast_launch_matches_the_jit_launch(monkeypatch):
    # the installed Triton keeps the convention the fast path relies on, and both paths agree bit for bit
    q, k, v = random_qkv(1, 2, 200, 300, 64, dtype=torch.float16, seed=21)
    spec = fa_lab.make_spec(q, k, v, causal=True)
    fast_launch.reset()
    try:
        first = triton_forward(q, k, v, spec, config=FIXED_CONFIG)
        assert fast_launch._SUPPORTED is True, "this Triton's compiled kernels changed their calling convention"
        direct = triton_forward(q, k, v, spec, config=FIXED_CONFIG)
        fast_launch.reset()
        monkeypatch.setattr(fast_launch, "direct_launch_supported", lambda compiled, kern: False)
        triton_forward(q, k, v, spec, config=FIXED_CONFIG)
        jit = triton_forward(q, k, v, spec, config=FIXED_CONFIG)
    finally:
        fast_launch.reset()
    for a, b, c in zip(first, direct, jit):
        assert torch.equal(a, b) and torch.equal(a, c)


# ---- the regions chapter 4 prints (fa_lab.core.source) ----

def test_the_kernel_regions_the_book_prints():
    from fa_lab.core.source import source_text

    ranges = source_text(kernel.attn_fwd_block, "key-ranges")
    assert ranges.startswith("m0 = pid_m * BLOCK_M") and "mid_hi = tl.maximum(" in ranges
    assert "region" not in ranges and "attn_fwd_inner" not in ranges
    whole = source_text(kernel.attn_fwd_block)
    assert "def attn_fwd_block(" in whole and "# region" not in whole and "# endregion" not in whole
    for region in ("key-loops", "epilogue"):
        assert source_text(kernel.attn_fwd_block, region).strip()
    with pytest.raises(ValueError, match="key-loops"):   # the error lists the regions there are
        source_text(kernel.attn_fwd_block, "hot-loop")
