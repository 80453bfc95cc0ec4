"""Chapter 3: the tiled Numba CUDA kernel and its steps against the float64 reference.

In the CPU world these run in the Numba CUDA simulator, whose blocks are 4 threads and
whose tiles are 4 x 4 (``fa_lab.pick``): small shapes still span several query and key
tiles, tails included.  ``tests/test_attention.py`` also covers every registered step.
"""
import math
import time

import numpy as np
import pytest
import torch

import fa_lab
from fa_lab.core.reference import reference_attention
from fa_lab.core.testing import assert_close, random_qkv
from fa_lab.kernels.numba import steps as numba_steps
from fa_lab.kernels.numba import tiled as nt
from fa_lab.kernels.numba.tile_config import SMALL_SHARED_CONFIGS, STATIC_SHARED_LIMIT, VEC, gpu_config

STEPS = [name for name in numba_steps.STEPS if name != "numba_naive"]   # the chapter's kernels, in order

# (batch, heads, kv_heads, n_q, n_k, head_dim, mask)
CASES = [
    (1, 2, 2, 17, 17, 16, dict()),                               # tails on both sides
    (1, 2, 2, 17, 17, 16, dict(causal=True)),
    (2, 2, 1, 5, 23, 32, dict(causal=True)),                     # Nq < Nk, GQA
    (1, 4, 2, 23, 9, 16, dict(causal=True)),                     # Nq > Nk: first rows see no key
    (1, 2, 2, 13, 11, 64, dict(window=(2, 3))),
    (1, 1, 1, 21, 21, 8, dict(window=(4, 0))),                   # head dim padded 8 -> 16
    (1, 3, 1, 10, 14, 100, dict(causal=True, window=(3, -1))),   # D = 100 padded to 128, GQA 3:1
    (1, 1, 1, 9, 12, 128, dict(window=(0, 0))),                  # each row sees one key
    (2, 1, 1, 1, 1, 24, dict()),                                 # N = 1
    (1, 2, 2, 16, 16, 32, dict(causal=True)),                    # exact multiples of the tiles
]


def _id(case):
    B, H, Hkv, Nq, Nk, D, mask = case
    return f"{B}x{H}/{Hkv}-{Nq}x{Nk}-D{D}-{'-'.join(f'{k}={v}' for k, v in mask.items()) or 'none'}"


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_numba_tiled_matches_reference(case):
    B, H, Hkv, Nq, Nk, D, mask = case
    q, k, v = random_qkv(B, H, Nq, Nk, D, kv_heads=Hkv, seed=Nq * 31 + Nk + D)
    o, lse = fa_lab.attention(q, k, v, impl="numba_tiled", return_lse=True, **mask)
    ref_o, ref_lse = reference_attention(q, k, v, fa_lab.make_spec(q, k, v, **mask))
    assert_close(o, ref_o, torch.float32, what="numba_tiled O")
    assert_close(lse, ref_lse, torch.float32, what="numba_tiled lse")


def _launch_matches_reference(cfg, q, k, v, spec):
    o, lse = nt.launch_tiled(q, k, v, spec, cfg=cfg)
    ref_o, ref_lse = reference_attention(q, k, v, spec)
    assert_close(o, ref_o, torch.float32, what=f"{cfg} O")
    assert_close(lse, ref_lse, torch.float32, what=f"{cfg} lse")


# both ways the kernel stages K and V (own buffers, or one they take turns in), with blocks of
# several threads per row so that the row reductions combine threads
LOADING = [nt.TileConfig(8, 8, 2, 2, d_pad, share_kv=share) for d_pad in (16, 32) for share in (False, True)]


@pytest.mark.parametrize("cfg", LOADING, ids=lambda c: f"D{c.d_pad}-share{int(c.share_kv)}")
@pytest.mark.parametrize("case", [CASES[2], CASES[3], CASES[9]], ids=[_id(c) for c in (CASES[2], CASES[3], CASES[9])])
def test_every_loading_variant_matches_reference(cfg, case):
    B, H, Hkv, Nq, Nk, D, mask = case
    if D > cfg.d_pad:
        D = cfg.d_pad - 3                                  # a padded head dim: the zero-filled tails
    q, k, v = random_qkv(B, H, Nq, Nk, D, kv_heads=Hkv, seed=Nq * 7 + D)
    _launch_matches_reference(cfg, q, k, v, fa_lab.make_spec(q, k, v, **mask))


def test_more_shared_memory_than_a_block_gets_by_default():
    # 64-key tiles at D = 128: 78 KiB of shared memory, so the launch opts in to more than 48 KiB (on a GPU)
    cfg = nt.TileConfig(16, 64, 2, 2, 128)
    assert cfg.shared_bytes() > STATIC_SHARED_LIMIT
    q, k, v = random_qkv(1, 2, 20, 77, 100, kv_heads=1, seed=5)
    _launch_matches_reference(cfg, q, k, v, fa_lab.make_spec(q, k, v, causal=True))


def test_shared_tiles_do_not_overlap():
    for cfg in (*nt.GPU_CONFIGS.values(), *SMALL_SHARED_CONFIGS.values(), *LOADING):
        floats = cfg.shared_floats()
        assert 4 * sum(floats.values()) == cfg.shared_bytes() == cfg.static_bytes() + cfg.dynamic_bytes()
        assert cfg.dynamic_bytes() == 4 * floats["kv"]
        assert all(n % VEC == 0 for name, n in floats.items() if name != "red")   # tiles start 16-byte aligned
        # rows hold the head dim (Q, K) or the keys (P) plus padding that keeps them 16-byte aligned
        assert cfg.q_stride == cfg.k_stride >= cfg.d_pad and cfg.p_stride >= cfg.block_n
        assert cfg.q_stride % VEC == 0 and cfg.p_stride % VEC == 0 and cfg.red_stride > cfg.threads_n
        k_rows, v_rows = cfg.block_n * cfg.k_stride, cfg.block_n * cfg.d_pad
        assert floats["kv"] == (max(k_rows, v_rows) if cfg.share_kv else k_rows + v_rows)
        # V after K in its own buffer, or over K when they take turns; either way inside the K/V tile
        assert cfg.v_at == (0 if cfg.share_kv else k_rows) and cfg.v_at + v_rows <= floats["kv"]


@pytest.mark.slow   # 128 Python threads a block in the simulator: seconds per launch
@pytest.mark.parametrize("cfg", [nt.GPU_CONFIGS[64], SMALL_SHARED_CONFIGS[64]], ids=["tuned", "small-shared"])
def test_gpu_tile_shape_matches_reference(cfg):
    q, k, v = random_qkv(1, 2, 70, 45, 64, kv_heads=1, seed=3)
    _launch_matches_reference(cfg, q, k, v, fa_lab.make_spec(q, k, v, causal=True))


def test_a_gpu_with_less_shared_memory_gets_a_shape_that_fits():
    h100, turing = 227 * 1024, 64 * 1024                 # what a block may opt in to on each
    for bucket, tuned in nt.GPU_CONFIGS.items():
        assert gpu_config(bucket, h100) == tuned
        small = gpu_config(bucket, turing)
        assert small.shared_bytes() <= turing and small.d_pad == bucket
        # every shipped shape also fits the 48 KiB every GPU gives without the opt-in
        assert gpu_config(bucket, STATIC_SHARED_LIMIT).shared_bytes() <= STATIC_SHARED_LIMIT
    assert gpu_config(64, turing) == SMALL_SHARED_CONFIGS[64] != nt.GPU_CONFIGS[64]
    with pytest.raises(ValueError, match="this GPU allows 16384"):
        gpu_config(128, 16 * 1024)


@pytest.mark.slow   # the steps' fast-tier case is tests/test_attention.py's STEP_SHAPE, under every mask
@pytest.mark.parametrize("name", STEPS[:-1])
@pytest.mark.parametrize("case", [CASES[3], CASES[6]], ids=[_id(CASES[3]), _id(CASES[6])])
def test_steps_match_reference(name, case):
    B, H, Hkv, Nq, Nk, D, mask = case
    q, k, v = random_qkv(B, H, Nq, Nk, D, kv_heads=Hkv, seed=5)
    o, lse = fa_lab.attention(q, k, v, impl=name, return_lse=True, **mask)
    ref_o, ref_lse = reference_attention(q, k, v, fa_lab.make_spec(q, k, v, **mask))
    assert_close(o, ref_o, torch.float32, what=f"{name} O")
    assert_close(lse, ref_lse, torch.float32, what=f"{name} lse")


@pytest.mark.skipif(fa_lab.ON_GPU, reason="about the Numba CUDA simulator")
def test_threads_of_a_simulated_block_share_its_shared_arrays(monkeypatch):
    # The simulator plays each CUDA thread with a Python thread, and each thread fetches the block's
    # shared arrays itself when it first reaches them.  A thread switch at that moment must not give two
    # threads two different arrays (each would see only the part of a tile it loaded itself).  Left to
    # chance such a switch hits about 1 launch in 1000; an np.empty that yields the GIL makes it happen
    # in most launches, so a few launches would fail unless the arrays are handed out atomically.
    real_empty = np.empty

    def yielding_empty(*args, **kwargs):
        time.sleep(0)   # let the block's other threads run here
        return real_empty(*args, **kwargs)

    q, k, v = random_qkv(1, 2, 7, 2, 16, seed=0)   # 2 query tiles, one key tile, a tail on each side
    ref_o, ref_lse = reference_attention(q, k, v, fa_lab.make_spec(q, k, v))
    monkeypatch.setattr(np, "empty", yielding_empty)
    for name in ("numba_tiled", "numba_smem"):      # both chapter 3 kernels with shared memory
        for _ in range(6):
            o, lse = fa_lab.attention(q, k, v, impl=name, return_lse=True)
            assert_close(o, ref_o, torch.float32, what=f"{name} O")
            assert_close(lse, ref_lse, torch.float32, what=f"{name} lse")


def test_steps_are_registered_for_chapter_3():
    assert STEPS == ["numba_rowwise", "numba_smem", "numba_regtile", "numba_tiled"]
    for name in STEPS:
        impl = fa_lab.get_implementation(name)
        assert impl.chapter == 3 and impl.head_dims == (1, 128) and impl.dtype_names == ["float32"]


def test_scale_is_respected():
    q, k, v = random_qkv(1, 1, 7, 9, 16, seed=2)
    o = fa_lab.attention(q, k, v, impl="numba_tiled", scale=0.3)
    ref_o, _ = reference_attention(q, k, v, fa_lab.make_spec(q, k, v, scale=0.3))
    assert_close(o, ref_o, torch.float32)


def test_masked_tiles_are_skipped_not_computed():
    # Window (2, 0): query block 0 (rows 0-3) never needs the last key tile.  Poison that tile's V
    # with NaN: the skipping kernel never loads it for those rows; the step that computes every
    # tile and masks the scores afterwards multiplies 0 by NaN and poisons every row.
    cfg = nt.config_for(16)
    n = 10 * cfg.block_n
    q, k, v = random_qkv(1, 1, n, n, 16, seed=3)
    v[0, 0, -1] = float("nan")
    mask = dict(window=(2, 0))
    o_skip = fa_lab.attention(q, k, v, impl="numba_tiled", **mask)
    o_all = fa_lab.attention(q, k, v, impl="numba_regtile", **mask)
    last_tile = n - cfg.block_n
    first_clean = last_tile - cfg.block_m   # rows whose block reaches the last tile
    assert torch.isfinite(o_skip[0, 0, :first_clean]).all()
    assert torch.isnan(o_all[0, 0, :first_clean]).any()


def test_head_dim_over_128_is_refused_clearly():
    q, k, v = random_qkv(1, 1, 4, 4, 129, seed=0)
    with pytest.raises(ValueError, match="head dims 1..128"):
        fa_lab.attention(q, k, v, impl="numba_tiled")
    with pytest.raises(ValueError, match="head dims 1..128"):
        nt.launch_tiled(q, k, v, fa_lab.make_spec(q, k, v))
    with pytest.raises(ValueError, match="head dims"):
        fa_lab.attention(q, k, v, impl="numba_rowwise")


def test_fp16_is_refused_not_converted():
    q, k, v = random_qkv(1, 1, 4, 4, 16, dtype=torch.float16, seed=0)
    with pytest.raises(ValueError, match="supports dtypes"):
        fa_lab.attention(q, k, v, impl="numba_tiled")


@pytest.mark.parametrize("d,bucket", [(1, 16), (16, 16), (17, 32), (64, 64), (65, 128), (128, 128)])
def test_head_dim_buckets(d, bucket):
    assert nt.head_dim_bucket(d) == bucket
    assert nt.config_for(d).d_pad == bucket


def test_tile_configs_are_consistent():
    for world_configs in (nt.CPU_CONFIGS, nt.GPU_CONFIGS):
        for d, cfg in world_configs.items():
            cfg.check()
            assert cfg.d_pad == d and cfg.shared_bytes() <= nt.SHARED_LIMIT
    # the simulator runs a Python thread per CUDA thread: keep its blocks tiny
    assert all(cfg.threads <= 8 for cfg in nt.CPU_CONFIGS.values())
    with pytest.raises(ValueError, match="shared memory"):
        nt.TileConfig(256, 128, 16, 16, 128).check()      # 420 KiB: more than a block can opt in to
    with pytest.raises(ValueError, match="multiple"):
        nt.TileConfig(64, 30, 16, 8, 64).check()
    with pytest.raises(ValueError, match="block_n\\*d_pad=128 must be a multiple of 256"):
        nt.TileConfig(64, 8, 64, 4, 16).check()   # 256 threads, 128 K elements a tile: LOADS would be 0
    # the inner loops read runs of VEC = 4 floats: a thread's features and a P row's keys come in fours
    with pytest.raises(ValueError, match="d_pad=16 must be a multiple of 32"):
        nt.TileConfig(64, 32, 16, 8, 16).check()
    with pytest.raises(ValueError, match="block_n=18 must be a multiple of 4"):
        nt.TileConfig(64, 18, 32, 2, 16).check()
    with pytest.raises(ValueError, match="threads_n=3 must divide 32"):
        nt.TileConfig(64, 24, 16, 3, 96).check()


def test_hbm_traffic_model():
    def spec(causal):
        t = torch.empty(1, 16, 4096, 64, device="meta")   # shapes only: no memory, no kernel
        return fa_lab.make_spec(t, t, t, causal=causal)

    full, causal = nt.hbm_bytes(spec(False), 64, 32), nt.hbm_bytes(spec(True), 64, 32)
    # K and V are re-read once per query tile: 64 tiles x 4096 keys x 64 dims x 4 bytes x 2, per head
    assert full["kv"] == 64 * 4096 * 64 * 4 * 2 * 16
    assert full["s_and_p"] == 0
    # under a causal mask a query tile reads only the key tiles up to its diagonal: about half
    assert 0.45 < causal["kv"] / full["kv"] < 0.55


@pytest.mark.gpu
def test_numba_tiled_on_gpu_large():
    q, k, v = random_qkv(2, 8, 1000, 1537, 64, kv_heads=2, seed=1)
    for mask in (dict(), dict(causal=True), dict(window=(200, 10))):
        o, lse = fa_lab.attention(q, k, v, impl="numba_tiled", return_lse=True, **mask)
        ref_o, ref_lse = reference_attention(q, k, v, fa_lab.make_spec(q, k, v, **mask))
        assert_close(o, ref_o, torch.float32)
        assert_close(lse, ref_lse, torch.float32)
        assert math.isfinite(float(o.abs().max()))
