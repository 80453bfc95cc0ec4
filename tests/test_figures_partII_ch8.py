"""Chapter 8's figures and numbers: each figure builds in both themes, carries its labels and saves; the
padding ratios obey their bounds; the chapter reads a recording (a synthetic one, and one the recording
script writes in its smoke mode) and says "(not recorded)" without one."""
import random
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from matplotlib.figure import Figure
from matplotlib.text import Text

import fa_lab  # noqa: F401  (picks the world before triton is imported)
from fa_lab import figures
from fa_lab.bench import records
from fa_lab.figures import varlen

ROOT = Path(__file__).resolve().parents[1]

EXPECTED = {
    "packed_batch": ["padded: B × max L = 5 × 13 = 65 positions for 31 tokens", "cu_seqlens", "19 (×2)", "p9",
                     "programs (BLOCK_M = 4)", "seq 2  (L = 0)", "10 programs"],
    "block_schedule": ["cu_blocks", "(0, 2)", "(1, 0)", "(3, 0)", "(4, 0)", "(−1, ·)", "10 programs ≥ Σ blocks = 8",
                       "the last b with cu_blocks[b] ≤ p"],
    "attention_waste": ["16 sequences", "tokens × 2.84", "scores × 4.39", "packed: Σ L² on the diagonal",
                        "padded: 16 × max L²"],
}


def shown(fig: Figure) -> str:
    return "\n".join(t.get_text() for t in fig.findobj(Text) if t.get_visible())


@pytest.mark.parametrize("theme", sorted(figures.THEMES))
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_figure_builds_labels_and_saves(name, theme):
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # a missing glyph, a layout that does not fit, a bad mathtext
        fig = getattr(varlen, name)(theme=theme)
        missing = [s for s in EXPECTED[name] if s not in shown(fig)]
        assert not missing, f"{name} lacks {missing}"
        assert figures.figure_to_png(fig, dpi=50).startswith(b"\x89PNG")
        assert "<svg" in figures.figure_to_svg(fig)


def test_the_schedule_figure_draws_the_kernels_table():
    from fa_lab.kernels.varlen.schedule import schedule_table

    lengths, block_m = (40, 9, 0, 33, 16), 16
    text = shown(varlen.block_schedule(lengths, block_m))
    for b, i in schedule_table(lengths, block_m):
        assert f"({b}, {i})" in text


def test_figures_refuse_what_they_cannot_draw():
    with pytest.raises(ValueError):
        varlen.packed_batch((0, 0))
    with pytest.raises(ValueError):
        varlen.block_schedule((3, -1))
    with pytest.raises(ValueError):
        varlen.padding_ratios([])


def test_chapter_lengths_are_the_draw_written_out():
    lengths = varlen.chapter_lengths()
    assert lengths == varlen.draw_lengths() and len(lengths) == varlen.BATCH
    assert all(varlen.SHORTEST <= n <= varlen.LONGEST for n in lengths)
    assert varlen.draw_lengths(seed=1) != lengths


def test_padding_ratios_closed_form_and_bounds():
    assert varlen.padding_ratios([7, 7, 7]) == dict(tokens=1.0, attention=1.0)
    r = varlen.padding_ratios([1, 3])
    assert r["tokens"] == pytest.approx(2 * 3 / 4) and r["attention"] == pytest.approx(2 * 9 / 10)
    rng = random.Random(0)
    for _ in range(200):   # r_tokens <= r_attention <= r_tokens² (the chapter's proof)
        r = varlen.padding_ratios([rng.randint(0, 500) for _ in range(rng.randint(1, 20))] + [1])
        assert r["tokens"] <= r["attention"] * (1 + 1e-12) and r["attention"] <= r["tokens"] ** 2 * (1 + 1e-12)


def _synthetic():
    """Two masks × two passes of the recording's ``step`` section; the nested tensors refuse causal."""
    import pandas as pd

    rows = []
    for causal in (False, True):
        for mode, scale in (("fwd", 1.0), ("fwd+bwd", 3.5)):
            def rec(impl, ms, **extra):
                return dict(section="step", impl=impl, mode=mode, causal=causal, dtype="bfloat16", ms=ms * scale,
                            flops=1e12 * scale, tflops=1e3 / ms, status="ok", **extra)
            rows += [rec("varlen", 2.0), rec("sdpa-flash-padded", 5.0, tflops_computed=400.0),
                     rec("flash_triton-fixed", 1.0), rec("varlen-fixed", 1.1)]
            rows[-2]["tflops"] = 800.0
            if causal:
                rows.append(dict(section="step", impl="sdpa-nested", mode=mode, causal=True, dtype="bfloat16",
                                 status="unsupported: RuntimeError: No viable backend"))
            else:
                rows.append(rec("sdpa-nested", 3.0))
    return pd.DataFrame(rows)


def test_recorded_values_from_a_synthetic_recording():
    df = _synthetic()
    summary = varlen.recorded_summary(df)
    assert len(summary) == 4 and set(summary["mode"]) == {"fwd", "fwd+bwd"}
    assert summary["vs_padded"].tolist() == pytest.approx([2.5] * 4)
    values = varlen.recorded_values(df)
    assert values["vs_padded"] == "2.50×" and values["vs_nested"] == "1.50×"
    assert values["varlen_tflops"] == "500 TFLOP/s" and values["fixed_tflops"] == "800 TFLOP/s"
    assert values["of_fixed"] == "62%" and values["padded_tflops"] == "400 TFLOP/s"
    assert values["nested_causal"] == "was refused"
    assert summary.loc[summary["causal"], "sdpa-nested_ms"].str.startswith("unsupported").all()
    fig = varlen.recorded_times(df, label="synthetic")
    assert "packed (ours)" in shown(fig) and "SDPA on nested (jagged) tensors" in shown(fig)


def test_without_a_recording_every_value_says_so():
    for df in (None, _synthetic().iloc[:0]):
        assert set(varlen.recorded_values(df).values()) == {varlen.NOT_RECORDED}


def test_the_recording_script_runs_and_the_chapter_reads_it(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_ch8.py"), "--smoke", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    meta, recs = records.read(tmp_path / "gpu_ch8.json")
    assert meta["lengths"] == [9, 0, 21, 4] and meta["sources"] == records.fingerprint("gpu_ch8")
    assert "bench_ch8.py --smoke" in records.command(meta)
    import pandas as pd

    df = pd.DataFrame(recs)
    assert set(df["impl"]) == set(varlen.IMPLS) and set(df["mode"]) == {"fwd", "fwd+bwd"}
    ours = df[df["impl"] == "varlen"]
    assert (ours["status"] == "ok").all() and (ours["padding_ratio_tokens"] > 1).all()
    values = varlen.recorded_values(df)
    assert values["varlen_tflops"] != varlen.NOT_RECORDED and values["of_fixed"].endswith("%")
