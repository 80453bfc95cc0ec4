"""The benchmark suite: every (implementation × shape × dtype × mask × mode) through
``fa_lab.bench.measure.benchmark``, then the columns that compare rows with each other.

Data first: ``run_suite`` returns records (dicts, one per measurement, schema in
``COLUMNS``); ``save`` writes them as CSV plus a recording (``fa_lab.bench.records``);
``table`` prints them; ``plot_suite`` draws TFLOP/s and memory against N.

Nothing here raises for a case that cannot run: out-of-memory, an unsupported dtype or
mask, a kernel that does not exist in this world — each becomes a row whose ``status``
says so (``ok``, ``oom``, ``oom: predicted …``, ``unsupported: …``, ``skipped: …``).
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from fa_lab.bench import records as recordings
from fa_lab.bench.configs import Shape
from fa_lab.bench.measure import benchmark, plot, to_frame
from fa_lab.bench.peers import PEERS, canonical_name
from fa_lab.bench.timer import CPU_TIMER, GPU_TIMER
from fa_lab.core import registry
from fa_lab.core.dtypes import as_dtype, long_name
from fa_lab.core.flops import attention_flops
from fa_lab.core.world import DEVICE, ON_GPU, WORLD

#: every record has these keys, in this order (CSV column order)
COLUMNS = [
    "suite", "impl", "shape", "batch", "heads", "kv_heads", "n_q", "n_k", "head_dim", "dtype", "mask",
    "causal", "window_left", "window_right", "mode", "status",
    "ms", "ms_p10", "ms_p90", "ms_back_to_back", "flops", "tflops",
    "io_bytes", "peak_extra_bytes", "memory_source", "naive_extra_bytes", "mem_vs_naive",
    "baseline", "speedup", "max_abs_err", "max_abs_err_grad", "world", "device", "timer",
]
MODES = ("fwd", "bwd", "fwd+bwd")
MASKS = ("none", "causal", "window")
#: B·H·Nq·Nk up to which the float64 reference judges each result (its S, P are 3 × 8 bytes each)
CHECK_MAX = 2 ** 28 if ON_GPU else 2 ** 18


def known_impls() -> list[str]:
    """Registered implementations (the book's, in its order) then peers."""
    return list(registry.implementations()) + list(PEERS)


def is_step(impl) -> bool:
    """A chapter's intermediate step (``triton_minimal``, ``numba_smem``, ...) rather than its final kernel."""
    return impl.step_of is not None


def slow_here(impl) -> bool:
    """A kernel the Numba CUDA simulator runs thread by thread in Python: 15-25 s per call at
    (2, 4, 64, 64) on a laptop core, against well under a second for everything else."""
    return not ON_GPU and not impl.host_only and impl.fn.__module__.startswith("fa_lab.kernels.numba.")


def default_impls(*, steps: bool = True, slow: bool = True) -> list[str]:
    """What runs when ``--impl`` is not given: every kernel that runs in this world, then SDPA.

    On a GPU the host-only ones (the float64 reference, NumPy, Numba @njit) are left out:
    they are the CPU story, and at GPU sizes they would take minutes per call.  ``steps=False``
    also leaves out the chapters' intermediate steps; ``slow=False`` the simulator kernels of
    ``slow_here`` (``left_out`` names them).
    """
    ours = [n for n, i in registry.implementations(runnable=True).items()
            if not (ON_GPU and i.host_only) and (steps or not is_step(i)) and (slow or not slow_here(i))]
    peers = [n for n, p in PEERS.items() if WORLD in p.worlds and n != "sdpa"]
    return ours + peers


def left_out(*, steps: bool = True) -> list[str]:
    """The implementations ``default_impls(slow=False)`` leaves out in this world."""
    return [n for n in default_impls(steps=steps) if n not in default_impls(steps=steps, slow=False)]


def device_name() -> str:
    return torch.cuda.get_device_name(0) if ON_GPU else "cpu (Numba CUDA simulator, Triton interpreter)"


def _implementation(name):
    return registry.get(name) if name in registry.implementations() else PEERS[name]


def _model_spec(shape: Shape, dtype, causal, window):
    from fa_lab.core.masks import effective_window, mask_kind

    left, right = effective_window(causal, window)
    kv = shape.kv_heads or shape.heads
    return SimpleNamespace(batch=shape.batch, heads=shape.heads, kv_heads=kv, group=shape.heads // kv,
                           n_q=shape.n_q, n_k=shape.n_k or shape.n_q, head_dim=shape.head_dim,
                           head_dim_v=shape.head_dim, dtype=as_dtype(dtype), causal=causal,
                           window=tuple(window), left=left, right=right, mask=mask_kind(causal, window),
                           device=DEVICE)


def _input_bytes(shape: Shape, dtype) -> int:
    """q, k, v and o."""
    item = torch.empty((), dtype=as_dtype(dtype)).element_size()
    kv = shape.kv_heads or shape.heads
    n_k = shape.n_k or shape.n_q
    return item * shape.batch * shape.head_dim * (2 * shape.heads * shape.n_q + 2 * kv * n_k)


def io_bytes(shape: Shape, dtype, mode: str) -> int:
    """What any implementation must hold: q, k, v, o (and do, dq, dk, dv for a backward)."""
    return _input_bytes(shape, dtype) * (1 if mode == "fwd" else 2)


def _predicted_oom(name, shape, dtype, causal, window, mode) -> str | None:
    """On a GPU, refuse up front what the registry's memory model says cannot fit."""
    if not ON_GPU:
        return None
    impl = _implementation(name)
    if impl.extra_memory is None:
        return None
    need = impl.extra_memory(_model_spec(shape, dtype, causal, window)) * (2 if mode != "fwd" else 1)
    need += 3 * _input_bytes(shape, dtype)   # inputs, outputs, gradients
    free, _ = torch.cuda.mem_get_info()
    if need > 0.9 * free:
        return f"oom: predicted {need / 2**30:.1f} GiB > {free / 2**30:.1f} GiB free (not run)"
    return None


def _shape_key(r):
    return (r["batch"], r["heads"], r["kv_heads"], r["n_q"], r["n_k"], r["head_dim"], r["dtype"],
            r["causal"], r["window_left"], r["window_right"], r["mode"])


def case_key(impl, shape: Shape, dtype, causal: bool, window, mode: str) -> tuple:
    """What names one case of the suite: equal to ``record_key`` of the record it gives."""
    return (canonical_name(impl), shape.batch, shape.heads, shape.kv_heads or shape.heads, shape.n_q,
            shape.n_k or shape.n_q, shape.head_dim, long_name(dtype), causal, window[0], window[1], mode)


def record_key(r: dict) -> tuple:
    """``case_key`` of the case a record measured."""
    return (canonical_name(r["impl"]), *_shape_key(r))


def cases(impls, shapes, *, dtypes=("fp32",), masks=("none",), modes=("fwd",), window=(-1, -1)):
    """Every combination, shape outermost so that one shape's rows sit together."""
    for shape in shapes:
        for dtype in dtypes:
            for mask in masks:
                causal = mask == "causal"
                win = tuple(window) if mask == "window" else (-1, -1)
                for mode in modes:
                    for impl in impls:
                        yield impl, shape, dtype, causal, win, mode


def run_suite(impls, shapes, *, baseline=None, **kwargs) -> list[dict]:
    """Run every case; return records with the columns of ``COLUMNS``.

    Keyword arguments are those of ``iter_suite``.  ``baseline``: the implementation
    ``speedup`` is measured against (default: ``naive_torch`` if it runs, else the first).
    """
    records = list(iter_suite(impls, shapes, baseline=baseline, **kwargs))
    return compare(records, baseline=baseline or ("naive_torch" if "naive_torch" in impls else list(impls)[0]))


def iter_suite(impls, shapes, *, dtypes=("fp32",), masks=("none",), modes=("fwd",), window=(-1, -1),
               baseline=None, warmup=None, rep=None, gpu_ms=None, check=True, max_ms=None, suite="custom",
               progress=True, seed=0, done=frozenset()):
    """Yield one record per case as it is measured (``compare`` fills the cross-row columns).

    ``done``: ``case_key``s of cases measured before (a resumed recording); they are left out.

    ``max_ms``: skip a case whose time, predicted from the same implementation's last
    measured shape scaled by FLOPs, would exceed this many milliseconds per call (sweeps
    stay within a budget; the row says ``skipped``).
    """
    from tqdm import tqdm

    for m in masks:
        if m not in MASKS:
            raise ValueError(f"mask must be one of {MASKS}, got {m!r}")
    for m in modes:
        if m not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {m!r}")
    known = known_impls()
    for name in list(impls) + ([baseline] if baseline else []):
        if name not in known:
            raise ValueError(f"unknown impl {name!r}; known: {', '.join(known)}")
    device = device_name()
    todo = [case for case in cases(impls, shapes, dtypes=dtypes, masks=masks, modes=modes, window=window)
            if case_key(*case) not in done]
    last = {}
    timing = dict(gpu_ms=gpu_ms)
    if warmup is not None:
        timing["warmup"] = warmup
    if rep is not None:
        timing["rep"] = rep
    with tqdm(todo, disable=not progress, desc=f"fa-lab bench ({WORLD})", unit="case") as bar:
        yield from _measure_cases(bar, last, timing, device, suite, seed, check, max_ms)


def _measure_cases(bar, last, timing, device, suite, seed, check, max_ms):
    """``iter_suite``'s loop: one record per case of ``bar``."""
    for impl, shape, dtype, causal, win, mode in bar:
        bar.set_postfix_str(f"{impl} {shape.label} {dtype} {mode}", refresh=False)
        n_k = shape.n_k or shape.n_q
        flops = attention_flops(shape.batch, shape.heads, shape.n_q, n_k, shape.head_dim, causal=causal, mode=mode)
        series = (impl, dtype, causal, win, mode)
        status = _predicted_oom(impl, shape, dtype, causal, win, mode)
        if status is None and max_ms is not None and series in last:
            prev_ms, prev_flops = last[series]
            guess = prev_ms * flops / prev_flops
            if guess > max_ms:
                status = f"skipped: predicted {guess:.0f} ms per call > budget {max_ms:g} ms"
        if status is None:
            rec = benchmark(impl, **shape.kwargs(), dtype=dtype, causal=causal, window=win, mode=mode,
                            seed=seed, check_max=CHECK_MAX if check else None, **timing)
            if rec["status"] == "ok":
                last[series] = (rec["ms"], flops)
        else:
            rec = dict(impl=impl, **{k: v for k, v in shape.kwargs().items()}, status=status)
            rec.update(n_q=shape.n_q, n_k=n_k, kv_heads=shape.kv_heads or shape.heads,
                       dtype=long_name(dtype), causal=causal, mode=mode, world=WORLD)
        rec.update(suite=suite, shape=shape.label, flops=flops, device=device, io_bytes=io_bytes(shape, dtype, mode),
                   mask="window" if tuple(win) != (-1, -1) else ("causal" if causal else "none"),
                   window_left=win[0], window_right=win[1], causal=causal)
        rec.setdefault("timer", GPU_TIMER if ON_GPU else CPU_TIMER)
        yield {c: rec.get(c) for c in COLUMNS}


def compare(records, *, baseline):
    """Fill ``speedup`` (baseline ms / ms) and ``mem_vs_naive``.

    ``mem_vs_naive`` is naive's peak footprint over this one's, each counted as ``io_bytes``
    (q, k, v, o, and gradients for a backward) plus the peak extra memory: "naive needs 40×
    the memory".  (A ratio of extra memory alone divides by ~0 for a fused kernel.)  The naive
    extra memory is ``naive_torch``'s measured peak when it ran on the same case, else the
    registry's model of it (``memory_source`` of that row says which).
    """
    by_key = {}
    for r in records:
        by_key.setdefault(_shape_key(r), {})[r["impl"]] = r
    naive_model = registry.get("naive_torch").extra_memory
    for r in records:
        group = by_key[_shape_key(r)]
        r["baseline"] = baseline
        base = group.get(baseline)
        if r["status"] == "ok" and base is not None and base["status"] == "ok":
            r["speedup"] = base["ms"] / r["ms"]
        naive = group.get("naive_torch")
        if naive is not None and naive["status"] == "ok" and naive["memory_source"] == r["memory_source"]:
            r["naive_extra_bytes"] = naive["peak_extra_bytes"]
        else:
            shape = Shape(r["batch"], r["heads"], r["n_q"], r["head_dim"], r["kv_heads"], r["n_k"])
            r["naive_extra_bytes"] = int(naive_model(_model_spec(shape, r["dtype"], r["causal"],
                                                                  (r["window_left"], r["window_right"]))))
        if r["status"] == "ok" and r["peak_extra_bytes"] is not None and r.get("io_bytes"):
            r["mem_vs_naive"] = (r["io_bytes"] + r["naive_extra_bytes"]) / (r["io_bytes"] + r["peak_extra_bytes"])
    return records


# ----------------------------------------------------------------------------- output

def save(records, path, *, command: str | None = None, **extra) -> tuple[Path, Path]:
    """Write ``path`` as CSV (``.csv``) and as a recording (``.json``, ``fa_lab.bench.records``) beside it."""
    path = Path(path)
    csv_path, json_path = path.with_suffix(".csv"), path.with_suffix(".json")
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    records = list(records)
    to_frame(records).to_csv(csv_path, index=False)
    recordings.write(json_path, records, recordings.metadata(command, **extra))
    return csv_path, json_path


#: the columns ``table`` shows, in order (a column with one value in every row goes to the caption)
TABLE_COLUMNS = ["impl", "shape", "dtype", "mask", "mode", "ms", "spread", "tflops", "peak_extra_bytes",
                 "mem_vs_naive", "speedup", "max_abs_err", "status"]


def why_not(records) -> list[str]:
    """One line per implementation and reason for the cases that did not run:
    ``sdpa-cudnn (2 cases): unsupported: ... runs only on gpu, this is the cpu world``."""
    counts = {}
    for r in records:
        if r["status"] != "ok":
            key = (r["impl"], r["status"])
            counts[key] = counts.get(key, 0) + 1
    return [f"{impl} ({n} case{'s' if n > 1 else ''}): {status}" for (impl, status), n in counts.items()]


def table(records, *, title=None, console=None):
    """Print the measured records as a table as wide as the terminal (``fa_lab.core.tables``: units
    in the headers, 3 significant figures, constant columns said once in the caption), then a line
    for each implementation and reason that left cases unmeasured.  Returns the rich Table (None
    when nothing was measured)."""
    from rich import box
    from rich.console import Console

    from fa_lab.core.tables import rich_table

    records = list(records)
    console = console or Console()   # the terminal's width (COLUMNS where there is no terminal)
    timer = next((r["timer"] for r in records if r.get("timer")), "")
    baseline = next((r["baseline"] for r in records if r.get("baseline")), None)
    # how steady the timing was, as one unitless number (p10 and p90 are in the CSV)
    measured = [dict(r, spread=r["ms_p90"] / r["ms_p10"] if (r.get("ms_p10") or 0) > 0 and r.get("ms_p90") else None)
                for r in records if r["status"] == "ok"]
    t = None
    if measured:
        t = rich_table(measured, title=title or f"fa-lab bench — {device_name()} — {timer}", columns=TABLE_COLUMNS,
                       rename={"impl": "impl", "mem_vs_naive": "memory ÷ naive's", "spread": "p90 ÷ p10"},
                       kinds={"mem_vs_naive": "ratio", "spread": "ratio"},
                       caption=f"speedup vs {baseline}" if baseline else None)
        # no vertical rules: the columns get the room (a bench table is wide)
        t.box, t.show_edge = box.SIMPLE_HEAD, False
        for column in t.columns:   # a narrow terminal folds a long word rather than cutting it off
            column.overflow = "fold"
        # where the terminal has room, neither the names nor a word of a header (a unit: MFLOP/s) is cut;
        # the values fold first
        t.columns[0].no_wrap = True
        whole = [max(len(str(r["impl"])) for r in measured)] + [
            max((len(word) for word in str(c.header).split()), default=1) for c in t.columns[1:]]
        if sum(whole) + 2 * len(whole) <= console.width:
            for column, width in zip(t.columns, whole):
                column.min_width = width
        console.print(t)
    unmeasured = why_not(records)
    if unmeasured:
        console.print("not measured:", markup=False, highlight=False)
        for line in unmeasured:
            console.print("  " + line, markup=False, highlight=False)
    return t


def plot_suite(records, path=None, *, title=None):
    """TFLOP/s and extra memory against N, a line per implementation (and dtype, when several).

    With a single N, a bar chart of p50 per implementation and shape instead.  Saved to
    ``path`` when given; returns the figure.
    """
    import matplotlib

    if path is not None:
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    df = to_frame(records)
    ok = df[df["status"] == "ok"]
    if ok.empty:
        fig, ax = plt.subplots(figsize=(6, 2))
        ax.text(0.5, 0.5, "no successful runs to plot", ha="center", va="center")
        ax.set_axis_off()
    elif ok["n_q"].nunique() > 1:
        fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4))
        series = ok["impl"] + (" " + ok["dtype"] if ok["dtype"].nunique() > 1 else "")
        ok = ok.assign(series=series, extra_mib=ok["peak_extra_bytes"] / 2**20)
        plot(ok.to_dict("records"), x="n_q", y="tflops", hue="series", ax=ax_t, logy=False, title="")
        plot(ok.to_dict("records"), x="n_q", y="extra_mib", hue="series", ax=ax_m, title="")
        ax_t.set(xlabel="sequence length N", ylabel="TFLOP/s")
        ax_m.set(xlabel="sequence length N", ylabel="peak extra memory (MiB)")
        ax_m.get_legend().remove()
    else:
        fig, ax = plt.subplots(figsize=(8, 0.35 * len(ok) + 1.5))
        labels = [f"{r.impl} {r.dtype} {r.mode} {r.shape}" for r in ok.itertuples()]
        ax.barh(labels, ok["ms"], xerr=[ok["ms"] - ok["ms_p10"], ok["ms_p90"] - ok["ms"]], color="tab:blue")
        ax.set_xscale("log")
        ax.set_xlabel("ms (p50, bars p10–p90)")
        ax.invert_yaxis()
    fig.suptitle(title or f"fa-lab bench — {device_name()} ({WORLD} world)", fontsize=10)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig
