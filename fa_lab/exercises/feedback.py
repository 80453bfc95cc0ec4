"""Feedback that teaches: what is wrong, where, and the usual reason.

``compare_tensor`` judges one result tensor and, when it is off, raises a ``Mismatch``
(an ``AssertionError``) that carries the worst element, the tile / program id it belongs
to, the rows that are wrong and a short diagnosis ("every wrong row is a row that sees
no key", "this is log2, not ln").  ``heatmap_png`` draws expected | got | error for the
2-D slice around the worst element, with the tile grid on top; it is only called when a
result is displayed as HTML, so a passing check costs nothing.
"""
from __future__ import annotations

import base64
import io
import math
import warnings

import torch

from fa_lab.core.masks import effective_window, key_range
from fa_lab.core.testing import tolerance

LN2 = math.log(2.0)
_CROP = 48  # the heatmap shows at most a 48 x 48 window around the worst element


class Mismatch(AssertionError):
    """Wrong numbers in one result tensor; the message teaches, the fields feed the heatmap."""

    def __init__(self, message: str, *, what: str, index: tuple, got=None, expected=None,
                 origin=(0, 0), tile=(None, None), key_cols: bool = False, one_d: bool = False, summary: str = ""):
        super().__init__(message)
        self.summary = summary    # one line for a table row
        self.what = what
        self.index = index
        self.got = got            # 2-D float64 slice (or None)
        self.expected = expected
        self.origin = origin      # (row, col) of the slice's top-left element in the full tensor
        self.tile = tile          # (BLOCK_M, BLOCK_N) or Nones
        self.key_cols = key_cols  # columns are keys (tile lines every BLOCK_N)
        self.one_d = one_d        # a 1-D result (e.g. lse) drawn as one row: columns are query rows


# --------------------------------------------------------------------------- small helpers

def ranges(ix) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8' (shortened when long)."""
    ix = sorted(set(int(i) for i in ix))
    parts, start, prev = [], None, None
    for i in ix:
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = i
    if start is not None:
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ", ".join(parts[:6]) + (f", … ({len(parts) - 6} more runs)" if len(parts) > 6 else "")


def _window(meta: dict):
    """(left, right) from a case's meta (``causal`` and/or ``window``), or None if unknown."""
    if "causal" not in meta and "window" not in meta:
        return None
    return effective_window(bool(meta.get("causal", False)), tuple(meta.get("window", (-1, -1))))


def empty_rows(meta: dict) -> list[int]:
    """Query rows that see no key under the case's mask (needs meta n_q, n_k and the mask)."""
    win = _window(meta)
    if win is None or "n_q" not in meta or "n_k" not in meta:
        return []
    n_q, n_k = meta["n_q"], meta["n_k"]
    spans = (key_range(i, n_q, n_k, *win) for i in range(n_q))
    return [i for i, (lo, hi) in enumerate(spans) if hi <= lo]


#: results whose rows are keys, not queries (the backward's gradients of K and V)
_KEY_ROWS = ("dk", "dv")


def _row_dim(t: torch.Tensor, what: str = ""):
    """Results are laid out (..., Nq, D), (..., Nq, Nk) or (..., Nq): the row is dim -2, or -1 for 1-D and for
    a per-row result such as lse (..., Nq)."""
    if t.dim() == 0:
        return None
    if what.startswith(("lse", "delta", "m_", "l_")):
        return t.dim() - 1
    return t.dim() - 2 if t.dim() >= 2 else 0


def locate(index: tuple, shape: tuple, *, tile=(None, None), meta: dict | None = None) -> str:
    """Words for where element ``index`` sits: query row, row tile / program id, key tiles it sees."""
    meta = meta or {}
    if not index:
        return ""
    block_m, block_n = tile
    row = index[-2] if len(index) >= 2 else index[-1]
    n_rows = shape[-2] if len(shape) >= 2 else shape[-1]
    bits = []
    if block_m:
        pid = row // block_m
        lo, hi = pid * block_m, min(n_rows, (pid + 1) * block_m)
        tail = " — the tail tile" if hi - lo < block_m else ""
        bits.append(f"query row {row} is in row tile pid_m={pid} (rows {lo}-{hi - 1}){tail}")
    n_k = meta.get("n_k")
    if block_n and n_k:
        if len(shape) >= 2 and shape[-1] == n_k and len(index) >= 2:   # an (Nq, Nk) result: the column is a key
            col = index[-1]
            pid_n = col // block_n
            tail = " — the tail tile" if (pid_n + 1) * block_n > n_k else ""
            last = min(n_k, (pid_n + 1) * block_n) - 1
            bits.append(f"key {col} is in key tile {pid_n} (keys {pid_n * block_n}-{last}){tail}")
        else:
            win = _window(meta)
            n_q = meta.get("n_q", n_rows)
            lo, hi = key_range(row, n_q, n_k, *win) if win else (0, n_k)
            if hi <= lo:
                bits.append(f"query row {row} sees no key")
            else:
                t0, t1 = lo // block_n, (hi - 1) // block_n
                tail = (f"; tile {t1} is a tail tile of {n_k - t1 * block_n} key(s)"
                        if (t1 + 1) * block_n > n_k else "")
                tiles = f"tile {t0}" if t0 == t1 else f"tiles {t0}-{t1}"
                bits.append(f"query row {row} sees keys {lo}-{hi - 1}: key {tiles} of block_n={block_n}{tail}")
    return "; ".join(bits)


# --------------------------------------------------------------------------- the judge

def compare_tensor(got, expected: torch.Tensor, *, what: str, tol_dtype: torch.dtype,
                   expected_dtype: torch.dtype | None = None, strict_dtype: bool = True,
                   tile=(None, None), meta: dict | None = None) -> None:
    """Raise ``AssertionError`` (``Mismatch`` for wrong numbers) unless ``got`` matches ``expected``.

    ``expected`` may be the float64 judge; ``expected_dtype`` is then the dtype the learner
    must return (the solution's output dtype on the real inputs).
    """
    meta = meta or {}
    check_like(got, expected, what=what, expected_dtype=expected_dtype, strict_dtype=strict_dtype)
    got_c, exp_c = got.detach().cpu(), expected.detach().cpu()
    if not exp_c.is_floating_point():                    # bool / integer results: exact
        bad = got_c.to(exp_c.dtype) != exp_c
        if bad.any():
            _raise_mismatch(what, got_c.double(), exp_c.double(), bad, (got_c != exp_c).double(),
                            tol_text="exact match required", tile=tile, meta=meta, exact=True)
        return
    atol, rtol = tolerance(tol_dtype)
    g, e = got_c.double(), exp_c.double()
    same_inf = torch.isinf(g) & torch.isinf(e) & (torch.sign(g) == torch.sign(e))
    both_nan = torch.isnan(g) & torch.isnan(e)
    err = (g - e).abs().masked_fill(same_inf | both_nan, 0.0).nan_to_num(nan=math.inf, posinf=math.inf)
    bad = (err > atol + rtol * e.abs().nan_to_num(posinf=0.0, neginf=0.0)) & ~(same_inf | both_nan)
    if bad.any():
        _raise_mismatch(what, g, e, bad, err, tol_text=f"tolerance for {str(tol_dtype).replace('torch.', '')}: "
                        f"atol={atol:g}, rtol={rtol:g}", tile=tile, meta=meta)


def check_like(got, expected: torch.Tensor, *, what: str, expected_dtype: torch.dtype | None = None,
               strict_dtype: bool = True) -> None:
    """A tensor of ``expected``'s shape, device and dtype, or an ``AssertionError`` that says what differs."""
    expected_dtype = expected.dtype if expected_dtype is None else expected_dtype
    if not isinstance(got, torch.Tensor):
        extra = ""
        if type(got).__module__ == "numpy":
            extra = " (a NumPy array: convert it with torch.from_numpy)"
        elif got is None:
            extra = " (None: did you forget the `return`?)"
        raise AssertionError(f"{what}: expected a torch.Tensor, got {type(got).__name__}{extra}")
    if tuple(got.shape) != tuple(expected.shape):
        hint = ""
        if tuple(got.shape) == tuple(expected.shape)[::-1] and got.dim() > 1:
            hint = " — transposed?"
        elif got.numel() == expected.numel():
            hint = (" — the right number of elements, in the wrong shape "
                    "(a missing keepdim, or a view in the wrong order?)")
        elif [s for s in got.shape if s != 1] == [s for s in expected.shape if s != 1]:
            hint = " — an extra or missing dimension of size 1 (keepdim? squeeze?)"
        raise AssertionError(f"{what}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}{hint}")
    if got.device != expected.device:
        raise AssertionError(f"{what}: on device {got.device}, expected {expected.device} "
                             "(allocate with device=q.device, or compute from the inputs)")
    if got.dtype != expected_dtype:
        both_float = got.is_floating_point() and expected_dtype.is_floating_point
        if strict_dtype or not both_float:
            raise AssertionError(f"{what}: dtype {got.dtype}, expected {expected_dtype} "
                                 "(results keep the inputs' dtype: create buffers with dtype=q.dtype)")


def _raise_mismatch(what, g, e, bad, err, *, tol_text, tile, meta, exact=False):
    n_bad, n = int(bad.sum()), bad.numel()
    masked_err = torch.where(bad, err, torch.full_like(err, -1.0))
    worst = tuple(int(i) for i in torch.unravel_index(torch.argmax(masked_err), bad.shape)) if bad.dim() else ()
    fmt = (lambda x: str(bool(x))) if exact and e.max() <= 1 and e.min() >= 0 else (lambda x: f"{x:.6g}")
    lines = [f"{what}: {n_bad} of {n} elements wrong ({tol_text})."]
    where = locate(worst, tuple(bad.shape), tile=tile, meta=meta)
    at = f"[{', '.join(map(str, worst))}]" if worst else ""
    lines.append(f"Worst at {at}: got {fmt(g[worst].item())}, expected {fmt(e[worst].item())}"
                 + (f" ({where})." if where else "."))
    rd = _row_dim(bad, what)
    bad_rows = []
    if rd is not None and bad.shape[rd] > 1:
        per_row = bad.movedim(rd, 0).reshape(bad.shape[rd], -1).any(dim=1)
        bad_rows = torch.nonzero(per_row).flatten().tolist()
        kind = "key" if what in _KEY_ROWS else "query"
        lines.append(f"Wrong {kind} rows: {ranges(bad_rows)} (of {bad.shape[rd]}).")
    lines += diagnose(g, e, bad, bad_rows, tile=tile, meta=meta)
    # the 2-D slice for the heatmap: the last two dims at the worst element's leading index
    if bad.dim() <= 1:
        gs, es = g.reshape(1, -1), e.reshape(1, -1)
    else:
        gs, es = g[worst[:-2]], e[worst[:-2]]
    r0 = max(0, min((worst[-2] if len(worst) >= 2 else 0) - _CROP // 2, gs.shape[0] - _CROP))
    c0 = max(0, min((worst[-1] if worst else 0) - _CROP // 2, gs.shape[1] - _CROP))
    gs, es = gs[r0:r0 + _CROP, c0:c0 + _CROP].clone(), es[r0:r0 + _CROP, c0:c0 + _CROP].clone()
    key_cols = bool(meta.get("n_k")) and bad.dim() >= 2 and bad.shape[-1] == meta.get("n_k")
    summary = (f"{what}: {n_bad}/{n} wrong, worst {at}: got {fmt(g[worst].item())}, "
               f"expected {fmt(e[worst].item())}")
    raise Mismatch(" ".join(lines), what=what, index=worst, got=gs, expected=es, origin=(r0, c0),
                   tile=tuple(tile), key_cols=key_cols, one_d=bad.dim() == 1, summary=summary)


def diagnose(g, e, bad, bad_rows, *, tile=(None, None), meta=None) -> list[str]:
    """Generic patterns behind wrong numbers; each is one sentence for the learner."""
    meta = meta or {}
    out = []
    nan = torch.isnan(g) & ~torch.isnan(e)
    if nan.any():
        out.append(f"{int(nan.sum())} NaN where a number is expected: the usual causes are exp(−inf − (−inf)) in a "
                   "row or tile where every score is masked, 0/0 when l = 0, or an element that was never "
                   "written (the checker fills torch.empty buffers and output arguments with NaN).")
    fin = bad & torch.isfinite(g) & torch.isfinite(e) & (e.abs() > 1e-6)
    if int(fin.sum()) >= 2 and int(fin.sum()) == int(bad.sum()):
        ratio = g[fin] / e[fin]
        med = float(ratio.median())
        if float((ratio - med).abs().max()) < 1e-3 * abs(med):
            if abs(med - 1 / LN2) < 2e-3:
                out.append("Every wrong value is the expected one divided by ln 2: a base-2 logarithm. The log-sum-exp "
                           "is a natural log; if you used exp2/log2 for speed, multiply by ln 2 at the end.")
            elif abs(med - LN2) < 2e-3:
                out.append("Every wrong value is the expected one times ln 2: a base-2 / natural log mix-up.")
            else:
                out.append(f"Every wrong value is the expected one times {med:.4g}: a missing or extra factor "
                           "(the softmax scale 1/sqrt(D)? a normalisation?).")
    empty = empty_rows(meta)
    if bad_rows and empty and set(bad_rows) <= set(empty):
        out.append(f"Every wrong row sees no key under the mask (rows {ranges(empty)}; with a bottom-right causal mask "
                   "and Nq > Nk the first Nq − Nk queries see nothing): such rows must give o = 0 and lse = −inf.")
    block_m = tile[0] if tile else None
    if bad_rows and block_m and "n_q" in meta and meta["n_q"] % block_m:
        tail_start = meta["n_q"] // block_m * block_m
        if min(bad_rows) >= tail_start:
            out.append(f"Only rows of the last, partial row tile (rows {tail_start}-{meta['n_q'] - 1}) are wrong: "
                       "check the bounds (offs_m < Nq) on the tail tile.")
    return out


# --------------------------------------------------------------------------- the picture

def heatmap_png(m: Mismatch, title: str = "") -> str | None:
    """Base64 PNG: expected | got | |got − expected| around the worst element, tile grid on top."""
    if m.got is None or m.got.numel() == 0:
        return None
    try:
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except Exception:  # no matplotlib: the table alone still teaches
        return None
    e = m.expected.clone()
    g = m.got.clone()
    err = (g - e).abs()
    err[torch.isinf(g) & torch.isinf(e) & (torch.sign(g) == torch.sign(e))] = 0.0
    err = err.nan_to_num(nan=math.inf, posinf=math.inf)
    show = lambda t: t.masked_fill(~torch.isfinite(t), float("nan")).numpy()  # noqa: E731  inf/NaN → 'bad' colour
    rows, cols = e.shape
    aspect = min(4.0, max(0.25, cols / max(rows, 1)))
    fig = Figure(figsize=(8.4, 2.6 if rows > 1 else 1.6), dpi=72)
    FigureCanvasAgg(fig)
    finite = e[torch.isfinite(e)]   # the colour scale is the expected one: wild values saturate
    if finite.numel() == 0:
        finite = g[torch.isfinite(g)].clamp(-1e30, 1e30)
    vmin, vmax = (float(finite.min()), float(finite.max())) if finite.numel() else (0.0, 1.0)
    if vmin == vmax:
        vmin, vmax = vmin - 0.5, vmax + 0.5
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="magenta")
    ecmap = matplotlib.colormaps["Reds"].with_extremes(bad="magenta")
    r0, c0 = m.origin
    extent = (c0 - 0.5, c0 + cols - 0.5, r0 + rows - 0.5, r0 - 0.5)
    finite_err = err[torch.isfinite(err)]
    emax = min(float(finite_err.max()), 1e30) if finite_err.numel() and float(finite_err.max()) > 0 else 1.0
    panels = [("expected", show(e), cmap, vmin, vmax), ("got", show(g), cmap, vmin, vmax),
              ("|got − expected|", show(err), ecmap, 0.0, emax)]
    block_m, block_n = m.tile if m.tile else (None, None)
    for k, (name, data, cm, lo, hi) in enumerate(panels):
        ax = fig.add_subplot(1, 3, k + 1)
        im = ax.imshow(data, cmap=cm, vmin=lo, vmax=hi, extent=extent, aspect="auto" if aspect > 3 else None,
                       interpolation="nearest")
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.02)
        ax.set_title(name, fontsize=9)
        ax.tick_params(labelsize=7)
        if rows > 1 and block_m:
            for y in range(block_m * (r0 // block_m + 1), r0 + rows, block_m):
                ax.axhline(y - 0.5, color="white", lw=0.8, ls="--")
        if m.one_d and block_m:
            for x in range(block_m * (c0 // block_m + 1), c0 + cols, block_m):
                ax.axvline(x - 0.5, color="white", lw=0.8, ls="--")
        if m.key_cols and block_n:
            for x in range(block_n * (c0 // block_n + 1), c0 + cols, block_n):
                ax.axvline(x - 0.5, color="white", lw=0.8, ls="--")
        if m.index:
            wy = m.index[-2] if len(m.index) >= 2 else 0
            wx = m.index[-1]
            ax.plot([wx], [wy], marker="s", mfc="none", mec="red", ms=7, mew=1.5)
        ax.set_xlabel("keys" if m.key_cols else ("query row" if m.one_d else "column"), fontsize=8)
        if k == 0 and rows > 1:
            ax.set_ylabel("query row", fontsize=8)
    fig.suptitle((title or m.what) + "   (magenta: NaN or ±inf; red square: worst element; dashed: tiles)",
                 fontsize=8)
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fig.tight_layout()
        fig.savefig(buf, format="png")
    return base64.b64encode(buf.getvalue()).decode("ascii")
