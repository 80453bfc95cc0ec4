#!/usr/bin/env python3
"""Record the benchmark suite on a GPU: the one command behind fa_lab/data/gpu_bench_*.

    python scripts/record_gpu_bench.py                       # everything, into fa_lab/data/
    python scripts/record_gpu_bench.py --part seed-table latency --out-dir $OUT
    python scripts/record_gpu_bench.py --part sweep --impl triton sdpa-flash naive_torch
    python scripts/record_gpu_bench.py --part seed-table --resume gpu_bench_h200_seed-table.json

Parts (each one recording gpu_bench_<device>_<part>.json, the format of fa_lab.bench.records):

* ``latency``    — (1, 8, 512, 64): bf16 and fp32; no mask, causal, window (128, 0); fwd and fwd+bwd;
* ``seed-table`` — the FlashAttention-2 table (16k tokens, H=16, D=128): bf16, no mask and
                   causal, fwd and fwd+bwd; fp32 fwd;
* ``sweep``      — B=1, H=16, causal, N=128..65536 × D=16..128 × bf16/fp32, forward, with a
                   shorter do_bench budget and a per-call time cap so it finishes in minutes.

Every part runs our kernels (every registered GPU implementation) against every SDPA backend
(and flash-attn if installed) in the same process.  Out-of-memory and unsupported cases are rows.
A part stopped by a time limit is saved as partial; ``--resume FILE`` measures only the cases that
file lacks, on the same GPU with the same code, and saves them together (the file's meta lists how
many records were carried over).
"""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import fa_lab  # noqa: E402  (first: it picks the world)
from fa_lab.bench import configs  # noqa: E402
from fa_lab.bench import records  # noqa: E402
from fa_lab.bench import runner  # noqa: E402

PARTS = {
    "latency": [dict(shapes=[configs.LATENCY], dtypes=["bf16", "fp32"], masks=["none", "causal", "window"],
                     window=(128, 0), modes=["fwd", "fwd+bwd"], extra_impls=["sdpa"], gpu_ms=(10, 50))],
    "seed-table": [dict(shapes=configs.SEED_TABLE, dtypes=["bf16"], masks=["none", "causal"],
                        modes=["fwd", "fwd+bwd"], gpu_ms=(5, 25), max_ms=300),
                   dict(shapes=configs.SEED_TABLE, dtypes=["fp32"], masks=["none"], modes=["fwd"], gpu_ms=(5, 25),
                        max_ms=300)],
    "sweep": [dict(shapes=configs.CONFIGS["sweep"][0], dtypes=configs.SWEEP_DTYPES, masks=["causal"],
                   modes=["fwd"], gpu_ms=(3, 15), max_ms=60)],
}


def device_tag() -> str:
    name = runner.device_name().lower()
    for tag in ("h200", "h100", "a100", "l40s", "l4", "a10g", "t4", "rtx"):
        if tag in name:
            return tag
    return "".join(c for c in name if c.isalnum())[:16] or "gpu"


def resumable(path: str, parts: list[str]) -> tuple[dict, list]:
    """``(meta, records)`` of a partial recording that this run can finish; SystemExit saying why not."""
    meta, old = records.read(path)
    part = meta.get("part")
    why = None
    if not meta.get("partial"):
        why = "it is not partial (nothing to finish)"
    elif part not in parts:
        why = f"it records part {part!r}, this run measures {', '.join(parts)}"
    elif meta.get("device") != runner.device_name():
        why = f"it was measured on {meta.get('device')}, this is {runner.device_name()}"
    elif meta.get("sources") != records.fingerprint(Path(path).stem):
        why = "the code it measured has changed since"
    if why:
        raise SystemExit(f"record_gpu_bench: cannot resume {path}: {why}")
    return meta, old


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", nargs="+", choices=list(PARTS), default=list(PARTS))
    p.add_argument("--impl", nargs="+", help="default: every GPU implementation and every SDPA backend")
    p.add_argument("--out-dir", default=str(ROOT / "fa_lab" / "data"))
    p.add_argument("--baseline", default="sdpa-math",
                   help="speedup is measured against this (default sdpa-math: PyTorch's standard attention)")
    p.add_argument("--tag", help="device tag in the file names (default from the GPU's name)")
    p.add_argument("--allow-cpu", action="store_true", help="run in the CPU world too (a dry run)")
    p.add_argument("--resume", metavar="FILE",
                   help="a partial recording of one part, made on this GPU with this code: measure what it lacks")
    args = p.parse_args(argv)

    fa_lab.banner()
    if not fa_lab.ON_GPU and not args.allow_cpu:
        print("record_gpu_bench: no CUDA GPU here (use --allow-cpu for a dry run)", file=sys.stderr)
        return 2
    # the chapters' intermediate steps (triton_minimal, numba_smem, ...) are their chapters' story
    impls = args.impl or runner.default_impls(steps=False)
    print("implementations:", ", ".join(impls), flush=True)
    command = "python scripts/record_gpu_bench.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    tag = args.tag or device_tag()
    # Triton launch configs: shipped ones for this GPU if any, else tuned here (FA_LAB_TRITON_AUTOTUNE=1)
    # or Triton's defaults (=0); the files say which
    autotune = os.environ.get("FA_LAB_TRITON_AUTOTUNE", "1")
    # `timeout` sends SIGTERM: keep what was measured (the file says it is partial)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    resumed = resumable(args.resume, args.part) if args.resume else None
    for part in args.part:
        t0 = time.time()
        measured, partial, done, earlier_s = [], False, frozenset(), 0.0
        if resumed is not None and resumed[0]["part"] == part:
            meta, measured = resumed
            done, earlier_s = frozenset(map(runner.record_key, measured)), float(meta.get("seconds") or 0)
            print(f"{part}: resuming {args.resume}: {len(measured)} cases measured before", flush=True)
        carried = len(measured)
        try:
            for block in PARTS[part]:
                block = dict(block)
                shapes = block.pop("shapes")
                extra = [n for n in block.pop("extra_impls", []) if n not in impls]
                if not fa_lab.ON_GPU:  # dry run: the smallest shape only
                    shapes = [configs.Shape(1, 2, 16, 16)]
                for rec in runner.iter_suite(impls + extra, shapes, suite=part, progress=False, done=done, **block):
                    measured.append(rec)
                    if len(measured) % 25 == 0:
                        print(f"  {part}: {len(measured)} cases, {time.time() - t0:.0f} s", flush=True)
        except KeyboardInterrupt:
            partial = True
            print(f"{part}: interrupted after {len(measured)} cases; saving them", flush=True)
        measured = runner.compare(measured, baseline=args.baseline)
        json_path = records.save(f"gpu_bench_{tag}_{part}", measured, command=command.strip(), directory=args.out_dir,
                                 part=part, partial=partial, seconds=round(earlier_s + time.time() - t0, 1),
                                 triton_autotune=autotune, **({"resumed_records": carried} if carried else {}))
        if part == "sweep":  # a few hundred rows: print TFLOP/s at D = 64 and 128 as N × impl
            df = runner.to_frame(measured)
            ok = df[(df["status"] == "ok") & df["head_dim"].isin([64, 128])]
            if not ok.empty:
                print(ok.pivot_table(index=["dtype", "head_dim", "n_q"], columns="impl", values="tflops",
                                     sort=False).round(1).to_string())
        else:
            runner.table(measured, title=f"{part} ({tag})")
        print(f"{part}: {len(measured)} cases in {time.time() - t0:.0f} s -> {json_path.name}", flush=True)
        if partial:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
