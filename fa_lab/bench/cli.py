"""Benchmark implementations (ours and PyTorch SDPA's) on named or explicit shapes.

Examples::

    fa-lab bench --config tiny --impl reference naive_torch --out r.csv
    fa-lab bench --config seed-table --impl triton sdpa-flash --dtype bf16 --mode fwd fwd+bwd
    fa-lab bench --batch 1 --heads 8 --seq-len 512 --head-dim 64 --mask causal --plot p.png

Every case becomes a record (the CSV's row): p50, p10 and p90 times, TFLOP/s, peak extra
memory and its reduction vs naive, speedup vs --baseline, max abs error vs the float64
reference (small sizes), and a status (ok / oom / unsupported: why / skipped: why).  The
printed table, as wide as the terminal, shows the measured cases; the others are listed
under it with their reason.  Nothing that cannot run stops the run, but an implementation
named with --impl that could not be measured on any case makes the exit status 1.  Ctrl-C
stops the run and keeps (with --out, writes) what was measured: exit status 130.  On a
CPU-only machine the times are wall clock of the simulator, and the Numba CUDA kernels,
which the simulator runs thread by thread, are left out unless named with --impl.
"""
from __future__ import annotations

import shlex
import sys

from fa_lab.cli import INTERRUPTED  # the exit status of a run stopped by Ctrl-C

EPILOG = """configs: tiny (2,4,8,64), small (2,4,64,64), medium (2,8,128,64), llama_small (1,12,256,64),
llama_med (1,32,512,128), seed-table (6 shapes of 16k tokens, H=16, D=128), sweep (B=1, H=16, causal,
N=128..65536 x D=16..128 x bf16/fp32), latency (1,8,512,64). Explicit --batch/--heads/--seq-len/--head-dim
(each may take several values: a grid) replace the config's dimensions, or stand alone without --config.
--warmup/--rep: calls in the CPU world; milliseconds of warm-up/repetition (triton do_bench) on a GPU."""

#: the exit status when an implementation named with --impl could not be measured on any case
NOT_MEASURED = 1


def configure(parser) -> None:
    import argparse

    from fa_lab.bench.configs import config_names
    from fa_lab.cli import add_problem_arguments, positive_int

    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--impl", nargs="+", metavar="IMPL",
                        help="registered implementations and/or peers (sdpa, sdpa-flash, sdpa-cudnn, "
                             "sdpa-efficient, sdpa-math, flash-attn); default: all that run in this world "
                             "(in the CPU world, without the slow Numba CUDA simulator kernels)")
    parser.add_argument("--mode", nargs="+", default=["fwd"], choices=["fwd", "bwd", "fwd+bwd"])
    parser.add_argument("--config", choices=config_names())
    add_problem_arguments(parser, grid=True)
    parser.add_argument("--baseline", metavar="IMPL", help="speedup = baseline ms / ms (default naive_torch if run)")
    parser.add_argument("--out", metavar="FILE.csv", help="write CSV, and JSON (with machine facts) beside it")
    parser.add_argument("--plot", metavar="FILE.png", help="save TFLOP/s and memory vs N (or ms per case)")
    parser.add_argument("--warmup", type=positive_int, help="CPU: calls; GPU: ms (default 3 calls / 25 ms)")
    parser.add_argument("--rep", type=positive_int, help="CPU: calls; GPU: ms (default 10 calls / 100 ms)")
    parser.add_argument("--max-ms", type=float, metavar="MS",
                        help="skip cases predicted (from the previous N) to take longer than MS per call")
    parser.add_argument("--no-check", action="store_true", help="skip the max-abs-error column")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--quiet", action="store_true", help="no table (files only)")


def plan(args) -> dict:
    """The parsed arguments as ``run_suite`` keyword arguments; ``ValueError`` says what is wrong."""
    from fa_lab.bench.configs import default_dtypes, default_mask, shapes
    from fa_lab.bench.peers import canonical_name
    from fa_lab.bench.runner import default_impls, known_impls
    from fa_lab.core.dtypes import short_name

    impls = [canonical_name(n) for n in args.impl] if args.impl else default_impls(slow=False)
    baseline = canonical_name(args.baseline) if args.baseline else None
    known = known_impls()
    bad = [n for n in impls + ([baseline] if baseline else []) if n not in known]
    if bad:
        raise ValueError(f"unknown impl {', '.join(map(repr, bad))}; known: {', '.join(known)}")
    dtypes = [short_name(d) for d in args.dtype or default_dtypes(args.config) or ["fp32"]]
    window = tuple(args.window) if args.window else (-1, -1)
    masks = args.mask or (["window"] if args.window else [default_mask(args.config)])
    if "window" in masks and window == (-1, -1):
        raise ValueError("--mask window needs --window LEFT RIGHT (at least one >= 0)")
    if any(w < -1 for w in window):
        raise ValueError(f"--window sizes must be >= 0, or -1 for unbounded; got {window}")
    if args.warmup is not None or args.rep is not None:
        from fa_lab.core.world import ON_GPU

        gpu_ms = (args.warmup or 25, args.rep or 100) if ON_GPU else None
    else:
        gpu_ms = None
    return dict(
        impls=impls,
        shapes=shapes(args.config, batch=args.batch, heads=args.heads, seq_len=args.seq_len,
                      head_dim=args.head_dim, kv_heads=args.kv_heads, seq_len_k=args.seq_len_k),
        dtypes=dtypes, masks=masks, modes=args.mode, window=window, baseline=baseline,
        warmup=args.warmup, rep=args.rep, gpu_ms=gpu_ms, check=not args.no_check, max_ms=args.max_ms,
        suite=args.config or "custom", progress=not args.no_progress, seed=args.seed)


def measure(kwargs, on_record=None) -> tuple[list, bool]:
    """``(records, interrupted)``: every case of the plan, or those measured before Ctrl-C.

    ``on_record(record)`` is called as each case finishes (a KeyboardInterrupt it raises stops
    the run like Ctrl-C).
    """
    from fa_lab.bench import runner

    baseline = kwargs.pop("baseline") or ("naive_torch" if "naive_torch" in kwargs["impls"] else kwargs["impls"][0])
    records = []
    try:
        for rec in runner.iter_suite(**kwargs, baseline=baseline):
            records.append(rec)
            if on_record is not None:
                on_record(rec)
        interrupted = False
    except KeyboardInterrupt:
        interrupted = True
    return runner.compare(records, baseline=baseline), interrupted


def not_measured(records, requested) -> dict[str, str]:
    """Implementations in ``requested`` with no measured case: name -> why (the first row's status).

    A case skipped on purpose (``--max-ms``) is not a failure: an implementation whose every
    case was skipped is left out.
    """
    why = {}
    for name in requested:
        rows = [r for r in records if r["impl"] == name]
        if rows and not any(r["status"] == "ok" for r in rows):
            failed = [r["status"] for r in rows if not r["status"].startswith("skipped")]
            if failed:
                why[name] = failed[0]
    return why


def _cases(n: int) -> str:
    return f"{n} case" + ("" if n == 1 else "s")


def run(args, on_record=None) -> int:
    from collections import Counter

    from fa_lab.bench import runner

    try:
        kwargs = plan(args)
    except ValueError as exc:
        print(f"fa-lab bench: error: {exc}", file=sys.stderr)
        return 2
    if not args.impl and runner.left_out():
        print(f"left out in the {runner.WORLD} world (Numba CUDA simulator, 15-25 s a call at the small config): "
              f"{', '.join(runner.left_out())}; name them with --impl to include them")
    requested = list(kwargs["impls"]) if args.impl else []
    records, interrupted = measure(kwargs, on_record)
    if records and not args.quiet:
        runner.table(records)
    counts = Counter(r["status"].split(":")[0] for r in records)
    print("cases: " + (", ".join(f"{n} {s}" for s, n in counts.most_common()) or "none"))
    saved = None
    if args.out and records:
        command = "fa-lab " + " ".join(shlex.quote(a) for a in (getattr(args, "_argv", None) or ["bench"]))
        saved = runner.save(records, args.out, command=command.strip(), partial=interrupted)
        print(f"wrote {saved[0]} and {saved[1]}")
    if interrupted:
        if not records:
            kept = "nothing was measured"
        elif saved:
            kept = f"the rows finished so far are kept, written to {saved[0]} and {saved[1]}"
        else:
            kept = "the rows finished so far are kept, shown above (--out FILE.csv writes them)"
        print(f"fa-lab bench: interrupted after {_cases(len(records))} (Ctrl-C): {kept}", file=sys.stderr)
        return INTERRUPTED
    failed = not_measured(records, requested)
    if failed or (records and not any(r["status"] == "ok" for r in records)):
        lines = [f"  {name}: {why}" for name, why in failed.items()] or ["  no case was measured"]
        print("fa-lab bench: error: could not measure what was asked for:\n" + "\n".join(lines), file=sys.stderr)
        status = NOT_MEASURED
    else:
        status = 0
    if args.plot:
        runner.plot_suite(records, args.plot)
        print(f"wrote {args.plot}")
    return status
