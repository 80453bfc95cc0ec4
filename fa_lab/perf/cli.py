"""Predict attention's FLOPs, HBM traffic, time and cycles on a GPU preset; optionally measure and compare.

    fa-lab correlate --batch 1 --heads 8 --seq-len-q 1024 --dim-qk 128 --dim-v 128 \\
        --sim-device H100_80GB_fp16 --attention-mask causal \\
        [--measure-hardware --hardware-kernel flash --profile-iters 20 --gpu-clock-khz 1980000] [--json-out FILE]
"""
from __future__ import annotations

import json
import sys

MASK_CHOICES = ("full", "causal", "sliding_window")


def _window(text: str):
    """'W' → W (= (W, 0)); 'L,R' → (L, R)."""
    parts = [p.strip() for p in str(text).split(",")]
    try:
        vals = [int(p) for p in parts]
    except ValueError:
        raise ValueError(f"--attention-window takes W or LEFT,RIGHT (ints, -1 = unbounded), got {text!r}") from None
    if len(vals) == 1:
        return vals[0]
    if len(vals) == 2:
        return tuple(vals)
    raise ValueError(f"--attention-window takes W or LEFT,RIGHT, got {text!r}")


def configure(parser) -> None:
    from fa_lab.perf.model import ALGORITHMS

    g = parser.add_argument_group("problem")
    g.add_argument("--batch", type=int, default=1)
    g.add_argument("--heads", type=int, default=8)
    g.add_argument("--kv-heads", type=int, default=None, help="key/value heads (grouped-query attention); default = heads")
    g.add_argument("--seq-len-q", type=int, default=1024)
    g.add_argument("--seq-len-k", type=int, default=None, help="default = --seq-len-q")
    g.add_argument("--dim-qk", type=int, default=128, help="head dim D of q and k")
    g.add_argument("--dim-v", type=int, default=None, help="head dim Dv of v (default = --dim-qk)")
    g.add_argument("--attention-mask", choices=MASK_CHOICES, default="full")
    g.add_argument("--attention-window", default=None, metavar="W|L,R",
                   help="sliding window: W = the query and the W keys before it, i.e. (W, 0); or LEFT,RIGHT")
    m = parser.add_argument_group("model")
    m.add_argument("--sim-device", default="H100_80GB_fp16",
                   help="device preset and dtype, e.g. H100_80GB_fp16, H200_bf16, A100_80GB_fp16, RTX4090_fp32 "
                        "(fp32 = CUDA cores, tf32 = Tensor Cores); 'list' prints them all")
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
    h.add_argument("--measure-hardware", action="store_true", help="also time the kernel on this machine's GPU")
    h.add_argument("--hardware-kernel", default="flash",
                   help="flash, efficient, cudnn, math (torch SDPA backends) or any fa_lab implementation "
                        "(triton, numba_tiled, …); also picks the tile sizes and efficiency of the model")
    h.add_argument("--profile-iters", type=int, default=20,
                   help="timed repetitions (CPU world; on a GPU do_bench fills its 100 ms budget)")
    h.add_argument("--gpu-clock-khz", type=float, default=None,
                   help="clock for the cycle counts (default: the preset's boost clock)")
    parser.add_argument("--json-out", default=None, metavar="FILE", help="write every reported figure as JSON")


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
    from fa_lab.bench import records as recorded
    from fa_lab.perf.correlate import Calibration

    meta, _ = recorded.load("gpu_ch6")
    key = "calibration" if measured_ceilings else "calibration_datasheet"
    if not meta or kernel not in (meta.get(key) or {}):
        return None, "no recorded calibration for this kernel"
    fields = {k: v for k, v in meta[key][kernel].items() if k in Calibration.__dataclass_fields__}
    basis = "measured ceilings" if measured_ceilings else "datasheet peaks"
    return Calibration(**fields), f"calibrated against {basis} on {recorded.label(meta)}"


def _kernel_blocks(kernel: str, problem) -> dict:
    """The tile sizes a fa_lab kernel picks for ``problem`` on a GPU (empty for the SDPA backends)."""
    from fa_lab.perf import hardware

    got = hardware.kernel_blocks(kernel, problem)
    return {k: int(got[k]) for k in ("block_m", "block_n") if k in got}


def run(args) -> int:
    from fa_lab.perf import correlate
    from fa_lab.perf import devices
    from fa_lab.perf import model

    if args.sim_device == "list":
        print("\n".join(devices.sim_device_names()))
        return 0
    try:
        device, dtype = devices.select(args.sim_device)
        window = _window(args.attention_window) if args.attention_window is not None else None
        if args.attention_mask == "sliding_window" and window is None:
            raise ValueError("--attention-mask sliding_window needs --attention-window W (or LEFT,RIGHT)")
        if args.attention_mask != "sliding_window" and window is not None:
            raise ValueError(f"--attention-window is only for --attention-mask sliding_window (got {args.attention_mask})")
        problem = model.Problem(batch=args.batch, heads=args.heads, kv_heads=args.kv_heads, n_q=args.seq_len_q,
                                n_k=args.seq_len_k, head_dim=args.dim_qk, head_dim_v=args.dim_v,
                                mask=args.attention_mask, window=window, dtype=dtype)
        if args.ceilings:
            path = args.ceilings
            if path == "recorded":
                from fa_lab.bench.records import DATA_DIR

                path = DATA_DIR / "gpu_ch6_ceilings.json"
            device = device.with_ceilings_file(path)
        km = correlate.kernel_model(args.hardware_kernel)
        blocks = {**km.blocks(), **_kernel_blocks(args.hardware_kernel, problem)}
        if args.algorithm != km.algorithm:     # the user asked for another algorithm than the kernel's
            blocks = {} if args.algorithm == "naive" else dict(block_m=128, block_n=64)
            if args.algorithm == "flash_bwd":
                blocks = dict(block_m=64, block_n=128)
        if args.block_m:
            blocks["block_m"] = args.block_m
        if args.block_n:
            blocks["block_n"] = args.block_n
        counts = model.count(args.algorithm, problem, **blocks)
        if args.efficiency is not None:
            cal, cal_source = correlate.Calibration(eff=args.efficiency), "--efficiency"
        else:
            cal, cal_source = _recorded_calibration(args.hardware_kernel, bool(device.measured))
            if cal is None:
                cal, cal_source = correlate.Calibration(), "none (ideal roofline); " + cal_source
        clock_mhz = args.gpu_clock_khz / 1e3 if args.gpu_clock_khz else None
        common = dict(unit=km.unit, compute_dtype=km.compute_dtype, clock_mhz=clock_mhz)
        ideal = model.predict(counts, device, exp_overlap=cal.exp_overlap, **common)
        pred = model.predict(counts, device, **cal.predict_kw(), **common)
    except ValueError as exc:
        print(f"fa-lab correlate: error: {exc}", file=sys.stderr)
        return 2

    report = dict(problem=counts.problem.__dict__, device=device.summary(), dtype=dtype, algorithm=args.algorithm,
                  kernel=args.hardware_kernel, blocks=blocks, counts=counts.as_dict(),
                  ideal=ideal.as_dict(), predicted=pred.as_dict(), calibration=cal.__dict__,
                  calibration_source=cal_source)
    p = counts.problem
    print(f"problem   B={p.batch} H={p.heads} Hkv={p.kv_heads} Nq={p.n_q} Nk={p.n_k} D={p.head_dim} Dv={p.head_dim_v} "
          f"mask={p.mask}{' window=' + str(p.window) if p.window else ''} dtype={dtype}")
    print(f"device    {device.name}{' (measured ceilings)' if device.measured else ' (datasheet)'}: "
          f"{device.peak_flops(dtype, km.unit) / 1e12:.1f} TFLOP/s {pred.unit}, {device.hbm_bandwidth / 1e12:.2f} TB/s, "
          f"{device.sm_count} SMs, {pred.clock_mhz:.0f} MHz")
    as_kernel = f" (as {args.hardware_kernel}: {km.note})" if args.algorithm == km.algorithm else ""
    print(f"algorithm {args.algorithm} {blocks or ''}{as_kernel}")
    print(f"FLOPs     convention {counts.flops:.4g} (fa_lab.core.flops) | visible pairs {counts.flops_visible:.4g} "
          f"| executed tiles {counts.flops_executed:.4g}")
    print(f"traffic   HBM no-cache {_fmt_bytes(counts.hbm_bytes)} | compulsory {_fmt_bytes(counts.compulsory_bytes)} "
          f"| DRAM estimate (L2) {_fmt_bytes(pred.dram_bytes)}")
    print(f"intensity {counts.intensity:.1f} FLOP/B (no cache), {counts.flops_executed / pred.dram_bytes:.1f} (L2 estimate); "
          f"ridge {device.peak_flops(dtype, km.unit) / device.hbm_bandwidth:.1f}")
    print(f"ideal     {ideal.time_s * 1e3:.4f} ms = max(compute {ideal.t_compute * 1e3:.4f} [mma {ideal.t_mma * 1e3:.4f} "
          f"{'max' if cal.exp_overlap else '+'} exp {ideal.t_exp * 1e3:.4f}], memory {ideal.t_memory * 1e3:.4f}) "
          f"— {ideal.bound} bound, "
          f"{ideal.cycles:.4g} cycles")
    print(f"predicted {pred.time_s * 1e3:.4f} ms, {pred.cycles:.4g} cycles at {pred.clock_mhz:.0f} MHz "
          f"(efficiency {cal.eff:.3f}, per-program overhead {cal.overhead_tiles:.2f} tiles, exps "
          f"{'overlapped' if cal.exp_overlap else 'after the matmuls'}: {cal_source}); "
          f"{counts.flops / pred.time_s / 1e12:.1f} TFLOP/s by the "
          f"convention, {counts.flops_executed / pred.time_s / 1e12:.1f} executed")

    if args.measure_hardware:
        report["measured"] = _measure(args, counts, pred)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=1, default=str)
        print(f"wrote {args.json_out}")
    return 0


def _measure(args, counts, pred) -> dict:
    import torch

    from fa_lab.perf import hardware
    from fa_lab.core.world import ON_GPU

    if not ON_GPU:
        msg = ("--measure-hardware: no CUDA GPU in this world (fa_lab runs the CPU simulator/interpreter); "
               "nothing was measured — the figures above are the simulation only.")
        print(msg)
        return dict(status="no GPU", message=msg)
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
    print(f"measured  {rec['ms']:.4f} ms (p10 {rec['ms_p10']:.4f}, p90 {rec['ms_p90']:.4f}; {rec['timer']}) on {rec['gpu']}: "
          f"{rec['tflops']:.1f} TFLOP/s, {rec['cycles']:.4g} cycles at {clock_mhz:.0f} MHz")
    print(f"ratio     measured / predicted = {rec['measured_over_predicted']:.3f} "
          f"(model error {rec['error'] * 100:+.1f}%)")
    return rec
