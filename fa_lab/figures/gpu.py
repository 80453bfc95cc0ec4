"""Figures of the GPU itself: the memory hierarchy, the grid of blocks and warps, and two timelines of
how a kernel keeps the Tensor Cores busy (software pipelining, FA3's warpgroup ping-pong)."""
from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.patches import Polygon, Rectangle
from matplotlib.transforms import blended_transform_factory

from fa_lab.figures.style import add_arrow, add_box, add_text, new_canvas, new_plot, palette, style_axes, tint

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
    fig, ax = new_canvas(th, 15.2, 6.0)
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
    add_text(ax, 0.2, 0.45, f"{name} memory hierarchy: size and bandwidth", th, ha="left", fontweight="bold")
    cx, top, pitch = 4.2, 1.0, 1.17
    half = lambda k: 0.6 + 0.62 * k  # noqa: E731  half-widths grow down the pyramid
    for k, (label, hue, size, bandwidth) in enumerate(levels):
        y0, y1 = top + k * pitch, top + k * pitch + 1.05
        ax.add_patch(Polygon([(cx - half(k), y0), (cx + half(k), y0), (cx + half(k + 1), y1), (cx - half(k + 1), y1)],
                             facecolor=tint(th, hue, th.strong), edgecolor=getattr(th, hue), linewidth=1.3))
        add_text(ax, cx, (y0 + y1) / 2, label, th, fontweight="bold")
        ax.plot([cx + half(k + 0.5) + 0.1, 7.6], [(y0 + y1) / 2] * 2, color=th.line, linewidth=0.8)
        add_text(ax, 7.7, y0 + 0.3, size, th, ha="left")
        add_text(ax, 7.7, y0 + 0.72, bandwidth, th, color="muted", ha="left")
    chip_edge = top + 3 * pitch - 0.06
    ax.plot([0.2, 15.0], [chip_edge, chip_edge], color=th.line, linewidth=1, linestyle="--")
    add_text(ax, 15.0, chip_edge - 0.2, "on chip ↑", th, color="muted", ha="right")
    add_text(ax, 15.0, chip_edge + 0.2, "off chip ↓", th, color="muted", ha="right")
    add_arrow(ax, (0.45, top + 4 * pitch - 0.12), (0.45, top), th)
    add_text(ax, 0.75, top + 2 * pitch, "faster, smaller", th, color="muted", rotation=90)
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
    fig, ax = new_canvas(th, bx0 + bdx * cell + 3.4, note_y + 2.15)
    add_text(ax, x0, 0.35, f"grid: gridDim = ({gx}, {gy}) blocks", th, ha="left", fontweight="bold")
    add_text(ax, x0 + gx * step / 2, y0 - 0.3, "x →", th, color="muted")
    add_text(ax, x0 - 0.3, y0 + gy * step / 2, "y ↓", th, color="muted")
    for r in range(gy):
        for c in range(gx):
            here = (c, r) == (bx, by)
            add_box(ax, x0 + c * step, y0 + r * step, 1, 1, th, "blue", f"({c}, {r})",
                    amount=th.strong if here else 0.08, fontweight="bold" if here else "normal")
    warps = -(-bdx * bdy // 32)
    add_text(ax, bx0, 0.35, f"block ({bx}, {by}): blockDim = ({bdx}, {bdy}), {bdx * bdy} threads = {warps} warps",
             th, ha="left", fontweight="bold")
    for r in range(bdy):
        for c in range(bdx):
            hue = "orange" if (c, r) == (tx, ty) else ("green" if (r * bdx + c) // 32 % 2 else "blue")
            ax.add_patch(Rectangle((bx0 + c * cell, y0 + r * cell), cell, cell, edgecolor=th.bg, linewidth=0.8,
                                   facecolor=tint(th, hue, 0.9 if hue == "orange" else 0.35)))
    for w in range(warps):
        rows = [t // bdx for t in range(32 * w, min(32 * (w + 1), bdx * bdy))]
        add_text(ax, bx0 + bdx * cell + 0.15, y0 + (rows[0] + rows[-1] + 1) / 2 * cell,
                 f"warp {w}: threads {32 * w}–{32 * w + len(rows) - 1}", th, ha="left")
    for corner in (0, 1):   # the opened block's outline, traced back to its place in the grid
        ax.plot([x0 + bx * step + 1, bx0], [y0 + by * step + corner, y0 + corner * bdy * cell],
                color=th.line, linewidth=0.8, linestyle=":")
    i, j, tx_x = by * bdy + ty, bx * bdx + tx, bx0 + (tx + 0.5) * cell
    add_arrow(ax, (tx_x, note_y - 0.3), (tx_x, y0 + (ty + 1) * cell), th, hue="orange")
    add_text(ax, tx_x - 0.2, note_y, f"threadIdx = ({tx}, {ty}) is thread (i, j) = ({i}, {j})", th, ha="left")
    add_text(ax, x0, note_y + 0.65, f"i (row) = blockIdx.y · blockDim.y + threadIdx.y = {by} · {bdy} + {ty} = {i}",
             th, ha="left")
    add_text(ax, x0, note_y + 1.15, f"j (column) = blockIdx.x · blockDim.x + threadIdx.x = {bx} · {bdx} + {tx} = {j}"
             "      (in Numba: j, i = cuda.grid(2))", th, ha="left")
    add_text(ax, x0, note_y + 1.75, "a warp is 32 consecutive threads of tid = threadIdx.y · blockDim.x + threadIdx.x "
             "(x varies fastest): they run each instruction together", th, color="muted", ha="left")
    return fig


# --------------------------------------------------------------------------- 6, 7. timelines

def _timeline(th, groups, xmax: float, xlabel: str):
    """A figure of lanes of bars on one time axis.  ``groups``: [(title, [(lane name, height)], [bar])],
    a bar being (lane, start, duration, hue, label, (top, bottom) fraction of the lane it fills).
    Returns the figure, its axes and the top of every lane, per group."""
    height = sum(0.7 + sum(h for _, h in lanes) + 0.3 for _, lanes, _ in groups)
    fig, ax = new_plot(th, (10, 0.75 + 0.55 * height))
    y, ticks, names, tops = 0.0, [], [], []
    left = blended_transform_factory(ax.transAxes, ax.transData)
    for title, lanes, bars in groups:
        add_text(ax, 0.006, y + 0.45, title, th, ha="left", fontweight="bold", transform=left)
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
            add_text(ax, start + dur / 2, top + h * (f0 + f1) / 2, label, th)
        y += 0.3
    ax.set(xlim=(0, xmax), ylim=(y, 0))
    ax.set_yticks(ticks, names)
    style_axes(ax, th, xlabel=xlabel)
    ax.tick_params(axis="y", length=0)
    return fig, ax, tops


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
    add_text(ax, end * 1.01, tops[1][0] + 1.2, "dashed: named barriers\n(bar.sync / bar.arrive) hand the\nTensor "
             "Cores from one warpgroup\nto the other: one's GEMM overlaps\nthe other's softmax", th, color="muted",
             ha="right", linespacing=1.3)
    return fig
