"""Figures of the algorithm: online softmax's running max, FlashAttention-2's forward and backward
dataflow, and the causal mask's work balanced by pairing query blocks."""
from __future__ import annotations

import math

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Polygon

from fa_lab.figures.style import (
    CYCLE,
    add_arrow,
    add_box,
    add_legend,
    add_text,
    new_canvas,
    new_plot,
    palette,
    style_axes,
    tint,
)

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
    fig, (top, bottom) = new_plot(th, (9.5, 6.2), nrows=2, sharex=True, height_ratios=(3, 2))
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
        add_text(top, mid, hi + 0.42 * span, f"tile {k}", th, color="muted")
        if k == 0:
            note = r"$m_i$ starts at $-\infty$: $\alpha = 0$"
        elif st["m_new"] > st["m_old"]:
            top.annotate("", (edges[k], st["m_new"]), (edges[k], st["m_old"]),
                         arrowprops=dict(arrowstyle="-|>", color=th.purple, linewidth=1.6))
            note = rf"$\alpha = e^{{{st['m_old']:.2f} - {st['m_new']:.2f}}} = {st['alpha']:.2f}$"
        else:
            note = r"max unchanged: $\alpha = 1$"
        add_text(top, mid, hi + 0.25 * span, note, th, color="ink" if 0 < st["alpha"] < 1 else "muted")
    top.set_ylim(lo - 0.45 * span, hi + 0.55 * span)
    add_legend(top, th, loc="lower center", ncols=2)
    style_axes(top, th, ylabel="score", title=r"online softmax: where $m_i$ grows, acc and $l_i$ are "
               r"multiplied by $\alpha = \exp(m_\mathrm{old} - m_\mathrm{new})$")
    l_line = [st["l"] for st in steps]
    bottom.stairs(l_line, edges, color=th.green, baseline=0, fill=True, alpha=0.35)
    bottom.stairs(l_line, edges, color=th.green, linewidth=2.2,
                  label=r"$l_i \leftarrow \alpha\, l_i + \Sigma_\mathrm{tile}\, e^{s_j - m_i}$")
    for st in steps:
        add_text(bottom, (st["start"] + st["stop"] - 1) / 2, st["l"], f"{st['l']:.2f}", th, va="bottom")
    exact = float(np.exp(s - s.max()).sum())
    bottom.axhline(exact, color=th.ink, linewidth=1, linestyle=":",
                   label=rf"$\Sigma_j\, e^{{s_j - \max s}}$ over the whole row $= {exact:.2f}$")
    bottom.set_ylim(0, max(l_line + [exact]) * 1.5)
    add_legend(bottom, th, loc="upper center", ncols=2)
    style_axes(bottom, th, xlabel="key position j", ylabel="$l_i$")
    return fig


# --------------------------------------------------------------------------- 4, 5. FlashAttention-2's dataflow

def _dataflow(ax, th, y, title, once, accumulators, loop, streamed, steps, stores, epilogue):
    """One program's dataflow from ``y`` down: HBM on the left, its copies on chip at the same height
    (loaded once, streamed every iteration of ``loop``, stored once), the work on chip at the right.
    ``steps`` are (hue, text): green for a matrix multiply, purple for elementwise softmax work.
    Returns the y below the panel."""
    pitch, bh, step_pitch = 0.62, 0.46, 0.56
    add_text(ax, 0.2, y + 0.3, title, th, ha="left", fontweight="bold")
    top = y + 0.8
    loop_h = max(len(streamed) * pitch, 0.55 + len(steps) * step_pitch)
    y_once = top + 0.6
    y_loop = y_once + len(once) * pitch + 0.3
    y_store = y_loop + loop_h + 0.3
    bottom = y_store + len(stores) * pitch + 0.1
    add_box(ax, 0.2, top, 1.9, bottom - top, th, "orange", amount=0.08)
    add_text(ax, 1.15, top + 0.27, "HBM", th, fontweight="bold")
    add_box(ax, 3.9, top, 10.3, bottom - top, th, "blue", amount=0.04)
    add_text(ax, 4.05, top + 0.27, "on chip: one program (SRAM and registers)", th, ha="left", fontweight="bold")
    add_box(ax, 4.05, y_loop - 0.15, 10.0, loop_h + 0.15, th, "line", dashed=True, fill=False)
    add_text(ax, 13.95, y_loop + 0.05, loop, th, color="muted", ha="right", va="top")
    flows = ([(label, y_once + k * pitch, "load once") for k, label in enumerate(once)]
             + [(label, y_loop + 0.1 + k * pitch, "every iteration") for k, label in enumerate(streamed)]
             + [(label, y_store + k * pitch, "store once") for k, label in enumerate(stores)])
    seen = set()
    for label, yy, how in flows:
        out = how == "store once"
        add_box(ax, 0.4, yy, 1.5, bh, th, "orange", label, amount=th.strong)
        add_box(ax, 4.25, yy, 1.5, bh, th, "green" if out else "blue", label, amount=th.strong)
        ends = ((4.25, yy + bh / 2), (1.9, yy + bh / 2))
        add_arrow(ax, *(ends if out else ends[::-1]), th, hue="orange", label=None if how in seen else how)
        seen.add(how)
    add_box(ax, 6.2, y_once, 7.8, bh, th, "green", accumulators, amount=th.strong)
    for k, (hue, text) in enumerate(steps):
        add_box(ax, 6.2, y_loop + 0.45 + k * step_pitch, 6.3, step_pitch - 0.1, th, hue, text, ha="left")
    add_box(ax, 6.2, y_store, 7.8, bh, th, "green", epilogue, amount=th.strong)
    return bottom


def _dataflow_figure(th, panels, scale: float = 0.68):
    """The panels stacked, the figure cut to their height."""
    fig, ax = new_canvas(th, 14.4, 30.0, scale=scale)
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
    """The FlashAttention-2 backward as two passes that recompute P from lse: a Q-stationary pass accumulating
    dQ_i, which first computes and stores each row's Delta_i, then a K/V-stationary pass accumulating dK_j and
    dV_j over the query blocks."""
    th = palette(theme)
    recompute = [("green", r"$S = Q_i K_j^\top$  (scaled)"), ("purple", r"$P = e^{S - \mathrm{lse}_i}$  (recomputed)")]
    fig, _ = _dataflow_figure(th, [
        ("dQ pass, first: one program per query block i, no atomics",
         ["$Q_i$", "$dO_i$", "$O_i$", r"$\mathrm{lse}_i$"],
         r"$\Delta_i = \mathrm{rowsum}(dO_i \circ O_i)$,  $dQ_i = 0$  (registers)",
         "for each key/value block j that block i sees", ["$K_j$", "$V_j$"],
         recompute + [("green", r"$dP = dO_i V_j^\top$"), ("purple", r"$dS = P \circ (dP - \Delta_i)$"),
                      ("green", r"$dQ_i$ += $dS\, K_j$")],
         [r"$\Delta_i$", "$dQ_i$"], r"write $\Delta_i$ for the next pass, $dQ_i$ (times the scale) once"),
        ("dK, dV pass, second: outer loop over key/value blocks j, one program each",
         ["$K_j$", "$V_j$"], r"$dK_j = 0$,  $dV_j = 0$  (registers)",
         "for each query block i that sees block j", ["$Q_i$", "$dO_i$", r"$\mathrm{lse}_i$", r"$\Delta_i$"],
         recompute + [("green", r"$dV_j$ += $P^\top dO_i$"), ("green", r"$dP = dO_i V_j^\top$"),
                      ("purple", r"$dS = P \circ (dP - \Delta_i)$"), ("green", r"$dK_j$ += $dS^\top Q_i$")],
         ["$dK_j$", "$dV_j$"], r"epilogue: write $dK_j$ (times the scale) and $dV_j$ once")])
    return fig


def warp_specialized_dkdv(*, theme: str = "light") -> Figure:
    """The dK/dV pass split into warpgroups: a producer that only issues the copy engine's (TMA) copies of
    each query block into a ring of shared-memory stages, and two consumers that each own half of the key
    block, its K, V rows and its dK, dV accumulators, and both read every stage."""
    th = palette(theme)
    fig, ax = new_canvas(th, 14.4, 8.7, scale=0.68)
    add_text(ax, 0.2, 0.3, "dK, dV pass, warp-specialized: one program of 3 warpgroups (12 warps) for key block j "
             "(128 keys)", th, ha="left", fontweight="bold")
    # HBM, streamed every iteration
    add_box(ax, 0.2, 0.8, 1.9, 3.5, th, "orange", amount=0.08)
    add_text(ax, 1.15, 1.1, "HBM", th, fontweight="bold")
    streamed = ["$Q_i$", "$dO_i$", r"$\mathrm{lse}_i$", r"$\Delta_i$"]
    for k, label in enumerate(streamed):
        add_box(ax, 0.4, 1.5 + k * 0.62, 1.5, 0.46, th, "orange", label, amount=th.strong)
    # the producer and the ring of stages
    add_box(ax, 3.0, 0.8, 4.3, 1.25, th, "orange", amount=th.tint)
    add_text(ax, 5.15, 1.15, "producer warpgroup (warps 0–3)", th, fontweight="bold")
    add_text(ax, 5.15, 1.65, "issues the TMA copies; few registers", th, color="muted")
    for k in range(2):
        y = 2.7 + k * 1.65
        add_box(ax, 3.0, y, 4.3, 1.35, th, "blue", amount=0.08)
        add_text(ax, 3.15, y + 0.3, f"stage {k}", th, ha="left", fontweight="bold")
        add_text(ax, 5.15, y + 0.88, ",  ".join(label for label in streamed), th)
    add_text(ax, 5.15, 6.2, "shared memory: num_stages = 2 buffers,\nbarriers say full / empty",
             th, color="muted", linespacing=1.3)
    add_arrow(ax, (2.1, 3.4), (3.0, 3.4), th, hue="orange")
    add_text(ax, 1.15, 4.95, "TMA copy:\nblock i into\nstage i mod 2", th, color="muted", linespacing=1.2)
    add_arrow(ax, (5.15, 2.05), (5.15, 2.7), th, hue="orange")
    # two consumers, half the keys each
    for c, (lo, hi) in enumerate(((0, 63), (64, 127))):
        x = 8.6 + c * 2.95
        add_box(ax, x, 0.8, 2.75, 6.0, th, "green", amount=0.08)
        add_text(ax, x + 1.375, 1.15, f"consumer warpgroup {c + 1}", th, fontweight="bold")
        add_text(ax, x + 1.375, 1.6, f"keys {lo}–{hi} of block j", th, color="muted")
        rows = f"$K_j$, $V_j$ rows {lo}–{hi}\n$dK_j$, $dV_j$ rows {lo}–{hi}"
        add_box(ax, x + 0.15, 2.0, 2.45, 0.95, th, "green", rows, amount=th.strong, linespacing=1.3)
        for k, (hue, text) in enumerate([("green", r"$S^\top = K_j Q_i^\top$"), ("purple", r"$P^\top$ from lse"),
                                         ("green", r"$dV_j$ += $P^\top dO_i$"), ("green", r"$dP^\top = V_j dO_i^\top$"),
                                         ("purple", r"$dS^\top = P^\top \circ (dP^\top - \Delta_i)$"),
                                         ("green", r"$dK_j$ += $dS^\top Q_i$")]):
            add_box(ax, x + 0.15, 3.1 + k * 0.5, 2.45, 0.42, th, hue, text)
    add_arrow(ax, (7.3, 4.2), (8.6, 4.2), th, hue="blue")
    add_text(ax, 7.95, 3.65, "both read\nevery stage", th, color="muted", linespacing=1.2)
    add_text(ax, 14.3, 7.3, "setmaxnreg: the consumers get 232 registers a thread, the producer fewer;  "
             "each consumer writes its 64 rows of $dK_j$, $dV_j$ once, at the end", th, color="muted", ha="right")
    ax.set_ylim(7.8, 0)
    fig.set_size_inches(14.4 * 0.68, 7.8 * 0.68)
    return fig


# --------------------------------------------------------------------------- 8. causal pairing

def causal_pairing(n_blocks: int = 8, *, theme: str = "light") -> Figure:
    """Under a causal mask query block i sees i + 1 key blocks, a triangle of work; pairing block i with
    block n − 1 − i in one program gives every program n + 1 key blocks, the same work."""
    if n_blocks < 2:
        raise ValueError(f"n_blocks must be >= 2, got {n_blocks}")
    th = palette(theme)
    n, programs = n_blocks, (n_blocks + 1) // 2
    fig, (tri, bars) = new_plot(th, (10.5, 4.8), ncols=2, width_ratios=(1, 1.25))
    hue = lambda i: CYCLE[min(i, n - 1 - i) % len(CYCLE)]  # noqa: E731  block i runs in program min(i, n-1-i)
    fill = lambda i: tint(th, hue(i), th.tint if i < n - 1 - i else th.strong)  # noqa: E731
    for i in range(n):
        for j in range(i + 1):   # the diagonal tile is half masked: its lower-left triangle is seen
            corners = [(j, i), (j, i + 1), (j + 1, i + 1)] + ([] if j == i else [(j + 1, i)])
            tri.add_patch(Polygon(corners, facecolor=fill(i), edgecolor=th.bg, linewidth=1))
        add_text(tri, n + 0.15, i + 0.5, f"{i + 1}", th, ha="left")
    add_text(tri, n + 0.15, -0.35, "work", th, color="muted", ha="left")
    tri.set(xlim=(0, n + 1.2), ylim=(n, -0.7), aspect="equal")
    tri.set_xticks([k + 0.5 for k in range(n)], range(n))
    tri.set_yticks([k + 0.5 for k in range(n)], range(n))
    style_axes(tri, th, xlabel="key block j", ylabel="query block i",
               title="causal: query block i sees i + 1 key blocks")
    for p in range(programs):
        left = 0
        for blk in sorted({p, n - 1 - p}):
            bars.barh(p, blk + 1, left=left, color=fill(blk), edgecolor=getattr(th, hue(blk)))
            add_text(bars, left + (blk + 1) / 2, p, f"{blk + 1}", th)
            left += blk + 1
    bars.axvline(n + 1, color=th.ink, linewidth=1.2, linestyle="--")
    add_text(bars, n + 1.15, -0.62, f"n + 1 = {n + 1}", th, ha="left")
    bars.set(xlim=(0, n + 3), ylim=(programs - 0.45, -0.9))
    bars.set_yticks(range(programs), [f"program {p}\n(blocks {p}, {n - 1 - p})" if p != n - 1 - p
                                      else f"program {p}\n(block {p})" for p in range(programs)])
    style_axes(bars, th, xlabel="key blocks computed",
               title=f"paired: program p runs blocks p and {n - 1} − p ({programs} programs)")
    return fig
