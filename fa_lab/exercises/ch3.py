"""Chapter 3 exercises, the warm-ups: the decisions inside the tiled kernel's loop, in PyTorch.

On small tensors (milliseconds on any machine):

1. ``ch3_tile_mask``    which entries of one (BLOCK_M x BLOCK_N) score tile are visible: the
                        causal / window mask *and* the tails past ``Nq`` and ``Nk``;
2. ``ch3_key_tiles``    which key tiles a query block must visit at all (masked-tile skipping);
3. ``ch3_tile_update``  the online-softmax update of (m_i, l_i, acc) with one tile of scores.

The kernels that put these decisions together, in Numba CUDA, are the exercises of ``ch3_kernels``.
"""
from __future__ import annotations

import torch

from fa_lab.exercises.registry import Case, Exercise, Mistake, register_exercise

# --------------------------------------------------------------------------- solutions

def tile_mask(m_start, n_start, block_m, block_n, n_q, n_k, left, right):
    """Boolean (block_m, block_n): True where query ``m_start + r`` may see key ``n_start + c``.

    Bottom-right alignment (query i sits at key i + n_k - n_q); window ``(left, right)`` with
    -1 for unbounded (causal is ``(-1, 0)``); rows past ``n_q`` and keys past ``n_k`` are False.
    """
    i = torch.arange(m_start, m_start + block_m)[:, None]
    j = torch.arange(n_start, n_start + block_n)[None, :]
    diag = i + (n_k - n_q)
    ok = (i < n_q) & (j < n_k)
    if left >= 0:
        ok = ok & (j >= diag - left)
    if right >= 0:
        ok = ok & (j <= diag + right)
    return ok


def key_tiles(m_start, m_end, n_q, n_k, left, right, block_n):
    """The key tiles the query rows ``[m_start, m_end)`` must visit: ``range(first, stop, block_n)``.

    Exactly the tiles that hold at least one key some row of the block may see; tiles start
    at multiples of ``block_n``.  Empty when no row of the block sees any key.
    """
    shift = n_k - n_q
    lo = 0 if left < 0 else max(0, m_start + shift - left)              # the first row sees the least far back
    hi = n_k if right < 0 else min(n_k, m_end - 1 + shift + right + 1)  # the last row sees the furthest ahead
    if hi <= lo:
        return range(0)
    return range(lo // block_n * block_n, hi, block_n)


def tile_update(m_i, l_i, acc, s, v_tile):
    """One step of the tile loop: fold a tile of scores ``s`` (rows, keys) into the state.

    ``m_i`` (rows,) running max, ``l_i`` (rows,) running sum of exp(s - m_i), ``acc`` (rows, D)
    running sum of exp(s - m_i) · v.  Masked scores are -inf; a row with no finite score so
    far has m_i = -inf, l_i = 0, acc = 0 and must stay that way (never NaN).
    Returns the new ``(m_i, l_i, acc)``.
    """
    m_new = torch.maximum(m_i, s.amax(dim=1))
    m_use = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)   # nothing visible yet: exp(-inf) = 0
    alpha = torch.exp(m_i - m_use)
    p = torch.exp(s - m_use[:, None])
    return m_new, l_i * alpha + p.sum(dim=1), acc * alpha[:, None] + p @ v_tile


# --------------------------------------------------------------------------- cases

def _mask_cases(seed):
    g = torch.Generator().manual_seed(seed)
    bm, bn = (4, 8) if seed % 2 else (8, 4)
    specs = [  # m_start, n_start, n_q, n_k, left, right, note
        (0, 0, 16, 16, -1, 0, "causal, diagonal tile"),
        (8, 0, 16, 16, -1, 0, "causal, tile below the diagonal (all visible)"),
        (0, 8, 16, 16, -1, 0, "causal, tile above the diagonal (all masked)"),
        (8, 16, 13, 19, -1, -1, "no mask, tail tile: rows past n_q, keys past n_k"),
        (0, 4, 5, 23, -1, 0, "causal, Nq < Nk (decoding-like)"),
        (16, 0, 23, 9, -1, 0, "causal, Nq > Nk: early rows see no key"),
        (4, 4, 20, 20, 2, 1, "window (2, 1)"),
        (8, 0, 12, 30, 3, -1, "window (3, -1): only a left bound"),
        (0, 0, 1, 1, -1, 0, "N = 1"),
    ]
    cases = []
    for m0, n0, nq, nk, left, right, note in specs:
        label = f"m_start={m0} n_start={n0} tile {bm}x{bn} n_q={nq} n_k={nk} window=({left}, {right}) — {note}"
        cases.append(Case(label,
                          (m0, n0, bm, bn, nq, nk, left, right),
                          meta=dict(n_q=nq, n_k=nk, window=(left, right))))
    nq, nk = (int(x) for x in torch.randint(3, 40, (2,), generator=g))
    m0 = int(torch.randint(0, nq, (1,), generator=g)) // bm * bm
    n0 = int(torch.randint(0, nk, (1,), generator=g)) // bn * bn
    cases.append(Case(f"random: m_start={m0} n_start={n0} n_q={nq} n_k={nk} window=(5, 2)",
                      (m0, n0, bm, bn, nq, nk, 5, 2), meta=dict(n_q=nq, n_k=nk, window=(5, 2))))
    return cases


def _tiles_cases(seed):
    g = torch.Generator().manual_seed(seed)
    bn = 8 if seed % 2 else 16
    specs = [  # m_start, m_end, n_q, n_k, left, right, note
        (0, 16, 64, 64, -1, -1, "no mask: every tile"),
        (0, 16, 64, 64, -1, 0, "causal, first query block"),
        (48, 64, 64, 64, -1, 0, "causal, last query block"),
        (16, 32, 50, 50, -1, 0, "causal, the diagonal ends inside a tile"),
        (0, 16, 16, 100, -1, 0, "causal, Nq < Nk: the block sits at the end of the keys"),
        (0, 16, 100, 20, -1, 0, "causal, Nq > Nk: no row of this block sees a key"),
        (32, 48, 64, 64, 10, 0, "window (10, 0): a band near the diagonal"),
        (32, 48, 64, 64, 3, 20, "window (3, 20)"),
        (0, 5, 5, 37, -1, -1, "no mask, a tail tile"),
        (0, 1, 1, 1, -1, 0, "N = 1"),
    ]
    cases = []
    for m0, m1, nq, nk, left, right, note in specs:
        cases.append(Case(f"rows [{m0}, {m1}) n_q={nq} n_k={nk} window=({left}, {right}) block_n={bn} — {note}",
                          (m0, m1, nq, nk, left, right, bn),
                          meta=dict(n_q=nq, n_k=nk, window=(left, right), block_n=bn)))
    nq = int(torch.randint(20, 90, (1,), generator=g))
    m0 = int(torch.randint(0, nq - 8, (1,), generator=g))
    cases.append(Case(f"random: rows [{m0}, {m0 + 8}) n_q={nq} n_k={nq} window=(7, 3) block_n={bn}",
                      (m0, m0 + 8, nq, nq, 7, 3, bn), meta=dict(n_q=nq, n_k=nq, window=(7, 3), block_n=bn)))
    return cases


def _update_cases(seed):
    g = torch.Generator().manual_seed(seed)
    rows, keys, d = 6, 5, 8
    ninf = float("-inf")

    def state(scale=3.0):
        x = torch.randn(rows, 9, generator=g) * scale
        m = x.amax(1)
        e = torch.exp(x - m[:, None])
        return m, e.sum(1), e @ torch.randn(9, d, generator=g)

    cases = []
    v = torch.randn(keys, d, generator=g)
    empty = (torch.full((rows,), ninf), torch.zeros(rows), torch.zeros(rows, d))
    cases.append(Case("first tile: state empty (m=-inf, l=0, acc=0)",
                      (*empty, torch.randn(rows, keys, generator=g) * 3, v)))
    cases.append(Case("random state and tile", (*state(), torch.randn(rows, keys, generator=g) * 3, v)))
    m, l, acc = state()
    cases.append(Case("the tile raises every row's max (by ~20)",
                      (m, l, acc, m[:, None] + 20 + torch.rand(rows, keys, generator=g), v)))
    s = torch.randn(rows, keys, generator=g) * 3
    s[:, 2:] = ninf
    s[1] = ninf
    cases.append(Case("a masked tile edge, and a row fully masked in this tile", (*state(), s, v)))
    s = torch.randn(rows, keys, generator=g) * 3
    s[::2] = ninf
    cases.append(Case("rows that saw no key so far and see none here stay empty (no NaN)", (*empty, s, v)))
    m, l, acc = state(scale=50.0)
    cases.append(Case("state and tile maxima far apart (±150)",
                      (m * 3, l, acc, -m[:, None] * 3 + torch.randn(rows, keys, generator=g), v)))
    return cases


# --------------------------------------------------------------------------- judges and typical mistakes

def _compare_tiles(got, expected, case):
    if not isinstance(got, (range, list, tuple)):
        forgot = " (None: did you forget the `return`?)" if got is None else ""
        raise AssertionError("expected a range of tile starts (e.g. range(first, stop, block_n)), "
                             f"got {type(got).__name__}{forgot}")
    got_l, exp_l = [int(x) for x in got], list(expected)
    if got_l == exp_l:
        return
    missing = sorted(set(exp_l) - set(got_l))
    extra = sorted(set(got_l) - set(exp_l))
    bn = case.args[-1]
    msg = f"tile starts {got_l}, expected {exp_l}"
    if missing:
        msg += f"; missing {missing}: a row of the block sees a key in those tiles"
    if extra:
        msg += f"; extra {extra}: no row of the block sees any key there (those tiles should be skipped)"
    if any(x % bn for x in got_l):
        msg += f"; tiles start at multiples of block_n={bn}: round the first key down"
    raise AssertionError(msg)


def _mask_top_left(m_start, n_start, block_m, block_n, n_q, n_k, left, right):
    return tile_mask(m_start, n_start, block_m, block_n, n_k, n_k, left, right) & \
        tile_mask(m_start, n_start, block_m, block_n, n_q, n_k, -1, -1)


def _mask_no_tails(m_start, n_start, block_m, block_n, n_q, n_k, left, right):
    big = max(n_q, n_k) + block_m + block_n + m_start + n_start
    i = torch.arange(m_start, m_start + block_m)[:, None]
    j = torch.arange(n_start, n_start + block_n)[None, :]
    diag = i + (n_k - n_q)
    ok = torch.ones(block_m, block_n, dtype=torch.bool) & (i < big)
    if left >= 0:
        ok = ok & (j >= diag - left)
    if right >= 0:
        ok = ok & (j <= diag + right)
    return ok


def _mask_strict_window(m_start, n_start, block_m, block_n, n_q, n_k, left, right):
    ok = tile_mask(m_start, n_start, block_m, block_n, n_q, n_k, left, right)
    i = torch.arange(m_start, m_start + block_m)[:, None]
    j = torch.arange(n_start, n_start + block_n)[None, :]
    diag = i + (n_k - n_q)
    if right >= 0:
        ok = ok & (j < diag + right)
    return ok


def _tiles_no_skip(m_start, m_end, n_q, n_k, left, right, block_n):
    return range(0, n_k, block_n)


def _tiles_unaligned(m_start, m_end, n_q, n_k, left, right, block_n):
    r = key_tiles(m_start, m_end, n_q, n_k, left, right, block_n)
    if len(r) == 0:
        return r
    shift = n_k - n_q
    lo = 0 if left < 0 else max(0, m_start + shift - left)
    return range(lo, r.stop, block_n)


def _tiles_first_row_only(m_start, m_end, n_q, n_k, left, right, block_n):
    return key_tiles(m_start, m_start + 1, n_q, n_k, left, right, block_n)


def _tiles_top_left(m_start, m_end, n_q, n_k, left, right, block_n):
    lo = 0 if left < 0 else max(0, m_start - left)
    hi = n_k if right < 0 else min(n_k, m_end + right)
    return range(lo // block_n * block_n, hi, block_n) if hi > lo else range(0)


def _update_no_acc_rescale(m_i, l_i, acc, s, v_tile):
    m_new, l_new, _ = tile_update(m_i, l_i, acc, s, v_tile)
    m_use = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
    return m_new, l_new, acc + torch.exp(s - m_use[:, None]) @ v_tile


def _update_tile_max(m_i, l_i, acc, s, v_tile):
    m_new = s.amax(dim=1)
    m_use = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
    alpha = torch.exp(m_i - m_use)
    p = torch.exp(s - m_use[:, None])
    return m_new, l_i * alpha + p.sum(dim=1), acc * alpha[:, None] + p @ v_tile


def _update_nan(m_i, l_i, acc, s, v_tile):
    m_new = torch.maximum(m_i, s.amax(dim=1))
    alpha = torch.exp(m_i - m_new)
    p = torch.exp(s - m_new[:, None])
    return m_new, l_i * alpha + p.sum(dim=1), acc * alpha[:, None] + p @ v_tile


register_exercise(Exercise(
    name="ch3_tile_mask", chapter=3, title="Masking one tile (causal, window, tails)",
    signature="tile_mask(m_start, n_start, block_m, block_n, n_q, n_k, left, right) -> bool Tensor (block_m, block_n)",
    solution=tile_mask, make_cases=_mask_cases, outputs=("mask",),
    hints=("A tile is a window onto the full mask: first work out which query row and which key each entry "
           "stands for, then apply the rules of chapter 1 — and remember the tile can hang over the edges.",
           "Row r of the tile is query i = m_start + r, column c is key j = n_start + c; query i sits at key "
           "diag = i + n_k − n_q.",
           "Keep j in [diag − left, diag + right] (a −1 bound is no bound), and i < n_q, j < n_k."),
    mistakes=(Mistake("a top-left mask", _mask_top_left,
                      "query i sits at key position i + n_k − n_q (bottom-right alignment), not at key i."),
              Mistake("tails not masked", _mask_no_tails,
                      "a tile that runs past the end holds rows ≥ n_q and keys ≥ n_k: they are never visible "
                      "(in the kernel those keys are zero padding, and they must not get softmax weight)."),
              Mistake("a strict inequality on the right", _mask_strict_window,
                      "the window is inclusive: key j is visible when j <= diag + right (right = 0 is causal: "
                      "a query sees its own key).")),
))
register_exercise(Exercise(
    name="ch3_key_tiles", chapter=3, title="Which key tiles a query block visits",
    signature="key_tiles(m_start, m_end, n_q, n_k, left, right, block_n) -> range of tile starts",
    solution=key_tiles, make_cases=_tiles_cases, compare=_compare_tiles,
    hints=("Which row of the block sees furthest back, and which sees furthest ahead? Only those two rows "
           "decide the range.",
           "The first row sees back to lo = m_start + n_k − n_q − left, the last row ahead to "
           "hi = m_end − 1 + n_k − n_q + right + 1 (a −1 bound means no bound on that side).",
           "Clip to [0, n_k], round lo down to a multiple of block_n, return range(lo, hi, block_n) "
           "(empty if hi <= lo)."),
    mistakes=(Mistake("every tile visited", _tiles_no_skip,
                      "correct attention, but the tiles that no row of the block can see are computed and thrown "
                      "away: loop only from the block's first visible key to its last."),
              Mistake("tiles not aligned to block_n", _tiles_unaligned,
                      "the K/V tiles start at multiples of block_n: round the first visible key down."),
              Mistake("bounds from the first row only", _tiles_first_row_only,
                      "the last row of the block sees further ahead than the first: take hi from row m_end − 1."),
              Mistake("a top-left alignment", _tiles_top_left,
                      "query i sits at key position i + n_k − n_q (bottom-right alignment).")),
))
register_exercise(Exercise(
    name="ch3_tile_update", chapter=3, title="The online-softmax update of one tile",
    signature="tile_update(m_i, l_i, acc, s, v_tile) -> (m_i, l_i, acc)",
    solution=tile_update, make_cases=_update_cases, outputs=("m_i", "l_i", "acc"), judge_dtype=torch.float64,
    hints=("This is chapter 2's one-pass update, one tile at a time: what must happen to l_i and acc when the "
           "running max grows?",
           "m_new = max(m_i, row max of s); everything summed so far is rescaled by alpha = exp(m_i − m_new).",
           "p = exp(s − m_new); l = l·alpha + Σp; acc = acc·alpha + p @ v_tile. Where m_new is −inf use 0 in the "
           "exps, so empty rows stay (−inf, 0, 0)."),
    mistakes=(Mistake("missing rescale of acc", _update_no_acc_rescale,
                      "acc was accumulated relative to the old max: multiply it by alpha = exp(m_old − m_new) too."),
              Mistake("the tile's max instead of the running max", _update_tile_max,
                      "m_new = max(m_i, max of this tile): a tile whose scores are all smaller must not lower it."),
              Mistake("NaN for rows that see nothing yet", _update_nan,
                      "with m_i = −inf and a fully masked row, exp(−inf − (−inf)) is NaN: use 0 as the max of a "
                      "row that has seen nothing (the kernel does the same with m_use).")),
))
