"""Chapter 3's exercises: the solutions are the kernel's logic, and learner-style wrong answers fail.

Together, the three warm-up solutions are the tiled forward: mask each tile (3.1), visit only the
tiles the block can see (3.2), fold each tile into (m_i, l_i, acc) (3.3) — which must reproduce the
float64 reference, exactly as ``numba_tiled`` does.  The two kernel exercises (3.4, 3.5): their
model answers get full marks, and learner-style wrong kernels fail with the feedback a learner
should see — a named mistake, or the per-thread load counts of the simulator.
"""
import math

import numpy as np
import pytest
import torch
from numba import cuda, float32

import fa_lab
from fa_lab.core.masks import block_key_range
from fa_lab.core.reference import reference_attention
from fa_lab.core.testing import assert_close
from fa_lab.core.world import ON_GPU
from fa_lab.exercises import get
from fa_lab.exercises.ch3 import key_tiles, tile_mask, tile_update
from fa_lab.exercises.ch3_kernels import BLOCK_M, BLOCK_N, D_MAX
from fa_lab.exercises.ch3_occupancy import blocks_per_sm
from fa_lab.exercises.runner import run_check
from fa_lab.exercises.sim_counts import MemoryCounter, tiles_needed

simulator_only = pytest.mark.skipif(ON_GPU, reason="load counts are taken in the CUDA simulator")

MASKS = [(-1, -1), (-1, 0), (4, 0), (2, 3), (0, 0), (3, -1)]
SHAPES = [(17, 17), (5, 23), (23, 9), (1, 1), (16, 32)]


@pytest.mark.parametrize("n_q,n_k", SHAPES)
@pytest.mark.parametrize("left,right", MASKS)
def test_tiles_of_the_mask_make_the_whole_mask(n_q, n_k, left, right):
    bm, bn = 4, 8
    whole = torch.zeros(-(-n_q // bm) * bm, -(-n_k // bn) * bn, dtype=torch.bool)
    for m0 in range(0, n_q, bm):
        for n0 in range(0, n_k, bn):
            whole[m0:m0 + bm, n0:n0 + bn] = tile_mask(m0, n0, bm, bn, n_q, n_k, left, right)
    assert torch.equal(whole[:n_q, :n_k], fa_lab.visible(n_q, n_k, left, right))
    assert not whole[n_q:].any() and not whole[:, n_k:].any()


@pytest.mark.parametrize("n_q,n_k", SHAPES)
@pytest.mark.parametrize("left,right", MASKS)
def test_key_tiles_are_exactly_the_tiles_with_a_visible_key(n_q, n_k, left, right):
    bm, bn = 4, 8
    ok = fa_lab.visible(n_q, n_k, left, right)
    for m0 in range(0, n_q, bm):
        m1 = min(n_q, m0 + bm)
        needed = [n0 for n0 in range(0, n_k, bn) if ok[m0:m1, n0:n0 + bn].any()]
        assert list(key_tiles(m0, m1, n_q, n_k, left, right, bn)) == needed


@pytest.mark.parametrize("n_q,n_k", SHAPES)
@pytest.mark.parametrize("left,right", MASKS)
def test_the_three_solutions_are_the_tiled_forward(n_q, n_k, left, right):
    g = torch.Generator().manual_seed(n_q * 7 + n_k)
    d, bm, bn = 8, 4, 8
    q, k, v = (torch.randn(1, 1, n, d, generator=g, dtype=torch.float64) for n in (n_q, n_k, n_k))
    o = torch.zeros(n_q, d, dtype=torch.float64)
    lse = torch.full((n_q,), -math.inf, dtype=torch.float64)
    for m0 in range(0, n_q, bm):
        m1 = min(n_q, m0 + bm)
        m_i = torch.full((m1 - m0,), -math.inf, dtype=torch.float64)
        l_i = torch.zeros(m1 - m0, dtype=torch.float64)
        acc = torch.zeros(m1 - m0, d, dtype=torch.float64)
        for n0 in key_tiles(m0, m1, n_q, n_k, left, right, bn):
            n1 = min(n_k, n0 + bn)
            s = q[0, 0, m0:m1] @ k[0, 0, n0:n1].T / math.sqrt(d)
            s = s.masked_fill(~tile_mask(m0, n0, m1 - m0, n1 - n0, n_q, n_k, left, right), -math.inf)
            m_i, l_i, acc = tile_update(m_i, l_i, acc, s, v[0, 0, n0:n1])
        seen = l_i > 0
        o[m0:m1][seen] = acc[seen] / l_i[seen, None]
        lse[m0:m1][seen] = m_i[seen] + torch.log(l_i[seen])
    ref_o, ref_lse = reference_attention(q, k, v, fa_lab.make_spec(q, k, v, window=(left, right)))
    assert_close(o, ref_o[0, 0], torch.float64)
    assert_close(lse, ref_lse[0, 0], torch.float32)


# --------------------------------------------------------------------------- learner-style wrong answers

def mask_forgets_rows_past_n_q(m_start, n_start, block_m, block_n, n_q, n_k, left, right):
    i = torch.arange(m_start, m_start + block_m).unsqueeze(1)
    j = torch.arange(n_start, n_start + block_n).unsqueeze(0)
    diag = i + n_k - n_q
    ok = j < n_k
    if left != -1:
        ok = ok & (j >= diag - left)
    if right != -1:
        ok = ok & (j <= diag + right)
    return ok


def mask_as_ints(m_start, n_start, block_m, block_n, n_q, n_k, left, right):
    i = torch.arange(m_start, m_start + block_m)[:, None]
    j = torch.arange(n_start, n_start + block_n)[None, :]
    diag = i + n_k - n_q
    ok = (i < n_q) & (j < n_k)
    if left >= 0:
        ok = ok & (j >= diag - left)
    if right >= 0:
        ok = ok & (j <= diag + right)
    return ok.int()


def tiles_as_list_without_rounding(m_start, m_end, n_q, n_k, left, right, block_n):
    shift = n_k - n_q
    lo = 0 if left < 0 else max(0, m_start + shift - left)
    hi = n_k if right < 0 else min(n_k, m_end - 1 + shift + right + 1)
    return list(range(lo, hi, block_n))


def tiles_ignoring_the_window(m_start, m_end, n_q, n_k, left, right, block_n):
    hi = n_k if right < 0 else min(n_k, m_end - 1 + n_k - n_q + right + 1)
    return range(0, max(hi, 0), block_n)


def update_without_guard_and_l_rescale(m_i, l_i, acc, s, v_tile):
    m_new = torch.max(m_i, s.max(dim=1).values)
    p = torch.exp(s - m_new[:, None])
    alpha = torch.exp(m_i - m_new)
    return m_new, l_i + p.sum(1), acc * alpha[:, None] + p @ v_tile


def update_in_place_old_max(m_i, l_i, acc, s, v_tile):
    m_new = torch.maximum(m_i, s.amax(1))
    safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
    p = torch.exp(s - safe[:, None])
    alpha = torch.exp(m_i - safe)
    acc = acc * alpha[:, None] + p @ v_tile
    return m_i, l_i * alpha + p.sum(1), acc            # forgets to return the new max


@pytest.mark.parametrize("name,fn,words", [
    ("ch3_tile_mask", mask_forgets_rows_past_n_q, ""),
    ("ch3_tile_mask", mask_as_ints, "dtype"),
    ("ch3_key_tiles", tiles_as_list_without_rounding, "multiples of block_n"),
    ("ch3_key_tiles", tiles_ignoring_the_window, "should be skipped"),
    ("ch3_tile_update", update_without_guard_and_l_rescale, ""),
    ("ch3_tile_update", update_in_place_old_max, "m_i"),
])
def test_wrong_answers_fail_with_feedback(name, fn, words):
    res = run_check(get(name), fn)
    assert res.max_score > 0 and res.score < res.max_score
    failure = res.first_failure["message"]
    assert words in failure, failure


@pytest.mark.parametrize("name", ["ch3_tile_mask", "ch3_key_tiles", "ch3_tile_update", "ch3_tiled_kernel",
                                  "ch3_causal_skip", "ch3_blocks_per_sm"])
def test_every_named_mistake_is_diagnosed(name):
    ex = get(name)
    assert ex.chapter == 3 and len(ex.mistakes) >= 3
    for mistake in ex.mistakes:
        res = run_check(ex, mistake.fn, trusted=True)     # the mistakes are built on the solutions
        assert res.score < res.max_score, mistake.name
        assert any(mistake.name in str(row.get("diagnosis", "")) for row in res.rows), mistake.name


# --------------------------------------------------------------------------- blocks per SM (3.6)

def test_blocks_per_sm_of_the_chapters_tile_shapes():
    # the shapes numba_tiled ships for the H100, by the rules of the exercise: static tiles, the K/V tile dynamic
    from fa_lab.kernels.numba.tile_config import GPU_CONFIGS

    got = {}
    for d, cfg in GPU_CONFIGS.items():
        got[d] = blocks_per_sm(cfg.threads, cfg.max_registers or 255, cfg.static_bytes(), cfg.dynamic_bytes())
    assert got[64] == (3, True)          # 69 KiB and 168 registers: three blocks, and the launch opts in
    assert got[128] == (4, False)
    assert all(blocks >= 3 for blocks, _ in got.values())


@pytest.mark.parametrize("shared,opt_in", [(48 * 1024, False), (48 * 1024 + 4, True), (227 * 1024, True)])
def test_blocks_per_sm_at_the_shared_memory_limits(shared, opt_in):
    blocks, got = blocks_per_sm(128, 32, shared - 4096, 4096)
    assert got == opt_in and blocks == 228 * 1024 // (shared + 1024) >= 1
    assert blocks_per_sm(128, 32, 227 * 1024, 4) == (0, True)      # more than any block may have


def test_blocks_per_sm_accepts_numpy_integers_and_booleans():
    def with_numpy(threads, registers, static_bytes, dynamic_bytes):
        shared = static_bytes + dynamic_bytes
        if shared > 227 * 1024:
            return np.int64(0), np.bool_(True)
        warps = -(-threads // 32)
        counts = [2048 // (32 * warps), 32, 65536 // (registers * 32 * warps), 228 * 1024 // (shared + 1024)]
        return np.min(np.array(counts)), np.bool_(shared > 48 * 1024)

    assert run_check(get("ch3_blocks_per_sm"), with_numpy).passed


def learner_blocks_as_floats(threads, registers, static_bytes, dynamic_bytes):
    shared = static_bytes + dynamic_bytes
    return min(2048 / threads, 32, 65536 / (registers * threads), 228 * 1024 / (shared + 1024)), shared > 48 * 1024


def learner_forgets_the_warp_rounding(threads, registers, static_bytes, dynamic_bytes):
    shared = static_bytes + dynamic_bytes
    if shared > 227 * 1024:
        return 0, True
    return (min(2048 // threads, 32, 65536 // (registers * threads), 228 * 1024 // (shared + 1024)),
            shared > 48 * 1024)


@pytest.mark.parametrize("fn,words", [(learner_blocks_as_floats, "(int, bool)"),
                                      (learner_forgets_the_warp_rounding, "blocks=")])
def test_wrong_blocks_per_sm_fail_with_feedback(fn, words):
    res = run_check(get("ch3_blocks_per_sm"), fn)
    assert res.max_score > 0 and res.score < res.max_score
    assert words in res.first_failure["message"], res.first_failure["message"]


# --------------------------------------------------------------------------- the kernel exercises (3.4, 3.5)

@pytest.mark.parametrize("name", ["ch3_tiled_kernel", "ch3_causal_skip"])
def test_kernel_model_answers_get_full_marks(name):
    ex = get(name)
    assert ex.kind == "numba" and ex.model_answer is not ex.solution
    res = run_check(ex, ex.model_answer)
    assert res.passed, res
    structure = [r for r in res.rows if r["kind"] == "structure" and "K/V loads" in r["case"]]
    assert bool(structure) != ON_GPU      # the load counts are scored in the simulator only


@pytest.mark.parametrize("name", ["ch3_tiled_kernel", "ch3_causal_skip"])
def test_kernel_hints_come_in_three_tiers_and_the_first_gives_nothing_away(name):
    ex = get(name)
    assert len(ex.hints) == 3
    first = ex.hints[0]
    for answer in ("n_k - n_q", "Nk − Nq", "m_end", "range(", "tid + BLOCK_M", "h // "):
        assert answer not in first, answer
    assert "range(" in ex.hints[2]


def test_tiles_needed_are_the_tiles_of_the_blocks_key_range():
    for n_q, n_k in [(16, 16), (13, 13), (8, 20), (11, 6), (1, 1), (5, 40)]:
        for m, bm in enumerate(tiles_needed(n_q, n_k, True, 4, 4, skip=True)):
            lo, hi = block_key_range(4 * m, min(4 * m + 4, n_q), n_q, n_k, -1, 0)
            assert lo == 0 and bm == -(-hi // 4)
        assert tiles_needed(n_q, n_k, True, 4, 4, skip=False) == [-(-n_k // 4)] * -(-n_q // 4)


# Learner-style kernels (top level: the check wants a kernel written outside fa_lab).

def as_numba(t):
    return cuda.as_cuda_array(t) if t.is_cuda else t.numpy()


@cuda.jit
def rowwise_kernel(Q, K, V, O, LSE, group, scale, causal):
    # right values, but every thread reads the keys of its own row from global memory: no tile is shared
    h = cuda.blockIdx.y
    i = cuda.blockIdx.x * BLOCK_M + cuda.threadIdx.x
    n_q, n_k, d_head = Q.shape[1], K.shape[1], Q.shape[2]
    if i >= n_q:
        return
    acc = cuda.local.array(D_MAX, float32)
    for d in range(d_head):
        acc[d] = 0.0
    m_i, l_i = -math.inf, 0.0
    for j in range(min(n_k, i + n_k - n_q + 1) if causal else n_k):
        x = 0.0
        for d in range(d_head):
            x += Q[h, i, d] * K[h // group, j, d]
        x *= scale
        m_new = max(m_i, x)
        alpha, p = math.exp(m_i - m_new), math.exp(x - m_new)
        l_i = l_i * alpha + p
        for d in range(d_head):
            acc[d] = acc[d] * alpha + p * V[h // group, j, d]
        m_i = m_new
    for d in range(d_head):
        O[h, i, d] = acc[d] / l_i if l_i > 0 else 0.0
    LSE[h, i] = m_i + math.log(l_i) if l_i > 0 else -math.inf


TOP_LEFT, TAIL, FIRST_ROW = 1, 2, 3


@cuda.jit
def buggy_tiled_kernel(Q, K, V, O, LSE, group, scale, causal, mistake):
    # a shared-memory tiled kernel (every tile, no skipping) with one of the classic mistakes built in
    h = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    m_start = cuda.blockIdx.x * BLOCK_M
    i = m_start + tid
    n_q, n_k, d_head = Q.shape[1], K.shape[1], Q.shape[2]
    shift = 0 if mistake == TOP_LEFT else n_k - n_q
    k_tile = cuda.shared.array((BLOCK_N, D_MAX), float32)
    v_tile = cuda.shared.array((BLOCK_N, D_MAX), float32)
    acc = cuda.local.array(D_MAX, float32)
    for d in range(d_head):
        acc[d] = 0.0
    m_i, l_i = -math.inf, 0.0
    stop = n_k
    if mistake == FIRST_ROW and causal:
        stop = min(n_k, m_start + shift + 1)       # the block's first row, not its last
    for n_start in range(0, stop, BLOCK_N):
        cuda.syncthreads()
        for e in range(tid, BLOCK_N * d_head, BLOCK_M):
            c, d = e // d_head, e % d_head
            ok = n_start + c < n_k
            k_tile[c, d] = K[h // group, n_start + c, d] if ok else 0.0
            v_tile[c, d] = V[h // group, n_start + c, d] if ok else 0.0
        cuda.syncthreads()
        if i < n_q:
            for c in range(BLOCK_N if mistake == TAIL else min(BLOCK_N, n_k - n_start)):
                if causal and n_start + c > i + shift:
                    continue
                x = 0.0
                for d in range(d_head):
                    x += Q[h, i, d] * k_tile[c, d]
                x *= scale
                m_new = max(m_i, x)
                alpha, p = math.exp(m_i - m_new), math.exp(x - m_new)
                l_i = l_i * alpha + p
                for d in range(d_head):
                    acc[d] = acc[d] * alpha + p * v_tile[c, d]
                m_i = m_new
    if i < n_q:
        for d in range(d_head):
            O[h, i, d] = acc[d] / l_i if l_i > 0 else 0.0
        LSE[h, i] = m_i + math.log(l_i) if l_i > 0 else -math.inf


def _launch(kernel, q, k, v, causal, *extra):
    heads, n_q, d = q.shape
    o = torch.empty_like(q)
    lse = torch.empty(heads, n_q, device=q.device)
    kernel[(math.ceil(n_q / BLOCK_M), heads), BLOCK_M](as_numba(q), as_numba(k), as_numba(v), as_numba(o),
                                                       as_numba(lse), heads // k.shape[0],
                                                       np.float32(1 / math.sqrt(d)), causal, *extra)
    return o, lse


def rowwise_attention(q, k, v, causal=False):
    return _launch(rowwise_kernel, q, k, v, causal)


def tiled_no_skip(q, k, v, causal=False):
    return _launch(buggy_tiled_kernel, q, k, v, causal, 0)


def top_left_attention(q, k, v, causal=False):
    return _launch(buggy_tiled_kernel, q, k, v, causal, TOP_LEFT)


def tail_scored_attention(q, k, v, causal=False):
    return _launch(buggy_tiled_kernel, q, k, v, causal, TAIL)


def first_row_stop_attention(q, k, v, causal=False):
    return _launch(buggy_tiled_kernel, q, k, v, causal, FIRST_ROW)


@pytest.mark.parametrize("name,fn,words", [
    ("ch3_tiled_kernel", top_left_attention, "a top-left causal mask"),
    ("ch3_tiled_kernel", tail_scored_attention, "the keys past Nk scored"),
    ("ch3_causal_skip", first_row_stop_attention, "the tile loop stops at the block's first row"),
])
def test_wrong_kernels_are_named(name, fn, words):
    res = run_check(get(name), fn, seeds=(0,))
    assert res.score < res.max_score
    diagnoses = [str(r.get("diagnosis") or "") for r in res.rows if not r["passed"]]
    assert any(words in d for d in diagnoses), res


@simulator_only
def test_a_kernel_that_loads_k_per_row_is_told_so_with_per_thread_counts():
    res = run_check(get("ch3_tiled_kernel"), rowwise_attention, seeds=(0,))
    values = [r for r in res.rows if r["kind"] == "values"]
    assert values and all(r["passed"] for r in values)          # right numbers ...
    failure = res.first_failure["message"]                       # ... loaded the wrong way
    assert "once per query block" in failure, failure
    assert "K 8×" in failure and "is 2×" in failure, failure     # 8 rows each read all of K; 2 blocks
    assert "thread  query row" in failure and "shared reads" in failure, failure


@simulator_only
def test_a_kernel_that_loads_every_tile_fails_the_skip_with_the_tiles_per_block():
    res = run_check(get("ch3_causal_skip"), tiled_no_skip, seeds=(0,))
    values = [r for r in res.rows if r["kind"] == "values"]
    assert values and all(r["passed"] for r in values)
    failure = res.first_failure["message"]
    assert "only the key tiles" in res.first_failure["case"] and "10 of the 16" in failure, failure
    assert "more than needed" in failure, failure
    skip_rows = [r for r in res.rows if "K/V loads" in r["case"]]
    assert skip_rows and not any(r["passed"] for r in skip_rows)


@cuda.jit
def _swap_through_shared(X, Y):
    buf = cuda.shared.array(4, float32)
    t = cuda.threadIdx.x
    buf[t] = X[cuda.blockIdx.x, t]
    cuda.syncthreads()
    Y[cuda.blockIdx.x, t] = buf[3 - t] + buf[t]


@simulator_only
def test_the_counter_sees_every_access_of_every_thread():
    x = torch.randn(2, 4)
    y = torch.zeros(2, 4)
    with MemoryCounter() as counter:
        _swap_through_shared[2, 4](x.numpy(), y.numpy())
    assert torch.equal(y, x + x.flip(1))
    counts = counter.per_thread({"X": counter.match(x.numpy())})
    assert len(counts) == 8
    for c in counts.values():
        assert (c["X"], c["global writes"], c["shared writes"], c["shared reads"]) == (1, 1, 1, 2)
    assert counter.launch_shape() == ((2, 1, 1), (4, 1, 1))
