"""Predict attention's FLOPs, HBM traffic, time and cycles on a GPU preset; optionally measure and compare.

    fa-lab correlate --batch 1 --heads 8 --seq-len 1024 --head-dim 128 --dtype fp16 \\
        --sim-device H100_80GB --mask causal \\
        [--measure-hardware --hardware-kernel sdpa-flash --profile-iters 20 --gpu-clock-khz 1980000] [--json-out FILE]

The problem takes the flags of ``fa-lab bench`` (one value each); ``--mask window --window LEFT RIGHT``
is a sliding window.  ``--measure-hardware`` needs a CUDA GPU: without one the simulation is
printed and the command exits with status 1.
"""
from __future__ import annotations

import argparse
import json
import sys

#: the exit status when --measure-hardware finds no GPU (the simulation was still printed)
NO_GPU = 1
#: the problem's defaults: one layer of a mid-sized model at 1k tokens
DEFAULTS = dict(batch=1, heads=8, seq_len=1024, head_dim=128)


def _old_window(text: str):
    """``--attention-window``: 'W' → (W, 0); 'L,R' → (L, R)."""
    parts = [p.strip() for p in str(text).split(",")]
    try:
        vals = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes W or LEFT,RIGHT (ints, -1 = unbounded), got {text!r}") from None
    if len(vals) not in (1, 2):
        raise argparse.ArgumentTypeError(f"takes W or LEFT,RIGHT, got {text!r}")
    return [vals[0], 0] if len(vals) == 1 else vals


def _old_mask(text: str) -> str:
    """``--attention-mask``: the model's older words for the package's masks."""
    from fa_lab.perf.model import MASK_ALIASES, MASKS

    mask = MASK_ALIASES.get(text, text)
    if mask not in MASKS:
        raise argparse.ArgumentTypeError(f"expected one of {list(MASKS) + list(MASK_ALIASES)}, got {text!r}")
    return mask


def _hidden_aliases(parser) -> None:
    """The flags ``fa-lab correlate`` had before it shared ``fa-lab bench``'s: still accepted, not shown."""
    hide = dict(help=argparse.SUPPRESS, default=argparse.SUPPRESS)
    parser.add_argument("--seq-len-q", dest="seq_len", type=int, **hide)
    parser.add_argument("--dim-qk", dest="head_dim", type=int, **hide)
    parser.add_argument("--dim-v", dest="head_dim_v", type=int, **hide)
    parser.add_argument("--attention-mask", dest="mask", type=_old_mask, **hide)
    parser.add_argument("--attention-window", dest="window", type=_old_window, **hide)


def configure(parser) -> None:
    from fa_lab.cli import add_problem_arguments, positive_int
    from fa_lab.perf.model import ALGORITHMS

    g = add_problem_arguments(parser, grid=False, defaults=DEFAULTS)
    g.add_argument("--head-dim-v", type=positive_int, default=None, metavar="N",
                   help="head dim Dv of v, for the model only (default = --head-dim)")
    _hidden_aliases(parser)
    m = parser.add_argument_group("model")
    m.add_argument("--sim-device", default="H100_80GB",
                   help="device preset, optionally with a dtype: H100_80GB, H200_bf16, A100_80GB_fp16, RTX4090_fp32 "
                        "(fp32 = CUDA cores, tf32 = Tensor Cores; --dtype wins); 'list' prints them all")
    m.add_argument("--algorithm", choices=ALGORITHMS, default="flash_fwd")
    m.add_argument("--block-m", type=int, default=None, help="query rows per program (default: the kernel's)")
    m.add_argument("--block-n", type=int, default=None, help="keys per tile (default: the kernel's)")
    m.add_argument("--efficiency", type=float, default=None,
                   help="compute efficiency factor (fraction of peak), with no per-program overhead; default: the "
                        "calibration of --hardware-kernel in the recorded GPU data when there is one, else 1.0")
    m.add_argument("--ceilings", default=None, metavar="FILE",
                   help="replace the datasheet peaks by measured ceilings (JSON from scripts/correlate_gpu.py); "
                        "'recorded' uses fa_lab/data/gpu_ch6_ceilings.json")
    h = parser.add_argument_group("hardware")
    h.add_argument("--measure-hardware", action="store_true",
                   help="also time the kernel on this machine's GPU (exit status 1 without one)")
    h.add_argument("--hardware-kernel", default="sdpa-flash",
                   help="sdpa-flash, sdpa-efficient, sdpa-cudnn, sdpa-math (PyTorch SDPA backends) or any fa_lab "
                        "implementation (triton, numba_tiled, …); "
                        "also picks the tile sizes and efficiency of the model")
    h.add_argument("--profile-iters", type=int, default=20,
                   help="timed repetitions (CPU world; on a GPU do_bench fills its 100 ms budget)")
    h.add_argument("--gpu-clock-khz", type=float, default=None,
                   help="clock for the cycle counts (default: the preset's boost clock)")
    parser.add_argument("--json-out", default=None, metavar="FILE", help="write every reported figure as JSON")


def _time(seconds: float) -> str:
    """A duration in the unit that keeps it readable: ``20.2 ns``, ``151 µs``, ``3.52 ms``, never ``0.0000 ms``."""
    from fa_lab.core.tables import sig

    for unit, scale in (("s", 1.0), ("ms", 1e3), ("µs", 1e6)):
        if abs(seconds) * scale >= 1:
            return f"{sig(seconds * scale)} {unit}"
    return f"{sig(seconds * 1e9)} ns"


def _fmt_bytes(b: float) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if b >= div:
            return f"{b / div:.3f} {unit}"
    return f"{b:.0f} B"


def _recorded_calibration(kernel: str, measured_ceilings: bool):
    """(Calibration, where it came from) for ``kernel`` from the recorded chapter-6 data, or (None, why not).

    The recording holds two fits of the same measurements: against the measured ceilings
    (``calibration``) and against the datasheet peaks (``calibration_datasheet``).
    """
    from fa_lab.bench import records
    from fa_lab.perf.correlate import Calibration

    meta, _ = records.load("gpu_ch6")
    key = "calibration" if measured_ceilings else "calibration_datasheet"
    if not meta or kernel not in (meta.get(key) or {}):
        return None, "no recorded calibration for this kernel"
    fields = {k: v for k, v in meta[key][kernel].items() if k in Calibration.__dataclass_fields__}
    basis = "measured ceilings" if measured_ceilings else "datasheet peaks"
    return Calibration(**fields), f"calibrated against {basis} on {records.label(meta)}"


def _kernel_blocks(kernel: str, problem) -> dict:
    """The tile sizes a fa_lab kernel picks for ``problem`` on a GPU (empty for the SDPA backends)."""
    from fa_lab.perf import hardware

    got = hardware.kernel_blocks(kernel, problem)
    return {k: int(got[k]) for k in ("block_m", "block_n") if k in got}


def problem(args, dtype: str):
    """The model's Problem from the shared problem flags; ValueError says what is wrong."""
    from fa_lab.perf.model import Problem

    mask = args.mask or ("window" if args.window else "none")
    if mask == "window" and not args.window:
        raise ValueError("--mask window needs --window LEFT RIGHT (-1 for unbounded)")
    if mask != "window" and args.window:
        raise ValueError(f"--window is only for --mask window (got --mask {mask})")
    return Problem(batch=args.batch, heads=args.heads, kv_heads=args.kv_heads, n_q=args.seq_len,
                   n_k=args.seq_len_k, head_dim=args.head_dim, head_dim_v=args.head_dim_v,
                   mask=mask, window=tuple(args.window) if args.window else None, dtype=dtype)


def _blocks(args, km, p) -> dict:
    """Tile sizes: the kernel's (as it would pick them for ``p``), or the algorithm's, or the flags'."""
    blocks = {**km.blocks(), **_kernel_blocks(args.hardware_kernel, p)}
    if args.algorithm != km.algorithm:     # the user asked for another algorithm than the kernel's
        blocks = {} if args.algorithm == "naive" else dict(block_m=128, block_n=64)
        if args.algorithm == "flash_bwd":
            blocks = dict(block_m=64, block_n=128)
    if args.block_m:
        blocks["block_m"] = args.block_m
    if args.block_n:
        blocks["block_n"] = args.block_n
    return blocks


def simulate(args) -> dict:
    """Every figure the command reports, as a dict (the JSON of ``--json-out``); ValueError for bad input."""
    from fa_lab.bench.peers import canonical_name
    from fa_lab.perf import correlate, devices, model, roofline

    args.hardware_kernel = canonical_name(args.hardware_kernel)   # 'flash' → 'sdpa-flash'
    device, dtype = devices.select(args.sim_device)
    if args.dtype:
        dtype = devices.canonical_dtype(args.dtype)
    p = problem(args, dtype)
    if args.ceilings:
        path = args.ceilings
        if path == "recorded":
            from fa_lab.core.data import DATA_DIR

            path = DATA_DIR / "gpu_ch6_ceilings.json"
        device = device.with_ceilings_file(path)
    km = correlate.kernel_model(args.hardware_kernel)
    blocks = _blocks(args, km, p)
    counts = model.count(args.algorithm, p, **blocks)
    if args.efficiency is not None:
        cal, cal_source = correlate.Calibration(eff=args.efficiency), "--efficiency"
    else:
        cal, cal_source = _recorded_calibration(args.hardware_kernel, bool(device.measured))
        if cal is None:
            cal, cal_source = correlate.Calibration(), "none (ideal roofline); " + cal_source
    clock_mhz = args.gpu_clock_khz / 1e3 if args.gpu_clock_khz else None
    common = dict(unit=km.unit, compute_dtype=km.compute_dtype, clock_mhz=clock_mhz)
    ideal = roofline.predict(counts, device, exp_overlap=cal.exp_overlap, **common)
    pred = roofline.predict(counts, device, **cal.predict_kw(), **common)
    return dict(problem=counts.problem.__dict__, device=device.summary(), dtype=dtype, algorithm=args.algorithm,
                kernel=args.hardware_kernel, blocks=blocks, counts=counts.as_dict(), ideal=ideal.as_dict(),
                predicted=pred.as_dict(), calibration=cal.__dict__, calibration_source=cal_source,
                _objects=(device, km, counts, cal, ideal, pred))


def _print(report: dict) -> None:
    device, km, counts, cal, ideal, pred = report["_objects"]
    p, dtype, kernel, blocks = counts.problem, report["dtype"], report["kernel"], report["blocks"]
    print(f"problem   B={p.batch} H={p.heads} Hkv={p.kv_heads} Nq={p.n_q} Nk={p.n_k} D={p.head_dim} Dv={p.head_dim_v} "
          f"mask={p.mask}{' window=' + str(p.window) if p.window else ''} dtype={dtype}")
    print(f"device    {device.name}{' (measured ceilings)' if device.measured else ' (datasheet)'}: "
          f"{device.peak_flops(dtype, km.unit) / 1e12:.1f} TFLOP/s {pred.unit}, "
          f"{device.hbm_bandwidth / 1e12:.2f} TB/s, "
          f"{device.sm_count} SMs, {pred.clock_mhz:.0f} MHz")
    as_kernel = f" (as {kernel}: {km.note})" if report["algorithm"] == km.algorithm else ""
    tiles = f"{blocks['block_m']}×{blocks['block_n']} tiles" if {"block_m", "block_n"} <= set(blocks or {}) else \
        " ".join(f"{k}={v}" for k, v in (blocks or {}).items())
    print(f"algorithm {report['algorithm']} {tiles}{as_kernel}".replace("  ", " "))
    print(f"FLOPs     convention {counts.flops:.4g} (fa_lab.core.flops) | visible pairs {counts.flops_visible:.4g} "
          f"| executed tiles {counts.flops_executed:.4g}")
    print(f"traffic   HBM no-cache {_fmt_bytes(counts.hbm_bytes)} | compulsory {_fmt_bytes(counts.compulsory_bytes)} "
          f"| DRAM estimate (L2) {_fmt_bytes(pred.dram_bytes)}")
    print(f"intensity {counts.intensity:.1f} FLOP/B (no cache), "
          f"{counts.flops_executed / pred.dram_bytes:.1f} (L2 estimate); "
          f"ridge {device.peak_flops(dtype, km.unit) / device.hbm_bandwidth:.1f}")
    print(f"ideal     {_time(ideal.time_s)} = max(compute {_time(ideal.t_compute)} "
          f"[mma {_time(ideal.t_mma)} "
          f"{'max' if cal.exp_overlap else '+'} exp {_time(ideal.t_exp)}], memory {_time(ideal.t_memory)}) "
          f"— {ideal.bound} bound, {ideal.cycles:.4g} cycles")
    print(f"predicted {_time(pred.time_s)}, {pred.cycles:.4g} cycles at {pred.clock_mhz:.0f} MHz "
          f"(efficiency {cal.eff:.3f}, per-program overhead {cal.overhead_tiles:.2f} tiles, exps "
          f"{'overlapped' if cal.exp_overlap else 'after the matmuls'}: {report['calibration_source']}); "
          f"{counts.flops / pred.time_s / 1e12:.1f} TFLOP/s by the "
          f"convention, {counts.flops_executed / pred.time_s / 1e12:.1f} executed")


def run(args) -> int:
    from fa_lab.core.world import ON_GPU
    from fa_lab.perf import devices

    if args.sim_device == "list":
        print("\n".join(devices.sim_device_names()))
        return 0
    try:
        report = simulate(args)
    except ValueError as exc:
        print(f"fa-lab correlate: error: {exc}", file=sys.stderr)
        return 2
    _print(report)
    _, _, counts, _, _, pred = report.pop("_objects")
    status = 0
    if args.measure_hardware and not ON_GPU:
        print("fa-lab correlate: error: --measure-hardware needs a CUDA GPU, and this is the CPU world "
              "(Numba simulator, Triton interpreter): nothing was measured; the figures above are the model's only.",
              file=sys.stderr)
        report["measured"] = dict(status="no GPU")
        status = NO_GPU
    elif args.measure_hardware:
        report["measured"] = _measure(args, counts, pred)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=1, default=str)
        print(f"wrote {args.json_out}")
    return status


def _measure(args, counts, pred) -> dict:
    import torch

    from fa_lab.perf import hardware

    if args.hardware_kernel not in hardware.kernel_names():
        msg = f"unknown --hardware-kernel {args.hardware_kernel!r}; known: {', '.join(hardware.kernel_names())}"
        print(msg)
        return dict(status="unknown kernel", message=msg)
    rec = hardware.measure(args.hardware_kernel, counts.problem, rep=args.profile_iters)
    if rec["status"] != "ok":
        print(f"measured  {args.hardware_kernel}: {rec['status']}")
        return rec
    seconds = rec["ms"] * 1e-3
    clock_mhz = pred.clock_mhz
    rec.update(gpu=torch.cuda.get_device_name(0), seconds=seconds, cycles=seconds * clock_mhz * 1e6,
               tflops=counts.flops / seconds / 1e12, tflops_executed=counts.flops_executed / seconds / 1e12,
               measured_over_predicted=seconds / pred.time_s, error=pred.time_s / seconds - 1)
    print(f"measured  {_time(seconds)} (p10 {_time(rec['ms_p10'] * 1e-3)}, p90 {_time(rec['ms_p90'] * 1e-3)}; "
          f"{rec['timer']}) "
          f"on {rec['gpu']}: "
          f"{rec['tflops']:.1f} TFLOP/s, {rec['cycles']:.4g} cycles at {clock_mhz:.0f} MHz")
    print(f"ratio     measured / predicted = {rec['measured_over_predicted']:.3f} "
          f"(model error {rec['error'] * 100:+.1f}%)")
    return rec
