"""``fa-lab bench``: parsing, the FLOP formula, OOM/unsupported rows, the CSV/JSON schema."""
import collections
import json
import time

import pandas as pd
import pytest
import torch
from script_loader import load_script

import fa_lab
from fa_lab import cli
from fa_lab.bench import COLUMNS, configs, load_recorded, measure, peers, recorded_table, records, report, runner
from fa_lab.core.flops import attention_flops


def _bench(tmp_path, *extra):
    out = tmp_path / "r.csv"
    rc = cli.main(["bench", "--config", "tiny", "--no-progress", "--quiet", "--out", str(out), *extra])
    return rc, out


# ---------------------------------------------------------------------------- the acceptance command

def test_tiny_reference_naive_torch_writes_csv_and_json(tmp_path, capsys):
    rc, out = _bench(tmp_path, "--impl", "reference", "naive_torch")
    assert rc == 0
    df = pd.read_csv(out)
    assert list(df.columns) == COLUMNS
    assert list(df["impl"]) == ["reference", "naive_torch"]
    assert (df["status"] == "ok").all()
    assert (df[["batch", "heads", "n_q", "head_dim"]].values == [2, 4, 8, 64]).all()
    assert (df["ms_p10"] <= df["ms"]).all() and (df["ms"] <= df["ms_p90"]).all()
    assert (df["max_abs_err"] < 1e-5).all()                       # fp32 vs the float64 reference
    assert df.loc[df["impl"] == "naive_torch", "speedup"].item() == pytest.approx(1.0)
    assert (df["world"] == fa_lab.WORLD).all()
    if not fa_lab.ON_GPU:
        assert df["timer"].str.contains("wall-clock").all()       # labelled: not GPU speed
    blob = json.loads(out.with_suffix(".json").read_text())
    assert set(blob) == {"meta", "records"}
    for key in ("device", "torch", "date", "command", "world"):
        assert key in blob["meta"]
    assert blob["meta"]["command"].startswith("fa-lab bench --config tiny")
    assert [set(r) for r in blob["records"]] == [set(COLUMNS)] * 2
    assert "2 ok" in capsys.readouterr().out


def test_plot_and_table(tmp_path, capsys):
    png = tmp_path / "p.png"
    rc = cli.main(["bench", "--impl", "naive_torch", "sdpa-math", "--batch", "1", "--heads", "2",
                   "--seq-len", "8", "16", "--head-dim", "16", "--no-progress", "--plot", str(png)])
    assert rc == 0 and png.stat().st_size > 1000
    text = capsys.readouterr().out
    assert "naive_torch" in text and "sdpa-math" in text and "FLOP/s" in text


# ---------------------------------------------------------------------------- parsing

def _plan(*argv):
    from fa_lab.bench.cli import plan

    return plan(cli.build_parser().parse_args(["bench", *argv]))


def test_parse_config_and_overrides():
    p = _plan("--config", "llama_med", "--impl", "naive_torch", "sdpa-flash", "--dtype", "bf16", "fp32",
              "--mode", "fwd", "fwd+bwd", "--baseline", "sdpa-flash")
    assert p["impls"] == ["naive_torch", "sdpa-flash"] and p["dtypes"] == ["bf16", "fp32"]
    assert p["modes"] == ["fwd", "fwd+bwd"] and p["baseline"] == "sdpa-flash" and p["masks"] == ["none"]
    assert [s.label for s in p["shapes"]] == ["(1, 32, 512, 128)"]
    grid = _plan("--config", "tiny", "--seq-len", "16", "32", "--head-dim", "32")["shapes"]
    assert [(s.batch, s.heads, s.n_q, s.head_dim) for s in grid] == [(2, 4, 16, 32), (2, 4, 32, 32)]


def test_parse_explicit_shape_gqa_and_window():
    p = _plan("--batch", "1", "--heads", "8", "--kv-heads", "2", "--seq-len", "5", "--seq-len-k", "9",
              "--head-dim", "16", "--window", "3", "0")
    (s,) = p["shapes"]
    assert (s.batch, s.heads, s.kv_heads, s.n_q, s.n_k, s.head_dim) == (1, 8, 2, 5, 9, 16)
    assert p["masks"] == ["window"] and p["window"] == (3, 0)
    assert s.label == "(1, 8/2, 5x9, 16)"


def test_named_configs_seed_table_and_sweep():
    named = {"tiny", "small", "medium", "llama_small", "llama_med", "seed-table", "sweep", "latency"}
    assert named <= set(configs.CONFIGS)
    seed = configs.shapes("seed-table")
    assert [(s.batch, s.n_q) for s in seed] == [(32, 512), (16, 1024), (8, 2048), (4, 4096), (2, 8192), (1, 16384)]
    assert all(s.heads == 16 and s.head_dim == 128 for s in seed)
    sweep = configs.shapes("sweep")
    assert {s.n_q for s in sweep} == {2 ** p for p in range(7, 17)} and {s.head_dim for s in sweep} == {16, 32, 64, 128}
    assert all(s.batch == 1 for s in sweep) and configs.default_mask("sweep") == "causal"
    assert configs.default_dtypes("sweep") == ["bf16", "fp32"]
    assert configs.shapes("latency")[0].label == "(1, 8, 512, 64)"


@pytest.mark.parametrize("argv,words", [
    (["--impl", "no_such_kernel"], "unknown impl"),
    (["--baseline", "nope"], "unknown impl"),
    (["--dtype", "int8"], "unknown dtype"),
    (["--mask", "window"], "needs --window"),
])
def test_bad_arguments_say_what_is_wrong(tmp_path, capsys, argv, words):
    rc = cli.main(["bench", "--config", "tiny", "--no-progress", *argv])
    assert rc == 2 and words in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--mode", "sideways"], ["--config", "huge"], ["--seq-len", "0"],
                                  ["--mask", "diagonal"], ["--window", "3"]])
def test_argparse_rejects(argv):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", *argv])
    assert exc.value.code == 2


def test_no_config_needs_every_dimension(capsys):
    assert cli.main(["bench", "--batch", "1", "--heads", "2", "--no-progress"]) == 2
    assert "--seq-len" in capsys.readouterr().err


# ---------------------------------------------------------------------------- the FLOP formula

def test_flop_formula():
    assert attention_flops(2, 3, 5, 7, 11) == 4 * 2 * 3 * 5 * 7 * 11
    assert attention_flops(1, 1, 64, 64, 8, causal=True) == 4 * 64 * 64 * 8 / 2        # halved: Nq == Nk
    assert attention_flops(1, 1, 16, 64, 8, causal=True) == 4 * 16 * 64 * 8            # not halved: Nq != Nk
    assert attention_flops(1, 2, 8, 8, 4, mode="bwd") == 2.5 * attention_flops(1, 2, 8, 8, 4)
    assert attention_flops(1, 2, 8, 8, 4, mode="fwd+bwd") == 3.5 * attention_flops(1, 2, 8, 8, 4)
    with pytest.raises(ValueError, match="mode"):
        attention_flops(1, 1, 1, 1, 1, mode="sideways")


def test_records_carry_flops_and_tflops():
    (r,) = runner.run_suite(["naive_torch"], [configs.Shape(1, 2, 16, 8)], masks=["causal"], progress=False)
    assert r["flops"] == 4 * 2 * 16 * 16 * 8 / 2
    assert r["tflops"] == pytest.approx(r["flops"] / (r["ms"] * 1e-3) / 1e12)


# ---------------------------------------------------------------------------- unsupported and OOM are rows

def test_unsupported_cases_are_recorded_not_raised():
    shapes = [configs.Shape(1, 2, 6, 16, n_k=10)]
    recs = runner.run_suite(["naive_torch", "sdpa-math", "sdpa-efficient", "numba_naive"], shapes,
                            dtypes=["bf16"], masks=["none", "causal", "window"], window=(2, 0),
                            modes=["fwd", "fwd+bwd"], progress=False)
    assert len(recs) == 4 * 3 * 2
    by = {(r["impl"], r["mask"], r["mode"]): r["status"] for r in recs}
    assert by[("naive_torch", "window", "fwd")] == "ok"
    assert "has no backward" in by[("naive_torch", "none", "fwd+bwd")]
    # SDPA is top-left causal: with Nq != Nk that is not our mask, so it must not run
    causal_math = by[("sdpa-math", "causal", "fwd")]
    assert causal_math.startswith("unsupported") and "top-left" in causal_math
    assert by[("sdpa-math", "window", "fwd")].startswith("unsupported")
    assert by[("sdpa-math", "none", "fwd")] == "ok"
    assert by[("numba_naive", "none", "fwd")].startswith("unsupported")              # fp32 only
    if not fa_lab.ON_GPU:
        assert by[("sdpa-efficient", "none", "fwd")].startswith("unsupported")       # no CPU kernel
    for r in recs:
        assert r["status"] == "ok" or r["ms"] is None


#: SDPA's fused backend that takes fp32 in this world (flash on the CPU; on a GPU, flash is 16-bit only)
FUSED_FP32 = "sdpa-efficient" if fa_lab.ON_GPU else "sdpa-flash"


def test_sdpa_causal_matches_ours_when_square():
    # GQA through sdpa-math; the fused fp32 backend without it (on a GPU the efficient backend
    # takes no GQA input: that is an 'unsupported' row, checked below)
    recs = runner.run_suite(["sdpa-math"], [configs.Shape(1, 4, 9, 16, kv_heads=2)], masks=["causal"],
                            progress=False)
    recs += runner.run_suite([FUSED_FP32], [configs.Shape(1, 4, 9, 16)], masks=["causal"], progress=False)
    for r in recs:
        assert r["status"] == "ok" and r["max_abs_err"] < 1e-5, r
    if fa_lab.ON_GPU:
        (gqa,) = runner.run_suite(["sdpa-efficient"], [configs.Shape(1, 4, 9, 16, kv_heads=2)], masks=["causal"],
                                  progress=False)
        assert gqa["status"].startswith("unsupported") and "num_heads" in gqa["status"], gqa


def test_oom_is_a_row(monkeypatch):
    import dataclasses

    def boom(*a, **k):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 TiB")

    monkeypatch.setitem(peers.PEERS, "sdpa-math", dataclasses.replace(peers.PEERS["sdpa-math"], fn=boom))
    recs = runner.run_suite(["naive_torch", "sdpa-math"], [configs.Shape(1, 1, 8, 8)], progress=False)
    assert [r["status"] for r in recs] == ["ok", "oom"]
    assert recs[1]["ms"] is None and recs[1]["naive_extra_bytes"] > 0


def test_predicted_oom_is_a_row(monkeypatch):
    monkeypatch.setattr(runner, "_predicted_oom",
                        lambda name, shape, *a: ("oom: predicted 9.0 GiB > 1.0 GiB free (not run)"
                                                 if shape.n_q > 16 else None))
    recs = runner.run_suite(["naive_torch"], [configs.Shape(1, 1, n, 8) for n in (8, 16, 32)], progress=False)
    assert [r["status"].split(":")[0] for r in recs] == ["ok", "ok", "oom"]


def test_time_budget_skips_what_would_be_too_slow():
    recs = runner.run_suite(["naive_torch"], [configs.Shape(1, 1, n, 8) for n in (8, 4096)], progress=False,
                            max_ms=1e-9)
    assert recs[0]["status"] == "ok" and recs[1]["status"].startswith("skipped: predicted")


def test_memory_reduction_and_speedup_columns():
    recs = runner.run_suite(["naive_torch", FUSED_FP32], [configs.Shape(1, 2, 32, 16)], progress=False,
                            baseline="naive_torch")
    naive, flash = recs
    assert naive["mem_vs_naive"] == pytest.approx(1.0) and naive["speedup"] == pytest.approx(1.0)
    assert flash["naive_extra_bytes"] == naive["peak_extra_bytes"]
    io = flash["io_bytes"]
    assert io == 4 * (2 * 2 * 32 * 16 * 2)                     # q, k, v, o in fp32
    assert flash["mem_vs_naive"] == pytest.approx((io + naive["peak_extra_bytes"]) / (io + flash["peak_extra_bytes"]))
    assert flash["mem_vs_naive"] > 1
    assert flash["speedup"] == pytest.approx(naive["ms"] / flash["ms"])
    assert flash["baseline"] == "naive_torch"


# ---------------------------------------------------------------------------- recorded data

def test_recorded_loader_never_fails():
    df = load_recorded("no-such-suite")
    assert df.empty and df.attrs["label"] == "no recorded GPU data"


@pytest.mark.parametrize("suite", ["seed-table", "latency", "sweep"])
def test_recorded_gpu_files_follow_the_schema(suite):
    df = load_recorded(suite)
    if df.empty:
        pytest.skip(f"no recorded {suite}")
    assert set(COLUMNS) <= set(df.columns)
    assert (df["world"] == "gpu").all()
    assert df["status"].str.match(r"^(ok|oom|unsupported|skipped|error)").all()
    for meta in df.attrs["meta"]:
        for key in ("device", "driver", "torch", "triton", "date", "command"):
            assert meta.get(key), key
    assert not recorded_table(suite, value="tflops").empty


# ---------------------------------------------------------------------------- interleaved timing

def test_time_interleaved_times_each_callable_every_round_in_balanced_orders(monkeypatch):
    from fa_lab.bench import timer as timing

    fns = {name: (lambda s=s: time.sleep(s)) for name, s in (("fast", 0.0005), ("slow", 0.003), ("mid", 0.0015))}
    out = timing.time_interleaved(fns, rounds=6)
    assert list(out) == ["fast", "slow", "mid"]
    assert out["fast"]["ms"] < out["mid"]["ms"] < out["slow"]["ms"]
    for rec in out.values():
        assert rec["rounds"] == 6 and rec["ms_p10"] <= rec["ms"] <= rec["ms_p90"]
    # every round times every callable once, in the design's orders (time_fn recorded, not run:
    # on a GPU do_bench picks how many calls one timing makes)
    timed = []
    monkeypatch.setattr(timing, "time_fn", lambda fn, **kw: (timed.append(fn), {"ms": 1.0})[1])
    timing.time_interleaved(fns, rounds=7)
    names = list(fns)
    orders = timing.balanced_orders(3)
    assert [next(n for n in names if fns[n] is fn) for fn in timed] == \
        [names[i] for r in range(7) for i in orders[r % len(orders)]]


def test_time_interleaved_takes_a_measure_and_keeps_going_past_a_failing_peer():
    from fa_lab.bench import timer as timing

    calls = []

    def refuses():
        raise RuntimeError("no such backend")

    fns = {"ok": lambda: calls.append("ok"), "refuses": refuses, "also_ok": lambda: calls.append("also_ok")}
    errors = {}
    out = timing.time_interleaved(fns, rounds=4, measure=lambda fn: (fn(), 2.0)[1], errors=errors)
    assert set(out) == {"ok", "also_ok"} and all(r["ms"] == 2.0 and r["rounds"] == 4 for r in out.values())
    assert errors == {"refuses": "error: RuntimeError: no such backend"}
    assert calls.count("ok") == calls.count("also_ok") == 4          # the refusing peer is not retried
    with pytest.raises(RuntimeError, match="no such backend"):       # without an errors dict it propagates
        timing.time_interleaved(fns, rounds=1, measure=lambda fn: (fn(), 1.0)[1])


@pytest.mark.parametrize("n", range(1, 9))
def test_balanced_orders_give_every_callable_each_predecessor_equally_often(n):
    from fa_lab.bench.timer import balanced_orders

    orders = balanced_orders(n)
    assert len(orders) == (2 * n if n % 2 and n > 1 else n)
    assert all(sorted(o) == list(range(n)) for o in orders)
    # within the rounds, and (the rounds run back to back) across their boundaries
    seq = [i for o in orders for i in o]
    pairs = collections.Counter(zip(seq, seq[1:] + seq[:1]))
    follows = collections.Counter({(a, b): c for (a, b), c in pairs.items() if a != b})
    if n > 1:
        assert set(follows) == {(a, b) for a in range(n) for b in range(n) if a != b}
        # within rounds it is exact; the round boundaries add at most one per pair here
        within = collections.Counter(p for o in orders for p in zip(o, o[1:]))
        assert len(set(within.values())) == 1


def test_recorded_chapter4_peers_are_interleaved_and_complete():
    meta, gpu = records.load("gpu_ch4")
    if meta is None:
        pytest.skip("no chapter 4 recording")
    peers = gpu[gpu.section == "peers"]
    # recorded as sdpa_flash, read under the one naming scheme
    assert set(peers.impl) == {"sdpa-flash", "sdpa-cudnn", "triton"} and (peers.status == "ok").all()
    assert peers.timer.str.contains("interleaved rounds").all()
    # every (dtype, shape) row has all three peers, and the small row its GPU-only time
    assert (peers.groupby(["dtype", "batch", "heads", "n_q", "head_dim", "causal"]).impl.nunique() == 3).all()
    assert peers[peers.n_q <= 1024].gpu_us_cudagraph.notna().all()
    assert (peers[peers.impl == "triton"].max_abs_diff_vs_sdpa_flash < 1e-2).all()


# ---------------------------------------------------------------------------- one of each

def test_timer_imports_nothing_of_the_benchmark_suite():
    import subprocess
    import sys

    code = ("import fa_lab, sys; import fa_lab.bench.timer; "
            "print(sorted(m for m in sys.modules if m.startswith('fa_lab.bench')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['fa_lab.bench', 'fa_lab.bench.timer']"


def test_chapters_import_the_measuring_names_from_the_package():
    from fa_lab.bench import benchmark, plot, sweep, time_fn, to_frame

    assert benchmark is measure.benchmark and sweep is measure.sweep and to_frame is runner.to_frame
    assert plot is measure.plot and time_fn(lambda: None, warmup=0, rep=2)["ms"] >= 0


@pytest.mark.parametrize("old,new", [("sdpa_flash", "sdpa-flash"), ("flash", "sdpa-flash"), ("math", "sdpa-math"),
                                     ("sdpa_cudnn", "sdpa-cudnn"), ("efficient", "sdpa-efficient"),
                                     ("triton", "triton")])
def test_one_peer_naming_scheme_with_old_spellings_as_aliases(old, new):
    assert peers.canonical_name(old) == new
    if new in peers.PEERS:
        assert peers.get_peer(old) is peers.PEERS[new]


@pytest.mark.parametrize("name", ["sdpa-math", "sdpa-flash", "naive_torch", "sdpa_math"])
@pytest.mark.parametrize("causal", [False, True])
def test_raw_call_matches_the_reference(name, causal):
    from fa_lab.core.reference import reference_attention
    from fa_lab.core.testing import max_error, random_qkv, stable_seed

    # on a GPU SDPA's flash backend takes fp16/bf16 only
    dtype, tol = (torch.float16, 4e-3) if fa_lab.ON_GPU else (torch.float32, 1e-5)
    q, k, v = random_qkv(1, 2, 33, 33, 16, dtype=dtype, seed=stable_seed(name, causal))
    ref, _ = reference_attention(q, k, v, fa_lab.make_spec(q, k, v, causal=causal))
    assert max_error(peers.raw_call(name)(q, k, v, causal), ref) < tol
    with pytest.raises(ValueError, match="unknown impl"):
        peers.raw_call("no_such_kernel")


@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (3, 1))])
def test_sdpa_given_a_mask_tensor_computes_our_mask(causal, window):
    from fa_lab.core.reference import reference_attention
    from fa_lab.core.testing import max_error, random_qkv

    q, k, v = random_qkv(1, 2, 7, 12, 16, seed=3)             # Nq != Nk: bottom-right causal
    spec = fa_lab.make_spec(q, k, v, causal=causal, window=window)
    ref, _ = reference_attention(q, k, v, spec)
    with pytest.raises(ValueError, match="top-left|sliding window"):
        peers.bind("sdpa-math", q, k, v, spec)
    assert max_error(peers.bind("sdpa-math", q, k, v, spec, mask_tensor=True)(), ref) < 1e-5


def test_recordings_round_trip(tmp_path):
    path = records.save("r", [dict(impl="sdpa_flash", ms=1.5, err=float("nan"))], command="test", directory=tmp_path)
    meta, rows = records.read(path)
    assert meta["command"] == "test" and "device" in meta and "date" in meta
    assert rows == [dict(impl="sdpa-flash", ms=1.5, err=None)]                # NaN is written as null
    assert records.label(meta).startswith(meta["device"]) and records.label(None) == "no recorded GPU data"


def test_no_csv_twins_are_shipped():
    from fa_lab.core.data import DATA_DIR

    assert not list(DATA_DIR.glob("*.csv"))


# ---------------------------------------------------------------------------- the CPU world's default and Ctrl-C

def test_cpu_default_leaves_out_the_simulator_kernels(monkeypatch, capsys):
    if fa_lab.ON_GPU:
        assert runner.left_out() == []
        return
    slow = runner.left_out()
    assert {"numba_naive", "numba_tiled"} <= set(slow) and "triton" not in slow and "naive_torch" not in slow
    fast = runner.default_impls(slow=False)
    assert not set(slow) & set(fast) and set(slow) | set(fast) == set(runner.default_impls())
    seen = []
    monkeypatch.setattr(runner, "iter_suite", lambda impls, shapes, **kw: seen.append(impls) or iter(()))
    assert cli.main(["bench", "--config", "small", "--no-progress", "--quiet"]) == 0
    assert seen == [fast]
    out = capsys.readouterr().out
    assert "left out" in out and "numba_tiled" in out and "--impl" in out
    assert cli.main(["bench", "--config", "tiny", "--impl", "numba_naive", "--no-progress", "--quiet"]) == 0
    assert seen[-1] == ["numba_naive"]


def test_ctrl_c_saves_what_was_measured_and_exits_130(tmp_path, monkeypatch, capsys):
    real = measure.benchmark
    calls = []

    def interrupted_on_the_third(*args, **kwargs):
        calls.append(args)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "benchmark", interrupted_on_the_third)
    out = tmp_path / "r.csv"
    rc = cli.main(["bench", "--config", "tiny", "--impl", "naive_torch", "reference", "sdpa-math", "--dtype", "fp32",
                   "fp64", "--no-progress", "--quiet", "--out", str(out)])
    assert rc == 130
    err = capsys.readouterr().err
    assert "interrupted after 2 cases" in err and "Traceback" not in err
    df = pd.read_csv(out)
    assert list(df["impl"]) == ["naive_torch", "reference"] and (df["status"] == "ok").all()
    assert json.loads(out.with_suffix(".json").read_text())["meta"]["partial"] is True


def test_wide_spread_lists_only_the_disturbed_cases_that_ran():
    from fa_lab.bench import report

    df = pd.DataFrame([dict(impl="a", shape="s", dtype="bf16", mask="none", mode="fwd", ms=1.0, ms_p10=1.0,
                            ms_p90=1.2, status="ok"),
                       dict(impl="b", shape="s", dtype="bf16", mask="none", mode="fwd", ms=1.0, ms_p10=1.0,
                            ms_p90=1.6, status="ok"),
                       dict(impl="c", shape="s", dtype="bf16", mask="none", mode="fwd", ms=1.0, ms_p10=1.0,
                            ms_p90=1.3, status="ok"),
                       dict(impl="d", shape="s", dtype="bf16", mask="none", mode="fwd", ms=float("nan"),
                            ms_p10=float("nan"), ms_p90=float("nan"), status="oom")])
    got = report.wide_spread(df)
    assert got["impl"].tolist() == ["b", "c"] and got["spread"].tolist() == pytest.approx([1.6, 1.3])
    assert report.wide_spread(df, ratio=2.0).empty


def test_the_cudnn_gap_script_records_what_the_report_reads(tmp_path):
    """``scripts/bench_cudnn_gap.py --smoke``: ours and both SDPA peers timed in one run, a summary per mode."""
    bench = load_script("bench_cudnn_gap")
    meta, rows = records.read(bench.main(["--smoke", "--out", str(tmp_path)]))
    assert meta["command"].startswith("python scripts/bench_cudnn_gap.py") and meta.get("sources")
    df = pd.DataFrame.from_records(rows)
    timing = df[df["section"] == "timing"]
    assert set(timing["impl"]) == {"flash_triton", "sdpa-cudnn", "sdpa-flash"}
    ours = timing[timing["impl"] == "flash_triton"]
    assert (ours["status"] == "ok").all() and len(ours) == 2 * len(bench.SMOKE_ROWS)   # fwd and fwd+bwd
    assert (ours["ms"] > 0).all() and (ours["rounds"] == 2).all()
    if not fa_lab.ON_GPU:     # no cuDNN on a CPU: a record that says why, never a crash
        assert timing[timing["impl"] == "sdpa-cudnn"]["status"].str.contains("declined").all()
    table = report.cudnn_gap(df)
    assert len(table) == len(bench.SMOKE_ROWS) and {"fwd ours", "fwd+bwd vs cudnn"} <= set(table.columns)
    assert table["fwd+bwd ours"].notna().all()


def test_a_partial_suite_recording_is_resumed_where_it_stopped(tmp_path, monkeypatch):
    """``record_gpu_bench.py --resume``: only the cases the partial file lacks run, and the file says so."""
    script = load_script("record_gpu_bench")
    argv = ["--part", "latency", "--allow-cpu", "--impl", "naive_torch", "reference", "--out-dir", str(tmp_path),
            "--tag", "t"]
    assert script.main(argv) == 0
    path = tmp_path / "gpu_bench_t_latency.json"
    meta, rows = records.read(path)
    assert len(rows) > 4
    kept = rows[: len(rows) // 2]
    with pytest.raises(SystemExit, match="not partial"):
        script.main([*argv, "--resume", str(path)])
    records.write(path, kept, dict(meta, partial=True, seconds=7.0))
    with pytest.raises(SystemExit, match="this run measures seed-table"):
        script.main([*argv[:1], "seed-table", *argv[2:], "--resume", str(path)])
    ran = []
    real = runner.benchmark
    monkeypatch.setattr(runner, "benchmark", lambda *a, **kw: ran.append(kw) or real(*a, **kw))
    assert script.main([*argv, "--resume", str(path)]) == 0
    meta2, rows2 = records.read(path)
    assert len(ran) == len(rows) - len(kept)      # the carried cases were not measured again
    assert sorted(map(runner.record_key, rows2)) == sorted(map(runner.record_key, rows))
    assert meta2["resumed_records"] == len(kept) and not meta2["partial"] and meta2["seconds"] >= 7.0
    records.write(path, kept, dict(meta, partial=True, sources="something else"))
    with pytest.raises(SystemExit, match="code it measured has changed"):
        script.main([*argv, "--resume", str(path)])


def test_a_chapter_quotes_the_cudnn_gap_from_the_table():
    t = pd.DataFrame([dict(shape="(4, 16, 4096, 128)", mask="none", dtype="bfloat16"),
                      dict(shape="(2, 16, 8192, 256)", mask="causal", dtype="bfloat16")])
    for mode, ratios in (("fwd", [0.9, 0.8]), ("fwd+bwd", [0.7, 0.75])):
        t[f"{mode} ours"], t[f"{mode} cudnn"] = [500.0, 400.0], [500.0 / r for r in ratios]
        t[f"{mode} gluon"], t[f"{mode} gluon vs cudnn"] = [550.0, float("nan")], [1.1 * ratios[0], float("nan")]
        t[f"{mode} vs cudnn"], t[f"{mode} vs flash"] = ratios, [1.5, 1.6]
    part, kinds, quoted = report.cudnn_gap_mode(t, "fwd+bwd")
    assert list(part.columns) == ["shape", "mask", "fwd+bwd ours", "fwd+bwd gluon", "fwd+bwd cudnn",
                                  "fwd+bwd vs cudnn", "fwd+bwd gluon vs cudnn", "fwd+bwd vs flash"]
    assert set(kinds) == set(part.columns) and kinds["fwd+bwd gluon vs cudnn"] == "ratio"
    # the Gluon kernels' quotes come from the rows they ran (the second row has none)
    assert quoted == dict(low="0.70×", high="0.75×", low_row="(4, 16, 4096, 128)",
                          high_row="(2, 16, 8192, 256) causal", gluon_low="0.77×", gluon_high="0.77×",
                          gluon_low_row="(4, 16, 4096, 128)", gluon_high_row="(4, 16, 4096, 128)")
    assert report.cudnn_gap_mode(t, "fwd")[2]["low_row"] == "(2, 16, 8192, 256) causal"
    t["fwd vs cudnn"] = t["fwd gluon vs cudnn"] = float("nan")   # cuDNN declined every row: nothing to quote
    assert report.cudnn_gap_mode(t, "fwd")[2] == {}
    with pytest.raises(ValueError, match="mode"):
        report.cudnn_gap_mode(t, "bwd")
