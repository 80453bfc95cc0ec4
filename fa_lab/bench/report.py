"""Chapter 7's summaries of benchmark records: the seed table, the latency answer, the gap to cuDNN, and the
measured "which should I use" table.  Each takes a DataFrame of records (recorded on a GPU
or live) and returns a DataFrame; the notebook only shows them.
"""
from __future__ import annotations

from fa_lab.bench.peers import PEERS


def is_ours(impl: str) -> bool:
    return impl not in PEERS


def seed_table(df, *, value="tflops", dtype="bfloat16"):
    """The FlashAttention-2 table: one row per (mask, mode, shape), one column per implementation.

    A cell holds ``value`` where the case ran and its status ('oom', 'unsupported: why') where it
    did not; ``fa_lab.core.tables.table(t, values=value)`` shows it.
    """
    d = df[df["dtype"] == dtype]
    if d.empty:
        return d
    cell = d.apply(lambda r: r[value] if r["status"] == "ok" else r["status"], axis=1)
    t = d.assign(_cell=cell).pivot_table(index=["mask", "mode", "shape"], columns="impl", values="_cell",
                                         aggfunc="first", sort=False)
    return t[[c for c in dict.fromkeys(d["impl"]) if c in t.columns]]


#: a case whose 90th-percentile time is more than this many times its 10th was disturbed during part of its
#: measurement: its median says less than the others'
SPREAD = 1.25


def wide_spread(df, *, ratio=SPREAD):
    """The cases that ran (status 'ok') whose ``ms_p90`` is more than ``ratio`` times their ``ms_p10``,
    widest first, with that ratio as ``spread``."""
    d = df[df["status"] == "ok"].copy()
    d["spread"] = d["ms_p90"] / d["ms_p10"]
    cols = ["impl", "shape", "dtype", "mask", "mode", "ms", "ms_p10", "ms_p90", "spread"]
    return d.loc[d["spread"] > ratio, cols].sort_values("spread", ascending=False).reset_index(drop=True)


def latency(df, *, shape="(1, 8, 512, 64)"):
    """Per implementation at the latency shape: GPU time (do_bench, µs) and what an eager program
    sees per call when calls run back to back (µs), for each dtype/mask/mode."""
    d = df[(df["shape"] == shape) & (df["status"] == "ok")].copy()
    d["gpu_us"] = d["ms"] * 1e3
    d["back_to_back_us"] = d["ms_back_to_back"] * 1e3
    # clipped at 0: do_bench flushes the L2 cache before each call, back-to-back calls find it warm
    d["host_overhead_us"] = (d["back_to_back_us"] - d["gpu_us"]).clip(lower=0)
    cols = ["dtype", "mask", "mode", "impl", "gpu_us", "back_to_back_us", "host_overhead_us", "tflops",
            "max_abs_err"]
    return d[cols].sort_values(["dtype", "mask", "mode", "back_to_back_us"]).reset_index(drop=True)


#: the summary columns of ``scripts/bench_cudnn_gap.py``'s recording, and their names in the table: ours
#: (``flash_triton``), chapter 11's Gluon kernels (``flash_gluon``, on the rows they run), SDPA's cuDNN backend
GAP_COLUMNS = {"tflops_flash_triton": "ours", "tflops_flash_gluon": "gluon", "tflops_sdpa-cudnn": "cudnn",
               "ratio_vs_cudnn": "vs cudnn", "ratio_gluon_vs_cudnn": "gluon vs cudnn", "ratio_vs_flash": "vs flash"}


def cudnn_gap(df):
    """``scripts/bench_cudnn_gap.py``'s recording as one row per (shape, mask, dtype): forward and
    forward-plus-backward TFLOP/s of ours, of the Gluon kernels and of SDPA's cuDNN backend, and ours (and the
    Gluon kernels) over cuDNN, ours over flash."""
    import pandas as pd

    d = df[df["section"] == "summary"].reindex(columns=["shape", "mask", "dtype", "mode", *GAP_COLUMNS])
    if d.empty:
        return d
    keys = ["shape", "mask", "dtype"]
    t = d.set_index([*keys, "mode"])[list(GAP_COLUMNS)].unstack("mode")    # a column per (value, mode)
    t.columns = [f"{mode} {GAP_COLUMNS[col]}" for col, mode in t.columns]
    rows = pd.MultiIndex.from_frame(d[keys].drop_duplicates())                # in the order they were run
    return t.reindex(index=rows, columns=[f"{mode} {name}" for mode in ("fwd", "fwd+bwd")
                                          for name in GAP_COLUMNS.values()]).reset_index()


def cudnn_gap_kinds(columns) -> dict:
    """How ``fa_lab.core.tables.table`` shows ``cudnn_gap``'s ``columns``: shape and mask as text, the
    ratios ("fwd vs cudnn") as ratios, the other measured columns as TFLOP/s."""
    return {c: "text" if c in ("shape", "mask") else "ratio" if " vs " in c else "tflops"
            for c in columns if c in ("shape", "mask") or c.startswith("fwd")}


def cudnn_gap_mode(gap_table, mode: str):
    """One mode's part of ``cudnn_gap`` (``"fwd"`` or ``"fwd+bwd"``) for a chapter: ``(table, kinds, quoted)``.

    ``kinds`` formats its columns for ``fa_lab.core.tables.table``; ``quoted`` is what prose says of it:
    the lowest and highest ratio to cuDNN (``low``, ``high``) and the rows where they fall (``low_row``,
    ``high_row``, e.g. ``'(2, 16, 8192, 256) causal'``); the same for the Gluon kernels with ``gluon_`` in
    front, where they ran.
    """
    if mode not in ("fwd", "fwd+bwd"):
        raise ValueError(f"mode must be 'fwd' or 'fwd+bwd', got {mode!r}")
    part = gap_table[["shape", "mask", *(f"{mode} {name}" for name in GAP_COLUMNS.values())]]
    kinds = cudnn_gap_kinds(part.columns)
    def row(i):
        return f"{part.loc[i, 'shape']}{'' if part.loc[i, 'mask'] == 'none' else ' ' + part.loc[i, 'mask']}"

    quoted = {}
    for prefix, column in (("", "vs cudnn"), ("gluon_", "gluon vs cudnn")):
        ratio = part[f"{mode} {column}"].dropna()
        if ratio.empty:   # cuDNN declined every row (no GPU, or no cuDNN), or no such kernel ran: nothing to quote
            continue
        quoted.update({f"{prefix}low": f"{ratio.min():.2f}×", f"{prefix}high": f"{ratio.max():.2f}×",
                       f"{prefix}low_row": row(ratio.idxmin()), f"{prefix}high_row": row(ratio.idxmax())})
    return part, kinds, quoted


#: the questions of the decision table: (question, suite, filter, time column)
SCENARIOS = [
    ("training: bf16, causal, fwd+bwd, seed-table shapes (16k tokens, D = 128)", "seed-table",
     dict(dtype="bfloat16", mask="causal", mode="fwd+bwd"), "ms"),
    ("training, no mask: bf16, fwd+bwd, seed-table shapes", "seed-table",
     dict(dtype="bfloat16", mask="none", mode="fwd+bwd"), "ms"),
    ("prefill / inference: bf16, causal, forward, N = 1k–16k, D = 128", "sweep",
     dict(dtype="bfloat16", mask="causal", mode="fwd", head_dim=128, min_n=1024, max_n=16384), "ms"),
    ("long context: bf16, causal, forward, N ≥ 32k, D = 128", "sweep",
     dict(dtype="bfloat16", mask="causal", mode="fwd", head_dim=128, min_n=32768), "ms"),
    ("short sequences: bf16, causal, forward, N ≤ 512, D = 64", "sweep",
     dict(dtype="bfloat16", mask="causal", mode="fwd", head_dim=64, max_n=512), "ms"),
    ("exact float32 (no TF32): causal forward, N = 1k–4k, D = 128", "sweep",
     dict(dtype="float32", mask="causal", mode="fwd", head_dim=128, min_n=1024, max_n=4096), "ms"),
    ("small shape, eager (1, 8, 512, 64) bf16 forward: per call, back to back", "latency",
     dict(dtype="bfloat16", mask="none", mode="fwd"), "ms_back_to_back"),
    ("small shape (1, 8, 512, 64) bf16 forward: do_bench time (kernel time plus launch gaps)", "latency",
     dict(dtype="bfloat16", mask="none", mode="fwd"), "ms"),
    ("sliding window (128, 0) at (1, 8, 512, 64), bf16 forward", "latency",
     dict(dtype="bfloat16", mask="window", mode="fwd"), "ms"),
    ("sliding window (128, 0) at (1, 8, 512, 64), bf16 fwd+bwd", "latency",
     dict(dtype="bfloat16", mask="window", mode="fwd+bwd"), "ms"),
]


def _select(df, f):
    d = df
    for key in ("dtype", "mask", "mode", "head_dim"):
        if key in f:
            d = d[d[key] == f[key]]
    if "min_n" in f:
        d = d[d["n_q"] >= f["min_n"]]
    if "max_n" in f:
        d = d[d["n_q"] <= f["max_n"]]
    return d


def decide(frames: dict, *, scenarios=SCENARIOS, max_err=None):
    """One row per question: the fastest implementation that ran every case of it, how much
    faster it is than the next, and the best of *our* kernels.

    ``frames`` maps a suite name ('seed-table', 'sweep', 'latency') to its records.  "Fastest" is
    the geometric mean of time over the cases of the question; an implementation that failed
    any case (oom, unsupported) is out.  ``max_err`` (per dtype name) excludes inaccurate ones.
    """
    import numpy as np
    import pandas as pd

    max_err = max_err or {"bfloat16": 5e-2, "float16": 1e-2, "float32": 1e-4}
    rows = []
    for question, suite, f, col in scenarios:
        df = frames.get(suite)
        d = _select(df, f) if df is not None and not df.empty else None
        if d is None or d.empty:
            rows.append(dict(question=question, use="(not in the recorded run)", evidence="", best_of_ours=""))
            continue
        n_cases = d["shape"].nunique()
        scores, failed = {}, {}
        for impl, part in d.groupby("impl", sort=False):
            ok = part[part["status"] == "ok"]
            err_ok = ok["max_abs_err"].isna() | (ok["max_abs_err"] <= max_err.get(f.get("dtype"), np.inf))
            bad = part[part["status"] != "ok"]["status"]
            if len(bad) or len(ok) < n_cases:
                failed[impl] = bad.iloc[0].split(":")[0] if len(bad) else "missing cases"
            elif not err_ok.all():
                failed[impl] = "inaccurate"
            elif ok[col].isna().any():
                failed[impl] = "over 1 ms a call" if col == "ms_back_to_back" else f"no {col}"
            else:
                scores[impl] = float(np.exp(np.log(ok[col]).mean()))
            continue
        if not scores:
            rows.append(dict(question=question, use="(nothing ran every case)", evidence="", best_of_ours=""))
            continue
        ranked = sorted(scores.items(), key=lambda kv: kv[1])
        best, t_best = ranked[0]
        unit = "µs" if t_best < 1 else "ms"
        scale = 1e3 if unit == "µs" else 1.0
        ev = f"{t_best * scale:.3g} {unit}"
        if len(ranked) > 1:
            ev += f"; {ranked[1][1] / t_best:.2f}× faster than {ranked[1][0]}"
        ours = [(i, t) for i, t in ranked if is_ours(i)]
        if ours:
            i, t = ours[0]
            mine = "this one" if i == best else f"{i}: {t / t_best:.2f}× the time"
        else:
            mine = "none ran every case"
        rows.append(dict(question=question, use=best, evidence=ev, best_of_ours=mine,
                         cases=n_cases, out=", ".join(f"{k} ({v})" for k, v in failed.items())))
    return pd.DataFrame(rows)


#: fixed colours: the book's kernels in warm colours, PyTorch's in cool ones
_COLORS = {
    "reference": "black", "naive_numpy": "darkgoldenrod", "naive_torch": "tab:gray", "online_numba": "teal",
    "numba_naive": "tab:brown", "numba_tiled": "tab:olive", "triton": "tab:red", "flash_triton": "tab:orange",
    "torch_tiled": "tab:pink", "torch_compile_bwd": "gold",
    "sdpa": "navy", "sdpa-flash": "tab:blue", "sdpa-cudnn": "tab:green", "sdpa-efficient": "tab:cyan",
    "sdpa-math": "tab:purple", "flash-attn": "darkslateblue",
}


def color(impl: str):
    """One colour per implementation, the same in every plot of the book."""
    if impl in _COLORS:
        return _COLORS[impl]
    import matplotlib

    from fa_lab.bench.runner import known_impls

    names = known_impls()
    return matplotlib.colormaps["tab20"]((names.index(impl) if impl in names else len(impl)) % 20)


def style(impl: str) -> dict:
    """``ax.plot`` keyword arguments: a fixed colour; solid for the book's kernels, dashed for peers."""
    return dict(color=color(impl), linestyle="-" if is_ours(impl) else "--")
