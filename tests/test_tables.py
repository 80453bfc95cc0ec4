"""fa_lab.core.tables: the one table formatter of the book and the CLI."""
from __future__ import annotations

import re

import pandas as pd
import pytest
import torch
from rich.console import Console

import fa_lab  # noqa: F401  (first: it picks the world before numba or triton is imported)
from fa_lab.core.tables import MISSING, config_label, frame, rich_table, sci, sig, table


@pytest.mark.parametrize("x, text", [
    (5.4321, "5.43"), (0.012345, "0.0123"), (123.4, "123"), (12345.0, "12,300"), (1.0, "1.00"),
    (5.4e-7, "5.40e-07"), (2.5e7, "2.50e+07"), (0, "0"), (-0.5, "-0.500"), (999.6, "1,000"),
    (0.99996, "1.00"), (999999.0, "1.00e+06"), (0.0099996, "0.0100"),
    (float("nan"), MISSING), (None, MISSING), (float("inf"), "∞"),
])
def test_three_significant_figures(x, text):
    assert sig(x) == text


def test_errors_in_scientific_notation():
    assert sci(1.1920929e-07) == "1.19e-07"
    assert sci(0.0) == "0"
    assert sci(float("nan")) == MISSING


def records():
    ok = dict(impl="naive_torch", world="cpu", n_q=16, dtype="float32", ms=0.000483, tflops=5.4e-7,
              peak_extra_bytes=3 * 2**20, max_abs_err=2.2e-7, status="ok")
    return [ok, dict(ok, n_q=32, ms=0.002, tflops=1.1e-6, peak_extra_bytes=12 * 2**20, max_abs_err=None),
            dict(impl="naive_torch", world="cpu", n_q=64, status="oom (skipped)"),
            dict(ok, impl="triton", n_q=16, ms=None, tflops=None, peak_extra_bytes=None, max_abs_err=None,
                 status="unsupported: head_dim=20 is not a multiple of 16")]


def test_units_in_names_values_scaled_per_column():
    shown = frame(records())
    assert list(shown.columns) == ["implementation", "Nq", "time (µs)", "MFLOP/s", "peak extra (MiB)",
                                   "max error", "status"]
    assert shown["time (µs)"].tolist() == ["0.483", "2.00", "OOM", "unsupported"]
    assert shown["MFLOP/s"].tolist()[:2] == ["0.540", "1.10"]
    assert shown["peak extra (MiB)"].tolist()[:2] == ["3.00", "12.0"]


def test_missing_numbers_say_why():
    shown = frame(records())
    # ran, no error recorded: a dash; failed: the row's short status; never NaN
    assert shown["max error"].tolist() == ["2.20e-07", MISSING, "OOM", "unsupported"]
    assert shown["status"].tolist() == ["ok", "ok", "OOM", "unsupported"]
    assert not shown.isin(["nan", "NaN", "None", "<NA>"]).any().any()


def test_constant_columns_dropped_and_said_once_in_the_caption():
    shown = frame(records(), caption="live")
    assert "world" not in shown.columns and "dtype" not in shown.columns
    assert shown.attrs["caption"] == "live · world: cpu · dtype: fp32"
    kept = frame(records(), keep=["dtype"])
    assert "dtype" in kept.columns and "dtype" not in kept.attrs["caption"]
    # one row: nothing is constant, nothing dropped
    assert "world" in frame(records()[:1]).columns


def test_all_ok_status_goes_without_a_word():
    shown = frame(records()[:2])
    assert "status" not in shown.columns and "status" not in shown.attrs["caption"]


def test_no_index_column_and_pivots_keep_their_row_labels():
    df = pd.DataFrame(dict(impl=["a", "a", "b", "b"], causal=[False, True, False, True],
                           tflops=[1.5, 2.25, 300.0, 0.0012]))
    pivot = df.pivot_table(index="impl", columns="causal", values="tflops")
    shown = frame(pivot, values="tflops")
    assert list(shown.columns) == ["implementation", "not causal", "causal"]
    assert shown.attrs["caption"] == "TFLOP/s"
    assert shown.iloc[1].tolist() == ["b", "300", "0.00120"]
    html = table(pivot, values="tflops").to_html()
    assert "results-table" in html and "<th" in html and "row_heading" not in html   # index hidden


def test_multiindex_columns_flattened():
    df = pd.DataFrame(dict(impl=["a", "a"], shape=["(1, 2)", "(1, 2)"], causal=[False, True], ms=[1.0, 2.0]))
    pivot = df.pivot_table(index="impl", columns=["shape", "causal"], values="ms")
    assert list(frame(pivot, values="ms").columns) == ["implementation", "(1, 2) · not causal", "(1, 2) · causal"]


def test_config_labels():
    assert config_label(dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=1, ws=False)) == "64×128 w4 s1"
    assert config_label(dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, paired=True)) == "128×64 w8 s3 paired"
    from fa_lab.bench.configs import Shape
    from fa_lab.kernels.numba.tiled import TileConfig

    assert config_label(TileConfig(64, 32, 16, 8, 64)) == "64×32 t16×8"
    assert config_label(TileConfig(64, 16, 16, 4, 128, share_kv=True)) == "64×16 t16×4 shared K/V"
    capped = TileConfig(64, 64, 16, 8, 64, share_kv=True, max_registers=128)
    assert config_label(capped) == "64×64 t16×8 shared K/V r128"
    assert config_label(Shape(1, 8, 512, 64)) == "(1, 8, 512, 64)"
    shown = frame([dict(config=TileConfig(4, 4, 2, 2, 16), dtype=torch.bfloat16, window=(8, -1), causal=True)])
    assert shown.iloc[0].tolist() == ["4×4 t2×2", "bf16", "(8, -1)", "yes"]


def test_kinds_rename_and_columns():
    df = pd.DataFrame(dict(impl=["a", "b"], wait_us=[12.345, 150.0], naive_GB=[1.5, 0.25], x=[0.5, 2.0]))
    shown = frame(df, columns=["impl", "wait_us", "naive_GB", "x"], rename={"x": "speedup"}, kinds={"x": "ratio"})
    assert list(shown.columns) == ["implementation", "wait (µs)", "naive (GB)", "speedup"]
    assert shown["speedup"].tolist() == ["0.500×", "2.00×"]
    with pytest.raises(KeyError, match="no column"):
        frame(df, columns=["nope"])


def test_float_columns_of_whole_numbers_read_as_integers():
    shown = frame([dict(n_q=16.0, ms=1.0), dict(n_q=float("nan"), ms=2.0)])
    assert shown["Nq"].tolist() == ["16", MISSING]


def test_rich_table_for_the_cli():
    t = rich_table(records(), title="bench")
    console = Console(width=160, record=True)
    console.print(t)
    text = console.export_text()
    assert "time (µs)" in text and "0.483" in text and "unsupported" in text and "world: cpu" in text
    assert "nan" not in text.lower().replace("naive", "")


def test_random_values_keep_three_significant_figures():
    rng = torch.Generator().manual_seed(7)
    values = torch.rand(60, generator=rng, dtype=torch.float64) * 10.0 ** torch.randint(-9, 9, (60,), generator=rng)
    shown = frame([dict(impl=f"i{j}", tflops=float(v), ms=float(v)) for j, v in enumerate(values)])
    assert len(shown.columns) == 3
    for cell in shown.drop(columns="implementation").to_numpy().ravel():
        mantissa = cell.split("e")[0]
        digits = re.sub(r"[^0-9]", "", mantissa).lstrip("0")
        if "." not in mantissa:   # 12,300: the zeros only place the digits
            digits = digits.rstrip("0")
        assert 1 <= len(digits) <= 3, cell


def test_error_columns_named_in_words():
    shown = frame([dict(impl="a", max_err_O=4.6e-7, max_err_lse=0.0, err_dq=1e-3, max_abs_error=2.0)])
    assert list(shown.columns) == ["implementation", "max error of O", "max error of lse", "error of dq",
                                   "max abs error"]
    assert shown.iloc[0].tolist() == ["a", "4.60e-07", "0", "1.00e-03", "2.00e+00"]


def test_pivot_value_columns_share_one_unit():
    df = pd.DataFrame(dict(n_q=[1, 1], impl=["a", "b"], ms=[0.0005, 2.0]))
    shown = frame(df.pivot_table(index="n_q", columns="impl", values="ms"), values="ms", caption="recorded")
    assert shown.attrs["caption"] == "recorded · time (ms)"
    assert shown.iloc[0].tolist() == ["1", "5.00e-04", "2.00"]


def test_fractions_as_percent():
    shown = frame([dict(kernel="a", worst=0.0762), dict(kernel="b", worst=-0.5)], kinds={"worst": "percent"})
    assert shown["worst"].tolist() == ["7.62%", "-50.0%"]


def test_pivot_cells_that_hold_a_status():
    df = pd.DataFrame(dict(impl=["a", "a", "b"], shape=["s", "t", "s"], cell=[1.5, "oom", "unsupported: no"]))
    grid = df.pivot_table(index="impl", columns="shape", values="cell", aggfunc="first", sort=False)
    shown = frame(grid, values="tflops")
    assert shown.to_numpy().tolist() == [["a", "1.50", "OOM"], ["b", "unsupported", MISSING]]
    assert shown.attrs["caption"] == "TFLOP/s"


def test_empty_input_gives_an_empty_table():
    assert frame([]).shape == (0, 0)
    assert "<table" in table(pd.DataFrame(dict(impl=[], ms=[]))).to_html()
