"""Chapter 10's figures and its reading of the recording: each figure builds in both themes, carries its labels
and saves; the numbers they draw agree with their closed forms; the chapter reads a recording that
``scripts/bench_ch10.py`` wrote, and says "(not recorded)" without one."""
import json
import math
import warnings
from pathlib import Path

import pandas as pd
import pytest
from matplotlib.figure import Figure
from matplotlib.text import Text
from script_loader import load_script

from fa_lab import figures
from fa_lab.bench import records
from fa_lab.figures import score_mods as sm
from fa_lab.kernels.triton.key_ranges import key_block_ranges

ROOT = Path(__file__).resolve().parents[1]
THEMES = sorted(figures.THEMES)

EXPECTED = {
    "softcap_row": ["the soft cap", "one row of scores, before and after the cap", "+cap = 30", "largest weight",
                    "softmax weight, capped", "slope (the backward's factor)"],
    "alibi_biases": ["head 1 of 8", "slope 2^-1 = 0.5", "head 8 of 8", "bias added to the score",
                     "query i sits at key i + 6"],
    "score_mod_cost": ["D = 64", "D = 128", "softcap, tanh.approx", "softcap, exp2 + reciprocal", "ALiBi",
                       "special-function unit", "Tensor Cores: 4·D FLOPs", "1.00×", "clock cycles per score per SM"],
    "block_mask_tiles": ["causal\n28 full, 8 partial, 28 skipped of 64 tiles", "sliding window of 64",
                         "documents 96, 40, 120, causal", "full: no mask_mod", "empty: never loaded"],
}


def shown_text(fig: Figure) -> str:
    return "\n".join(t.get_text() for t in fig.findobj(Text) if t.get_visible())


@pytest.mark.parametrize("theme", THEMES)
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_figure_builds_labels_and_saves(name, theme):
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # a missing glyph, a layout that does not fit, a bad mathtext
        fig = getattr(sm, name)(theme=theme)
        text = shown_text(fig)
        missing = [s for s in EXPECTED[name] if s not in text]
        assert not missing, f"{name} lacks {missing}"
        assert figures.figure_to_png(fig, dpi=50).startswith(b"\x89PNG")
        assert figures.figure_to_svg(fig).rstrip().endswith("</svg>")


def test_softcap_bounds_and_is_nearly_the_identity_near_zero():
    s = [-1e6, -60.0, -1.0, 0.0, 0.5, 60.0, 1e6]
    c = sm.softcap(s, 30.0)
    assert all(abs(x) < 30.0 + 1e-12 for x in c) and c[3] == 0.0
    assert abs(c[4] - (0.5 - 0.5 ** 3 / (3 * 30.0 ** 2))) < 1e-8      # s − s³/(3 cap²) + O(s⁵)
    assert list(sm.softcap(s, 0.0)) == s
    with pytest.raises(ValueError):
        sm.softcap_row(cap=0.0)


def test_alibi_bias_matrix_is_the_reference_bias():
    import torch

    from fa_lab.core.reference import alibi_bias

    for n_q, n_k in ((5, 9), (9, 5), (4, 4)):
        ref = alibi_bias(n_q, n_k, torch.tensor([[0.25]]))[0, 0].numpy()
        assert (sm.alibi_bias_matrix(n_q, n_k, 0.25) == ref).all()


def test_score_costs_follow_the_preset():
    from fa_lab.perf.devices import get_device

    dev = get_device("H100_80GB")
    per_clk = dev.sm_count * dev.boost_clock_mhz * 1e6
    for d in (64, 128):
        rows = {r["variant"]: r for r in sm.score_costs(d)}
        assert rows["none"]["tensor"] == pytest.approx(4 * d * per_clk / dev.tensor_flops["bf16"])
        assert rows["none"]["sfu"] == pytest.approx(1 / dev.sfu_per_clk_per_sm)
        assert rows["none"]["vs_none"] == 1.0
        for r in rows.values():
            assert r["cycles"] == max(r["tensor"], r["sfu"], r["fp32"]) and r["vs_none"] >= 1.0
    # at D = 128 the Tensor Cores still bound a hardware tanh; two special-function results per tanh do not
    rows = {r["variant"]: r for r in sm.score_costs(128)}
    assert rows["softcap, tanh.approx"]["bound"] == "tensor"
    assert rows["softcap, exp2 + reciprocal"]["bound"] == "sfu"


@pytest.mark.parametrize("n,block", [(256, 32), (96, 16)])
def test_causal_blocks_closed_form(n, block):
    kinds = sm.classify_blocks(lambda i, j: j <= i, n, n, block, block)
    nb = n // block
    assert (kinds == sm.FULL).sum() == nb * (nb - 1) // 2
    assert (kinds == sm.PARTIAL).sum() == nb
    assert (kinds == sm.EMPTY).sum() == nb * (nb - 1) // 2


@pytest.mark.parametrize("n_q,n_k,left,right", [(64, 128, -1, 0), (128, 64, -1, 0), (96, 96, 40, 0),
                                                (64, 96, 20, 30), (96, 64, -1, 16)])
def test_block_classes_are_chapter_4s_key_ranges(n_q, n_k, left, right):
    """Non-empty blocks are the ones chapter 4's kernel visits; full blocks the ones it runs without a mask."""
    bm = bn = 16
    diag = n_k - n_q

    def mod(i, j):
        ok = j >= 0
        if left >= 0:
            ok = ok & (j >= i + diag - left)
        if right >= 0:
            ok = ok & (j <= i + diag + right)
        return ok & (j < n_k)

    kinds = sm.classify_blocks(mod, n_q, n_k, bm, bn)
    for r in range(kinds.shape[0]):
        lo, mid_lo, mid_hi, hi = key_block_ranges(r * bm, bm, bn, n_q, n_k, left, right)
        visited = set(range(lo // bn, math.ceil(hi / bn))) if hi > lo else set()
        assert visited == {c for c in range(kinds.shape[1]) if kinds[r, c] != sm.EMPTY}, r
        assert set(range(mid_lo // bn, mid_hi // bn)) == {c for c in range(kinds.shape[1]) if kinds[r, c] == sm.FULL}


def test_block_mask_tiles_refuses_documents_that_do_not_fill_n():
    with pytest.raises(ValueError):
        sm.block_mask_tiles(n=256, documents=(100, 100))


# --------------------------------------------------------------------------- the recording

def _record(impl, mode, causal, mod, ms, **extra):
    flops = 4 * 4 * 16 * 4096 * 4096 * 128 * (0.5 if causal else 1.0) * (3.5 if mode == "fwd+bwd" else 1.0)
    return dict(section="peers", impl=impl, mode=mode, causal=causal, mod=mod, batch=4, heads=16, n_q=4096, n_k=4096,
                head_dim=128, dtype="bfloat16", status="ok", ms=ms, tflops=flops / ms / 1e9, **extra)


def synthetic():
    rows = []
    for causal in (False, True):
        for mode, f in (("fwd", 1.0), ("fwd+bwd", 3.0)):
            rows += [_record("triton_varlen", mode, causal, "none", 2.0 * f),
                     _record("flash_triton", mode, causal, "none", 1.6 * f),
                     _record("flex-attention", mode, causal, "none", 2.4 * f, compile_s=20.0),
                     _record("sdpa", mode, causal, "none", 1.5 * f),
                     _record("triton_varlen", mode, causal, "softcap", 2.5 * f),
                     _record("flex-attention", mode, causal, "softcap", 3.0 * f, compile_s=30.0),
                     dict(_record("sdpa", mode, causal, "softcap", 1.0), status="unsupported: SDPA has no soft cap"),
                     _record("triton_varlen", mode, causal, "alibi", 2.2 * f),
                     _record("flex-attention", mode, causal, "alibi", 2.2 * f, compile_s=25.0),
                     _record("sdpa", mode, causal, "alibi", 8.8 * f)]
    return rows


def test_recorded_values_from_a_recording(tmp_path):
    path = records.write(tmp_path / "gpu_ch10.json", synthetic(), records.metadata("python scripts/bench_ch10.py"))
    meta, rows = records.read(path)
    df = pd.DataFrame.from_records(rows)
    values = sm.recorded_values(df)
    assert values["softcap_fwd"] == "1.25×" and values["softcap_fwdbwd"] == "1.25×"
    assert values["alibi_fwd"] == "1.10×"
    assert values["vs_flex_fwd"] == "1.00×–1.20×"
    assert values["vs_sdpa_alibi_fwd"] == "4.00×"
    assert values["part1_vs_varlen"] == "0.80×"
    assert values["flex_compile"] == "20 s–30 s"
    assert values["ours_tflops"].endswith("TFLOP/s")
    summary = sm.recorded_summary(df)
    assert len(summary) == 12
    soft = summary[(summary["mod"] == "softcap") & (summary["mode"] == "fwd")].iloc[0]
    assert soft["sdpa"] == "unsupported" and soft["time vs none"] == pytest.approx(1.25)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fig = sm.recorded_tflops(df, label=records.label(meta))
    assert "fwd+bwd, causal" in shown_text(fig) and "triton_varlen" in shown_text(fig)


def test_without_a_recording_every_value_says_so():
    assert set(sm.recorded_values(None).values()) == {sm.NOT_RECORDED}
    assert set(sm.recorded_values(pd.DataFrame()).values()) == {sm.NOT_RECORDED}


def test_every_glued_name_of_the_chapter_is_glued():
    """The chapter's glue cell, run on no recording, defines every {glue:text} its prose quotes."""
    import re

    nb = json.loads((ROOT / "book" / "10_score_mods.ipynb").read_text(encoding="utf-8"))
    prose = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    quoted = set(re.findall(r"\{glue:text\}`([^`]+)`", prose))
    (cell,) = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"
               and "figs.recorded_values(gpu)" in "".join(c["source"])]
    glued = {}
    exec(cell, dict(figs=sm, recorded=records, gpu=None, meta=None,
                    glue=lambda name, value, display=False: glued.__setitem__(name, value)))
    assert quoted and quoted <= set(glued), sorted(quoted - set(glued))
    assert glued["ch10_softcap_fwd"] == sm.NOT_RECORDED


def test_the_recording_script_writes_what_the_chapter_reads(tmp_path, monkeypatch):
    """``bench_ch10.py --smoke`` (tiny problems, any world) writes a recording ``recorded_summary`` reads."""
    # importable by name while it runs: FlexAttention's tracing looks the score_mod's module up
    bench = load_script("bench_ch10", monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = bench.main(["--smoke", "--out", str(tmp_path), "--masks", "causal", "--mods", "none,softcap"])
    meta, rows = records.read(path)
    assert meta["command"].startswith("python scripts/bench_ch10.py") and meta.get("sources")
    df = pd.DataFrame.from_records(rows)
    assert set(df["impl"]) == {"triton_varlen", "flash_triton", "flex-attention", "sdpa"}
    ours = df[(df["impl"] == "triton_varlen") & (df["status"] == "ok")]
    assert len(ours) == 4                                              # 2 modifications × fwd, fwd+bwd
    flex = df[(df["impl"] == "flex-attention") & (df["mode"] == "fwd")]
    assert (flex["status"] == "ok").all() and (flex["max_abs_diff_vs_ours"] < 0.05).all()
    assert df[(df["impl"] == "sdpa") & (df["mod"] == "softcap")]["status"].str.startswith("unsupported").all()
    assert "softcap_fwd" in sm.recorded_values(df) and len(sm.recorded_summary(df)) == 4
