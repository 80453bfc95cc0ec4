"""Record chapter 3's GPU numbers: the tiled Numba kernel, its steps, and its peers.

    python scripts/bench_ch3.py [--out DIR] [--budget-s 360]       # the chapter's table
    python scripts/bench_ch3.py --check --tune --sass --out DIR     # development: correctness, tile sweep, SASS
    python scripts/bench_ch3.py --hbm [--out DIR]                   # HBM bytes per kernel, measured by ncu

First ``numba_tiled`` against SDPA's memory-efficient backend, the fastest fp32 peer, in
interleaved rounds (section ``versus``).  Then the table: ``numba_tiled`` and each chapter-3
step, against ``numba_naive``, ``naive_torch`` (fp32) and PyTorch SDPA's math and
memory-efficient backends (fp32), at (B, H, N, D) = (4, 16, 4096, 64),
(4, 16, 4096, 128) and (1, 16, 16384, 128), causal and not; then peak extra memory at
N = 8192.  Every number comes from ``fa_lab.bench.benchmark``.  Slow entries run last
and stop at ``--budget-s``: what did not fit is recorded as ``skipped (time cap)``.

Writes ``gpu_ch3.json`` (``fa_lab.bench.records`` format) into DIR (default ``fa_lab/data``).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fa_lab  # noqa: E402  (first: picks the world)
from fa_lab.bench import records as recorded  # noqa: E402
from fa_lab.core import registry

# Only the modules this benchmark needs: a chapter in progress elsewhere cannot break it.
for _module in list(registry.IMPLEMENTATION_MODULES):
    if _module not in ("fa_lab.core.reference", "fa_lab.kernels.naive", "fa_lab.kernels.online",
                       "fa_lab.kernels.numba.naive", "fa_lab.kernels.numba.tiled", "fa_lab.kernels.numba.steps"):
        del registry.IMPLEMENTATION_MODULES[_module]

import torch  # noqa: E402

from fa_lab.kernels.numba import tiled as nt  # noqa: E402
from fa_lab.kernels.numba.tile_config import SMALL_SHARED_CONFIGS  # noqa: E402
from fa_lab.bench import benchmark, time_fn, to_frame  # noqa: E402

SHAPES = [(4, 16, 4096, 64), (4, 16, 4096, 128), (1, 16, 16384, 128)]
OURS = ["numba_tiled", "numba_regtile", "numba_smem", "numba_rowwise"]
PEERS = ["naive_torch", "sdpa-math", "sdpa-efficient", "numba_naive"]
MEMORY_N = 8192
COMMAND = "python scripts/bench_ch3.py"


def table(budget_s: float) -> list[dict]:
    """Every implementation at every shape and mask; the slowest (by expectation) last."""
    t0 = time.time()
    jobs = []
    for impl in ["numba_tiled", "naive_torch", "sdpa-math", "sdpa-efficient", "numba_regtile", "numba_smem",
                 "numba_rowwise", "numba_naive"]:
        for shape in SHAPES:
            for causal in (False, True):
                jobs.append((impl, shape, causal))
    # N = 16384 runs of the slow kernels go last: the cap cuts those first
    jobs.sort(key=lambda j: (j[1][2] == 16384 and j[0] in ("numba_naive", "numba_rowwise", "numba_smem"),))
    records = []
    for impl, (B, H, N, D), causal in jobs:
        if time.time() - t0 > budget_s:
            rec = dict(impl=impl, batch=B, heads=H, n_q=N, n_k=N, head_dim=D, causal=causal,
                       status="skipped (time cap)")
        else:
            rec = benchmark(impl, batch=B, heads=H, seq_len=N, head_dim=D, causal=causal, dtype="fp32",
                            check_max=2 ** 26)
        rec["section"] = "table"
        records.append(rec)
        print(f"{time.time() - t0:7.1f}s {impl:14s} {(B, H, N, D)} causal={causal!s:5} "
              f"{rec.get('ms', float('nan')):10.3f} ms {rec.get('tflops', float('nan')):7.2f} TFLOP/s "
              f"err={rec.get('max_abs_err', float('nan')):.2e} {rec['status'][:60]}", flush=True)
    return records


def memory() -> list[dict]:
    records = []
    for impl in ["numba_tiled", "naive_torch", "sdpa-math"]:
        for D in (64, 128):
            rec = benchmark(impl, batch=1, heads=16, seq_len=MEMORY_N, head_dim=D, dtype="fp32")
            rec["section"] = "memory"
            records.append(rec)
            print(f"memory {impl:12s} D={D} {rec.get('peak_extra_bytes')} {rec['status'][:60]}", flush=True)
    return records


def check() -> list[dict]:
    """Our kernels against the float64 reference on the GPU: tails, Nq != Nk, masks, GQA, head dims."""
    from fa_lab.core.reference import reference_attention
    from fa_lab.core.testing import max_error, random_qkv

    cases = [((1, 2, 2, 1, 1, 16), {}), ((2, 4, 2, 1000, 777, 64), dict(causal=True)),
             ((1, 4, 1, 333, 1025, 128), {}), ((1, 3, 3, 700, 300, 80), dict(causal=True)),
             ((2, 2, 2, 513, 513, 32), dict(window=(100, 0))), ((1, 8, 2, 260, 1000, 100), dict(window=(37, 45))),
             ((1, 2, 1, 129, 2000, 7), dict(causal=True, window=(64, -1))),
             ((2, 16, 16, 4096, 4096, 64), dict(causal=True))]
    out = []
    for (B, H, Hkv, Nq, Nk, D), mask in cases:
        q, k, v = random_qkv(B, H, Nq, Nk, D, kv_heads=Hkv, seed=Nq + D)
        spec = fa_lab.make_spec(q, k, v, **mask)
        ref_o, ref_lse = reference_attention(q, k, v, spec)
        for impl in OURS:
            o, lse = fa_lab.attention(q, k, v, impl=impl, return_lse=True, **mask)
            torch.cuda.synchronize()
            rec = dict(section="check", impl=impl, shape=(B, H, Hkv, Nq, Nk, D), mask=str(mask),
                       err_o=max_error(o, ref_o), err_lse=max_error(lse, ref_lse),
                       nan=bool(torch.isnan(o).any() or torch.isnan(lse).any()))
            rec["status"] = "ok" if rec["err_o"] < 2e-4 and rec["err_lse"] < 2e-4 and not rec["nan"] else "WRONG"
            out.append(rec)
            print(f"check {impl:14s} {rec['shape']} {mask} err_o={rec['err_o']:.2e} err_lse={rec['err_lse']:.2e} "
                  f"{rec['status']}", flush=True)
    return out


TC = nt.TileConfig
TUNE_CONFIGS = {   # the first of each is the default (numba_tiled.GPU_CONFIGS)
    16: [nt.GPU_CONFIGS[16], TC(64, 64, 16, 4, 16, max_registers=128), TC(64, 32, 16, 4, 16, max_registers=128)],
    32: [nt.GPU_CONFIGS[32], TC(64, 64, 16, 8, 32, max_registers=168), TC(64, 32, 16, 8, 32, max_registers=104)],
    64: [nt.GPU_CONFIGS[64], TC(64, 64, 16, 8, 64, max_registers=160),
         TC(64, 64, 16, 8, 64), TC(64, 64, 16, 8, 64, max_registers=128),
         SMALL_SHARED_CONFIGS[64], TC(64, 32, 16, 8, 64, max_registers=104),
         TC(128, 64, 32, 8, 64, max_registers=128), TC(64, 64, 16, 8, 64, share_kv=True, max_registers=128)],
    128: [nt.GPU_CONFIGS[128],
          TC(64, 32, 16, 8, 128, True, 168), TC(64, 16, 16, 4, 128), TC(32, 32, 8, 8, 128, True)],
}


def versus(rounds: int = 8) -> list[dict]:
    """numba_tiled against SDPA's memory-efficient backend (the fastest fp32 peer), interleaved rounds."""
    from fa_lab.bench import time_interleaved
    from fa_lab.bench.peers import raw_call
    from fa_lab.core.testing import random_qkv

    ours, peer = raw_call("numba_tiled"), raw_call("sdpa-efficient")
    out = []
    for D in (64, 128):
        for causal in (False, True):
            q, k, v = random_qkv(4, 16, 4096, 4096, D, seed=D)
            flops = fa_lab.attention_flops(4, 16, 4096, 4096, D, causal=causal)
            timed = time_interleaved({"numba_tiled": lambda: ours(q, k, v, causal),
                                      "sdpa-efficient": lambda: peer(q, k, v, causal)}, rounds=rounds)
            for impl, t in timed.items():
                out.append(dict(section="versus", impl=impl, batch=4, heads=16, n_q=4096, n_k=4096, head_dim=D,
                                causal=causal, dtype="float32", tflops=flops / (t["ms"] * 1e-3) / 1e12,
                                status="ok", **t))
            ratio = timed["sdpa-efficient"]["ms"] / timed["numba_tiled"]["ms"]
            print(f"versus D={D} causal={causal!s:5} numba_tiled {timed['numba_tiled']['ms']:.3f} ms, "
                  f"sdpa-efficient {timed['sdpa-efficient']['ms']:.3f} ms: {ratio:.3f}x", flush=True)
    return out


def tune() -> list[dict]:
    """Time candidate tile shapes of the final kernel (what the defaults in numba_tiled came from)."""
    from fa_lab.core.testing import random_qkv

    out = []
    for D, cfgs in TUNE_CONFIGS.items():
        for causal in (False, True):
            q, k, v = random_qkv(4, 16, 4096, 4096, D, seed=0)
            spec = fa_lab.make_spec(q, k, v, causal=causal)
            flops = fa_lab.attention_flops(4, 16, 4096, 4096, D, causal=causal)
            for cfg in cfgs:
                rec = dict(section="tune", impl="numba_tiled", batch=4, heads=16, n_q=4096, n_k=4096, head_dim=D,
                           causal=causal, config=repr(cfg), shared_bytes=cfg.shared_bytes())
                try:
                    cfg.check()
                    kernel = nt.build_kernel(cfg, True)
                    nt.launch_tiled(q, k, v, spec, cfg=cfg)
                    torch.cuda.synchronize()
                    rec.update(time_fn(lambda: nt.launch_tiled(q, k, v, spec, cfg=cfg)))
                    rec["tflops"] = flops / (rec["ms"] * 1e-3) / 1e12
                    compiled = kernel.overloads[kernel.signatures[0]]
                    rec["registers"] = compiled.regs_per_thread
                    rec["local_bytes"] = compiled.local_mem_per_thread
                    rec["status"] = "ok"
                except Exception as exc:  # a shape that does not compile or launch is a result too
                    rec["status"] = f"error: {type(exc).__name__}: {str(exc)[:200]}"
                out.append(rec)
                print(f"tune D={D} causal={causal!s:5} {cfg} {rec.get('ms', float('nan')):8.3f} ms "
                      f"{rec.get('tflops', float('nan')):6.2f} TFLOP/s regs={rec.get('registers')} "
                      f"local={rec.get('local_bytes')} {rec['status'][:80]}", flush=True)
    return out


def sass(out_dir: Path) -> None:
    """Dump PTX and SASS of the default kernels, and count the instruction mix of the whole kernel."""
    from fa_lab.perf import sass as sass_listing

    for D in (64, 128):
        cfg = nt.config_for(D)
        kernel = nt.build_kernel(cfg, True)
        (out_dir / f"tiled{D}.ptx").write_text(kernel.inspect_asm(kernel.signatures[0]))
        try:
            s = sass_listing.numba_sass(kernel)
            (out_dir / f"tiled{D}.sass").write_text(s)
            top = sass_listing.op_counts(sass_listing.parse(s)).most_common(14)
            print(f"SASS D={D}: " + ", ".join(f"{k}:{v}" for k, v in top), flush=True)
        except Exception as exc:
            print(f"SASS D={D}: {type(exc).__name__}: {exc}", flush=True)


HBM_SHAPE = (4, 16, 4096, 64)
HBM_PLAN = [("numba_naive", 3), ("numba_rowwise", 1), ("numba_smem", 1), ("numba_regtile", 1), ("numba_tiled", 1)]
HBM_METRICS = ["dram__bytes_read.sum", "dram__bytes_write.sum", "lts__t_bytes.sum"]
HBM_KERNELS = "regex:scores|softmax_rows|pv|rowwise_fwd|smem_fwd|flash_attention_fwd"


def hbm_launches() -> None:
    """Each step once per mask, in HBM_PLAN's order (run under ncu by ``hbm``)."""
    from fa_lab.core.testing import random_qkv

    B, H, N, D = HBM_SHAPE
    q, k, v = random_qkv(B, H, N, N, D, seed=0)
    for causal in (False, True):
        for impl, _ in HBM_PLAN:
            fa_lab.attention(q, k, v, impl=impl, causal=causal)
            torch.cuda.synchronize()


def launch_metrics(text: str) -> dict[int, dict]:
    """``{launch id: {"kernel": name, metric: value}}`` from ncu's ``--csv`` output (ValueError if none)."""
    from fa_lab.perf import ncu

    launches: dict[int, dict] = {}
    for r in ncu.read_details(text).itertuples():
        one = launches.setdefault(int(r.id), dict(kernel=r.kernel_name.split("(")[0][-60:]))
        one[r.metric] = float(r.value)
    if not launches:
        raise ValueError("no launch in ncu's output")
    return launches


def hbm(out_dir) -> list[dict]:
    """Bytes read from / written to HBM (DRAM) and moved through L2, per kernel, from Nsight Compute."""
    from fa_lab.core.flops import attention_flops
    from fa_lab.perf import ncu

    cmd = [ncu.find_ncu() or "ncu", "--csv", "--print-units", "base", "--metrics", ",".join(HBM_METRICS), "-k",
           HBM_KERNELS, sys.executable, str(Path(__file__).resolve()), "--hbm-launches"]
    run = ncu.run(cmd, timeout=420)
    try:
        launches = launch_metrics(run.stdout)
    except ValueError:
        print("ncu gave no rows:", run.returncode, run.stdout[-2000:], run.stderr[-2000:], flush=True)
        return [dict(section="hbm", status=f"error: ncu rc={run.returncode}")]
    order = [launches[i] for i in sorted(launches)]
    expected = [impl for impl, n in HBM_PLAN for _ in range(n)] * 2
    if len(order) != len(expected):
        return [dict(section="hbm", status=f"error: {len(order)} kernel launches profiled, expected {len(expected)}")]
    B, H, N, D = HBM_SHAPE
    out, i = [], 0
    for causal in (False, True):
        for impl, n in HBM_PLAN:
            part = order[i:i + n]
            i += n
            rec = dict(section="hbm", impl=impl, batch=B, heads=H, n_q=N, n_k=N, head_dim=D, causal=causal,
                       kernels=[p["kernel"] for p in part], status="ok",
                       flops=attention_flops(B, H, N, N, D, causal=causal))
            for m in HBM_METRICS:
                rec[m] = sum(p.get(m, 0.0) for p in part)
            out.append(rec)
            print(f"hbm {impl:14s} causal={causal!s:5} read {rec[HBM_METRICS[0]] / 1e9:8.2f} GB  write "
                  f"{rec[HBM_METRICS[1]] / 1e9:8.2f} GB  L2 {rec[HBM_METRICS[2]] / 1e9:8.2f} GB", flush=True)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="directory for the JSON (default: fa_lab/data)")
    parser.add_argument("--budget-s", type=float, default=360.0, help="stop starting table entries after this")
    parser.add_argument("--check", action="store_true", help="only: correctness on the GPU")
    parser.add_argument("--tune", action="store_true", help="only: time candidate tile shapes")
    parser.add_argument("--sass", action="store_true", help="only: dump PTX/SASS of the default kernels")
    parser.add_argument("--quick", action="store_true", help="only: every implementation at (4, 16, 4096, 64)")
    parser.add_argument("--hbm", action="store_true", help="only: HBM/L2 bytes per kernel with Nsight Compute")
    parser.add_argument("--hbm-launches", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not fa_lab.ON_GPU:
        sys.exit("bench_ch3 records GPU numbers: run it on a machine with a CUDA GPU")
    out_dir = Path(args.out) if args.out else None
    if args.hbm_launches:
        hbm_launches()
        return
    print(fa_lab.describe(), flush=True)
    if args.hbm:
        path = recorded.save("gpu_ch3_hbm", hbm(out_dir), command="python scripts/bench_ch3.py --hbm",
                             directory=out_dir, shape=HBM_SHAPE, metrics=HBM_METRICS)
        print("wrote", path)
        return
    if args.check or args.tune or args.sass or args.quick:
        records = []
        if args.quick:
            for impl in OURS + PEERS:
                rec = benchmark(impl, batch=4, heads=16, seq_len=4096, head_dim=64, dtype="fp32")
                rec["section"] = "quick"
                records.append(rec)
                print(f"quick {impl:14s} {rec.get('ms', float('nan')):9.3f} ms {rec.get('tflops', float('nan')):7.2f} "
                      f"TFLOP/s {rec['status'][:70]}", flush=True)
        if args.check:
            records += check()
        if args.sass:
            sass(out_dir or Path("."))
        if args.tune:
            records += tune()
        path = recorded.save("gpu_ch3_dev", records, command=" ".join(["python scripts/bench_ch3.py"] + sys.argv[1:]),
                             directory=out_dir)
        print("wrote", path)
        return
    t0 = time.time()
    records = []

    def save():   # after every section, so that a run cut short still leaves its numbers
        return recorded.save("gpu_ch3", records, command=COMMAND, directory=out_dir, shapes=SHAPES,
                             memory_n=MEMORY_N, configs={D: repr(nt.config_for(D)) for D in (64, 128)},
                             seconds=round(time.time() - t0, 1))

    records += check()
    records += versus()
    save()
    records += table(args.budget_s)
    save()
    records += memory()
    save()
    if time.time() - t0 < args.budget_s + 60:
        records += tune()
    path = save()
    df = to_frame([r for r in records if r["section"] == "table"])
    print(df[["impl", "batch", "n_q", "head_dim", "causal", "ms", "tflops", "status"]].to_string())
    print("wrote", path)


if __name__ == "__main__":
    main()
