"""Chapter 9's figures and its recording as the chapter reads it.

Each figure builds in both themes, shows its labels, keeps its text inside the figure and apart, and
draws what the kernels' own arithmetic says (the heuristic's split count, the intensity of a
decoding step).  The chapter's reading of ``gpu_ch9`` is checked on a synthetic recording with known
numbers, on no recording at all (every quoted number reads "(not recorded)"), and on what
``scripts/bench_ch9.py --smoke`` writes.
"""
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pandas as pd
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.text import Text

import fa_lab
from fa_lab.bench import records
from fa_lab.figures import FONT_SIZE, THEMES, decoding, figure_to_png, figure_to_svg, palette
from fa_lab.kernels.decode.configs import num_splits_heuristic, wave_efficiency

ROOT = Path(__file__).resolve().parents[1]

#: texts each figure must show (substrings of its Text artists)
EXPECTED = {
    "decode_roofline": ["ridge: 295 FLOP/B", "no GQA packing: 1 FLOP/B", "group 4 packed: 4 FLOP/B",
                        "Nq = 4, group 4 packed: 16 FLOP/B", "BLOCK_M = 128"],
    "split_kv_grid": ["q tile", "program: split 0", "program: split 3", r"\mathrm{lse}_3", "combine:",
                      "o, lse of each row"],
    "wave_efficiency": ["8 programs before splitting", "64 programs before splitting", "85% of the best",
                        "heuristic: S = 15", "heuristic: S = 1", "132 SMs, 1 resident per SM: 132 slots"],
    "paged_cache": ["seq 0: 40 tokens", "p0 →", "free", "block_table[b, j // page_size]", "physical blocks"],
}
KWARGS = {"wave_efficiency": dict(programs=(8, 64), keys=65536, max_splits=40)}


def texts(fig: Figure) -> list[Text]:
    """The texts a reader sees: not empty, and no tick label outside its axes' view."""
    hidden = set()
    for ax in fig.axes:
        for axis, lim in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
            lo, hi = sorted(lim)
            hidden |= {id(t.label1) for t in axis.get_major_ticks() if not lo <= t.get_loc() <= hi}
    return [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip() and id(t) not in hidden]


def assert_legible(fig: Figure, theme: str, check_font: bool = True) -> None:
    """Every text inside the figure, none on another, in the palette's ink at the book's font size."""
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    width, height = canvas.get_width_height()
    th = palette(theme)
    boxes = []
    for t in texts(fig):
        box = t.get_window_extent(renderer)
        assert box.x0 >= -1 and box.y0 >= -1 and box.x1 <= width + 1 and box.y1 <= height + 1, \
            f"{t.get_text()!r} is cut off at the figure's edge"
        boxes.append((t.get_text(), box.shrunk(0.97, 0.8)))
        assert to_rgb(t.get_color()) in {to_rgb(th.ink), to_rgb(th.muted)}, (t.get_text(), t.get_color())
        if check_font:
            assert t.get_fontsize() == FONT_SIZE, (t.get_text(), t.get_fontsize())
    for k, (a, box_a) in enumerate(boxes):
        for b, box_b in boxes[k + 1:]:
            assert not box_a.overlaps(box_b), f"{a!r} overlaps {b!r}"
    assert to_rgb(fig.get_facecolor()) == to_rgb(THEMES[theme]["bg"])


@pytest.mark.parametrize("theme", sorted(THEMES))
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_figure_builds_labels_and_is_legible(name, theme):
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # a missing glyph, a layout that does not fit, a bad mathtext
        fig = getattr(decoding, name)(theme=theme, **KWARGS.get(name, {}))
        shown = "\n".join(t.get_text() for t in texts(fig))
        missing = [s for s in EXPECTED[name] if s not in shown]
        assert not missing, f"{name} lacks {missing}"
        png = figure_to_png(fig, dpi=60)
        svg = figure_to_svg(fig)
    assert png.startswith(b"\x89PNG") and "<svg" in svg
    assert_legible(fig, theme)


@pytest.mark.parametrize("group,n_q,itemsize", [(1, 1, 2), (4, 1, 2), (8, 4, 2), (4, 1, 4)])
def test_intensity_is_flops_over_bytes_of_k_and_v(group, n_q, itemsize):
    b, hkv, n_k, d = 3, 2, 1000, 64
    flops = fa_lab.attention_flops(b, hkv * group, n_q, n_k, d)
    kv_bytes = 2 * b * hkv * n_k * d * itemsize
    assert decoding.decode_intensity(group, n_q, itemsize) == pytest.approx(flops / kv_bytes)


@pytest.mark.parametrize("programs", [(8, 64), (3, 100, 500)])
def test_wave_figure_draws_the_model_and_marks_the_heuristics_choice(programs):
    fig = decoding.wave_efficiency(programs=programs, keys=65536, max_splits=30)
    for ax, p in zip(fig.axes, programs):
        bars = [r for r in ax.patches if r.get_width() > 0]
        assert [round(r.get_height(), 12) for r in bars] == [round(wave_efficiency(p * s, 132), 12)
                                                              for s in range(1, 31)]
        chosen = num_splits_heuristic(p, 65536, 64, 132)
        green = to_rgb(palette().green)
        strong = [round(r.get_x() + r.get_width() / 2) for r in bars if r.get_edgecolor()[:3] == green]
        assert strong == ([chosen] if chosen <= 30 else [])


def test_paged_figure_maps_every_page_once():
    lengths, page = (40, 22, 55), 16
    fig = decoding.paged_cache(lengths, page)
    shown = [t.get_text() for t in texts(fig)]
    pages = [s for s in shown if s.startswith("p") and "→" in s]
    assert len(pages) == sum(-(-n // page) for n in lengths)
    blocks = [int(s.split("→")[1]) for s in pages]
    assert len(set(blocks)) == len(blocks)                    # no block holds two pages
    assert all(f"block {b}" in shown for b in blocks)
    with pytest.raises(ValueError, match="do not fit"):
        decoding.paged_cache((100, 100), 16, n_blocks=8)


# --------------------------------------------------------------------------- the recording, read for the chapter

def _rec(section, impl, shape, dtype="float16", page_size=0, **fields):
    b, h, hkv, nq, nk, d = shape
    return dict(section=section, impl=impl, batch=b, heads=h, kv_heads=hkv, n_q=nq, n_k=nk, head_dim=d, dtype=dtype,
                page_size=page_size, **fields)


def synthetic(tmp_path) -> pd.DataFrame:
    """A recording with round numbers: the copy at 3 TB/s, ours at 2.4 TB/s (80%), SDPA 1.5× and 2× slower."""
    shape, kv = (8, 32, 8, 1, 8192, 128), 2 * 8 * 8 * 8192 * 128 * 2
    us = kv / 2.4e12 * 1e6
    rows = [
        _rec("decode", "triton_decode", shape, status="ok", gpu_us=us, bandwidth=2.4e12, splits=1, kv_bytes=kv,
             host_us_per_call=40.0),
        _rec("decode", "sdpa-flash", shape, status="ok", gpu_us=1.5 * us, bandwidth=1.6e12, kv_bytes=kv,
             host_us_per_call=20.0),
        _rec("decode", "sdpa-cudnn", shape, status="ok", gpu_us=2 * us, bandwidth=1.2e12, kv_bytes=kv,
             host_us_per_call=25.0),
        _rec("decode", "copy", shape, status="ok", gpu_us=2 * kv / 3e12 * 1e6, bandwidth=3e12, kv_bytes=kv),
        _rec("decode", "triton_decode", shape, page_size=16, status="ok", gpu_us=1.25 * us, bandwidth=2.4e12 / 1.25,
             splits=1, kv_bytes=kv, host_us_per_call=41.0),
        _rec("decode", "sdpa-flash", shape, page_size=16, status="unsupported: SDPA takes no paged KV cache"),
        _rec("decode", "copy", shape, page_size=16, status="ok", gpu_us=2 * kv / 3e12 * 1e6, bandwidth=3e12,
             kv_bytes=kv),
        # the same pages in the order an allocator hands them out (the row above, older, names no placement),
        # read in pool order, and in key order beside it
        _rec("decode", "triton_decode", shape, page_size=16, placement="allocator order", status="ok",
             gpu_us=1.05 * us, bandwidth=2.4e12 / 1.05, splits=1, pool_order=True, kv_bytes=kv,
             host_us_per_call=41.0),
        _rec("decode", "triton_decode_key_order", shape, page_size=16, placement="allocator order", status="ok",
             gpu_us=1.1 * us, bandwidth=2.4e12 / 1.1, splits=2, kv_bytes=kv),
    ]
    rows += [_rec("loop", "triton_decode", shape, page_size=16, placement="scattered", status="ok", gpu_us=92.5,
                  pool_order=True, steps=256),
             _rec("loop", "triton_decode_key_order", shape, page_size=16, placement="scattered", status="ok",
                  gpu_us=94.25, pool_order=False, steps=256)]
    rows += [_rec("splits", "triton_decode", shape, num_splits=s, chosen=s == 1, gpu_us=us * (1 + 0.1 * (s == 4)),
                  status="ok") for s in (1, 2, 4)]
    long = (1, 32, 8, 1, 65536, 128)
    rows += [_rec("splits", "triton_decode", long, num_splits=s, chosen=s == 29, gpu_us=100.0 / min(s, 16),
                  status="ok") for s in (1, 16, 29)]
    path = records.write(tmp_path / "gpu_ch9.json", rows, records.metadata("python scripts/bench_ch9.py"))
    _, recs = records.read(path)
    return pd.DataFrame.from_records(recs)


def test_summary_and_quoted_numbers_of_a_synthetic_recording(tmp_path):
    df = synthetic(tmp_path)
    us = 2 * 8 * 8 * 8192 * 128 * 2 / 2.4e12 * 1e6
    summary = decoding.recorded_summary(df)
    assert list(summary["cache"]) == ["contiguous", "paged, 16-token pages, scattered",
                                      "paged, 16-token pages, allocator order"]
    first = summary.iloc[0]
    assert first["of_copy"] == pytest.approx(0.8) and first["ours (TB/s)"] == pytest.approx(2.4)
    assert first["vs_sdpa_flash"] == pytest.approx(1.5) and first["vs_sdpa_cudnn"] == pytest.approx(2.0)
    assert summary.iloc[1]["sdpa_flash_us"].startswith("unsupported")
    values = decoding.recorded_values(df)
    assert values["of_copy"] == "80%" and values["copy_tbs"] == "3.00 TB/s"
    assert values["vs_flash"] == "1.50×" and values["vs_cudnn"] == "2.00×"
    assert values["host_ours"] == "40 µs" and values["host_sdpa"] == "20 µs"
    assert values["paged_16"] == "1.25×" and values["paged_256"] == decoding.NOT_RECORDED
    assert values["paged_16_in_order"] == "1.05×" and values["paged_splits"] == "1"   # the scattered pages' splits
    assert values["paged_16_in_order_key_order"] == "1.10×" and values["paged_16_key_order"] == decoding.NOT_RECORDED
    assert values["loop_us"] == "92.5 µs" and values["loop_key_order_us"] == "94.2 µs"
    assert values["paged_16_vs_cudnn"] == "1.60×"    # cuDNN on the contiguous cache (2·us) ÷ ours on pages (1.25·us)
    assert list(summary["order"])[1:] == ["key", "pool"] and pd.isna(summary.iloc[0]["order"])
    assert summary.iloc[2]["key_order_us"] == pytest.approx(1.1 * us) and pd.isna(summary.iloc[1]["key_order_us"])
    assert "heuristic's S = 1 took 1.00× the time of the fastest, S = 1" in values["sweep"]
    assert "(1, 32, 8, 1, 65536, 128) the heuristic's S = 29 took 1.00× the time of the fastest, S = 16" \
        in values["sweep"]
    from fa_lab.core.tables import frame

    shown = frame(summary, kinds={"of_copy": "percent"})
    assert "unsupported" in shown.to_string()
    for theme in sorted(THEMES):
        assert_legible(decoding.recorded_bandwidth(df, label="synthetic", theme=theme), theme, check_font=False)
        assert_legible(decoding.recorded_splits(df, theme=theme), theme, check_font=False)


def test_no_recording_quotes_not_recorded():
    values = decoding.recorded_values(None)
    assert values and set(values.values()) == {decoding.NOT_RECORDED}
    assert decoding.recorded_values(pd.DataFrame()) == values


def test_the_recording_script_writes_what_the_chapter_reads(tmp_path):
    """``--smoke``: tiny problems in whatever world this is, the recording format end to end."""
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_ch9.py"), "--smoke", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    meta, recs = records.read(tmp_path / "gpu_ch9.json")
    assert meta["command"].startswith("python scripts/bench_ch9.py")
    assert meta["sources"] == records.fingerprint("gpu_ch9")
    df = pd.DataFrame.from_records(recs)
    assert {"decode", "loop", "splits"} <= set(df["section"])
    ours = df[(df["section"] == "decode") & (df["impl"] == "triton_decode")]
    assert (ours["status"] == "ok").all() and (ours["gpu_us"] > 0).all() and (ours["host_us_per_call"] > 0).all()
    paged = ours[ours["page_size"] > 0]
    assert len(paged) and (paged["max_abs_diff_vs_contiguous"] == 0).all()
    assert set(paged["placement"]) == {"scattered", "allocator order"} and ours[ours["page_size"] == 0][
        "placement"].isna().all()
    cudnn = df[(df["section"] == "decode") & (df["impl"] == "sdpa-cudnn")]
    if not fa_lab.ON_GPU:
        assert cudnn["status"].str.startswith("unsupported").all()
    summary = decoding.recorded_summary(df)
    keys = ["dtype", "batch", "n_k", "page_size", "placement"]
    assert len(summary) == len(df[df["section"] == "decode"].groupby(keys, dropna=False))
    values = decoding.recorded_values(df)
    assert values["of_copy"] != decoding.NOT_RECORDED and values["sweep"] != decoding.NOT_RECORDED
    json.dumps(values)


def test_the_recording_script_answers_help():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_ch9.py"), "--help"], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0 and "--quick" in done.stdout and "--smoke" in done.stdout
