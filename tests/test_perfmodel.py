"""Chapter 6's performance model: FLOP and byte counts against hand counts, the roofline, the CLI.

Hand counts use B = H = 1, fp16 (2 bytes), D = Dv = 64 unless a test says otherwise, and
BLOCK_M = 128, BLOCK_N = 64 for the forward.
"""
import json
import math
import random

import pytest

from fa_lab.core.flops import attention_flops
from fa_lab.core.masks import block_key_range, visible
from fa_lab.core.testing import stable_seed
from fa_lab.perf import correlate, devices
from fa_lab.perf.model import (
    Problem,
    count,
    flash_backward_counts,
    flash_forward_counts,
    naive_counts,
    tiles,
    visible_pairs,
)
from fa_lab.perf.roofline import predict


def P(n_q=256, n_k=None, mask="none", window=None, D=64, Dv=None, **kw):
    return Problem(batch=1, heads=1, n_q=n_q, n_k=n_k, head_dim=D, head_dim_v=Dv, mask=mask, window=window,
                   dtype=kw.pop("dtype", "fp16"), **kw)


# ----------------------------------------------------------------------------- hand counts
def test_full_forward_by_hand():
    c = flash_forward_counts(P(), block_m=128, block_n=64)
    assert c.flops == c.flops_visible == c.flops_executed == 4 * 256 * 256 * 64
    # Q once, K and V once per query block (2 blocks), O once, lse (fp32) once
    assert c.bytes_breakdown == dict(q=2 * 256 * 64, k=2 * 2 * 256 * 64, v=2 * 2 * 256 * 64, o=2 * 256 * 64,
                                     lse=4 * 256)
    assert c.hbm_bytes == 197_632
    assert c.compulsory_bytes == 2 * 256 * 64 * 4 + 4 * 256      # q, k, v, o once + lse
    assert c.tiles == 2 * 4 and c.programs == 2
    assert c.exps == 256 * 256


def test_naive_by_hand():
    c = naive_counts(P())
    # Q, K, V read and O written once; S written, read, P written, read: four N² passes
    assert c.hbm_bytes == 4 * 2 * 256 * 64 + 4 * 2 * 256 * 256 == 655_360
    assert c.flops_executed == 4 * 256 * 256 * 64
    assert [ph.name for ph in c.phases] == ["S = Q Kᵀ", "P = softmax(S)", "O = P V"]
    assert naive_counts(P(), score_bytes=4).hbm_bytes == 4 * 2 * 256 * 64 + 4 * 4 * 256 * 256
    # the mask does not make the naive algorithm cheaper: it computes, then overwrites
    causal = naive_counts(P(mask="causal"))
    assert causal.flops_executed == c.flops_executed and causal.hbm_bytes == c.hbm_bytes
    assert causal.flops == c.flops / 2


def test_causal_forward_by_hand():
    c = flash_forward_counts(P(mask="causal"), block_m=128, block_n=64)
    assert c.flops == 4 * 256 * 256 * 64 / 2                        # the book's convention: exactly half
    assert c.visible_pairs == 256 * 257 // 2                          # the diagonal is visible
    assert c.flops_visible == 2 * (64 + 64) * (256 * 257 // 2)
    # block 0 (rows 0..127) needs keys [0, 128): 2 tiles; block 1 needs [0, 256): 4 tiles
    assert c.tiles == 6
    assert c.flops_executed == 2 * 128 * 6 * 128 * 64
    assert c.bytes_breakdown["k"] == c.bytes_breakdown["v"] == 2 * (128 + 256) * 64
    assert c.hbm_bytes == 2 * 256 * 64 * 2 + 2 * 2 * 384 * 64 + 4 * 256 == 164_864


def test_sliding_window_forward_by_hand():
    c = flash_forward_counts(P(mask="window", window=64), block_m=128, block_n=64)
    # row i sees keys [i - 64, i]: 1, 2, ..., 65 for the first rows, then 65 each
    assert c.visible_pairs == sum(range(1, 65)) + 65 * 192 == 14_560
    assert c.flops == 4 * 256 * 256 * 64                             # the convention ignores windows
    assert c.flops_visible == 256 * 14_560
    # block 0: keys [0, 128) → tiles 0, 1; block 1: keys [64, 256) → tiles 1, 2, 3
    assert c.tiles == 5 and c.flops_executed == 256 * 5 * 128 * 64
    assert c.bytes_breakdown["k"] == 2 * (128 + 192) * 64
    assert Problem(1, 1, 256, mask="window", window=64).left_right == (64, 0)
    assert Problem(1, 1, 256, mask="window", window=(3, 5)).left_right == (3, 5)


def test_kv_cache_shape_nq_less_than_nk():
    # bottom-right causal: query i of 64 sits at key i + 192 and sees keys [0, i + 192]
    c = flash_forward_counts(P(64, 256, mask="causal"), block_m=64, block_n=64)
    assert c.visible_pairs == sum(i + 193 for i in range(64)) == 14_368
    assert c.flops == 4 * 64 * 256 * 64                              # halved only when Nq == Nk
    assert c.tiles == 4 and c.flops_executed == 256 * 4 * 64 * 64
    assert c.bytes_breakdown == dict(q=2 * 64 * 64, k=2 * 256 * 64, v=2 * 256 * 64, o=2 * 64 * 64, lse=4 * 64)


def test_nq_greater_than_nk_rows_that_see_nothing():
    # Nq=256 > Nk=64: rows 0..191 sit before the first key and see nothing
    c = flash_forward_counts(P(256, 64, mask="causal"), block_m=128, block_n=64)
    assert c.visible_pairs == sum(range(1, 65)) == 2080
    assert c.tiles == 1                                             # block 0 is skipped entirely
    assert c.flops_executed == 256 * 128 * 64
    assert c.bytes_breakdown["k"] == 2 * 64 * 64


def test_dv_differs_from_d():
    c = flash_forward_counts(P(D=64, Dv=32), block_m=128, block_n=64)
    assert c.flops == 2 * 256 * 256 * (64 + 32)
    assert c.bytes_breakdown["v"] == 2 * 2 * 256 * 32 and c.bytes_breakdown["o"] == 2 * 256 * 32
    b = flash_backward_counts(P(D=64, Dv=32))
    assert b.flops_executed == 2 * (3 * 64 + 2 * 32) * 256 * 256


def test_backward_by_hand():
    c = flash_backward_counts(P(), block_m=64, block_n=128)
    assert c.flops_executed == c.flops == 2.5 * 4 * 256 * 256 * 64   # five matmuls: 2.5x the forward
    pre = 2 * 256 * 64 * 2 + 4 * 256                                # read O, dO; write delta
    q_rows = 2 * 256                                                # 2 key blocks, each sees all 256 queries
    main = (4 * 2 * 256 * 64                                        # K, V in; dK, dV out
            + 2 * q_rows * 64 * 2 + 4 * q_rows * 2                  # Q, dO, lse, delta per visit
            + 2 * 4 * q_rows * 64)                                  # dQ fp32 read + write per visit
    post = 4 * 256 * 64 * 2 + 2 * 256 * 64                          # zero dQ, read it, write it in fp16
    assert c.hbm_bytes == pre + main + post == 758_784
    assert [ph.name for ph in c.phases][1] == "flash backward"
    causal = flash_backward_counts(P(mask="causal"), block_m=64, block_n=128)
    assert causal.flops == c.flops / 2
    # key block 0 (keys 0..127) is seen by queries 0..255 (4 query tiles), block 1 by 128..255 (2)
    assert causal.tiles == 6


@pytest.mark.parametrize("mask,window", [("none", None), ("causal", None), ("window", 5),
                                         ("window", (3, 2)), ("window", (-1, 4))])
def test_counts_agree_with_fa_lab_masks(mask, window):
    rng = random.Random(stable_seed(mask, str(window)))
    for _ in range(5):
        n_q, n_k = rng.randint(1, 70), rng.randint(1, 70)
        bm, bn = rng.choice([4, 8, 16]), rng.choice([4, 8, 16])
        p = P(n_q, n_k, mask=mask, window=window)
        left, right = p.left_right
        assert visible_pairs(n_q, n_k, left, right) == int(visible(n_q, n_k, left, right).sum())
        t = tiles(n_q, n_k, left, right, bm, bn)
        for i, m0 in enumerate(range(0, n_q, bm)):
            lo, hi = block_key_range(m0, min(m0 + bm, n_q), n_q, n_k, left, right)
            want = 0 if hi <= lo else math.ceil(hi / bn) - lo // bn
            assert t.count[i] == want


@pytest.mark.parametrize("mask", ["none", "causal"])
@pytest.mark.parametrize("n_q,n_k", [(256, 256), (100, 300)])
def test_convention_is_fa_lab_flops(mask, n_q, n_k):
    p = Problem(batch=2, heads=3, n_q=n_q, n_k=n_k, head_dim=32, mask=mask)
    for alg, mode in (("flash_fwd", "fwd"), ("naive", "fwd"), ("flash_bwd", "bwd")):
        assert count(alg, p).flops == attention_flops(2, 3, n_q, n_k, 32, causal=mask == "causal", mode=mode)


def test_gqa_reads_kv_once_per_kv_head_only_in_the_compulsory_count():
    mha = flash_forward_counts(Problem(1, 8, 512, head_dim=64))
    gqa = flash_forward_counts(Problem(1, 8, 512, head_dim=64, kv_heads=2))
    assert gqa.hbm_bytes == mha.hbm_bytes                      # every query head streams K/V
    assert gqa.compulsory_bytes == mha.compulsory_bytes - 2 * 6 * 512 * 128


def test_older_mask_words_are_read_as_the_package_vocabulary():
    assert Problem(1, 1, 8, mask="full").mask == "none"
    assert Problem(1, 1, 8, mask="sliding_window", window=3).mask == "window"
    assert correlate.problem_of(dict(batch=1, heads=1, n_q=8, n_k=8, head_dim=8, mask="sliding_window", window=3,
                                     dtype="fp16")).left_right == (3, 0)


def test_bad_problems_are_refused():
    with pytest.raises(ValueError, match="mask"):
        Problem(1, 1, 8, mask="diagonal")
    with pytest.raises(ValueError, match="needs window"):
        Problem(1, 1, 8, mask="window")
    with pytest.raises(ValueError, match="only for"):
        Problem(1, 1, 8, mask="causal", window=3)
    with pytest.raises(ValueError, match="n_q"):
        Problem(1, 1, 0)
    with pytest.raises(ValueError, match="multiple"):
        Problem(1, 6, 8, kv_heads=4)
    with pytest.raises(ValueError, match="dtype"):
        Problem(1, 1, 8, dtype="int8")
    with pytest.raises(ValueError, match="algorithm"):
        count("flash_v9", Problem(1, 1, 8))


# ----------------------------------------------------------------------------- roofline
def test_predict_compute_and_memory_terms():
    dev = devices.get_device("H100_80GB")
    c = flash_forward_counts(Problem(4, 16, 4096, head_dim=128))
    pr = predict(c, dev)
    assert pr.bound == "compute"
    assert pr.t_mma == pytest.approx(c.flops_executed / 989.4e12)
    assert pr.t_exp == pytest.approx(c.exps / (16 * 132 * 1980e6))
    assert pr.time_s == pytest.approx(pr.t_mma + pr.t_exp)
    assert pr.cycles == pytest.approx(pr.time_s * 1980e6)
    half = predict(c, dev, eff_compute=0.5)
    assert half.time_s == pytest.approx(2 * pr.time_s)
    assert predict(c, dev, exp_overlap=True).time_s == pytest.approx(max(pr.t_mma, pr.t_exp))
    assert predict(c, dev, clock_mhz=1000).cycles == pytest.approx(pr.time_s * 1e9)
    naive = predict(naive_counts(Problem(4, 16, 4096, head_dim=128)), dev)
    assert naive.bound == "memory"
    # every phase of the naive algorithm is memory bound here: time = all bytes / bandwidth
    assert naive.time_s == pytest.approx(naive_counts(Problem(4, 16, 4096, head_dim=128)).hbm_bytes / 3.35e12)


def test_l2_estimate_between_compulsory_and_streamed():
    dev = devices.get_device("H100_80GB")
    small = flash_forward_counts(Problem(1, 8, 4096, head_dim=128))        # K/V of a head: 2 MB, fits in L2
    assert predict(small, dev).dram_bytes == pytest.approx(small.compulsory_bytes)
    assert predict(small, dev, bytes_model="streamed").dram_bytes == pytest.approx(small.hbm_bytes)
    huge = flash_forward_counts(Problem(1, 1, 1 << 19, head_dim=128))     # 256 MB per head: it does not
    d = predict(huge, dev).dram_bytes
    assert huge.compulsory_bytes < d < huge.hbm_bytes


def test_device_presets_and_names():
    for key in ("H100_80GB", "H200", "A100_80GB", "L4", "RTX3090", "RTX4090", "RTX5080"):
        dev = devices.get_device(key)
        assert dev.sm_count > 0 and dev.hbm_bandwidth > 1e11 and dev.smem_per_sm >= 100 * 1024
        assert dev.tensor_flops["fp16"] > dev.cuda_flops["fp32"] > 1e12
        # prose names a preset by its short name, and that name (spaces dropped) selects it again
        assert dev.short and devices.get_device(dev.short.replace(" ", "")) is dev
        assert devices.get_device(dev) is dev
        assert devices.preset_for(dev.name) is dev
    dev, dt = devices.select("H100_80GB_fp16")
    assert dev.name.startswith("NVIDIA H100") and dt == "fp16"
    assert devices.select("rtx4090_bf16")[1] == "bf16" and devices.select("A100")[1] == "fp16"
    assert devices.get_device("H200").hbm_bandwidth == 4.8e12
    assert devices.get_device("H100").peak_flops("fp32") == pytest.approx(66.9e12)        # CUDA cores
    assert devices.get_device("H100").peak_flops("tf32") == pytest.approx(494.7e12)       # Tensor Cores
    assert "H100_80GB_fp16" in devices.sim_device_names()
    with pytest.raises(ValueError, match="unknown device"):
        devices.select("H900_fp16")


def test_measured_ceilings_replace_datasheet_numbers(tmp_path):
    dev = devices.get_device("H100_80GB")
    m = dev.with_ceilings({"tensor_bf16": 7.9e14, "copy_bytes_per_s": 3.0e12, "cuda_fp32": 5.1e13,
                           "exp_per_s": 16 * 132 * 1980e6 / 2})
    assert m.peak_flops("bf16") == 7.9e14 and m.peak_flops("fp16") == dev.peak_flops("fp16")
    assert m.hbm_bandwidth == 3.0e12 and m.peak_flops("fp32") == 5.1e13
    assert m.exp_rate == pytest.approx(dev.exp_rate / 2)
    assert m.measured["tensor_bf16"] == 7.9e14 and not dev.measured
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"meta": {}, "records": [{"name": "copy_bytes_per_s", "value": 2.5e12},
                                                         {"name": "tensor_fp16", "value": None}]}))
    assert dev.with_ceilings_file(path).hbm_bandwidth == 2.5e12
    with pytest.raises(ValueError, match="no known ceiling"):
        dev.with_ceilings({"bogus": 1})


# ----------------------------------------------------------------------------- calibration
def _records_with(cal, dev):
    recs = []
    for which, shapes in (("calibration", correlate.CALIBRATION), ("report", correlate.REPORT)):
        for s in shapes:
            rec = dict(kernel="sdpa-flash", set=which, dtype="fp16", status="ok", window=None, ms=1.0)
            rec.update(s)
            rec["ms"] = correlate.predict_record(rec, dev, cal)["predicted_ms"]
            recs.append(rec)
    return recs


@pytest.mark.parametrize("truth", [correlate.Calibration(eff=0.4),
                                   correlate.Calibration(eff=0.7, overhead_tiles=3.0),
                                   correlate.Calibration(eff=0.5, overhead_tiles=1.5, exp_overlap=True)])
def test_calibration_recovers_known_numbers(truth):
    dev = devices.get_device("H100_80GB")
    recs = _records_with(truth, dev)
    fit = correlate.calibrate(recs, dev)["sdpa-flash"]
    assert fit.eff == pytest.approx(truth.eff, rel=1e-6)
    assert fit.overhead_tiles == pytest.approx(truth.overhead_tiles, abs=1e-6)
    assert fit.exp_overlap == truth.exp_overlap and fit.calibration_error < 1e-9
    tab = correlate.table(recs, dev, {"sdpa-flash": fit})
    assert tab["error"].abs().max() < 1e-6
    s = correlate.summary(tab)
    assert s.loc["sdpa-flash", "shapes"] == len(correlate.REPORT) and s.loc["sdpa-flash", "within_25"] == 1.0


def test_overhead_tiles_charge_each_program():
    dev = devices.get_device("H100_80GB")
    c = flash_forward_counts(Problem(1, 1, 1024, head_dim=128), block_m=128, block_n=64)  # 8 programs x 16 tiles
    base = predict(c, dev)
    assert predict(c, dev, overhead_tiles=4).time_s == pytest.approx(base.time_s * (1 + 4 * 8 / 128))


def test_a_kernel_that_does_not_skip_masked_tiles():
    p = P(mask="window", window=64)
    skip = flash_forward_counts(p, block_m=128, block_n=64)
    dense = flash_forward_counts(p, block_m=128, block_n=64, skip_masked=False, mask_bytes=1)
    assert dense.tiles == 8 and dense.flops_executed == 4 * 256 * 256 * 64 > skip.flops_executed
    assert dense.flops_visible == skip.flops_visible
    assert dense.bytes_breakdown["mask"] == 256 * 256
    assert dense.hbm_bytes == flash_forward_counts(P(), block_m=128, block_n=64).hbm_bytes + 256 * 256


def test_sdpa_given_a_mask_tensor_is_modelled_without_skipping():
    rec = dict(kernel="sdpa-efficient", mask="window", window=64, batch=1, heads=1, n_q=256, n_k=256,
               head_dim=64, dtype="bf16")
    km = correlate.record_model(rec)
    assert not km.skip_masked and km.mask_bytes == 1
    assert correlate.record_model(dict(rec, kernel="triton")).skip_masked


def test_compute_dtype_picks_the_peak():
    dev = devices.get_device("H100_80GB")
    c = naive_counts(Problem(1, 16, 4096, head_dim=128, dtype="bf16"), score_bytes=4)
    upcast = predict(c, dev, unit="cuda", compute_dtype="fp32")
    assert upcast.peak_flops == pytest.approx(66.9e12) and upcast.dtype == "fp32"


def test_report_shapes_are_not_calibration_shapes():
    lengths = lambda shapes: {(s["n_q"], s["n_k"]) for s in shapes}  # noqa: E731
    assert not lengths(correlate.CALIBRATION) & lengths(correlate.REPORT)
    assert min(max(s["n_q"], s["n_k"]) for s in correlate.REPORT) >= 2048


def test_recorded_gpu_data_is_consistent():
    from fa_lab.bench import records

    meta, df = records.load("gpu_ch6")
    if meta is None:
        pytest.skip("no recorded chapter-6 GPU data")
    ok = df[df["status"] == "ok"]
    assert set(ok["set"]) >= {"calibration", "report"}
    assert set(meta["calibration"]) <= set(ok["kernel"])
    assert {"eff", "overhead_tiles", "exp_overlap"} <= set(meta["calibration"]["sdpa-flash"])
    assert set(ok["mask"]) <= {"none", "causal", "window"}
    cmeta, ceil = records.load("gpu_ch6_ceilings")
    assert cmeta is not None and {"tensor_bf16", "copy_bytes_per_s"} <= set(ceil["name"])


# ----------------------------------------------------------------------------- the CLI
def _cli(argv, capsys):
    import argparse

    from fa_lab.perf import cli as cli_correlate

    parser = argparse.ArgumentParser()
    cli_correlate.configure(parser)
    rc = cli_correlate.run(parser.parse_args(argv))
    return rc, capsys.readouterr()


def test_cli_prints_the_simulation_and_writes_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc, cap = _cli(["--batch", "1", "--heads", "8", "--seq-len", "1024", "--seq-len-k", "2048", "--head-dim", "128",
                    "--head-dim-v", "64", "--sim-device", "H100_80GB", "--dtype", "fp16", "--mask", "causal",
                    "--gpu-clock-khz", "1500000", "--efficiency", "0.5", "--json-out", str(out)], capsys)
    assert rc == 0
    for word in ("FLOPs", "traffic", "predicted", "cycles", "1500 MHz"):
        assert word in cap.out
    rep = json.loads(out.read_text())
    p = Problem(batch=1, heads=8, n_q=1024, n_k=2048, head_dim=128, head_dim_v=64, mask="causal")
    c = count("flash_fwd", p, block_m=128, block_n=64)
    assert rep["counts"]["flops"] == c.flops and rep["counts"]["hbm_bytes"] == c.hbm_bytes
    assert rep["counts"]["flops_executed"] == c.flops_executed
    assert rep["predicted"]["clock_mhz"] == 1500 and rep["calibration"]["eff"] == 0.5
    assert rep["predicted"]["time_s"] == pytest.approx(2 * rep["ideal"]["time_s"])
    assert rep["predicted"]["cycles"] == pytest.approx(rep["predicted"]["time_s"] * 1.5e9)


def test_cli_window_and_algorithms(tmp_path, capsys):
    out = tmp_path / "w.json"
    rc, _ = _cli(["--seq-len", "4096", "--window", "256", "0", "--algorithm", "flash_bwd", "--json-out", str(out)],
                 capsys)
    assert rc == 0
    rep = json.loads(out.read_text())
    assert rep["problem"]["window"] == [256, 0] and rep["problem"]["mask"] == "window"
    assert rep["algorithm"] == "flash_bwd"
    rc, cap = _cli(["--algorithm", "naive", "--sim-device", "A100_80GB_bf16"], capsys)
    assert rc == 0 and "memory bound" in cap.out


def test_cli_still_reads_its_older_flags(tmp_path, capsys):
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    assert _cli(["--seq-len-q", "512", "--dim-qk", "64", "--dim-v", "32", "--attention-mask", "sliding_window",
                 "--attention-window", "100", "--hardware-kernel", "flash", "--json-out", str(old)], capsys)[0] == 0
    assert _cli(["--seq-len", "512", "--head-dim", "64", "--head-dim-v", "32", "--mask", "window",
                 "--window", "100", "0", "--json-out", str(new)], capsys)[0] == 0
    a, b = json.loads(old.read_text()), json.loads(new.read_text())
    assert a["problem"] == b["problem"] and a["counts"] == b["counts"] and a["kernel"] == b["kernel"] == "sdpa-flash"
    with pytest.raises(SystemExit):
        _cli(["--attention-window", "a,b"], capsys)


@pytest.mark.parametrize("argv,words", [
    (["--mask", "window"], "needs --window"),
    (["--window", "4", "0", "--mask", "causal"], "only for --mask window"),
    (["--sim-device", "H900_fp16"], "unknown device"),
    (["--dtype", "int8"], "unknown dtype"),
])
def test_cli_bad_arguments_say_what_is_wrong(argv, words, capsys):
    rc, cap = _cli(argv, capsys)
    assert rc == 2 and words in cap.err


def test_cli_measure_hardware(tmp_path, capsys):
    import fa_lab

    out = tmp_path / "m.json"
    rc, cap = _cli(["--seq-len", "256", "--heads", "2", "--head-dim", "64", "--measure-hardware",
                    "--hardware-kernel", "sdpa-flash", "--json-out", str(out)], capsys)
    rep = json.loads(out.read_text())
    if fa_lab.ON_GPU:
        assert rc == 0 and rep["measured"]["status"] == "ok" and rep["measured"]["ms"] > 0
    else:   # the simulation is printed, then a clear error and a non-zero status
        assert rc != 0 and "predicted" in cap.out
        assert "needs a CUDA GPU" in cap.err and "nothing was measured" in cap.err
        assert rep["measured"]["status"] == "no GPU" and rep["predicted"]["time_s"] > 0


def test_cli_is_a_fa_lab_subcommand():
    from fa_lab.cli import SUBCOMMANDS

    assert SUBCOMMANDS["correlate"] == "fa_lab.perf.cli"


def test_cli_lists_devices(capsys):
    rc, cap = _cli(["--sim-device", "list"], capsys)
    assert rc == 0 and "RTX5080_fp16" in cap.out and "L4_bf16" in cap.out


def test_the_model_takes_the_tiles_the_kernel_runs(monkeypatch):
    """On a GPU without shipped entries of its own (an H200) the kernel runs its architecture's, and the
    performance model must describe those tiles, not the untuned default."""
    import types

    import torch

    from fa_lab.kernels.triton import CACHE, FINAL, config_key, policy
    from fa_lab.perf import hardware

    spec = types.SimpleNamespace(head_dim=128, n_q=4096, n_k=4096, mask="causal")
    shipped = CACHE.get("NVIDIA H100 80GB HBM3", config_key(spec, torch.bfloat16, FINAL.space))
    assert shipped is not None
    monkeypatch.setattr(hardware, "ON_GPU", True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(policy, "device_facts", lambda index: ("NVIDIA H200", (9, 0)))
    blocks = hardware.kernel_blocks("triton", Problem(batch=4, heads=16, n_q=4096, head_dim=128, mask="causal",
                                                      dtype="bf16"))
    assert "source" not in blocks, blocks
    assert {k: blocks[k] for k in ("block_m", "block_n", "num_warps", "num_stages")} == {
        "block_m": shipped["BLOCK_M"], "block_n": shipped["BLOCK_N"], "num_warps": shipped["num_warps"],
        "num_stages": shipped["num_stages"]}


# ----------------------------------------------------------------------------- on a GPU
@pytest.mark.gpu
def test_measure_kernels_on_the_gpu():
    from fa_lab.perf import hardware

    p = Problem(batch=2, heads=4, n_q=1024, head_dim=64, mask="causal", dtype="bf16")
    for kernel in ("sdpa-flash", "sdpa-math", "triton"):
        rec = hardware.measure(kernel, p)
        assert rec["status"] == "ok" and rec["ms"] > 0, rec
    assert "sliding window" in hardware.measure("sdpa-flash", Problem(1, 1, 64, mask="window", window=8))["status"]
    assert hardware.measure("sdpa-efficient", Problem(1, 1, 64, mask="window", window=8))["status"] == "ok"


@pytest.mark.gpu
def test_ceilings_on_the_gpu():
    from fa_lab.perf import hardware

    recs = {r["name"]: r for r in hardware.measure_ceilings(n=2048, copy_bytes=2**28)}
    assert all(r["status"] == "ok" for r in recs.values()), recs
    dev = devices.current_device({k: r["value"] for k, r in recs.items()})
    assert dev is None or dev.measured["copy_bytes_per_s"] > 1e11
