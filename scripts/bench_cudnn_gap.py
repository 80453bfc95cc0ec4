"""The gap to cuDNN in one run: fa_lab's Triton attention against SDPA's cuDNN and flash backends.

    python scripts/bench_cudnn_gap.py [--out DIR] [--dtypes bf16,fp16] [--rounds 8] [--rows 0,2]
    python scripts/bench_cudnn_gap.py --smoke          # tiny rows in any world: checks the script

For every row, the forward and then forward plus backward of ``flash_triton`` (``fa_lab.attention``: the
Triton forward and the two-pass backward), of ``flash_gluon`` on the rows it runs (chapter 11's Gluon
forward on Hopper, the same backward) and of SDPA's cuDNN and flash backends, on the same inputs, timed in
interleaved rounds (``fa_lab.bench.time_interleaved``: every round times each one, in balanced orders), so all
three see the same clock.  TFLOP/s count FLOPs as DESIGN.md does: 4·B·H·N²·D (halved under the causal mask),
×3.5 for forward plus backward.  A ``summary`` record per (row, dtype, mode) holds the ratios: ours over
cuDNN and ours over flash, in TFLOP/s (``ratio_gluon_vs_*``: the Gluon forward's).  Each row also records
how far our O and gradients are from cuDNN's (max |difference|).  A backend that declines a row is a record
with its reason, never a crash.
Writes ``gpu_cudnn_gap.json`` (``fa_lab.bench.records``) into DIR (default fa_lab/data).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fa_lab  # noqa: E402  (first: picks the world)
import torch  # noqa: E402

from fa_lab.bench import records as recorded  # noqa: E402
from fa_lab.bench import time_fn, time_interleaved  # noqa: E402
from fa_lab.bench.configs import Shape  # noqa: E402
from fa_lab.bench.peers import bind  # noqa: E402
from fa_lab.core.dtypes import as_dtype, long_name  # noqa: E402
from fa_lab.core.flops import attention_flops  # noqa: E402
from fa_lab.core.masks import mask_kind  # noqa: E402
from fa_lab.core.testing import random_qkv  # noqa: E402

#: (B, H, Hkv, N, D, causal): D = 128 without and with the mask, long and short sequences, D = 64, GQA, D = 256
ROWS = [(4, 16, 16, 4096, 128, False), (1, 16, 16, 16384, 128, False), (4, 16, 16, 4096, 128, True),
        (4, 32, 32, 4096, 64, True), (4, 32, 8, 4096, 128, True), (2, 16, 16, 8192, 256, True),
        (16, 16, 16, 1024, 128, False)]
SMOKE_ROWS = [(1, 2, 2, 40, 16, False), (1, 4, 2, 40, 16, True)]
OURS = "flash_triton"
#: chapter 11's Gluon forward (with chapter 5's backward), timed beside ours on the rows it runs
GLUON = "flash_gluon"
PEERS = ("sdpa-cudnn", "sdpa-flash")
MODES = ("fwd", "fwd+bwd")


def header(row, dtype, **fields) -> dict:
    """The fields every record of a row starts with, ``shape`` and ``mask`` labelled as the benchmark suite's."""
    B, H, Hkv, N, D, causal = row
    return dict(batch=B, heads=H, kv_heads=Hkv, n_q=N, n_k=N, head_dim=D, causal=causal, dtype=long_name(dtype),
                shape=Shape(B, H, N, D, kv_heads=Hkv).label, mask=mask_kind(causal, (-1, -1)), **fields)


def forwards(q, k, v, spec) -> dict:
    """name -> a zero-argument callable giving O: ours, and each SDPA backend."""
    calls = {OURS: lambda: fa_lab.attention(q, k, v, impl=OURS, causal=spec.causal)}
    if fa_lab.get_implementation(GLUON).unsupported(spec, fa_lab.WORLD) is None:
        calls[GLUON] = lambda: fa_lab.attention(q, k, v, impl=GLUON, causal=spec.causal)
    # Nq = Nk on every row: SDPA's top-left causal mask is the bottom-right one here
    calls.update({name: bind(name, q, k, v, spec) for name in PEERS})
    return calls


def no_grad(call):
    with torch.no_grad():
        return call()


def contenders(q, k, v, spec, mode: str, do) -> dict:
    """name -> what is timed for ``mode``: the forward alone (no autograd graph), or forward plus backward."""
    calls = forwards(q, k, v, spec)
    if mode == "fwd":
        return {name: (lambda call=call: no_grad(call)) for name, call in calls.items()}
    return {name: (lambda call=call: torch.autograd.grad(call(), (q, k, v), do)) for name, call in calls.items()}


def agreement(q, k, v, spec, do) -> dict:
    """Max |difference| of O, dQ, dK, dV between ours and cuDNN's (an unrelated result would show here)."""
    calls, out = forwards(q, k, v, spec), {}
    for name in (OURS, "sdpa-cudnn"):
        try:
            o = calls[name]()
            out[name] = [o.detach(), *torch.autograd.grad(o, (q, k, v), do)]
        except Exception as exc:
            return dict(agreement=f"{name} gave no result: {type(exc).__name__}: {str(exc)[:150]}")
    fields = ("o", "dq", "dk", "dv")
    rec = {f"max_diff_{f}": float((a.float() - b.float()).abs().max()) for f, a, b in zip(fields, out[OURS],
                                                                                         out["sdpa-cudnn"])}
    # a NaN difference (stored as null) says which side had the NaNs
    for name, tensors in out.items():
        nans = {f: int(t.isnan().sum()) for f, t in zip(fields, tensors) if t.isnan().any()}
        if nans:
            rec[f"nan_{name}"] = nans
    return rec


def measure_row(row, dtype, rounds: int, measure=None) -> list[dict]:
    B, H, Hkv, N, D, causal = row
    q, k, v = random_qkv(B, H, N, N, D, kv_heads=Hkv, dtype=dtype, seed=N + D + H, requires_grad=True)
    do = torch.randn_like(q)
    spec = fa_lab.make_spec(q, k, v, causal=causal)
    recs = [dict(header(row, dtype, section="agreement"), **agreement(q, k, v, spec, do))]
    for mode in MODES:
        flops = attention_flops(B, H, N, N, D, causal=causal, mode=mode)
        errors: dict = {}
        calls = contenders(q, k, v, spec, mode, do)
        timed = time_interleaved(calls, rounds=rounds, errors=errors, measure=measure)
        for name in calls:   # ours, the Gluon kernels where they run, the peers
            rec = header(row, dtype, section="timing", impl=name, mode=mode)
            if name in timed:
                t = timed[name]
                rec.update(t, tflops=flops / (t["ms"] * 1e-3) / 1e12, status="ok")
            else:
                rec["status"] = errors.get(name, "not timed")
            recs.append(rec)
        rate = {r["impl"]: r["tflops"] for r in recs if r.get("mode") == mode and r.get("status") == "ok"}
        summary = header(row, dtype, section="summary", mode=mode, **{f"tflops_{n}": rate.get(n) for n in rate})
        for peer in PEERS:
            for name, prefix in ((OURS, ""), (GLUON, "gluon_")):
                if name in rate and peer in rate:
                    summary[f"ratio_{prefix}vs_{peer.removeprefix('sdpa-')}"] = rate[name] / rate[peer]
        recs.append(summary)
        ratios = ", ".join(f"{key} {val:.2f}" for key, val in summary.items() if key.startswith("ratio"))
        print(f"({B}, {H}, {Hkv}, {N}, {D}){' causal' if causal else ''} {long_name(dtype)} {mode}: "
              + ", ".join(f"{n} {r:.0f}" for n, r in rate.items()) + f" TFLOP/s; {ratios}", flush=True)
    return recs


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="directory for gpu_cudnn_gap.json (default fa_lab/data)")
    parser.add_argument("--dtypes", default="bf16", help="comma-separated: bf16, fp16")
    parser.add_argument("--rounds", type=int, default=8, help="interleaved rounds per row and mode")
    parser.add_argument("--rows", default=None, help="indices into ROWS, comma-separated (default: all)")
    parser.add_argument("--smoke", action="store_true", help="tiny rows, any world: checks the script")
    args = parser.parse_args(argv)
    measure = None
    if args.smoke:   # one call a round: the interpreter takes a fraction of a second per call
        rows, args.rounds = SMOKE_ROWS, min(args.rounds, 2)
        args.out = args.out or "/tmp"
        measure = lambda fn: time_fn(fn, warmup=1, rep=1)["ms"]  # noqa: E731
    elif not fa_lab.ON_GPU:
        sys.exit("bench_cudnn_gap records GPU numbers: run it on a machine with a CUDA GPU (or pass --smoke)")
    else:
        rows = ROWS if args.rows is None else [ROWS[int(i)] for i in args.rows.split(",")]
    records, t_start = [], time.perf_counter()
    for dtype in (as_dtype(d) for d in args.dtypes.split(",")):
        for row in rows:
            records += measure_row(row, dtype, args.rounds, measure)
            path = recorded.save("gpu_cudnn_gap", records, directory=args.out, rows=[list(r) for r in rows],
                          command="python scripts/bench_cudnn_gap.py " + " ".join(argv or sys.argv[1:]),
                          seconds=round(time.perf_counter() - t_start, 1))
    return path


if __name__ == "__main__":
    main()
