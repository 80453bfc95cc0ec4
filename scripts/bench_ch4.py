"""Record chapter 4 on a GPU: the Triton kernel against PyTorch SDPA (flash and cuDNN backends),
the chapter's steps, and the autotuner's measurements.

    python scripts/bench_ch4.py [--out DIR] [--tune] [--configs-out FILE] [--no-steps]

Every peer in a row gets the same q, k, v and is timed the same way, in interleaved rounds
(fa_lab.bench.timer.time_interleaved: triton.testing.do_bench, L2 cleared between calls, the median
of twelve rounds' medians, each peer following each other peer equally often), so that neither a
clock drifting under load nor the clock a power-hungry predecessor leaves behind favours one of them.
Writes gpu_ch4.json (fa_lab.bench.records format) into DIR (default fa_lab/data).  ``--tune`` tunes every key the
benchmark touches again (instead of using the cached winners) and ``--configs-out`` writes
the winners in the format of fa_lab/data/triton_fwd_configs.json.
"""
import argparse
import functools
import json
import sys
import time

import fa_lab  # noqa: F401  (first: picks the world)
import torch

from fa_lab.bench import records as recorded
from fa_lab.bench.peers import raw_call
from fa_lab.bench.timer import time_fn, time_interleaved
from fa_lab.core.flops import attention_flops
from fa_lab.core.testing import random_qkv
from fa_lab.kernels.triton import (CACHE, CONFIG_KEYS, FINAL, TUNING_LOG, choose_config, make_launcher,
                                   triton_forward)
from fa_lab.kernels.triton.steps import STEPS, VARIANTS

# (batch, heads, seq, head_dim, causal): the chapter's rows, then the small-shape latency row
ROWS = [
    (4, 16, 4096, 128, False),
    (1, 16, 16384, 128, False),
    (4, 16, 4096, 128, True),
    (4, 32, 4096, 64, True),
    (1, 8, 512, 64, False),
]
STEP_ROWS = [(4, 16, 4096, 128, False), (4, 16, 4096, 128, True)]
#: record name -> peer name (fa_lab.bench.peers)
PEERS = {"sdpa_flash": "sdpa-flash", "sdpa_cudnn": "sdpa-cudnn"}


def header(section, impl, row, dtype, **fields):
    """What every record of this script starts with: its section, what ran, on which row and dtype."""
    B, H, N, D, causal = row
    return dict(section=section, impl=impl, batch=B, heads=H, n_q=N, n_k=N, head_dim=D, dtype=dtype,
                causal=causal, **fields)


def measure(fn, q, k, v, causal, row, dtype, impl, section):
    B, H, N, D, _ = row
    rec = header(section, impl, row, dtype)
    try:
        fn(q, k, v, causal)
        rec.update(time_fn(lambda: fn(q, k, v, causal)))
        rec["tflops"] = attention_flops(B, H, N, N, D, causal=causal) / (rec["ms"] * 1e-3) / 1e12
        rec["status"] = "ok"
    except Exception as exc:  # a peer that cannot run a row is a fact, not a crash
        rec["status"] = f"error: {type(exc).__name__}: {str(exc)[:200]}"
    torch.cuda.empty_cache()
    return rec


def measure_peers(row, dtype, rounds=12):
    """Our kernel and each SDPA backend on the same inputs, timed in interleaved rounds.

    Small problems also get the GPU-only time of one call, from a CUDA graph replay: there
    do_bench partly measures the host (Python, launch), for every peer alike.
    """
    import triton.testing

    B, H, N, D, causal = row
    q, k, v = random_qkv(B, H, N, N, D, dtype=getattr(torch, dtype), device="cuda", seed=1)
    calls = {name: raw_call(peer) for name, peer in PEERS.items()}
    calls["triton"] = raw_call("triton")
    flops = attention_flops(B, H, N, N, D, causal=causal)
    recs, fns, outs = {}, {}, {}
    for name, fn in calls.items():  # sdpa_flash first: its output is the reference for ours
        rec = recs[name] = header("peers", name, row, dtype)
        try:
            outs[name] = fn(q, k, v, causal)
            if name == "triton":
                rec["max_abs_diff_vs_sdpa_flash"] = float((outs[name].float() - outs["sdpa_flash"].float()).abs().max())
            fns[name] = functools.partial(fn, q, k, v, causal)
            rec["status"] = "ok"
        except Exception as exc:  # a peer that cannot run a row is a fact, not a crash
            rec["status"] = f"error: {type(exc).__name__}: {str(exc)[:200]}"
    for name, timing in time_interleaved(fns, rounds=rounds, gpu_ms=(10, 50)).items():
        recs[name].update(timing, tflops=flops / (timing["ms"] * 1e-3) / 1e12)
        if timing["ms"] < 0.1:
            try:
                recs[name]["gpu_us_cudagraph"] = triton.testing.do_bench_cudagraph(fns[name], rep=50) * 1e3
            except Exception as exc:
                recs[name]["gpu_us_cudagraph"] = None
                recs[name]["cudagraph_error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
    del q, k, v, outs
    torch.cuda.empty_cache()
    return list(recs.values())


def tune_row(row, dtype, variant, candidates=None):
    """Tune the key of this row again; returns the tuner's log entries for it."""
    B, H, N, D, causal = row
    q, k, v = random_qkv(B, H, N, N, D, dtype=getattr(torch, dtype), device="cuda", seed=0)
    spec = fa_lab.make_spec(q, k, v, causal=causal)
    start = len(TUNING_LOG)
    t0 = time.perf_counter()
    triton_forward(q, k, v, spec, variant=variant, retune=True, candidates=candidates)
    torch.cuda.synchronize()
    log = TUNING_LOG[start:]
    print(f"tuned {log[0]['key'] if log else '?'}: {len(log)} configs in {time.perf_counter() - t0:.1f}s", flush=True)
    flops = attention_flops(B, H, N, N, D, causal=causal)
    return [dict(section="tuning", variant=variant.name, batch=B, heads=H, n_q=N, n_k=N, head_dim=D, dtype=dtype,
                 causal=causal, **e, tflops=(flops / (e["ms"] * 1e-3) / 1e12) if e.get("ms") else None)
            for e in log]


def top_configs(log, n):
    out = []
    for e in sorted((e for e in log if e.get("ms")), key=lambda e: e["ms"]):
        cfg = {k: e[k] for k in CONFIG_KEYS if k in e}
        if cfg not in out:
            out.append(cfg)
    return out[:n]


def kernel_facts(row=(4, 16, 4096, 128, False), dtype="float16"):
    """What the compiler made of tl.dot: Tensor Core instructions, copies and resources, per variant."""
    import re
    from collections import Counter

    def shapes(pattern, ptx):  # instruction shape -> how many
        return dict(Counter(m.group(1) for m in re.finditer(pattern, ptx)))

    B, H, N, D, causal = row
    q, k, v = random_qkv(B, H, N, N, D, dtype=getattr(torch, dtype), device="cuda", seed=1)
    spec = fa_lab.make_spec(q, k, v, causal=causal)
    out = []
    for variant in (VARIANTS["triton_desc"], FINAL):
        launch, o, lse, work = make_launcher(q, k, v, spec, variant=variant)
        cfg = choose_config(launch, spec, work, variant)
        kern = launch(cfg, warmup=True)
        ptx = kern.asm["ptx"]
        rec = header("kernel", variant.name, row, dtype, config=dict(cfg), shared_bytes=kern.metadata.shared,
                     wgmma=shapes(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx),
                     mma_sync=shapes(r"\bmma\.sync\.aligned\.(m\d+n\d+k\d+)", ptx),
                     tma_loads=len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared", ptx)),
                     tma_stores=len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.global", ptx)),
                     ex2=len(re.findall(r"\bex2\.approx", ptx)))
        try:
            rec.update(registers=kern.n_regs, spills=kern.n_spills)
        except Exception:  # attributes that need the kernel loaded differ between Triton versions
            pass
        out.append(rec)
        print("kernel", rec, flush=True)
    return out


def host_overhead(row=(1, 8, 512, 64, False), calls=400):
    """Where a small call's time goes: host microseconds per call of each layer.

    Back-to-back calls with one synchronize at the end: for a kernel this small the GPU
    finishes first, so the time per call is the host's (Python, argument packing, launch).
    Also the GPU-only time of each, from a CUDA graph replay.
    """
    import triton.testing

    B, H, N, D, causal = row
    q, k, v = random_qkv(B, H, N, N, D, dtype=torch.float16, device="cuda", seed=1)
    spec = fa_lab.make_spec(q, k, v, causal=causal)
    launch, o, lse, work = make_launcher(q, k, v, spec)
    cfg = choose_config(launch, spec, work, FINAL)
    sdpa_flash = raw_call("sdpa-flash")
    layers = {
        "sdpa_flash": lambda: sdpa_flash(q, k, v, causal),
        "fa_lab.attention(impl='triton')": lambda: fa_lab.attention(q, k, v, impl="triton", causal=causal),
        "triton_forward(q, k, v, spec)": lambda: triton_forward(q, k, v, spec),
        "launch(cfg): descriptors + kernel launch": lambda: launch(cfg),
        "make_spec alone": lambda: fa_lab.make_spec(q, k, v, causal=causal),
    }
    out = []
    for name, fn in layers.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        us = (time.perf_counter() - t0) / calls * 1e6
        rec = header("host", name, row, "float16", host_us_per_call=us, config=dict(cfg))
        if not name.startswith("make_spec"):
            try:
                rec["gpu_us_cudagraph"] = triton.testing.do_bench_cudagraph(fn, rep=50) * 1e3
            except Exception as exc:
                rec["gpu_us_cudagraph"] = None
                rec["status"] = f"cudagraph: {type(exc).__name__}: {str(exc)[:120]}"
        out.append(rec)
        print(f"host {name:45s} {us:7.1f} us/call  gpu {rec.get('gpu_us_cudagraph') or float('nan'):6.1f} us",
              flush=True)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="directory for gpu_ch4.json (default: fa_lab/data)")
    parser.add_argument("--tune", action="store_true", help="tune every key again instead of using cached configs")
    parser.add_argument("--configs-out", default=None, help="write the tuned configs (shipped-cache format) here")
    parser.add_argument("--no-steps", action="store_true", help="skip the chapter's step-by-step rows")
    parser.add_argument("--rows", default=None, help="comma-separated row indices to run (default: all)")
    args = parser.parse_args(argv)
    if not fa_lab.ON_GPU:
        sys.exit("bench_ch4 records GPU numbers: run it on a machine with a CUDA GPU")
    out_dir = args.out
    records = []
    t_start = time.perf_counter()
    rows = ROWS if args.rows is None else [ROWS[int(i)] for i in args.rows.split(",")]

    def flush():
        recorded.save("gpu_ch4", records, command="python scripts/bench_ch4.py" + (" --tune" if args.tune else ""),
                      directory=out_dir, rows=[list(r) for r in ROWS], seconds=round(time.perf_counter() - t_start, 1))

    if args.tune:
        for row in rows:
            log16 = tune_row(row, "float16", FINAL)
            records += log16
            records += tune_row(row, "bfloat16", FINAL, candidates=top_configs(log16, 4))
            flush()
        if not args.no_steps:
            for row in STEP_ROWS:
                records += tune_row(row, "float16", VARIANTS["triton_autotuned"])
            flush()

    for dtype in ("float16", "bfloat16"):
        for row in rows:
            records += measure_peers(row, dtype)
            flush()
            r = {rec["impl"]: rec.get("tflops") for rec in records[-3:]}
            print(f"{dtype} {row}: " + "  ".join(f"{n} {t:.0f}" if t else f"{n} -" for n, t in r.items()), flush=True)

    records += host_overhead()
    try:
        records += kernel_facts()
    except Exception as exc:
        print("kernel facts failed:", type(exc).__name__, exc, flush=True)
    flush()

    if not args.no_steps:
        for row in STEP_ROWS:
            B, H, N, D, causal = row
            q, k, v = random_qkv(B, H, N, N, D, dtype=torch.float16, device="cuda", seed=1)
            for name, _ in STEPS:
                rec = measure(raw_call(name), q, k, v, causal, row, "float16", name, "steps")
                records.append(rec)
                print(f"step {name} {row}: {rec.get('tflops') or rec['status']}", flush=True)
            del q, k, v
            flush()

    flush()
    if args.configs_out:
        device = torch.cuda.get_device_name()
        shipped = {"configs": {dev: dict(table) for dev, table in CACHE.shipped_entries().items()}}
        shipped["configs"].setdefault(device, {}).update(CACHE.user_entries().get(device, {}))
        shipped["note"] = ("winning launch configs per device and key (dtype|D_PAD|Nq bucket|Nk bucket|mask|space), "
                           "written by scripts/bench_ch4.py --tune --configs-out")
        with open(args.configs_out, "w") as f:
            json.dump(shipped, f, indent=1, sort_keys=True)
    peers = [r for r in records if r["section"] == "peers" and r["status"] == "ok"]
    for r in peers:
        print(f"{r['dtype']:9s} {r['batch']},{r['heads']},{r['n_q']},{r['head_dim']} causal={r['causal']!s:5s} "
              f"{r['impl']:11s} {r['ms'] * 1e3:9.1f} us {r['tflops']:6.1f} TFLOP/s")


if __name__ == "__main__":
    main()
