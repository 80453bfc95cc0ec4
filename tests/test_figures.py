"""The book's conceptual figures: each builds in both themes, carries its labels, stays legible and
saves cleanly; the schedules and numbers they draw are checked against their closed forms."""
import io
import math
import subprocess
import sys
import warnings

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Polygon, Rectangle, StepPatch
from matplotlib.text import Text

from fa_lab import figures

THEMES = sorted(figures.THEMES)

#: texts each figure must show (substrings of its Text artists, mathtext source included)
EXPECTED = {
    "memory_hierarchy": ["registers", "shared memory / L1", "L2 cache", "HBM3", "256 KB per SM", "228 KB per SM",
                         "50 MB", "80 GB", "3.35 TB/s", "132 SMs", "≈ 33 TB/s"],
    "grid_block_warp": ["gridDim = (4, 3)", "blockDim = (16, 8)", "4 warps", "warp 0: threads 0–31",
                        "warp 3: threads 96–127", "(i, j) = (11, 21)", "cuda.grid(2)", "(1, 1)"],
    "online_softmax_rescaling": ["m_i", "l_i", r"\alpha", "tile 0", "tile 3", "= 0.30", "= 0.45", r"\alpha = 1",
                                 "= 4.12"],
    "fa2_forward_dataflow": ["HBM", "$Q_i$", "$K_j$", "$V_j$", r"S = Q_i K_j^\top", r"\mathrm{lse}_i", "load once",
                             "every iteration", "store once", "epilogue", "m_i", "l_i"],
    "fa2_backward_dataflow": ["HBM", "$dK_j$", "$dV_j$", "$dO_i$", r"$\Delta_i$", "$dQ_i$", "dQ pass", "recomputed",
                              r"\mathrm{rowsum}(dO_i \circ O_i)", "outer loop over key/value blocks j"],
    "pipelining_timeline": ["num_stages = 1", "num_stages = 2", "num_stages = 3", "load 4", "mma 4",
                            "done at t = 15", "done at t = 9", "done at t = 7", "MMAs"],
    "pingpong_timeline": ["warpgroup 1", "warpgroup 2", "softmax", "GEMM", "Tensor Cores", "named barriers",
                          "done at t = 12", "done at t = 7"],
    "warp_specialized_dkdv": ["producer warpgroup", "consumer warpgroup 1", "consumer warpgroup 2", "keys 0–63",
                              "keys 64–127", "stage 0", "stage 1", "TMA copy", "setmaxnreg", "12 warps",
                              r"$dK_j$ += $dS^\top Q_i$"],
    "causal_pairing": ["query block i", "key block j", "program 0", "program 3", "(blocks 0, 7)", "n + 1 = 9"],
}


def texts(fig: Figure) -> list[Text]:
    """The texts a reader sees: not empty, and no tick label outside its axes' view (never drawn)."""
    hidden = set()
    for ax in fig.axes:
        for axis, lim in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
            lo, hi = sorted(lim)
            hidden |= {id(tick.label1) for tick in axis.get_major_ticks() if not lo <= tick.get_loc() <= hi}
    return [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip() and id(t) not in hidden]


def luminance(color) -> float:
    """WCAG relative luminance."""
    lin = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in to_rgb(color)]
    return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]


def contrast(a, b) -> float:
    hi, lo = sorted((luminance(a), luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def test_every_figure_is_listed():
    assert set(figures.FIGURES) == set(EXPECTED)


@pytest.mark.parametrize("theme", THEMES)
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_figure_builds_labels_and_saves(name, theme):
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # a missing glyph, a layout that does not fit, a bad mathtext
        fig = figures.FIGURES[name](theme=theme)
        assert isinstance(fig, Figure)
        shown = "\n".join(t.get_text() for t in texts(fig))
        missing = [s for s in EXPECTED[name] if s not in shown]
        assert not missing, f"{name} lacks {missing}"
        png = figures.figure_to_png(fig, dpi=60)
        svg = figures.figure_to_svg(fig)
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg and svg.rstrip().endswith("</svg>")
    assert to_rgb(fig.get_facecolor()) == to_rgb(figures.THEMES[theme]["bg"])   # opaque: legible on any page


@pytest.mark.parametrize("theme", THEMES)
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_text_is_inside_the_figure_and_does_not_collide(name, theme):
    fig = figures.FIGURES[name](theme=theme)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    width, height = canvas.get_width_height()
    boxes = []
    for t in texts(fig):
        box = t.get_window_extent(renderer)
        assert box.x0 >= -1 and box.y0 >= -1 and box.x1 <= width + 1 and box.y1 <= height + 1, \
            f"{t.get_text()!r} is cut off at the figure's edge"
        boxes.append((t.get_text(), box.shrunk(0.97, 0.8)))   # ascenders and descenders may touch
    for k, (a, box_a) in enumerate(boxes):
        for b, box_b in boxes[k + 1:]:
            assert not box_a.overlaps(box_b), f"{a!r} overlaps {b!r}"


@pytest.mark.parametrize("theme", THEMES)
def test_palette_is_legible(theme):
    th = figures.palette(theme)
    assert contrast(th.ink, th.bg) >= 7 and contrast(th.muted, th.bg) >= 4.5
    for hue in figures.CYCLE:   # text sits on tinted fills up to the strong amount (and the warp cells' 0.35)
        for amount in (0.04, 0.08, th.tint, 0.35, th.strong):
            fill = figures.tint(th, hue, amount)
            assert contrast(th.ink, fill) >= 4.5, (hue, amount)
            assert contrast(th.muted, fill) >= 3 or amount > 0.1, (hue, amount)


@pytest.mark.parametrize("theme", THEMES)
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_text_colours_come_from_the_palette(name, theme):
    th = figures.palette(theme)
    allowed = {to_rgb(th.ink), to_rgb(th.muted)}
    for t in texts(figures.FIGURES[name](theme=theme)):
        assert to_rgb(t.get_color()) in allowed, (t.get_text(), t.get_color())
        assert t.get_fontsize() == figures.FONT_SIZE, (t.get_text(), t.get_fontsize())


def test_online_softmax_steps_match_the_whole_row(seed):
    rng = np.random.default_rng(seed)
    for _ in range(20):
        s = rng.normal(scale=rng.uniform(0.1, 30), size=rng.integers(1, 40))
        block_n = int(rng.integers(1, 9))
        steps = figures.online_softmax_steps(s, block_n)
        assert len(steps) == math.ceil(s.size / block_n)
        for st in steps:
            assert st["m_new"] == s[:st["stop"]].max()
            assert st["alpha"] == pytest.approx(math.exp(st["m_old"] - st["m_new"]), rel=1e-12)
            assert st["l"] == pytest.approx(np.exp(s[:st["stop"]] - st["m_new"]).sum(), rel=1e-12)
        assert steps[0]["alpha"] == 0.0


def test_online_softmax_figure_draws_the_running_max():
    fig = figures.online_softmax_rescaling()
    row = np.array(figures.EXAMPLE_ROW)
    top = fig.axes[0]
    (m_line,) = [p for p in top.patches if isinstance(p, StepPatch)]
    np.testing.assert_array_equal(m_line.get_data().values, np.maximum.accumulate(row.reshape(4, 4).max(axis=1)))
    shown = "\n".join(t.get_text() for t in texts(fig))
    for m_old, m_new in ((1.1, 2.3), (2.3, 3.1)):   # where the example's max grows
        assert f"= {math.exp(m_old - m_new):.2f}$" in shown
    assert f"= {np.exp(row - row.max()).sum():.2f}$" in shown


def test_online_softmax_takes_another_row():
    fig = figures.online_softmax_rescaling([3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0], block_n=3)
    (m_line,) = [p for p in fig.axes[0].patches if isinstance(p, StepPatch)]
    np.testing.assert_array_equal(m_line.get_data().values, [4.0, 9.0, 9.0])


@pytest.mark.parametrize("load_latency, mma_time", [(2.0, 1.0), (0.5, 1.5), (3.0, 0.7)])
def test_pipeline_schedule(load_latency, mma_time):
    n = 7
    ends = []
    for stages in range(1, 7):
        loads, mmas = figures.pipeline_schedule(stages, n, load_latency, mma_time)
        for k in range(n):
            assert mmas[k][0] >= loads[k][1]                      # an MMA waits for its tile
            assert k == 0 or mmas[k][0] >= mmas[k - 1][1]         # one MMA at a time
            assert k < stages or loads[k][0] >= mmas[k - stages][1]   # a buffer is reused once consumed
        in_flight = max(sum(a <= t < b for a, b in loads) for t, _ in loads)
        assert in_flight <= stages
        ends.append(mmas[-1][1])
    assert ends[0] == pytest.approx(n * (load_latency + mma_time))   # no overlap at all
    assert all(a >= b - 1e-12 for a, b in zip(ends, ends[1:]))       # more stages never hurt
    deep = 1 + math.ceil(load_latency / mma_time)                     # enough buffers to hide the load
    if deep <= 6:
        assert ends[deep - 1] == pytest.approx(load_latency + n * mma_time)


@pytest.mark.parametrize("gemm, softmax", [(1.0, 1.0), (1.0, 0.6), (0.7, 1.3)])
def test_pingpong_schedule(gemm, softmax):
    n = 4
    (one,) = figures.pingpong_schedule(1, 2 * n, gemm, softmax)
    assert one[-1][2] == pytest.approx(2 * n * (gemm + softmax))
    two = figures.pingpong_schedule(2, n, gemm, softmax)
    gemms = sorted((a, b) for p in two for name, a, b in p if name == "GEMM")
    assert len(gemms) == 2 * n
    assert all(b <= c + 1e-12 for (_, b), (c, _) in zip(gemms, gemms[1:]))   # the Tensor Cores run one GEMM
    for p in two:                                                              # a warpgroup runs one phase
        assert all(p[k][2] <= p[k + 1][1] + 1e-12 for k in range(len(p) - 1))
    if softmax <= gemm:   # the other's GEMM covers every softmax: the Tensor Cores never wait
        assert gemms[-1][1] == pytest.approx(2 * n * gemm)
    assert max(p[-1][2] for p in two) < one[-1][2]


@pytest.mark.parametrize("n_blocks", [2, 7, 8, 11])
def test_causal_pairing_balances_the_work(n_blocks):
    fig = figures.causal_pairing(n_blocks)
    tri, bars = fig.axes
    assert len([p for p in tri.patches if isinstance(p, Polygon)]) == n_blocks * (n_blocks + 1) // 2
    work = {}
    for r in bars.patches:
        if isinstance(r, Rectangle) and r.get_width() > 0:
            row = round(r.get_y() + r.get_height() / 2)
            work[row] = work.get(row, 0) + r.get_width()
    programs = (n_blocks + 1) // 2
    assert sorted(work) == list(range(programs))
    assert sum(work.values()) == n_blocks * (n_blocks + 1) // 2        # every block runs exactly once
    full = [w for p, w in work.items() if p != n_blocks - 1 - p]
    assert full == [n_blocks + 1] * (n_blocks // 2)
    if n_blocks % 2:
        assert work[programs - 1] == (n_blocks + 1) // 2                # the middle block runs alone


def test_memory_hierarchy_takes_other_numbers():
    fig = figures.memory_hierarchy(sm_count=108, registers_per_sm_kb=256, smem_per_sm_kb=164, l2_mb=40,
                                   hbm_gb=80, hbm_tbs=2.039, clock_ghz=1.41, l2_tbs=5.0, name="A100 SXM4")
    shown = "\n".join(t.get_text() for t in texts(fig))
    for s in ("A100 SXM4", "164 KB per SM", "17.3 MB in all", "40 MB", "2.039 TB/s", "≈ 19 TB/s", "≈ 5 TB/s"):
        assert s in shown, s


def test_jupyter_shows_the_figure_without_pyplot():
    fig = figures.causal_pairing()
    png, meta = fig._repr_png_()
    assert png.startswith(b"\x89PNG")
    assert (meta["width"], meta["height"]) == tuple(int(v) for v in fig.get_size_inches() * fig.dpi)


def test_import_draws_nothing():
    code = ("import sys, fa_lab.figures; import matplotlib; "
            "assert 'matplotlib.pyplot' not in sys.modules, 'pyplot imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("call", [
    lambda: figures.memory_hierarchy(theme="sepia"),
    lambda: figures.grid_block_warp(block=(4, 0)),
    lambda: figures.grid_block_warp(thread=(0, 8)),
    lambda: figures.online_softmax_rescaling([]),
    lambda: figures.online_softmax_rescaling([1.0, float("nan")]),
    lambda: figures.online_softmax_rescaling(np.ones((2, 2))),
    lambda: figures.online_softmax_rescaling(block_n=0),
    lambda: figures.pipelining_timeline(num_stages=0),
    lambda: figures.pipelining_timeline(num_stages=2.5),
    lambda: figures.pingpong_timeline(iterations=0),
    lambda: figures.causal_pairing(1),
])
def test_bad_arguments_raise(call):
    with pytest.raises(ValueError):
        call()


def test_figures_are_independent():
    a, b = figures.causal_pairing(), figures.causal_pairing()
    assert a is not b and a.axes[0] is not b.axes[0]
    buf = io.BytesIO()
    a.savefig(buf, format="png")   # saving one leaves the other untouched
    assert len(b.axes) == 2
