"""Chapter 3's exercises: the solutions are the kernel's logic, and learner-style wrong answers fail.

Together, the three solutions are the tiled forward: mask each tile (3.1), visit only the tiles
the block can see (3.2), fold each tile into (m_i, l_i, acc) (3.3) — which must reproduce the
float64 reference, exactly as ``numba_tiled`` does.
"""
import math

import pytest
import torch

import fa_lab
from fa_lab.core.reference import reference_attention
from fa_lab.core.testing import assert_close
from fa_lab.exercises import check, get
from fa_lab.exercises.ch3 import key_tiles, tile_mask, tile_update

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
    return tile_mask(m_start, n_start, block_m, block_n, n_q, n_k, left, right).int()


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
    res = check(name, fn)
    assert res.max_score > 0 and res.score < res.max_score
    failure = res.first_failure["message"]
    assert words in failure, failure


@pytest.mark.parametrize("name", ["ch3_tile_mask", "ch3_key_tiles", "ch3_tile_update"])
def test_every_named_mistake_is_diagnosed(name):
    ex = get(name)
    assert ex.chapter == 3 and len(ex.mistakes) >= 3
    for mistake in ex.mistakes:
        res = check(name, mistake.fn)
        assert res.score < res.max_score, mistake.name
        assert any(mistake.name in str(row.get("diagnosis", "")) for row in res.rows), mistake.name
