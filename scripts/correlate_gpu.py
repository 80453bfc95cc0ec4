"""Chapter 6's GPU data: measure the ceilings, time the attention forwards, correlate with the model.

Writes two recordings (``fa_lab.bench.records``): ``gpu_ch6_ceilings.json`` (matmul, copy and exp
ceilings) and ``gpu_ch6.json`` (one record per kernel × shape × dtype, with the model's
prediction after calibration).  Run on a GPU, from the repository root:

    python scripts/correlate_gpu.py                        # everything, into fa_lab/data/
    python scripts/correlate_gpu.py --kernels flash,triton --out /tmp/x
    python scripts/correlate_gpu.py --recalibrate           # re-fit recorded data after a model change
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import fa_lab  # noqa: E402  (first: it picks the world)
from fa_lab.bench import records as recorded  # noqa: E402
from fa_lab.bench.peers import canonical_name  # noqa: E402
from fa_lab.core.data import DATA_DIR  # noqa: E402
from fa_lab.perf import correlate  # noqa: E402
from fa_lab.perf import devices  # noqa: E402
from fa_lab.perf import hardware  # noqa: E402
from fa_lab.perf.model import Problem  # noqa: E402

DEFAULT_KERNELS = ["sdpa-flash", "triton", "numba_tiled", "sdpa-cudnn:bf16", "sdpa-efficient:bf16", "sdpa-math:bf16",
                   "naive_torch:bf16", "numba_naive"]
#: the chapter-1 kernels materialise S: a few small shapes are enough for the roofline plot
NAIVE_SHAPES = [dict(batch=8, heads=16, n_q=2048, n_k=2048, head_dim=128, mask="none"),
                dict(batch=4, heads=16, n_q=4096, n_k=4096, head_dim=128, mask="none")]


def kernel_dtypes(kernel: str, wanted: list[str]) -> list[str]:
    """The dtypes to time ``kernel`` in: ``wanted`` where it supports them, else its fp32 (CUDA-core kernels)."""
    if kernel in hardware.SDPA_BACKENDS:
        return wanted
    impl = fa_lab.get_implementation(kernel)
    have = [devices.canonical_dtype(d) for d in impl.dtype_names if d != "float64"]
    both = [d for d in wanted if d in have]
    return both or (["fp32"] if "fp32" in have else have[:1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", default=",".join(DEFAULT_KERNELS),
                    help="comma list: SDPA backends and/or registered fa_lab implementations; "
                         "'name:bf16' (or 'name:fp16+bf16') limits one kernel's dtypes")
    ap.add_argument("--dtypes", default="fp16,bf16")
    ap.add_argument("--out", default=None, help="directory for the JSON files (default fa_lab/data)")
    ap.add_argument("--name", default="gpu_ch6")
    ap.add_argument("--no-ceilings", action="store_true")
    ap.add_argument("--budget-s", type=float, default=300, help="stop timing new shapes after this many seconds")
    ap.add_argument("--dry-run", action="store_true",
                    help="go through the jobs without timing (tests the script on a CPU)")
    ap.add_argument("--recalibrate", action="store_true",
                    help="no measuring: re-fit the model on fa_lab/data/<name>.json and rewrite its predictions")
    args = ap.parse_args(argv)
    if args.recalibrate:
        return recalibrate(args.name)
    if not fa_lab.ON_GPU and not args.dry_run:
        print("correlate_gpu: no CUDA GPU here; this script records GPU data and has nothing to do on a CPU.")
        return 1
    t0 = time.time()
    command = "python scripts/correlate_gpu.py " + " ".join(argv if argv is not None else sys.argv[1:])
    fa_lab.banner()
    known = set(fa_lab.implementations())
    dtypes = [devices.canonical_dtype(d) for d in args.dtypes.split(",")]
    kernels = {}                       # kernel -> dtypes; 'cudnn:bf16' times cudnn in bf16 only
    for item in args.kernels.split(","):
        name, _, only = item.partition(":")
        name = canonical_name(name)        # 'flash' → 'sdpa-flash'
        if name not in hardware.SDPA_BACKENDS and name not in known:
            print(f"not registered in this tree, skipped: {name}")
            continue
        kernels[name] = [devices.canonical_dtype(d) for d in only.split("+")] if only else dtypes

    ceilings = []
    if not args.no_ceilings and not args.dry_run:
        ceilings = hardware.measure_ceilings()
        for c in ceilings:
            print(f"ceiling {c['name']:17s} {c['value'] or float('nan'):.4g} {c['unit']}  ({c['status']}; {c['how']})")
        recorded.save(f"{args.name}_ceilings", ceilings, command=command, directory=args.out)
    measured = {c["name"]: c["value"] for c in ceilings if c.get("value")}

    records = []
    jobs = []
    for kernel, wanted in kernels.items():
        if correlate.kernel_model(kernel).algorithm == "naive":
            shapes = [("roofline", s) for s in NAIVE_SHAPES]
        else:
            shapes = [("calibration", s) for s in correlate.CALIBRATION] + [("report", s) for s in correlate.REPORT]
        for dt in kernel_dtypes(kernel, wanted):
            jobs += [(kernel, which, dict(shape, dtype=dt)) for which, shape in shapes]
    for i, (kernel, which, shape) in enumerate(jobs):
        rec = dict(kernel=kernel, set=which, head_dim_v=shape["head_dim"], kv_heads=shape["heads"], window=None)
        rec.update(shape)
        if time.time() - t0 > args.budget_s:
            rec["status"] = "skipped (time budget)"
        elif args.dry_run:
            rec.update(status="ok", ms=1.0, timer="dry run (nothing timed)")
        else:
            rec.update(hardware.measure(kernel, Problem(**shape)))
        if rec["status"] == "ok":
            rec["tflops"] = correlate.ideal(rec, devices.get_device("H100_80GB"))[0].flops / (rec["ms"] * 1e-3) / 1e12
        print(f"[{i + 1}/{len(jobs)} {time.time() - t0:5.0f}s] {kernel:12s} {which:11s} {shape['dtype']} "
              f"B={shape['batch']} H={shape['heads']} Nq={shape['n_q']} Nk={shape['n_k']} D={shape['head_dim']} "
              f"{shape['mask']:14s} {rec.get('ms', float('nan')):9.3f} ms {rec.get('tflops', float('nan')):6.1f} TF/s "
              f"{rec['status'] if rec['status'] != 'ok' else ''}", flush=True)
        records.append(rec)

    path = save(args.name, records, measured, args.out, command=command, seconds=round(time.time() - t0))
    print(f"wrote {path} ({len(records)} records) in {time.time() - t0:.0f} s")
    return 0


def annotate(records: list, measured: dict, gpu_name: str | None = None) -> dict:
    """Calibrate on the calibration shapes and write each record's prediction and error into it.

    Returns the meta entries: the fit against the measured ceilings (``calibration``, what the
    book reports) and the same fit against the datasheet peaks (``calibration_datasheet``, what
    ``fa-lab correlate`` uses without ``--ceilings``).
    """
    sheet = (devices.preset_for(gpu_name) if gpu_name else devices.current_device()) or devices.get_device("H100_80GB")
    dev = sheet.with_ceilings(measured) if measured else sheet
    cal = correlate.calibrate(records, dev)
    cal_sheet = correlate.calibrate(records, sheet)
    for rec in records:
        if rec.get("status") == "ok":
            rec.update(correlate.predict_record(rec, dev, cal.get(rec["kernel"])))
    print(correlate.calibration_frame(cal).to_string())
    tab = correlate.table(records, dev, cal)
    if len(tab):
        print(correlate.summary(tab).to_string())
    as_dict = lambda c: {k: dataclasses.asdict(v) for k, v in c.items()}  # noqa: E731
    return dict(calibration=as_dict(cal), calibration_datasheet=as_dict(cal_sheet), model_device=sheet.name)


def save(name, records, measured, directory, *, command, **extra):
    meta = annotate(records, measured)
    return recorded.save(name, records, command=command, directory=directory, ceilings=measured, **meta, **extra)


def recalibrate(name: str) -> int:
    """Re-fit and re-annotate a recording in fa_lab/data with the current model (no GPU needed)."""
    path = DATA_DIR / f"{name}.json"
    meta, records = recorded.read(path)
    cblob = json.loads((DATA_DIR / f"{name}_ceilings.json").read_text())
    measured = devices.ceilings_from_blob(cblob)
    meta.update(annotate(records, measured, meta.get("device")), ceilings=measured)
    for old in ("efficiency", "efficiency_datasheet"):
        meta.pop(old, None)
    meta["recalibrated"] = (f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}: "
                            "predictions re-fitted by `python scripts/correlate_gpu.py --recalibrate` "
                            "(measurements unchanged)")
    recorded.write(path, records, meta)
    print(f"rewrote {path}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
