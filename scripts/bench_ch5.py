"""Record chapter 5 on a GPU: fwd+bwd of ``flash_triton`` against PyTorch SDPA (flash and cuDNN
backends), the chapter's steps, the memory a backward keeps, and the backward kernels' tiles.

    python scripts/bench_ch5.py [--out DIR] [--sections tune,peers,steps,memory] [--rows 0,1]
                                [--fwd-tune] [--apply-tuned]

Every implementation in a row gets the same q, k, v, dO and is timed the same way
(fa_lab.bench.timer.time_fn: triton.testing.do_bench, L2 cleared between calls, median).
TFLOP/s count FLOPs as DESIGN.md does: forward 4·B·H·N²·D (halved for causal), backward
2.5×, fwd+bwd 3.5×.  Writes gpu_ch5.json (fa_lab.bench.records format) into DIR (default fa_lab/data).

``tune`` times the dK/dV and dQ kernels alone for each candidate tile config (the candidates
are those that compile for sm_90 without spilling); ``--apply-tuned`` runs the later sections
with the winners.  ``--fwd-tune`` tunes chapter 4's forward over a short list for each row
(otherwise its shipped/default config runs: FA_LAB_TRITON_AUTOTUNE=0).
"""
import argparse
import os
import sys
import time

if "--fwd-tune" not in sys.argv:
    os.environ.setdefault("FA_LAB_TRITON_AUTOTUNE", "0")

import fa_lab  # noqa: E402  (first: picks the world)
import torch  # noqa: E402

from fa_lab.autograd import saved_for_backward  # noqa: E402
from fa_lab.bench import records as recorded  # noqa: E402
from fa_lab.bench.peers import raw_call  # noqa: E402
from fa_lab.bench.timer import time_fn  # noqa: E402
from fa_lab.core.flops import attention_flops  # noqa: E402
from fa_lab.core.testing import random_qkv  # noqa: E402
from fa_lab.kernels.triton import bwd, triton_forward, tuner  # noqa: E402

# (batch, heads, seq, head_dim, causal): the chapter's rows
ROWS = [
    (4, 16, 4096, 128, False),
    (4, 16, 4096, 128, True),
    (1, 16, 16384, 128, True),
    (4, 32, 4096, 64, True),
]
#: reference numbers measured on another H100 (fwd+bwd TFLOP/s): (row index, dtype) -> (flash, cudnn, tutorial 06)
REFERENCE_TABLE = {
    (0, "float16"): (307, 516, None),
    (1, "bfloat16"): (265, 473, None), (1, "float16"): (None, None, 144),
    (2, "bfloat16"): (318, 539, None), (2, "float16"): (None, None, 158),
    (3, "bfloat16"): (241, 392, None), (3, "float16"): (None, None, 327),
}
#: record name -> peer name (fa_lab.bench.peers)
SDPA = {"sdpa_flash": "sdpa-flash", "sdpa_cudnn": "sdpa-cudnn"}
FWD_CANDIDATES = [dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2, ws=False),
                  dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, ws=False),
                  dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3, ws=False),
                  dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, ws=False),
                  dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3, ws=False)]


def inputs(row, dtype, seed=1):
    B, H, N, D, _ = row
    q, k, v = random_qkv(B, H, N, N, D, dtype=getattr(torch, dtype), device=fa_lab.DEVICE, seed=seed,
                         requires_grad=True)
    do = torch.randn_like(q)
    return q, k, v, do


def base_record(section, impl, row, dtype):
    B, H, N, D, causal = row
    return dict(section=section, impl=impl, batch=B, heads=H, n_q=N, n_k=N, head_dim=D, dtype=dtype, causal=causal)


def measure(fn, q, k, v, do, row, dtype, impl, section, modes=("fwd", "bwd", "fwd+bwd")):
    """One record per mode; a peer that cannot run a row is a fact, not a crash."""
    B, H, N, D, causal = row
    out = []
    for mode in modes:
        rec = base_record(section, impl, row, dtype) | dict(mode=mode)
        try:
            if mode == "fwd":
                run = lambda: fn(q, k, v, causal)  # noqa: E731
            elif mode == "bwd":
                o = fn(q, k, v, causal)
                run = lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)  # noqa: E731
            else:
                run = lambda: torch.autograd.grad(fn(q, k, v, causal), (q, k, v), do)  # noqa: E731
            run()
            rec.update(time_fn(run))
            rec["tflops"] = attention_flops(B, H, N, N, D, causal=causal, mode=mode) / (rec["ms"] * 1e-3) / 1e12
            rec["status"] = "ok"
        except Exception as exc:
            rec["status"] = f"error: {type(exc).__name__}: {str(exc)[:200]}"
        out.append(rec)
        torch.cuda.empty_cache()
    return out


def sdpa_flash_forward(q, k, v, spec):
    """O and lse from PyTorch's FlashAttention-2 forward: the backward is tuned on an independent forward
    (the float64 reference in the CPU world, where that kernel does not exist: --smoke)."""
    if not fa_lab.ON_GPU:
        from fa_lab.core.reference import reference_attention

        o, lse = reference_attention(q.detach(), k.detach(), v.detach(), spec)
        return o.to(q.dtype), lse.float()
    with torch.no_grad():
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, spec.causal, False, scale=spec.scale)
    return out[0], out[1]


#: the descriptor dK/dV tiles tried beside the plain ones: unsplit (``bwd.WARP_SPECIALIZE_DKDV``), where 8 warps
#: pay (4 at D = 64); the tuner's own table lists the 4-warp tiles of the warp-specialized split
DESCRIPTOR_TILES = {64: [(64, 64, 4, 3, True)],
                    128: [(64, 128, 8, 3, True), (64, 128, 8, 2, True), (32, 128, 8, 3, True)],
                    256: [(64, 64, 8, 2, True), (64, 64, 8, 3, True)]}


def tune_candidates(head_dim):
    """``tuner.tune_backward``'s candidates for ``head_dim``, with ``DESCRIPTOR_TILES`` as the descriptor tiles."""
    block = bwd.block_d(head_dim)
    table = tuner.BWD_TUNE_CANDIDATES[block]
    return dict(dkdv=[c for c in table["dkdv"] if len(c) == 4] + DESCRIPTOR_TILES.get(block, []), dq=table["dq"])


def tune_row(row, dtype="float16"):
    """Time the dK/dV and dQ kernels alone for every candidate (fa_lab.kernels.triton.tuner.tune_backward)."""
    B, H, N, D, causal = row
    q, k, v, do = inputs(row, dtype)
    spec = fa_lab.make_spec(q, k, v, causal=causal)
    o, lse = sdpa_flash_forward(q, k, v, spec)
    t0 = time.perf_counter()
    timed = tuner.tune_backward(q, k, v, o, lse, do, spec, tune_candidates(D))
    # each kernel does part of the backward: TFLOP/s against the whole backward's FLOPs, for scale
    flops = attention_flops(B, H, N, N, D, causal=causal, mode="bwd")
    recs = []
    for t in timed:
        rec = base_record("tune", f"bwd_{t['kernel']}", row, dtype) | t
        if t.get("ms"):
            rec["tflops_of_bwd"] = flops / (t["ms"] * 1e-3) / 1e12
        recs.append(rec)
    print(f"tuned {row} {dtype}: {len(timed)} configs in {time.perf_counter() - t0:.0f}s", flush=True)
    for kernel in ("dkdv", "dq"):
        ok = sorted((r for r in recs if r["kernel"] == kernel and r["status"] == "ok"), key=lambda r: r["ms"])
        print(f"  {kernel}: " + "  ".join(f"{tuple(r['config'])} {r['ms']:.3f}ms" for r in ok[:4]), flush=True)
    return recs


def apply_tuned(records):
    """Put each head dim's fastest plain tiles (summed over the tuned rows) into the backward's GPU_CONFIGS,
    and a warp-specialized tile into WS_CONFIGS where it beat the plain one."""
    tune_records = [r for r in records if r.get("section") == "tune"]
    for D, (plain, ws) in tuner.backward_tables(tune_records).items():
        key = (bwd.block_d(D), 2)
        bwd.GPU_CONFIGS[key] = plain
        bwd.WS_CONFIGS[key] = ws
        print(f"applied D={D}: dkdv {plain[0]} dq {plain[1]}, warp-specialized {ws}", flush=True)


def fwd_tune(row, dtype):
    B, H, N, D, causal = row
    q, k, v, _ = inputs(row, dtype)
    spec = fa_lab.make_spec(q, k, v, causal=causal)
    with torch.no_grad():
        triton_forward(q, k, v, spec, retune=True, candidates=FWD_CANDIDATES)


def peers_row(i, row, dtype):
    q, k, v, do = inputs(row, dtype)
    recs = []
    for name, peer in SDPA.items():
        recs += measure(raw_call(peer), q, k, v, do, row, dtype, name, "peers")
    recs += measure(raw_call("flash_triton"), q, k, v, do, row, dtype, "flash_triton", "peers")
    # agreement with SDPA flash's gradients, and bit-identical gradients run to run
    try:
        ref = torch.autograd.grad(raw_call("sdpa-flash")(q, k, v, row[4]), (q, k, v), do)
        g1 = torch.autograd.grad(raw_call("flash_triton")(q, k, v, row[4]), (q, k, v), do)
        g2 = torch.autograd.grad(raw_call("flash_triton")(q, k, v, row[4]), (q, k, v), do)
        check = dict(max_abs_diff_vs_sdpa_flash={n: float((a.float() - b.float()).abs().max())
                                                 for n, a, b in zip(("dq", "dk", "dv"), g1, ref)},
                     ref_max_abs={n: float(b.float().abs().max()) for n, b in zip(("dq", "dk", "dv"), ref)},
                     bit_identical=all(torch.equal(a, b) for a, b in zip(g1, g2)))
    except Exception as exc:
        check = dict(check_error=f"{type(exc).__name__}: {str(exc)[:200]}")
    for r in recs:
        if r["impl"] == "flash_triton":
            r.update(check)
        ref_nums = REFERENCE_TABLE.get((i, dtype))
        if ref_nums:
            r["reference"] = dict(zip(("sdpa_flash", "sdpa_cudnn", "tutorial06"), ref_nums))
    cfgs = bwd.configs(fa_lab.make_spec(q, k, v, causal=row[4]), tensors=(q, k, v, do))
    for r in recs:
        if r["impl"] == "flash_triton":
            r["bwd_configs"] = [list(c) for c in cfgs]
            resolved = [c for key, c in tuner.resolved_configs() if key.dtype == q.dtype and key.head_dim == row[3]]
            r["fwd_config"] = resolved[-1] if resolved else None
    del q, k, v, do
    torch.cuda.empty_cache()
    return recs


STEPS_ROW = (1, 16, 4096, 64, False)


def steps(dtype="float16"):
    """The chapter's path: PyTorch tiles, torch.compile backward, Triton backward (and SDPA's math backend)."""
    row = STEPS_ROW
    q, k, v, do = inputs(row, dtype)
    ref = torch.autograd.grad(raw_call("sdpa-flash")(q, k, v, row[4]), (q, k, v), do)
    recs = []
    for name in ("torch_tiled", "torch_compile_bwd", "flash_triton"):
        t0 = time.perf_counter()
        recs += measure(raw_call(name), q, k, v, do, row, dtype, name, "steps", modes=("fwd+bwd",))
        recs[-1]["first_call_s"] = time.perf_counter() - t0   # includes torch.compile's compile
        try:
            got = torch.autograd.grad(raw_call(name)(q, k, v, row[4]), (q, k, v), do)
            recs[-1]["max_abs_diff_vs_sdpa_flash"] = {n: float((a.float() - b.float()).abs().max())
                                                      for n, a, b in zip(("dq", "dk", "dv"), got, ref)}
        except Exception as exc:
            recs[-1]["check_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        print(f"step {name}: {recs[-1].get('tflops') or recs[-1]['status']} "
              f"{recs[-1].get('max_abs_diff_vs_sdpa_flash')}", flush=True)
    recs += measure(raw_call("sdpa-math"), q, k, v, do, row, dtype, "sdpa_math", "steps", modes=("fwd+bwd",))
    return recs


def memory(ns=(1024, 4096, 16384), dtype="float16"):
    """Peak memory of a fwd+bwd beyond the inputs and dO, and the bytes autograd keeps between the passes."""
    recs = []
    for n in ns:
        row = (1, 16, n, 64, False)
        fns = {"flash_triton": raw_call("flash_triton"), "sdpa_flash": raw_call("sdpa-flash"),
               "torch_compile_bwd": raw_call("torch_compile_bwd"), "sdpa_math": raw_call("sdpa-math")}
        for name, fn in fns.items():
            rec = base_record("memory", name, row, dtype) | dict(mode="fwd+bwd")
            try:
                q, k, v, do = inputs(row, dtype)
                torch.autograd.grad(fn(q, k, v, False), (q, k, v), do)   # warm (and compile)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
                g = torch.autograd.grad(fn(q, k, v, False), (q, k, v), do)
                torch.cuda.synchronize()
                rec["peak_extra_bytes"] = torch.cuda.max_memory_allocated() - before
                rec["grad_bytes"] = sum(t.numel() * t.element_size() for t in g)
                kept = saved_for_backward(fn, q, k, v, False)
                rec["saved_bytes"] = sum(b for _, _, b in kept)
                rec["saved"] = [[list(s), str(d).replace("torch.", ""), b] for s, d, b in kept]
                rec["status"] = "ok"
                del g
            except torch.cuda.OutOfMemoryError:
                rec["status"] = "oom"
            except Exception as exc:
                rec["status"] = f"error: {type(exc).__name__}: {str(exc)[:200]}"
            q = k = v = do = None
            torch.cuda.empty_cache()
            recs.append(rec)
            print(f"memory N={n} {name}: {rec.get('peak_extra_bytes', rec['status'])}", flush=True)
    return recs


def summarize(records):
    """One 'summary' record per (dtype, row): fwd+bwd TFLOP/s of each, ratios, the reference numbers, the bar."""
    out = []
    peers = [r for r in records if r.get("section") == "peers" and r.get("mode") == "fwd+bwd" and r.get("tflops")]
    for i, row in enumerate(ROWS):
        B, H, N, D, causal = row
        for dtype in sorted({r["dtype"] for r in peers}):
            got = {r["impl"]: r["tflops"] for r in peers if r["dtype"] == dtype
                   and (r["batch"], r["heads"], r["n_q"], r["head_dim"], r["causal"]) == row}
            if "flash_triton" not in got:
                continue
            rec = base_record("summary", "flash_triton", row, dtype) | dict(mode="fwd+bwd")
            rec.update({f"{n}_tflops": t for n, t in got.items()})
            ours_t = got["flash_triton"]
            for peer in ("sdpa_flash", "sdpa_cudnn"):
                if got.get(peer):
                    rec[f"ratio_vs_{peer}"] = ours_t / got[peer]
            ref = REFERENCE_TABLE.get((i, dtype))
            if ref:
                rec.update(ref_sdpa_flash=ref[0], ref_sdpa_cudnn=ref[1], ref_tutorial06=ref[2])
                if ref[2]:
                    rec["ratio_vs_ref_tutorial06"] = ours_t / ref[2]
            rec["bar_met"] = rec.get("ratio_vs_sdpa_flash", 0) >= 1.0
            out.append(rec)
    return out


def resummarize(path):
    """Recompute the summary records of a recording in place (its measurements and meta are kept)."""
    import json

    blob = json.loads(open(path).read())
    records = [r for r in blob["records"] if r.get("section") != "summary"]
    blob["records"] = records + summarize(records)
    open(path, "w").write(json.dumps(blob, indent=1, default=str))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="directory for gpu_ch5.json (default: fa_lab/data)")
    parser.add_argument("--sections", default="peers,steps,memory", help="tune,peers,steps,memory")
    parser.add_argument("--rows", default=None, help="comma-separated row indices (default: all)")
    parser.add_argument("--dtypes", default="float16,bfloat16")
    parser.add_argument("--apply-tuned", action="store_true", help="run later sections with the tuned winners")
    parser.add_argument("--fwd-tune", action="store_true", help="tune chapter 4's forward over a short list")
    parser.add_argument("--name", default="gpu_ch5", help="recording name")
    parser.add_argument("--smoke", action="store_true", help="tiny rows, any world: checks the script, records nothing")
    parser.add_argument("--resummarize", metavar="JSON", help="only recompute the summary records of a recording")
    args = parser.parse_args(argv)
    if args.resummarize:
        return resummarize(args.resummarize)
    global ROWS, STEPS_ROW
    if args.smoke:
        ROWS = [(1, 2, 40, 16, False), (1, 2, 40, 16, True)]
        STEPS_ROW = ROWS[0]
        args.out = args.out or "/tmp"
    elif not fa_lab.ON_GPU:
        sys.exit("bench_ch5 records GPU numbers: run it on a machine with a CUDA GPU")
    sections = args.sections.split(",")
    rows = list(enumerate(ROWS)) if args.rows is None else [(int(i), ROWS[int(i)]) for i in args.rows.split(",")]
    dtypes = args.dtypes.split(",")
    records = []
    t_start = time.perf_counter()

    def flush():
        recorded.save(args.name, records, command="python scripts/bench_ch5.py " + " ".join(argv or sys.argv[1:]),
                      directory=args.out, rows=[list(r) for r in ROWS],
                      gpu_configs={f"{k[0]},{k[1]}": v for k, v in bwd.GPU_CONFIGS.items()},
                      ws_configs={f"{k[0]},{k[1]}": v for k, v in bwd.WS_CONFIGS.items()},
                      seconds=round(time.perf_counter() - t_start, 1))

    if "tune" in sections:
        for _, row in rows:
            records += tune_row(row)
            flush()
        if args.apply_tuned:
            apply_tuned(records)
    if args.fwd_tune:
        for _, row in rows:
            for dtype in dtypes:
                fwd_tune(row, dtype)
    if "peers" in sections:
        for dtype in dtypes:
            for i, row in rows:
                recs = peers_row(i, row, dtype)
                records += recs
                flush()
                fb = {r["impl"]: r.get("tflops") for r in recs if r["mode"] == "fwd+bwd"}
                by_mode = {r["mode"]: r.get("tflops") for r in recs if r["impl"] == "flash_triton"}
                ours_r = next(r for r in recs if r["impl"] == "flash_triton" and r["mode"] == "fwd+bwd")
                print(f"{dtype} {row}: fwd+bwd " + "  ".join(f"{n} {t:.0f}" if t else f"{n} -" for n, t in fb.items())
                      + f" | ours fwd {by_mode.get('fwd') or 0:.0f} bwd {by_mode.get('bwd') or 0:.0f}"
                      + f" | ratio vs flash {(fb.get('flash_triton') or 0) / (fb.get('sdpa_flash') or 1):.2f}"
                      + f" | bit-identical {ours_r.get('bit_identical')}", flush=True)
    records += summarize(records)
    if "steps" in sections:
        records += steps()
        flush()
    if "memory" in sections:
        records += memory()
        flush()
    flush()
    print(f"done in {time.perf_counter() - t_start:.0f}s", flush=True)


if __name__ == "__main__":
    main()
