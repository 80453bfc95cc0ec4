"""Profile the book's kernels with Nsight Compute, for chapter 11.

    python scripts/profile_ncu.py [--out DIR] [--quick] [--cases fwd,fwd_causal,bwd_causal,numba_tiled,decode]
    python scripts/profile_ncu.py --smoke      # any machine, no GPU, no ncu: the plumbing on a small sample

One ``ncu`` run profiles one launch of each kernel, after two warm-up calls, at the chapters' sizes:

* ``fwd``, ``fwd_causal``: the Triton forward (``triton``, chapter 4), (B, H, N, D) = (4, 16, 4096, 128) bf16;
* ``bwd_causal``: the Triton backward's dK/dV and dQ kernels (chapter 5), same shape, causal;
* ``numba_tiled``: chapter 3's kernel, (4, 16, 4096, 64) fp32;
* ``decode``: chapter 9's split-KV kernel (and its merge, when it splits), (B, Hq, Hkv, Nq, Nk, D) =
  (8, 32, 8, 1, 8192, 128) fp16.

The paged-cache study is a recording of its own, the same decoding problem over 256-key pages with one split:
``paged_3_stages_int64`` (the loop as it first was), ``paged_5_stages_int64`` and ``paged`` (as shipped)::

    python scripts/profile_ncu.py --cases paged_3_stages_int64,paged_5_stages_int64,paged \
        --out fa_lab/data/profile_paged_decode

The profiled program warms every case up, then calls ``cudaProfilerStart`` (``--profile-from-start off``)
and runs each case once; ``-k`` keeps the kernels above.  Sections: speed of light and its roofline,
memory workload (with its tables and chart), compute workload, warp state, occupancy, launch and scheduler
statistics, source counters (``--quick``: speed of light, memory workload, warp state, occupancy and launch
statistics).  Clocks are left as they run (``--clock-control none``); every replay pass starts with flushed
caches.  The forward runs with its cached launch configuration (``FA_LAB_TRITON_AUTOTUNE=0`` unless set:
no tuning on a cache miss, the default configuration instead).  A few minutes on an H100, most of it
compiling the kernels on a fresh machine.

Writes into DIR (default ``fa_lab/data``): ``ncu/details.csv`` (``ncu --csv --page details``, without the
rules' paragraphs of advice), ``ncu/raw.csv`` (``--page raw``, cut to the metrics the chapter reads),
``ncu/sass_counts.csv`` and
``ncu/sass_<case>_<kernel>.txt`` (the hot loop of each kernel's SASS), and ``gpu_profile.json``
(``fa_lab.bench.records``): which case each launch is, problem, launch configuration, ncu's version.
A step that fails is recorded as a status; it never stops the others.  ``--keep-report PATH`` also keeps
ncu's own report file (``ncu-ui PATH`` opens it).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fa_lab  # noqa: E402  (first: picks the world)
from fa_lab.bench import records as recorded  # noqa: E402
from fa_lab.core.data import DATA_DIR  # noqa: E402
from fa_lab.perf import ncu, sass  # noqa: E402

#: case -> what it runs: implementation, (B, H, Hkv, Nq, Nk, D), dtype, mask, and its kernels in launch order
CASES = {
    "fwd": dict(impl="triton", shape=(4, 16, 16, 4096, 4096, 128), dtype="bfloat16", causal=False,
                kernels=("attn_fwd",)),
    "fwd_causal": dict(impl="triton", shape=(4, 16, 16, 4096, 4096, 128), dtype="bfloat16", causal=True,
                       kernels=("attn_fwd",)),
    "bwd_causal": dict(impl="triton_backward", shape=(4, 16, 16, 4096, 4096, 128), dtype="bfloat16", causal=True,
                       kernels=("bwd_dq", "bwd_dkdv", "bwd_dkdv_ws")),
    "numba_tiled": dict(impl="numba_tiled", shape=(4, 16, 16, 4096, 4096, 64), dtype="float32", causal=False,
                        kernels=("flash_attention_fwd",)),
    "decode": dict(impl="triton_decode", shape=(8, 32, 8, 1, 8192, 128), dtype="float16", causal=False,
                   kernels=("decode_split_kv", "combine_kernel")),
    # the paged-cache study (chapter 9's pages of 256 keys, one split): the loop as it first was, three
    # stages and int64 offsets; five stages; and as shipped (five stages, int32 offsets)
    "paged_3_stages_int64": dict(impl="triton_decode", shape=(8, 32, 8, 1, 8192, 128), dtype="float16",
                                 causal=False, page_size=256, splits=1, num_stages=3, offs32=False,
                                 kernels=("decode_split_kv",)),
    "paged_5_stages_int64": dict(impl="triton_decode", shape=(8, 32, 8, 1, 8192, 128), dtype="float16",
                                 causal=False, page_size=256, splits=1, num_stages=5, offs32=False,
                                 kernels=("decode_split_kv",)),
    "paged": dict(impl="triton_decode", shape=(8, 32, 8, 1, 8192, 128), dtype="float16", causal=False,
                  page_size=256, splits=1, kernels=("decode_split_kv",)),
}
#: the cases of the chapter's main recording (the rest: ``PAGED_STUDY``, recorded apart)
DEFAULT_CASES = ("fwd", "fwd_causal", "bwd_causal", "numba_tiled", "decode")
#: ``--cases`` of the paged-cache study, written to ``fa_lab/data/profile_paged_decode``
PAGED_STUDY = ("paged_3_stages_int64", "paged_5_stages_int64", "paged")
#: kernels that may not run: decode merges its splits only when the heuristic splits; the backward runs one of
#: its two dK/dV kernels, the warp-specialized one where its tile allows (``bwd_ws.eligible``)
OPTIONAL = {"combine_kernel", "bwd_dkdv", "bwd_dkdv_ws"}
KERNELS = "regex:attn_fwd|bwd_dkdv_ws|bwd_dkdv|bwd_dq|flash_attention_fwd|decode_split_kv|combine_kernel"
SECTIONS = ["SpeedOfLight", "SpeedOfLight_RooflineChart", "MemoryWorkloadAnalysis", "MemoryWorkloadAnalysis_Tables",
            "MemoryWorkloadAnalysis_Chart", "ComputeWorkloadAnalysis", "WarpStateStats", "Occupancy", "LaunchStats",
            "SchedulerStats", "SourceCounters"]
QUICK_SECTIONS = ["SpeedOfLight", "MemoryWorkloadAnalysis", "WarpStateStats", "Occupancy", "LaunchStats"]
#: metrics collected beside the sections (where this GPU has them) and kept in raw.csv
METRICS = ["gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum", "lts__t_bytes.sum",
           "lts__t_sector_hit_rate.pct", "sm__throughput.avg.pct_of_peak_sustained_elapsed",
           "sm__warps_active.avg.pct_of_peak_sustained_active", "launch__registers_per_thread",
           "sm__inst_executed_pipe_xu.sum", "smsp__inst_executed.sum", "sm__cycles_elapsed.avg.per_second"]
#: raw metrics kept besides METRICS: the warp-state breakdown, pipe usage, launch and occupancy facts
RAW_PATTERNS = (r"^smsp__average_warps_issue_stalled_\w+_per_issue_active\.ratio$",
                r"^smsp__pcsamp_warps_issue_stalled_\w+$", r"^sm__inst_executed_pipe_\w+\.sum$",
                r"^sm__pipe_\w+_cycles_active\.avg\.pct_of_peak_sustained_active$", r"^launch__",
                r"^sm__maximum_warps_per_active_cycle_pct$",
                r"^device__attribute_(multiprocessor_count|l2_cache_size)$")
SASS_LINES = 600


def plan(cases) -> list[tuple[str, str, bool]]:
    return [(c, k, k in OPTIONAL) for c in cases for k in CASES[c]["kernels"]]


# ----------------------------------------------------------------------------- the profiled program

def build(name: str):
    """``(run, info, pick)`` of one case: ``run()`` launches it; ``pick()``, called right after the case's warm-up,
    picks the compiled kernels it ran and returns ``sass()``, which gives {kernel: SASS text}."""
    import torch

    from fa_lab.core.testing import random_qkv

    c = CASES[name]
    B, H, Hkv, Nq, Nk, D = c["shape"]
    dtype = getattr(torch, c["dtype"])
    info = dict(case=name, impl=c["impl"], batch=B, heads=H, kv_heads=Hkv, n_q=Nq, n_k=Nk, head_dim=D,
                dtype=c["dtype"], causal=c["causal"])
    if c["impl"] == "triton":
        from fa_lab.kernels.triton.configs import FINAL
        from fa_lab.kernels.triton.launch import make_launcher
        from fa_lab.kernels.triton.tuner import choose_config

        q, k, v = random_qkv(B, H, Nq, Nk, D, kv_heads=Hkv, dtype=dtype, seed=0)
        spec = fa_lab.make_spec(q, k, v, causal=c["causal"])
        # the configuration triton_forward launches with: its launcher, its choice (cached after the first call)
        launch, _, _, work = make_launcher(q, k, v, spec)
        cfg = choose_config(launch, spec, work, FINAL, "ieee")
        info["config"] = {key: cfg[key] for key in sorted(cfg) if key != "ms"}
        run = lambda: fa_lab.attention(q, k, v, impl="triton", causal=c["causal"])  # noqa: E731
        return run, info, _picked({"attn_fwd": lambda: launch(cfg, warmup=True)})
    if c["impl"] == "triton_backward":
        from fa_lab.kernels.triton import bwd, bwd_ws

        q, k, v = random_qkv(B, H, Nq, Nk, D, kv_heads=Hkv, dtype=dtype, seed=1)
        spec = fa_lab.make_spec(q, k, v, causal=c["causal"])
        o, lse = fa_lab.attention(q, k, v, impl="triton", causal=c["causal"], return_lse=True)
        do = torch.randn_like(o)
        tiles = bwd.configs(spec, q.dtype, (q, k, v, do))
        info["config"] = dict(zip(("bwd_dkdv", "bwd_dq"), tiles))
        # a dK/dV tile with a fifth entry runs the warp-specialized kernel (bwd_ws)
        dkdv = bwd_ws.bwd_dkdv_ws if len(tiles[0]) > 4 else bwd.bwd_dkdv
        return (lambda: bwd.triton_backward(q, k, v, o, lse, do, spec)), info, \
            _new_kernels({"bwd_dq": bwd.bwd_dq, dkdv.__name__: dkdv})
    if c["impl"] == "numba_tiled":
        from fa_lab.kernels.numba import tiled

        q, k, v = random_qkv(B, H, Nq, Nk, D, kv_heads=Hkv, dtype=dtype, seed=2)
        cfg = tiled.config_for(D)
        info["config"] = dict(block_m=cfg.block_m, block_n=cfg.block_n, threads=cfg.threads, d_pad=cfg.d_pad,
                              share_kv=cfg.share_kv)
        return (lambda: fa_lab.attention(q, k, v, impl="numba_tiled", causal=c["causal"])), info, \
            _picked({"flash_attention_fwd": lambda: tiled.build_kernel(cfg, True)}, sass.numba_sass)
    from fa_lab.kernels.decode import combine, decode_forward, forward, kernel

    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, Nq, H, D, generator=g).to(fa_lab.DEVICE, dtype)
    k_cache, v_cache = (torch.randn(B, Nk, Hkv, D, generator=g).to(fa_lab.DEVICE, dtype) for _ in range(2))
    cache = {}
    if c.get("page_size"):
        from bench_ch9 import paged   # chapter 9's recording script: the same pool of pages at random places

        k_cache, v_cache, table = paged(k_cache, v_cache, c["page_size"])
        cache = dict(block_table=table, cache_seqlens=torch.full((B,), Nk, dtype=torch.int32, device=q.device))
    overrides = {"num_stages": c["num_stages"]} if "num_stages" in c else None
    # a limit of 0 sends the cache down the int64-offset path (forward.OFFS32_LIMIT), for this case's calls only
    offsets = contextlib.nullcontext() if c.get("offs32", True) else mock.patch.object(forward, "OFFS32_LIMIT", 0)

    def call():
        with offsets:
            return decode_forward(q, k_cache, v_cache, scale=None, num_splits=c.get("splits", 0), config=overrides,
                                  **cache)
    with offsets:
        plan = forward.decode_plan(q, k_cache, v_cache, num_splits=c.get("splits", 0), config=overrides, **cache)
    info["config"] = dict(BLOCK_N=plan.split_kv.meta["BLOCK_N"], num_warps=plan.split_kv.num_warps,
                          num_stages=plan.split_kv.num_stages, splits=plan.splits, page_size=c.get("page_size", 0),
                          int32_offsets=plan.split_kv.meta["OFFS32"])
    return call, info, \
        _new_kernels({"decode_split_kv": kernel.decode_split_kv, "combine_kernel": combine.combine_kernel})


def _picked(kernels: dict, disassemble=sass.triton_sass):
    """A ``pick()``: {name: a function giving the compiled kernel, or None}, called at the pick; the ``sass()``
    it returns disassembles those kernels."""
    def pick():
        found = {name: k for name, get in kernels.items() if (k := get()) is not None}
        return lambda: {name: disassemble(k) for name, k in found.items()}
    return pick


def _new_kernels(fns: dict):
    """A ``pick()`` for the kernels a case's warm-up compiled: those of ``fns`` (name -> @triton.jit function)
    that were not compiled before the case was built (the newest, if the warm-up compiled none)."""
    before = {name: {id(k) for k in sass.compiled_kernels(fn)} for name, fn in fns.items()}

    def newest(name):
        compiled = sass.compiled_kernels(fns[name])
        new = [k for k in compiled if id(k) not in before[name]] or compiled[-1:]
        return new[-1] if new else None
    return _picked({name: functools.partial(newest, name) for name in fns})


def launches(cases, manifest: Path) -> None:
    """The profiled program: warm each case up, then one launch of each between cudaProfilerStart/Stop."""
    import torch

    runs, infos, sass_fns = {}, {}, {}
    for name in cases:
        runs[name], infos[name], pick = build(name)
        for _ in range(2):
            runs[name]()
        torch.cuda.synchronize()
        sass_fns[name] = pick()   # now, before the next case compiles kernels of its own
    torch.cuda.profiler.start()
    for name in cases:
        runs[name]()
        torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    for name in cases:   # after profiling: the disassembler runs in a child process of its own
        try:
            texts = sass_fns[name]()
            folder = manifest.parent / "sass"
            folder.mkdir(exist_ok=True)
            for kernel_name, text in texts.items():
                (folder / f"{name}_{kernel_name}.sass").write_text(text)
            infos[name]["sass_status"] = "ok" if texts else "error: no compiled kernel found"
        except Exception as exc:
            infos[name]["sass_status"] = f"error: {type(exc).__name__}: {str(exc)[:300]}"
    manifest.write_text(json.dumps(infos, default=str, indent=1))


# ----------------------------------------------------------------------------- running ncu

def profile(tool, cases, sections, metrics, work: Path, timeout: float) -> tuple[str, Path | None]:
    """Run the profiled program under ncu; (status, report path)."""
    report = work / "report"
    program = [sys.executable, str(Path(__file__).resolve()), "--launches", ",".join(cases),
               "--manifest", str(work / "manifest.json")]
    base = [tool, "--profile-from-start", "off", "--clock-control", "none", "--target-processes", "all",
            "-k", KERNELS, "-c", str(len(plan(cases))), "-f", "-o", str(report)]
    for s in sections:
        base += ["--section", s]
    attempts = [(base + ["--metrics", ",".join(metrics)], "ok")] if metrics else []
    attempts.append((base, "ok (sections only: ncu refused the extra metrics)" if metrics else "ok"))
    status, rep = "error: not run", report.with_suffix(".ncu-rep")
    for cmd, success in attempts:
        t0 = time.time()
        try:
            run = ncu.run(cmd + program, timeout)
        except subprocess.TimeoutExpired:
            return f"error: ncu ran past {timeout:.0f}s", None
        said = (run.stderr or run.stdout)[-1500:]
        print(f"ncu rc={run.returncode} in {time.time() - t0:.0f}s", flush=True)
        if rep.exists():      # a program that failed after some launches still leaves their report
            return (success if run.returncode == 0 else f"partial: ncu rc={run.returncode}: {said}"), rep
        status = f"error: ncu rc={run.returncode}: {said}"
        print(status, flush=True)
        if "metric" not in said.lower():
            break             # not about the extra metrics: the same run without them would fail the same way
    return status, None


# ----------------------------------------------------------------------------- turning the outputs into the recording

def write_outputs(out_dir: Path, details: str | None, raw: str | None, manifest: dict, sass_dir: Path | None,
                  cases, statuses: dict, command: str, **meta) -> Path:
    """CSV files under ``out_dir/ncu`` and the index ``out_dir/gpu_profile.json``; returns the index."""
    folder = out_dir / ncu.SUBDIR
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*"):          # a new recording replaces the folder's files
        if old.is_file():
            old.unlink()
    records, ids, launch_rows = [], {}, {}
    try:
        table = ncu.read_details(details).drop_duplicates("id") if details is not None else None
    except (ValueError, KeyError) as exc:
        statuses["details"], table = f"error: ncu's details page: {exc}", None
    if table is not None:
        (folder / ncu.DETAILS).write_text(ncu.cut_details(details[re.search(r'^"ID",', details, re.M).start():]),
                                          encoding="utf-8")
        try:
            ids = ncu.assign_cases(list(zip(table["id"], table["kernel_name"])), plan(cases))
            statuses.setdefault("cases", "ok")
        except ValueError as exc:
            statuses["cases"] = f"error: {exc}"
        launch_rows = {int(r.id): r for r in table.itertuples()}
    try:
        if raw is not None:
            (folder / ncu.RAW).write_text(ncu.cut_raw(raw, METRICS, RAW_PATTERNS), encoding="utf-8")
    except (ValueError, IndexError) as exc:
        statuses["raw"] = f"error: ncu's raw page: {exc}"
    counts = []
    for case in cases:
        info = dict(manifest.get(case) or dict(case=case, sass_status="error: the profiled program wrote nothing"))
        for kernel in CASES[case]["kernels"]:
            rec = {k: v for k, v in info.items() if k != "config"}
            rec.update(case=case, kernel=kernel, config=json.dumps(info.get("config"), default=str))
            ran = [i for i, labelled in ids.items() if labelled == (case, kernel)]
            if ran:
                r = launch_rows[ran[0]]
                rec.update(id=int(r.id), grid=r.grid, block=r.block, status="ok")
            elif kernel in OPTIONAL and statuses.get("cases") == "ok":
                continue                      # it did not run: nothing to record
            else:
                why = [v for v in (statuses.get("cases"), statuses.get("details"), statuses.get("ncu"))
                       if str(v).startswith("error")]
                rec.update(id=None, status=why[0] if why else "error: not profiled")
            path = sass_dir / f"{case}_{kernel}.sass" if sass_dir is not None else None
            if path is not None and path.exists():
                text = path.read_text()
                instrs = sass.parse(text)
                (folder / f"sass_{case}_{kernel}.txt").write_text(
                    sass.excerpt(instrs, sass.main_loop(instrs), SASS_LINES), encoding="utf-8")
                counts.append(dict(case=case, kernel=kernel, **sass.summary(text)))
            records.append(rec)
    if counts:
        import pandas as pd

        pd.DataFrame(counts).to_csv(folder / ncu.SASS_COUNTS, index=False)
    files = sorted(p.name for p in folder.glob("*"))
    return recorded.save(ncu.RECORDING, records, command=command, directory=out_dir, statuses=statuses,
                         files=files, cases={c: CASES[c] for c in cases}, **meta)


def capture(out_dir: Path, cases, quick: bool, keep_report: str | None, command: str) -> Path:
    tool = ncu.find_ncu()
    statuses = {}
    # the profiled program launches the forward with its cached configuration (tuned for the chapters'
    # recordings) or the default: tuning on a cache miss would time dozens of candidates first
    os.environ.setdefault("FA_LAB_TRITON_AUTOTUNE", "0")
    work = Path(tempfile.mkdtemp(prefix="fa_lab_ncu_"))
    details = raw = None
    manifest, version, sections, metrics = {}, None, [], []
    if tool is None:
        statuses["ncu"] = "error: ncu not found (install Nsight Compute or put it on PATH)"
        # still record the launch configurations and the SASS, from the same program without ncu
        try:
            ncu.run([sys.executable, str(Path(__file__).resolve()), "--launches", ",".join(cases),
                     "--manifest", str(work / "manifest.json")], 540)
        except (OSError, subprocess.SubprocessError) as exc:
            statuses["launches"] = f"error: {type(exc).__name__}"
    else:
        version = ncu.version(tool)
        sections = ncu.available_sections(tool, QUICK_SECTIONS if quick else SECTIONS)
        metrics = ncu.available_metrics(tool, METRICS, fallback=METRICS[:8])
        print(f"ncu {version}; sections {sections}; metrics {metrics}", flush=True)
        statuses["ncu"], report = profile(tool, cases, sections, metrics, work, timeout=560)
        if report is not None:
            for page in ("details", "raw"):
                try:
                    text = ncu.export(tool, report, page)
                    details, raw = (text, raw) if page == "details" else (details, text)
                except Exception as exc:
                    statuses[page] = f"error: {type(exc).__name__}: {str(exc)[:300]}"
            if keep_report:
                shutil.copy(report, keep_report)
    if (work / "manifest.json").exists():
        manifest = json.loads((work / "manifest.json").read_text())
    path = write_outputs(out_dir, details, raw, manifest, work / "sass", cases, statuses, command,
                         ncu_version=version, sections=sections, metrics=metrics, clock_control="none",
                         kernel_filter=KERNELS)
    shutil.rmtree(work, ignore_errors=True)
    return path


# ----------------------------------------------------------------------------- --smoke: the plumbing, no GPU

_HEAD = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
         '"Device","CC"')
SMOKE_DETAILS = "\n".join([
    "==PROF== Connected to process 4242",
    _HEAD + ',"Section Name","Metric Name","Metric Unit","Metric Value","Rule Name","Rule Type","Rule Description",'
            '"Estimated Speedup Type","Estimated Speedup"',
    *(f'"{i}","4242","python3","h","{k}","1","7","{b}","{g}","0","9.0","{s}","{m}","{u}","{v}","","","","",""'
      for i, k, b, g in ((0, "attn_fwd", "(128, 1, 1)", "(64, 64, 1)"),
                         (1, "decode_split_kv", "(128, 1, 1)", "(64, 4, 1)"))
      for s, m, u, v in (("GPU Speed Of Light Throughput", "Duration", "nsecond", "1,052,160"),
                         ("GPU Speed Of Light Throughput", "Compute (SM) Throughput", "%", "71.20"),
                         ("GPU Speed Of Light Throughput", "Memory Throughput", "%", "48.10"),
                         ("Launch Statistics", "Registers Per Thread", "register/thread", "156"),
                         ("Occupancy", "Block Limit Registers", "block", "3"),
                         ("Occupancy", "Block Limit Shared Mem", "block", "4"))),
    '"0","4242","python3","h","attn_fwd","1","7","(128, 1, 1)","(64, 64, 1)","0","9.0",'
    '"GPU Speed Of Light Throughput","","","","SOLBottleneck","OPT","Compute is more heavily utilized than Memory.",'
    '"global","12.5"',
    "==PROF== Disconnected from process 4242", ""])
SMOKE_RAW = "\n".join([
    _HEAD + ',"dram__bytes_read.sum","dram__bytes_write.sum","lts__t_bytes.sum",'
            '"smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",'
            '"smsp__average_warps_issue_stalled_wait_per_issue_active.ratio","smsp__unwanted.sum"',
    '"","","","","","","","","","","","byte","byte","byte","","",""',
    '"0","4242","python3","h","attn_fwd","1","7","(128, 1, 1)","(64, 64, 1)","0","9.0","301,989,888",'
    '"67,108,864","8,858,370,048","3.1","1.9","7"',
    '"1","4242","python3","h","decode_split_kv","1","7","(128, 1, 1)","(64, 4, 1)","0","9.0","134,217,728",'
    '"1,048,576","136,314,880","20.5","0.8","7"', ""])
SMOKE_SASS = """Function : attn_fwd
        /*0000*/                   LDC R1, c[0x0][0x28] ;           /* 0x00000a00ff017b82 */
                                                                    /* 0x000fe40000000800 */
        /*0010*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT ; /* 0x0 */
        /*0020*/                   FFMA R3, R24, UR4, -R2 ;
        /*0030*/                   MUFU.EX2 R3, R3 ;
        /*0040*/                   HGMMA.64x128x16.F32.BF16 R88, R56, gdesc[UR12], R88 ;
        /*0050*/              @!P0 BRA 0x10 ;
        /*0060*/                   EXIT ;
"""


def smoke(out_dir: Path) -> Path:
    """The outputs' code path on embedded samples in ncu's formats: no GPU, no ncu."""
    cases = ["fwd", "decode"]
    sass_dir = out_dir / "_sass"
    sass_dir.mkdir(parents=True, exist_ok=True)
    (sass_dir / "fwd_attn_fwd.sass").write_text(SMOKE_SASS)
    manifest = {c: dict(case=c, impl=CASES[c]["impl"], config={"BLOCK_M": 64}, sass_status="ok") for c in cases}
    path = write_outputs(out_dir, SMOKE_DETAILS, SMOKE_RAW, manifest, sass_dir, cases, {"ncu": "ok (smoke sample)"},
                         "python scripts/profile_ncu.py --smoke", ncu_version="smoke")
    shutil.rmtree(sass_dir)
    profile = ncu.load(out_dir)
    assert profile is not None, "the smoke recording does not load"
    head = profile.launches().set_index("case")
    assert list(head.index) == ["fwd", "decode"], head.index
    assert abs(head.loc["fwd", "duration_s"] - 1.05216e-3) < 1e-12 and head.loc["fwd", "registers"] == 156
    assert head.loc["fwd", "limiter"] == "registers" and head.loc["fwd", "blocks_per_sm"] == 3
    assert head.loc["decode", "dram_bytes"] == 134217728 + 1048576
    stalls = profile.stalls()
    assert stalls.groupby("case")["reason"].first().to_dict() == {"decode": "long_scoreboard",
                                                                  "fwd": "long_scoreboard"}
    assert "smsp__unwanted.sum" not in (out_dir / ncu.SUBDIR / ncu.RAW).read_text()
    counts = profile.sass.set_index("kernel").loc["attn_fwd"]
    assert counts["loop_hgmma"] == 2 and counts["loop_mufu_ex2"] == 1 and counts["loop_instructions"] == 5
    assert len(profile.rules) == 1 and profile.rules.iloc[0]["rule"] == "SOLBottleneck"
    print(head[["kernel", "duration_s", "sm_pct", "registers", "limiter", "dram_bytes"]].to_string())
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="directory for gpu_profile.json and ncu/ (default: fa_lab/data)")
    parser.add_argument("--quick", action="store_true", help="five sections instead of eleven")
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES),
                        help=f"comma-separated, of {', '.join(CASES)} (default: {', '.join(DEFAULT_CASES)}; "
                             f"the paged-cache study: {','.join(PAGED_STUDY)} --out fa_lab/data/profile_paged_decode)")
    parser.add_argument("--keep-report", default=None, help="also copy ncu's report (.ncu-rep) to this path")
    parser.add_argument("--smoke", action="store_true", help="no GPU, no ncu: check the script on samples")
    parser.add_argument("--launches", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--manifest", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        if args.out:
            print("wrote", smoke(Path(args.out)))
        else:
            with tempfile.TemporaryDirectory(prefix="fa_lab_ncu_smoke_") as tmp:
                smoke(Path(tmp))
            print("smoke: ok")
        return
    if not fa_lab.ON_GPU:
        sys.exit("profile_ncu profiles GPU kernels: run it on a machine with a CUDA GPU (or --smoke)")
    if args.launches is not None:
        launches(args.launches.split(","), Path(args.manifest))
        return
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        sys.exit(f"unknown cases {unknown}; known: {', '.join(CASES)}")
    print(fa_lab.describe(), flush=True)
    t0 = time.time()
    out = Path(args.out) if args.out else DATA_DIR
    command = " ".join(["python scripts/profile_ncu.py", *(argv if argv is not None else sys.argv[1:])])
    path = capture(out, cases, args.quick, args.keep_report, command)
    print(f"wrote {path} in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
