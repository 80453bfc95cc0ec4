"""Conceptual figures for the book: the GPU's memory and threads, online softmax, FlashAttention-2's dataflow.

Every function builds and returns a new :class:`matplotlib.figure.Figure` without pyplot: nothing is drawn
or kept at import, and a notebook cell that ends with the call shows the figure once. ``theme="light"``
draws on an opaque white card that stays legible on a dark page; ``theme="dark"`` draws for a dark page.
One palette, one font size, and a colour means the same thing in every figure:

* orange: HBM and the traffic to and from it,
* blue: shared memory (SRAM) and the tiles that live in it,
* green: registers, accumulators and the matrix multiplies on the Tensor Cores,
* purple: the softmax's elementwise work (exponentials, rescaling).
"""
from __future__ import annotations

import io
import math
from types import SimpleNamespace

import numpy as np
from matplotlib.colors import to_hex, to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Polygon, Rectangle
from matplotlib.transforms import blended_transform_factory

FONT_SIZE = 10
#: ``tint`` and ``strong``: how much of a hue a light and a strong fill mix into the background
THEMES = {
    "light": dict(bg="#ffffff", ink="#1a1a1a", muted="#595959", line="#8c8c8c", tint=0.25, strong=0.5,
                  orange="#d55e00", blue="#0072b2", green="#009e73", purple="#cc79a7", sky="#56b4e9",
                  yellow="#e69f00"),
    "dark": dict(bg="#14181e", ink="#ececec", muted="#a9a9a9", line="#7d7d7d", tint=0.25, strong=0.4,
                 orange="#f28c45", blue="#5aa9e6", green="#3dc79b", purple="#e394c4", sky="#8fd3f7",
                 yellow="#f2c14e"),
}
#: the hues a figure cycles through when it needs several of one kind (the pairs of causal_pairing)
CYCLE = ("blue", "orange", "green", "purple", "sky", "yellow")


class _BookFigure(Figure):
    """A Figure that shows itself in Jupyter without pyplot: a PNG at twice the resolution, shown at 1x."""

    def _repr_png_(self):
        width, height = self.get_size_inches() * self.dpi
        return figure_to_png(self, dpi=2 * self.dpi), {"width": int(width), "height": int(height)}


def figure_to_png(fig: Figure, dpi: float = 150) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def figure_to_svg(fig: Figure) -> str:
    """The figure as an SVG document (its text drawn as paths: it looks the same without the fonts)."""
    buf = io.StringIO()
    fig.savefig(buf, format="svg")
    return buf.getvalue()


# --------------------------------------------------------------------------- drawing helpers

def palette(theme: str = "light") -> SimpleNamespace:
    """The colours of one theme: ``bg``, ``ink``, ``muted``, ``line``, the hues, and the fill amounts."""
    if theme not in THEMES:
        raise ValueError(f"theme must be one of {sorted(THEMES)}, got {theme!r}")
    return SimpleNamespace(name=theme, **THEMES[theme])


def tint(th, hue: str, amount: float | None = None) -> str:
    """The hue named ``hue`` mixed into the background: a fill the ink stays legible on."""
    a = th.tint if amount is None else amount
    return to_hex(a * np.array(to_rgb(getattr(th, hue))) + (1 - a) * np.array(to_rgb(th.bg)))


def _canvas(th, width: float, height: float, scale: float = 0.7):
    """A figure that one axes fills, in units of ``scale`` inches either way, y growing down."""
    fig = _BookFigure(figsize=(width * scale, height * scale), facecolor=th.bg)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set(xlim=(0, width), ylim=(height, 0), aspect="equal")
    ax.axis("off")
    return fig, ax


def _plot_figure(th, size, **subplots):
    fig = _BookFigure(figsize=size, facecolor=th.bg, layout="constrained")
    return fig, fig.subplots(**subplots)


def _axes_style(ax, th, xlabel: str = "", ylabel: str = "", title: str = ""):
    """Colours and the one font size on a plotting axes."""
    ax.set_facecolor(th.bg)
    for spine in ax.spines.values():
        spine.set_color(th.line)
    ax.tick_params(colors=th.ink, labelsize=FONT_SIZE)
    ax.set_xlabel(xlabel, color=th.ink, fontsize=FONT_SIZE)
    ax.set_ylabel(ylabel, color=th.ink, fontsize=FONT_SIZE)
    ax.set_title(title, color=th.ink, fontsize=FONT_SIZE, fontweight="bold", loc="left")


def _legend(ax, th, **kw):
    ax.legend(fontsize=FONT_SIZE, facecolor=th.bg, edgecolor=th.line, labelcolor=th.ink, **kw)


def _text(ax, x, y, s, th, color=None, **kw):
    return ax.text(x, y, s, **(dict(ha="center", va="center", fontsize=FONT_SIZE,
                                    color=getattr(th, color or "ink")) | kw))


def _box(ax, x, y, w, h, th, hue, label=None, amount=None, dashed=False, fill=True, **text_kw):
    """A rounded box with its top-left corner at (x, y) (y down), an edge in ``hue`` and a tinted fill."""
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0,rounding_size=0.08",
                                facecolor=tint(th, hue, amount) if fill else "none",
                                edgecolor=getattr(th, hue), linewidth=1.3, linestyle="--" if dashed else "-"))
    if label is not None:
        _text(ax, x + (0.15 if text_kw.get("ha") == "left" else w / 2), y + h / 2, label, th, **text_kw)


def _arrow(ax, start, end, th, hue="line", label=None):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=12, linewidth=1.3,
                                 color=getattr(th, hue), shrinkA=0, shrinkB=0))
    if label:
        _text(ax, (start[0] + end[0]) / 2, (start[1] + end[1]) / 2 - 0.18, label, th, color="muted")


def _timeline(th, groups, xmax: float, xlabel: str):
    """A figure of lanes of bars on one time axis.  ``groups``: [(title, [(lane name, height)], [bar])],
    a bar being (lane, start, duration, hue, label, (top, bottom) fraction of the lane it fills).
    Returns the figure, its axes and the top of every lane, per group."""
    height = sum(0.7 + sum(h for _, h in lanes) + 0.3 for _, lanes, _ in groups)
    fig, ax = _plot_figure(th, (10, 0.75 + 0.55 * height))
    y, ticks, names, tops = 0.0, [], [], []
    left = blended_transform_factory(ax.transAxes, ax.transData)
    for title, lanes, bars in groups:
        _text(ax, 0.006, y + 0.45, title, th, ha="left", fontweight="bold", transform=left)
        y += 0.7
        tops.append([])
        for name, h in lanes:
            tops[-1].append(y)
            ticks.append(y + h / 2)
            names.append(name)
            y += h
            ax.axhline(y, color=th.line, linewidth=0.5, alpha=0.5)
        for lane, start, dur, hue, label, (f0, f1) in bars:
            top, h = tops[-1][lane], lanes[lane][1]
            ax.add_patch(Rectangle((start, top + h * (f0 + 0.08 * (1 - f0))), dur, h * (f1 - f0) * 0.84,
                                   facecolor=tint(th, hue, th.strong), edgecolor=getattr(th, hue), linewidth=1))
            _text(ax, start + dur / 2, top + h * (f0 + f1) / 2, label, th)
        y += 0.3
    ax.set(xlim=(0, xmax), ylim=(y, 0))
    ax.set_yticks(ticks, names)
    _axes_style(ax, th, xlabel=xlabel)
    ax.tick_params(axis="y", length=0)
    return fig, ax, tops


# --------------------------------------------------------------------------- 1. the memory hierarchy

def memory_hierarchy(*, sm_count: int = 132, registers_per_sm_kb: int = 256, smem_per_sm_kb: int = 228,
                     l1_smem_per_sm_kb: int = 256, l2_mb: float = 50, hbm_gb: float = 80, hbm_tbs: float = 3.35,
                     smem_bytes_per_clock: int = 128, clock_ghz: float = 1.98, l2_tbs: float | None = None,
                     name: str = "H100 SXM", theme: str = "light") -> Figure:
    """Registers, shared memory/L1, L2 and HBM as a pyramid, with their sizes and bandwidths.

    The defaults are the H100 SXM5's datasheet and whitepaper figures.  Shared memory's bandwidth is
    derived (``smem_bytes_per_clock`` per SM per clock at the boost clock); L2's has no datasheet figure,
    so it is drawn as a number only when ``l2_tbs`` is given.
    """
    th = palette(theme)
    fig, ax = _canvas(th, 15.2, 6.0)
    smem_tbs = smem_bytes_per_clock * sm_count * clock_ghz * 1e9 / 1e12
    levels = [
        ("registers", "green", f"{registers_per_sm_kb} KB per SM, {registers_per_sm_kb * sm_count / 1024:.1f} MB "
         f"in all ({sm_count} SMs)", "operands every clock, next to the ALUs and Tensor Cores"),
        ("shared memory / L1", "blue", f"up to {smem_per_sm_kb} KB per SM (of {l1_smem_per_sm_kb} KB L1 + shared), "
         f"{smem_per_sm_kb * sm_count / 1024:.1f} MB in all",
         f"≈ {smem_tbs:.0f} TB/s in all ({smem_bytes_per_clock} B/clock/SM × {sm_count} SMs × {clock_ghz:g} GHz)"),
        ("L2 cache", "sky", f"{l2_mb:g} MB, shared by all {sm_count} SMs",
         f"≈ {l2_tbs:g} TB/s" if l2_tbs else "a few × HBM's bandwidth (no datasheet figure)"),
        ("HBM3", "orange", f"{hbm_gb:g} GB, off chip (stacks beside the die)", f"{hbm_tbs:g} TB/s"),
    ]
    _text(ax, 0.2, 0.45, f"{name} memory hierarchy: size and bandwidth", th, ha="left", fontweight="bold")
    cx, top, pitch = 4.2, 1.0, 1.17
    half = lambda k: 0.6 + 0.62 * k  # noqa: E731  half-widths grow down the pyramid
    for k, (label, hue, size, bandwidth) in enumerate(levels):
        y0, y1 = top + k * pitch, top + k * pitch + 1.05
        ax.add_patch(Polygon([(cx - half(k), y0), (cx + half(k), y0), (cx + half(k + 1), y1), (cx - half(k + 1), y1)],
                             facecolor=tint(th, hue, th.strong), edgecolor=getattr(th, hue), linewidth=1.3))
        _text(ax, cx, (y0 + y1) / 2, label, th, fontweight="bold")
        ax.plot([cx + half(k + 0.5) + 0.1, 7.6], [(y0 + y1) / 2] * 2, color=th.line, linewidth=0.8)
        _text(ax, 7.7, y0 + 0.3, size, th, ha="left")
        _text(ax, 7.7, y0 + 0.72, bandwidth, th, color="muted", ha="left")
    chip_edge = top + 3 * pitch - 0.06
    ax.plot([0.2, 15.0], [chip_edge, chip_edge], color=th.line, linewidth=1, linestyle="--")
    _text(ax, 15.0, chip_edge - 0.2, "on chip ↑", th, color="muted", ha="right")
    _text(ax, 15.0, chip_edge + 0.2, "off chip ↓", th, color="muted", ha="right")
    _arrow(ax, (0.45, top + 4 * pitch - 0.12), (0.45, top), th)
    _text(ax, 0.75, top + 2 * pitch, "faster, smaller", th, color="muted", rotation=90)
    return fig


# --------------------------------------------------------------------------- 2. grid, blocks, warps

def grid_block_warp(grid_dim: tuple[int, int] = (4, 3), block_dim: tuple[int, int] = (16, 8),
                    block: tuple[int, int] = (1, 1), thread: tuple[int, int] = (5, 3), *,
                    theme: str = "light") -> Figure:
    """A grid of blocks, one block opened into its warps of 32 threads, and how thread (i, j) is found.

    Sizes and indices are in CUDA's (x, y) order: x runs along a row (the column j), y down (the row i).
    """
    th = palette(theme)
    (gx, gy), (bx, by), (bdx, bdy), (tx, ty) = grid_dim, block, block_dim, thread
    if not (0 <= bx < gx and 0 <= by < gy and 0 <= tx < bdx and 0 <= ty < bdy):
        raise ValueError(f"block {block} must lie in the grid {grid_dim} and thread {thread} in the block {block_dim}")
    cell, x0, y0, step = min(6.0 / bdx, 3.2 / bdy), 0.9, 1.2, 1.15
    bx0, note_y = x0 + gx * step + 1.3, y0 + max(gy * step, bdy * cell) + 0.55
    fig, ax = _canvas(th, bx0 + bdx * cell + 3.4, note_y + 2.15)
    _text(ax, x0, 0.35, f"grid: gridDim = ({gx}, {gy}) blocks", th, ha="left", fontweight="bold")
    _text(ax, x0 + gx * step / 2, y0 - 0.3, "x →", th, color="muted")
    _text(ax, x0 - 0.3, y0 + gy * step / 2, "y ↓", th, color="muted")
    for r in range(gy):
        for c in range(gx):
            here = (c, r) == (bx, by)
            _box(ax, x0 + c * step, y0 + r * step, 1, 1, th, "blue", f"({c}, {r})",
                 amount=th.strong if here else 0.08, fontweight="bold" if here else "normal")
    warps = -(-bdx * bdy // 32)
    _text(ax, bx0, 0.35, f"block ({bx}, {by}): blockDim = ({bdx}, {bdy}), {bdx * bdy} threads = {warps} warps",
          th, ha="left", fontweight="bold")
    for r in range(bdy):
        for c in range(bdx):
            hue = "orange" if (c, r) == (tx, ty) else ("green" if (r * bdx + c) // 32 % 2 else "blue")
            ax.add_patch(Rectangle((bx0 + c * cell, y0 + r * cell), cell, cell, edgecolor=th.bg, linewidth=0.8,
                                   facecolor=tint(th, hue, 0.9 if hue == "orange" else 0.35)))
    for w in range(warps):
        rows = [t // bdx for t in range(32 * w, min(32 * (w + 1), bdx * bdy))]
        _text(ax, bx0 + bdx * cell + 0.15, y0 + (rows[0] + rows[-1] + 1) / 2 * cell,
              f"warp {w}: threads {32 * w}–{32 * w + len(rows) - 1}", th, ha="left")
    for corner in (0, 1):   # the opened block's outline, traced back to its place in the grid
        ax.plot([x0 + bx * step + 1, bx0], [y0 + by * step + corner, y0 + corner * bdy * cell],
                color=th.line, linewidth=0.8, linestyle=":")
    i, j, tx_x = by * bdy + ty, bx * bdx + tx, bx0 + (tx + 0.5) * cell
    _arrow(ax, (tx_x, note_y - 0.3), (tx_x, y0 + (ty + 1) * cell), th, hue="orange")
    _text(ax, tx_x - 0.2, note_y, f"threadIdx = ({tx}, {ty}) is thread (i, j) = ({i}, {j})", th, ha="left")
    _text(ax, x0, note_y + 0.65, f"i (row) = blockIdx.y · blockDim.y + threadIdx.y = {by} · {bdy} + {ty} = {i}",
          th, ha="left")
    _text(ax, x0, note_y + 1.15, f"j (column) = blockIdx.x · blockDim.x + threadIdx.x = {bx} · {bdx} + {tx} = {j}"
          "      (in Numba: j, i = cuda.grid(2))", th, ha="left")
    _text(ax, x0, note_y + 1.75, "a warp is 32 consecutive threads of tid = threadIdx.y · blockDim.x + threadIdx.x "
          "(x varies fastest): they run each instruction together", th, color="muted", ha="left")
    return fig


# --------------------------------------------------------------------------- 3. online softmax

#: one row of scores whose maximum grows in tiles 0, 1 and 3 of four, and not in tile 2
EXAMPLE_ROW = (0.3, 1.1, 0.4, 0.9, 0.2, 2.3, 1.0, 1.7, 1.4, 0.6, 2.0, 0.1, 3.1, 2.2, 0.5, 2.8)


def online_softmax_steps(scores, block_n: int = 4) -> list[dict]:
    """Per tile of ``block_n`` scores: the running max before and after it, alpha = exp(m_old − m_new), l_i."""
    s = np.asarray(scores, dtype=np.float64)
    if s.ndim != 1 or s.size == 0 or not np.isfinite(s).all() or block_n < 1:
        raise ValueError(f"expected a non-empty 1-D row of finite scores and block_n >= 1, got {s!r}, {block_n}")
    m, l, steps = -math.inf, 0.0, []
    for start in range(0, s.size, block_n):
        tile = s[start:start + block_n]
        m_new = max(m, float(tile.max()))
        alpha = math.exp(m - m_new)   # exp(-inf) = 0 on the first tile: there is nothing to rescale yet
        l = alpha * l + float(np.exp(tile - m_new).sum())
        steps.append(dict(start=start, stop=start + tile.size, m_old=m, m_new=m_new, alpha=alpha, l=l))
        m = m_new
    return steps


def online_softmax_rescaling(scores=None, block_n: int = 4, *, theme: str = "light") -> Figure:
    """One row of scores read in tiles: the running max m_i, the rescale factor alpha where it grows, and l_i."""
    th = palette(theme)
    s = np.asarray(EXAMPLE_ROW if scores is None else scores, dtype=np.float64)
    steps = online_softmax_steps(s, block_n)
    fig, (top, bottom) = _plot_figure(th, (9.5, 6.2), nrows=2, sharex=True, height_ratios=(3, 2))
    edges = [st["start"] - 0.5 for st in steps] + [s.size - 0.5]
    for ax in (top, bottom):
        for e in edges[1:-1]:
            ax.axvline(e, color=th.line, linewidth=0.8, linestyle="--")
    top.plot(np.arange(s.size), s, "o", color=th.blue, label="scores $s_j$ of the row")
    top.stairs([st["m_new"] for st in steps], edges, baseline=None, color=th.orange, linewidth=2.2,
               label="running max $m_i$ after each tile")
    lo, hi = float(s.min()), float(s.max())
    span = max(hi - lo, 1e-9)
    for k, st in enumerate(steps):
        mid = (st["start"] + st["stop"] - 1) / 2
        _text(top, mid, hi + 0.42 * span, f"tile {k}", th, color="muted")
        if k == 0:
            note = r"$m_i$ starts at $-\infty$: $\alpha = 0$"
        elif st["m_new"] > st["m_old"]:
            top.annotate("", (edges[k], st["m_new"]), (edges[k], st["m_old"]),
                         arrowprops=dict(arrowstyle="-|>", color=th.purple, linewidth=1.6))
            note = rf"$\alpha = e^{{{st['m_old']:.2f} - {st['m_new']:.2f}}} = {st['alpha']:.2f}$"
        else:
            note = r"max unchanged: $\alpha = 1$"
        _text(top, mid, hi + 0.25 * span, note, th, color="ink" if 0 < st["alpha"] < 1 else "muted")
    top.set_ylim(lo - 0.45 * span, hi + 0.55 * span)
    _legend(top, th, loc="lower center", ncols=2)
    _axes_style(top, th, ylabel="score", title=r"online softmax: where $m_i$ grows, acc and $l_i$ are "
                r"multiplied by $\alpha = \exp(m_\mathrm{old} - m_\mathrm{new})$")
    l_line = [st["l"] for st in steps]
    bottom.stairs(l_line, edges, color=th.green, baseline=0, fill=True, alpha=0.35)
    bottom.stairs(l_line, edges, color=th.green, linewidth=2.2,
                  label=r"$l_i \leftarrow \alpha\, l_i + \Sigma_\mathrm{tile}\, e^{s_j - m_i}$")
    for st in steps:
        _text(bottom, (st["start"] + st["stop"] - 1) / 2, st["l"], f"{st['l']:.2f}", th, va="bottom")
    exact = float(np.exp(s - s.max()).sum())
    bottom.axhline(exact, color=th.ink, linewidth=1, linestyle=":",
                   label=rf"$\Sigma_j\, e^{{s_j - \max s}}$ over the whole row $= {exact:.2f}$")
    bottom.set_ylim(0, max(l_line + [exact]) * 1.5)
    _legend(bottom, th, loc="upper center", ncols=2)
    _axes_style(bottom, th, xlabel="key position j", ylabel="$l_i$")
    return fig


# --------------------------------------------------------------------------- 4, 5. FlashAttention-2's dataflow

def _dataflow(ax, th, y, title, once, accumulators, loop, streamed, steps, stores, epilogue):
    """One program's dataflow from ``y`` down: HBM on the left, its copies on chip at the same height
    (loaded once, streamed every iteration of ``loop``, stored once), the work on chip at the right.
    ``steps`` are (hue, text): green for a matrix multiply, purple for elementwise softmax work.
    Returns the y below the panel."""
    pitch, bh, step_pitch = 0.62, 0.46, 0.56
    _text(ax, 0.2, y + 0.3, title, th, ha="left", fontweight="bold")
    top = y + 0.8
    loop_h = max(len(streamed) * pitch, 0.55 + len(steps) * step_pitch)
    y_once = top + 0.6
    y_loop = y_once + len(once) * pitch + 0.3
    y_store = y_loop + loop_h + 0.3
    bottom = y_store + len(stores) * pitch + 0.1
    _box(ax, 0.2, top, 1.9, bottom - top, th, "orange", amount=0.08)
    _text(ax, 1.15, top + 0.27, "HBM", th, fontweight="bold")
    _box(ax, 3.9, top, 10.3, bottom - top, th, "blue", amount=0.04)
    _text(ax, 4.05, top + 0.27, "on chip: one program (SRAM and registers)", th, ha="left", fontweight="bold")
    _box(ax, 4.05, y_loop - 0.15, 10.0, loop_h + 0.15, th, "line", dashed=True, fill=False)
    _text(ax, 13.95, y_loop + 0.05, loop, th, color="muted", ha="right", va="top")
    flows = ([(label, y_once + k * pitch, "load once") for k, label in enumerate(once)]
             + [(label, y_loop + 0.1 + k * pitch, "every iteration") for k, label in enumerate(streamed)]
             + [(label, y_store + k * pitch, "store once") for k, label in enumerate(stores)])
    seen = set()
    for label, yy, how in flows:
        out = how == "store once"
        _box(ax, 0.4, yy, 1.5, bh, th, "orange", label, amount=th.strong)
        _box(ax, 4.25, yy, 1.5, bh, th, "green" if out else "blue", label, amount=th.strong)
        ends = ((4.25, yy + bh / 2), (1.9, yy + bh / 2))
        _arrow(ax, *(ends if out else ends[::-1]), th, hue="orange", label=None if how in seen else how)
        seen.add(how)
    _box(ax, 6.2, y_once, 7.8, bh, th, "green", accumulators, amount=th.strong)
    for k, (hue, text) in enumerate(steps):
        _box(ax, 6.2, y_loop + 0.45 + k * step_pitch, 6.3, step_pitch - 0.1, th, hue, text, ha="left")
    _box(ax, 6.2, y_store, 7.8, bh, th, "green", epilogue, amount=th.strong)
    return bottom


def _dataflow_figure(th, panels, scale: float = 0.68):
    """The panels stacked, the figure cut to their height."""
    fig, ax = _canvas(th, 14.4, 30.0, scale=scale)
    y = 0.0
    for panel in panels:
        y = _dataflow(ax, th, y, *panel) + 0.3
    fig.set_size_inches(14.4 * scale, y * scale)
    ax.set_ylim(y, 0)
    return fig, ax


def fa2_forward_dataflow(*, theme: str = "light") -> Figure:
    """The FlashAttention-2 forward of one query block: Q_i stays on chip, K_j and V_j stream past it,
    S and P never reach HBM, and the epilogue writes O_i and lse_i once."""
    fig, _ = _dataflow_figure(palette(theme), [(
        "FlashAttention-2 forward: one program per query block i",
        ["$Q_i$"], r"$\mathrm{acc} = 0$,  $m_i = -\infty$,  $l_i = 0$  (registers)",
        "for each key/value block j", ["$K_j$", "$V_j$"],
        [("green", r"$S = Q_i K_j^\top$  (scaled)"),
         ("purple", r"$m_\mathrm{new} = \max(m_i, \mathrm{rowmax}(S))$,  $\alpha = e^{m_i - m_\mathrm{new}}$"),
         ("purple", r"$P = e^{S - m_\mathrm{new}}$,  $l_i \leftarrow \alpha\, l_i + \mathrm{rowsum}(P)$"),
         ("green", r"$\mathrm{acc} \leftarrow \alpha\, \mathrm{acc} + P V_j$,  $m_i \leftarrow m_\mathrm{new}$")],
        ["$O_i$", r"$\mathrm{lse}_i$"], r"epilogue: $O_i = \mathrm{acc} / l_i$,  $\mathrm{lse}_i = m_i + \log l_i$")])
    return fig


def fa2_backward_dataflow(*, theme: str = "light") -> Figure:
    """The FlashAttention-2 backward as two passes that recompute P from lse: a K/V-stationary pass
    accumulating dK_j and dV_j over the query blocks, and a Q-stationary pass accumulating dQ_i."""
    th = palette(theme)
    recompute = [("green", r"$S = Q_i K_j^\top$  (scaled)"), ("purple", r"$P = e^{S - \mathrm{lse}_i}$  (recomputed)")]
    fig, ax = _dataflow_figure(th, [
        ("dK, dV pass: outer loop over key/value blocks j, one program each",
         ["$K_j$", "$V_j$"], r"$dK_j = 0$,  $dV_j = 0$  (registers)",
         "for each query block i that sees block j", ["$Q_i$", "$dO_i$", r"$\mathrm{lse}_i$", r"$\Delta_i$"],
         recompute + [("green", r"$dV_j$ += $P^\top dO_i$"), ("green", r"$dP = dO_i V_j^\top$"),
                      ("purple", r"$dS = P \circ (dP - \Delta_i)$"), ("green", r"$dK_j$ += $dS^\top Q_i$")],
         ["$dK_j$", "$dV_j$"], r"epilogue: write $dK_j$ (times the scale) and $dV_j$ once"),
        ("dQ pass: one program per query block i, no atomics",
         ["$Q_i$", "$dO_i$", r"$\mathrm{lse}_i$", r"$\Delta_i$"], r"$dQ_i = 0$  (registers)",
         "for each key/value block j that block i sees", ["$K_j$", "$V_j$"],
         recompute + [("green", r"$dP = dO_i V_j^\top$"), ("purple", r"$dS = P \circ (dP - \Delta_i)$"),
                      ("green", r"$dQ_i$ += $dS\, K_j$")],
         ["$dQ_i$"], r"epilogue: write $dQ_i$ (times the scale) once")])
    _text(ax, 14.2, 0.3, r"computed first: $\Delta_i = \mathrm{rowsum}(dO_i \circ O_i)$", th, color="muted", ha="right")
    return fig


# --------------------------------------------------------------------------- 6, 7. timelines

def pipeline_schedule(num_stages: int, n_tiles: int = 5, load_latency: float = 2.0, mma_time: float = 1.0):
    """(start, end) of each tile's load and of its MMA when ``num_stages`` buffers let the loads run ahead.

    Tile k's load goes into buffer k mod num_stages: it may start once the MMA of tile k − num_stages
    has freed that buffer (and loads issue in order); its MMA starts once the load has landed and the
    previous MMA is done.  num_stages = 1 serialises load and MMA.
    """
    if int(num_stages) != num_stages or num_stages < 1 or n_tiles < 1:
        raise ValueError(f"num_stages and n_tiles must be integers >= 1, got {num_stages}, {n_tiles}")
    loads, mmas = [], []
    for k in range(n_tiles):
        start = max(loads[-1][0] if loads else 0.0, mmas[k - num_stages][1] if k >= num_stages else 0.0)
        loads.append((start, start + load_latency))
        begin = max(loads[k][1], mmas[-1][1] if mmas else 0.0)
        mmas.append((begin, begin + mma_time))
    return loads, mmas


def pipelining_timeline(num_stages: int = 3, n_tiles: int = 5, load_latency: float = 2.0, mma_time: float = 1.0,
                        *, theme: str = "light") -> Figure:
    """Loads and MMAs of a K/V loop for num_stages = 1, 2 … ``num_stages``: with more buffers the loads
    of the next tiles overlap the MMA of this one, until the Tensor Cores never wait."""
    th = palette(theme)
    groups, end = [], 0.0
    for stages in sorted({1, min(2, num_stages), num_stages}):
        loads, mmas = pipeline_schedule(stages, n_tiles, load_latency, mma_time)
        end = max(end, mmas[-1][1])
        bars = [(0, a, b - a, "orange", f"load {k}", (k % stages / stages, (k % stages + 1) / stages))
                for k, (a, b) in enumerate(loads)]
        bars += [(1, a, b - a, "green", f"mma {k}", (0, 1)) for k, (a, b) in enumerate(mmas)]
        groups.append((f"num_stages = {stages}: done at t = {mmas[-1][1]:g}, Tensor Cores busy "
                       f"{100 * n_tiles * mma_time / mmas[-1][1]:.0f}% of the time",
                       [("loads (HBM → SRAM)", 0.75 * stages), ("MMAs", 0.75)], bars))
    fig, _, _ = _timeline(th, groups, end * 1.02,
                          f"time (one MMA = {mma_time:g}, one load's latency = {load_latency:g})")
    return fig


def pingpong_schedule(warpgroups: int, iterations: int, gemm: float = 1.0, softmax: float = 1.0):
    """Per warpgroup, its [(phase, start, end)]: every iteration a GEMM then a softmax.  The Tensor Cores
    run one GEMM at a time, handed round the warpgroups in turn (FA3 orders them with named barriers)."""
    if warpgroups < 1 or iterations < 1:
        raise ValueError(f"warpgroups and iterations must be >= 1, got {warpgroups}, {iterations}")
    phases, tc_free = [[] for _ in range(warpgroups)], 0.0
    for _ in range(iterations):
        for wg in range(warpgroups):
            start = max(tc_free, phases[wg][-1][2] if phases[wg] else 0.0)
            tc_free = start + gemm
            phases[wg] += [("GEMM", start, tc_free), ("softmax", tc_free, tc_free + softmax)]
    return phases


def pingpong_timeline(iterations: int = 3, gemm: float = 1.0, softmax: float = 1.0, *,
                      theme: str = "light") -> Figure:
    """One warpgroup doing GEMM and softmax in turn, then two consumer warpgroups in FA3's ping-pong:
    while one runs its softmax the other has the Tensor Cores, and the same work takes about half the time."""
    th = palette(theme)
    groups, end = [], 0.0
    for wgs, title in ((1, "one warpgroup, two query blocks one after the other"),
                       (2, "two consumer warpgroups, one query block each, ping-pong")):
        phases = pingpong_schedule(wgs, iterations * 2 // wgs, gemm, softmax)
        done = max(p[-1][2] for p in phases)
        end = max(end, done)
        gemms = [(w, a, b) for w, p in enumerate(phases) for name, a, b in p if name == "GEMM"]
        bars = [(w, a, b - a, "green" if name == "GEMM" else "purple", name, (0, 1))
                for w, p in enumerate(phases) for name, a, b in p]
        bars += [(wgs, a, b - a, "green", f"WG {w + 1}", (0, 1)) for w, a, b in gemms]
        groups.append((f"{title}: done at t = {done:g}, Tensor Cores busy "
                       f"{100 * sum(b - a for _, a, b in gemms) / done:.0f}%",
                       [(f"warpgroup {w + 1}", 0.8) for w in range(wgs)] + [("Tensor Cores", 0.8)], bars))
    fig, ax, tops = _timeline(th, groups, end * 1.02,
                              f"time (one GEMM phase = {gemm:g}, one softmax phase = {softmax:g})")
    handoffs = [a for _, a, _ in sorted(gemms, key=lambda g: g[1])[1:]]
    ax.vlines(handoffs, tops[1][0], tops[1][-1] + 0.8, color=th.ink, linewidth=1.2, linestyles="--")
    _text(ax, end * 1.01, tops[1][0] + 1.2, "dashed: named barriers\n(bar.sync / bar.arrive) hand the\nTensor "
          "Cores from one warpgroup\nto the other: one's GEMM overlaps\nthe other's softmax", th, color="muted",
          ha="right", linespacing=1.3)
    return fig


# --------------------------------------------------------------------------- 8. causal pairing

def causal_pairing(n_blocks: int = 8, *, theme: str = "light") -> Figure:
    """Under a causal mask query block i sees i + 1 key blocks, a triangle of work; pairing block i with
    block n − 1 − i in one program gives every program n + 1 key blocks, the same work."""
    if n_blocks < 2:
        raise ValueError(f"n_blocks must be >= 2, got {n_blocks}")
    th = palette(theme)
    n, programs = n_blocks, (n_blocks + 1) // 2
    fig, (tri, bars) = _plot_figure(th, (10.5, 4.8), ncols=2, width_ratios=(1, 1.25))
    hue = lambda i: CYCLE[min(i, n - 1 - i) % len(CYCLE)]  # noqa: E731  block i runs in program min(i, n-1-i)
    fill = lambda i: tint(th, hue(i), th.tint if i < n - 1 - i else th.strong)  # noqa: E731
    for i in range(n):
        for j in range(i + 1):   # the diagonal tile is half masked: its lower-left triangle is seen
            corners = [(j, i), (j, i + 1), (j + 1, i + 1)] + ([] if j == i else [(j + 1, i)])
            tri.add_patch(Polygon(corners, facecolor=fill(i), edgecolor=th.bg, linewidth=1))
        _text(tri, n + 0.15, i + 0.5, f"{i + 1}", th, ha="left")
    _text(tri, n + 0.15, -0.35, "work", th, color="muted", ha="left")
    tri.set(xlim=(0, n + 1.2), ylim=(n, -0.7), aspect="equal")
    tri.set_xticks([k + 0.5 for k in range(n)], range(n))
    tri.set_yticks([k + 0.5 for k in range(n)], range(n))
    _axes_style(tri, th, xlabel="key block j", ylabel="query block i",
                title="causal: query block i sees i + 1 key blocks")
    for p in range(programs):
        left = 0
        for blk in sorted({p, n - 1 - p}):
            bars.barh(p, blk + 1, left=left, color=fill(blk), edgecolor=getattr(th, hue(blk)))
            _text(bars, left + (blk + 1) / 2, p, f"{blk + 1}", th)
            left += blk + 1
    bars.axvline(n + 1, color=th.ink, linewidth=1.2, linestyle="--")
    _text(bars, n + 1.15, -0.62, f"n + 1 = {n + 1}", th, ha="left")
    bars.set(xlim=(0, n + 3), ylim=(programs - 0.45, -0.9))
    bars.set_yticks(range(programs), [f"program {p}\n(blocks {p}, {n - 1 - p})" if p != n - 1 - p
                                      else f"program {p}\n(block {p})" for p in range(programs)])
    _axes_style(bars, th, xlabel="key blocks computed",
                title=f"paired: program p runs blocks p and {n - 1} − p ({programs} programs)")
    return fig


#: every figure of this module by name, for a chapter or a test that wants them all
FIGURES = {f.__name__: f for f in (memory_hierarchy, grid_block_warp, online_softmax_rescaling, fa2_forward_dataflow,
                                   fa2_backward_dataflow, pipelining_timeline, pingpong_timeline, causal_pairing)}
