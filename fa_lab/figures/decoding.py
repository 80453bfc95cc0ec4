"""Chapter 9's figures and its recording read for the page: decoding with a KV cache.

Four pictures of ideas, each a new Figure in the book's style (``fa_lab.figures.style``):

* ``decode_roofline``  — one-query decoding on the roofline: intensity 2·group·Nq / bytes per element;
* ``split_kv_grid``    — the keys of one row cut into splits, one program each, merged by lse;
* ``wave_efficiency``  — how much of the GPU's program slots S splits keep busy, and the heuristic's S;
* ``paged_cache``      — logical pages of each sequence mapped to blocks of one pool by its block table.

And the recording of ``scripts/bench_ch9.py`` (``gpu_ch9``) as the chapter shows it:
``recorded_summary`` (one row per problem), ``recorded_values`` (the numbers the prose quotes,
``"(not recorded)"`` when there is no recording), ``recorded_bandwidth`` and ``recorded_splits``
(its two plots).
"""
from __future__ import annotations

import math

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from fa_lab.figures.style import (
    CYCLE,
    FONT_SIZE,
    add_arrow,
    add_box,
    add_legend,
    add_text,
    new_canvas,
    new_plot,
    palette,
    style_axes,
    tint,
)

#: what the chapter says where a number would come from a recording that does not exist
NOT_RECORDED = "(not recorded)"


def decode_intensity(group: int, n_q: int, itemsize: int) -> float:
    """FLOP per byte of K and V when ``group`` query heads × ``n_q`` queries share each K/V element read:
    4·D FLOPs per (row, key) against 2·D·itemsize bytes per key."""
    return 2.0 * group * n_q / itemsize


# --------------------------------------------------------------------------- 1. the roofline

def decode_roofline(points=((1, 1), (4, 1), (8, 1), (4, 4)), *, itemsize: int = 2, device: str = "H100",
                    training_intensity: float = 128.0, theme: str = "light") -> Figure:
    """The device's roofline (datasheet fp16 Tensor Cores and HBM) with decoding problems on it.

    ``points`` are ``(group, n_q)`` pairs; the training forward of chapter 6 (``BLOCK_M = 128``,
    no cache: ``2 · BLOCK_M / itemsize`` FLOP per byte) is drawn for comparison.
    """
    from fa_lab.perf.devices import get_device

    th, dev = palette(theme), get_device(device)
    peak, bw = dev.tensor_flops["fp16"] / 1e12, dev.hbm_bandwidth / 1e12
    fig, ax = new_plot(th, (8.6, 4.2))
    x = np.logspace(-1, 4, 200)
    ax.plot(x, np.minimum(peak, bw * x), color=th.ink, linewidth=1.6)
    ax.axvline(dev.ridge, color=th.line, linestyle="--", linewidth=1)
    add_text(ax, dev.ridge * 1.15, 0.35, f"ridge: {dev.ridge:.0f} FLOP/B", th, color="muted", ha="left")
    add_text(ax, 0.13, peak * 1.35, f"{dev.name}: {peak:.0f} TFLOP/s fp16, {bw:.2f} TB/s HBM", th, color="muted",
             ha="left")
    for k, (group, n_q) in enumerate(points):
        i = decode_intensity(group, n_q, itemsize)
        ax.plot([i], [bw * i], "o", color=getattr(th, CYCLE[k % len(CYCLE)]), markersize=8)
        words = "no GQA packing" if group == 1 else f"group {group} packed"
        add_text(ax, i * 1.35, bw * i, f"decode, Nq = {n_q}, {words}: {i:g} FLOP/B", th, ha="left")
    ax.plot([training_intensity], [bw * training_intensity], "s", color=th.ink, markersize=7)
    add_text(ax, training_intensity / 1.35, bw * training_intensity * 1.6,
             f"training tile, BLOCK_M = 128: {training_intensity:g}", th, ha="right")
    ax.set(xscale="log", yscale="log", xlim=(0.1, 1e4), ylim=(0.2, peak * 3))
    style_axes(ax, th, xlabel="arithmetic intensity (FLOP per byte of K and V)", ylabel="TFLOP/s bound",
               title="decoding on the roofline: far below the ridge")
    return fig


# --------------------------------------------------------------------------- 2. split-KV

def split_kv_grid(n_splits: int = 4, tiles_per_split: int = 3, *, theme: str = "light") -> Figure:
    """One query tile's keys in ``n_splits`` splits: a program each writes (o_s, lse_s), a second kernel merges."""
    if n_splits < 1 or tiles_per_split < 1:
        raise ValueError(f"n_splits and tiles_per_split must be >= 1, got {n_splits} and {tiles_per_split}")
    th = palette(theme)
    fig, ax = new_canvas(th, 15.4, 7.3)
    x0, x1 = 1.9, 15.1
    span = (x1 - x0) / n_splits
    tile = (span - 0.3) / tiles_per_split
    add_text(ax, 0.2, 0.4, "split-KV decoding: one query tile against Nk keys, cut into splits", th, ha="left",
             fontweight="bold")
    add_box(ax, 0.2, 1.25, 1.3, 0.75, th, "green", "q tile")
    add_text(ax, 0.85, 2.4, "group × Nq", th, color="muted")
    add_text(ax, 0.85, 2.8, "rows", th, color="muted")
    centres = []
    for s in range(n_splits):
        left = x0 + s * span
        ax.add_patch(Rectangle((left, 1.05), span - 0.1, 1.15, facecolor="none", edgecolor=th.line, linewidth=1,
                               linestyle="--"))
        for t in range(tiles_per_split):
            add_box(ax, left + 0.1 + t * tile, 1.25, tile - 0.1, 0.75, th, "orange",
                    "K, V" if tile > 0.9 else None)
        centre = left + (span - 0.1) / 2
        centres.append(centre)
        add_text(ax, centre, 2.5, f"program: split {s}", th)
        add_arrow(ax, (centre, 2.75), (centre, 3.3), th)
        add_box(ax, centre - 1.2, 3.3, 2.4, 0.75, th, "green", rf"$o_{s}$, $\mathrm{{lse}}_{s}$  (fp32)")
        add_arrow(ax, (centre, 4.05), (7.5 + (centre - 8.5) * 0.35, 4.75), th)
    add_text(ax, x0, 0.85, f"keys 0 … Nk − 1 of one (sequence, K/V head) in HBM, in tiles of BLOCK_N; "
             f"{n_splits} splits of {tiles_per_split} tiles", th, color="muted", ha="left")
    add_box(ax, 2.3, 4.75, 10.4, 0.8, th, "purple",
            r"combine:  $\mathrm{lse} = \log \sum_s e^{\mathrm{lse}_s}$,   "
            r"$o = \sum_s e^{\mathrm{lse}_s - \mathrm{lse}}\, o_s$")
    add_arrow(ax, (7.5, 5.55), (7.5, 6.1), th)
    add_box(ax, 6.0, 6.1, 3.0, 0.75, th, "green", "o, lse of each row")
    add_text(ax, 15.1, 6.5, "a second, small kernel: one program per row", th, color="muted", ha="right")
    return fig


# --------------------------------------------------------------------------- 3. waves

def wave_efficiency(programs=(8, 64), *, sms: int = 132, programs_per_sm: int | None = None, keys: int = 8192,
                    block_n: int = 64, max_splits: int = 24, theme: str = "light") -> Figure:
    """For each grid size without splits, the busy share of the GPU's program slots against the split count,
    the heuristic's choice (``fa_lab.kernels.decode.configs.num_splits_heuristic``) highlighted."""
    from fa_lab.kernels.decode.configs import PROGRAMS_PER_SM, num_splits_heuristic
    from fa_lab.kernels.decode.configs import wave_efficiency as efficiency

    th = palette(theme)
    programs_per_sm = PROGRAMS_PER_SM if programs_per_sm is None else programs_per_sm
    slots = programs_per_sm * sms
    fig, axes = new_plot(th, (4.3 * len(programs), 3.5), ncols=len(programs), squeeze=False)
    for ax, p in zip(axes[0], programs):
        s = np.arange(1, max_splits + 1)
        eff = np.array([efficiency(p * k, slots) for k in s])
        chosen = num_splits_heuristic(p, keys, block_n, sms) if programs_per_sm == PROGRAMS_PER_SM else None
        colours = [tint(th, "green", th.strong) if k == chosen else tint(th, "blue", th.tint) for k in s]
        edges = [th.green if k == chosen else th.blue for k in s]
        ax.bar(s, eff, color=colours, edgecolor=edges, linewidth=0.8)
        ax.axhline(0.85 * eff.max(), color=th.line, linestyle="--", linewidth=1)
        add_text(ax, 0.98, 0.85 * eff.max() - 0.03, "85% of the best", th, color="muted", ha="right",
                 va="top", transform=ax.get_yaxis_transform())
        if chosen is not None:
            add_text(ax, 0.03, 1.13, f"heuristic: S = {chosen} ({p * chosen} programs)", th, ha="left",
                     transform=ax.get_yaxis_transform())
        ax.set(ylim=(0, 1.25), xlim=(0.3, max_splits + 0.7))
        style_axes(ax, th, xlabel="splits S", ylabel="busy share of the waves" if ax is axes[0][0] else "",
                   title=f"{p} programs before splitting")
    fig.suptitle(f"waves of programs on {sms} SMs, {programs_per_sm} resident per SM: {slots} slots", color=th.ink,
                 fontsize=FONT_SIZE)
    return fig


# --------------------------------------------------------------------------- 4. the paged cache

def paged_cache(lengths=(40, 22, 55), page_size: int = 16, n_blocks: int = 12, *, seed: int = 3,
                theme: str = "light") -> Figure:
    """Each sequence's logical pages, its block table, and where the pages live in the pool of blocks."""
    pages = [math.ceil(n / page_size) for n in lengths]
    if sum(pages) > n_blocks:
        raise ValueError(f"{sum(pages)} pages do not fit in {n_blocks} blocks")
    th = palette(theme)
    rng = np.random.default_rng(seed)
    physical = rng.permutation(n_blocks)[:sum(pages)].tolist()
    tables, start = [], 0
    for n in pages:
        tables.append(physical[start:start + n])
        start += n
    cols = 4
    rows = math.ceil(n_blocks / cols)
    height = max(1.5 + 1.1 * len(lengths), 1.5 + 1.0 * rows) + 1.3
    fig, ax = new_canvas(th, 16.4, height)
    add_text(ax, 0.2, 0.4, f"a paged KV cache: pages of {page_size} tokens, anywhere in one pool of blocks", th,
             ha="left", fontweight="bold")
    add_text(ax, 2.8, 1.05, "logical pages → block table entry", th, color="muted", ha="left")
    add_text(ax, 10.6, 1.05, "physical blocks (the cache tensor)", th, color="muted", ha="left")
    where = {}
    for k in range(n_blocks):
        r, c = divmod(k, cols)
        where[k] = (10.6 + c * 1.45, 1.5 + r * 1.0)
    owner = {blk: b for b, table in enumerate(tables) for blk in table}
    for k, (bx, by) in where.items():
        b = owner.get(k)
        if b is None:
            add_box(ax, bx, by, 1.3, 0.7, th, "line", f"{k}: free", dashed=True, fill=False)
        else:
            add_box(ax, bx, by, 1.3, 0.7, th, CYCLE[b % len(CYCLE)], f"block {k}", amount=th.tint)
    for b, (n, table) in enumerate(zip(lengths, tables)):
        y = 1.5 + 1.1 * b
        hue = CYCLE[b % len(CYCLE)]
        add_text(ax, 0.2, y + 0.35, f"seq {b}: {n} tokens", th, ha="left")
        for p, blk in enumerate(table):
            x = 2.8 + p * 1.75
            used = min(page_size, n - p * page_size) / page_size
            ax.add_patch(Rectangle((x, y), 1.5, 0.7, facecolor=th.bg, edgecolor="none"))   # hides the arrows behind
            ax.add_patch(Rectangle((x, y), 1.5 * used, 0.7, facecolor=tint(th, hue, th.strong), edgecolor="none"))
            add_box(ax, x, y, 1.5, 0.7, th, hue, f"p{p} → {blk}", fill=False)
            bx, by = where[blk]
            ax.annotate("", xy=(bx, by + 0.35), xytext=(x + 1.5, y + 0.35), zorder=0.5,
                        arrowprops=dict(arrowstyle="-|>", color=getattr(th, hue), linewidth=0.9, shrinkA=0, shrinkB=0,
                                        alpha=0.6))
    add_text(ax, 0.2, height - 0.75, "key j of sequence b: row j % page_size of block block_table[b, j // page_size]",
             th, ha="left")
    add_text(ax, 0.2, height - 0.3, "only a sequence's last page is partly empty; freed blocks return to the pool",
             th, color="muted", ha="left")
    return fig


# --------------------------------------------------------------------------- the recording, read for the chapter

#: implementations of a recording, in the order the chapter shows them
IMPLS = ("triton_decode", "sdpa-flash", "sdpa-cudnn")


def _shape(r) -> str:
    return f"({r['batch']}, {r['heads']}, {r['kv_heads']}, {r['n_q']}, {r['n_k']}, {r['head_dim']})"


def _placement(r) -> str | None:
    """Where the pages lie in the pool (a recording from before pages were placed two ways: scattered)."""
    if not r.get("page_size"):
        return None
    placement = r.get("placement")
    return placement if isinstance(placement, str) else "scattered"


def _placed(df):
    """``df`` with a ``placement`` column: ``_placement`` of every row."""
    return df.assign(placement=[_placement(r) for r in df.to_dict("records")])


def _layout(r) -> str:
    if not r.get("page_size"):
        return "contiguous"
    return f"paged, {int(r['page_size'])}-token pages, {_placement(r)}"


def _order(ours: dict, first: dict) -> str | None:
    """How ours visited a paged cache's pages: ``pool`` (ascending block number) or ``key`` (the table's order)."""
    if not first.get("page_size"):
        return None
    return "pool" if ours.get("pool_order") is True else "key"


def recorded_summary(df):
    """One row per (dtype, shape, cache layout) of a ``gpu_ch9`` recording's ``decode`` section.

    Columns: ``dtype``, ``shape`` (B, H, Hkv, Nq, Nk, D), ``cache``, ``splits`` and ``order`` (ours: a
    paged cache's pages visited in ``pool`` or ``key`` order), the CUDA-graph GPU time of each
    implementation (``<impl>_us``, or its status), ``key_order_us`` (ours made to keep key order, where it
    chose pool order), ``ours (TB/s)``, the share of the measured copy bandwidth ours reaches, the
    speed-ups over SDPA's backends and the host time per eager call (ours and SDPA flash's).
    """
    import pandas as pd

    rows = []
    dec = _placed(df[df["section"] == "decode"])
    keys = ["dtype", "batch", "heads", "kv_heads", "n_q", "n_k", "head_dim", "page_size", "placement"]
    for key, part in dec.groupby(keys, sort=False, dropna=False):
        first = dict(zip(keys, key))
        by = {r["impl"]: r for r in part.to_dict("records")}
        ours = by.get("triton_decode", {})
        row = dict(dtype=first["dtype"], shape=_shape(first), cache=_layout(first), splits=ours.get("splits"),
                   order=_order(ours, first))
        for impl in IMPLS:
            r = by.get(impl)
            ok = r is not None and r.get("status") == "ok"
            row[f"{impl.replace('-', '_')}_us"] = r["gpu_us"] if ok else (r.get("status") if r else "not run")
        copy = by.get("copy", {})
        if ours.get("status") == "ok" and copy.get("status") == "ok":
            row["ours (TB/s)"] = ours["bandwidth"] / 1e12
            row["of_copy"] = ours["bandwidth"] / copy["bandwidth"]
        for impl in IMPLS[1:]:
            r = by.get(impl, {})
            if ours.get("status") == "ok" and r.get("status") == "ok":
                row[f"vs_{impl.replace('-', '_')}"] = r["gpu_us"] / ours["gpu_us"]
        key_order = by.get("triton_decode_key_order", {})
        if key_order.get("status") == "ok" and ours.get("status") == "ok":
            row["key_order_us"] = key_order["gpu_us"]
        row["ours_host_us"] = ours.get("host_us_per_call")
        row["sdpa_flash_host_us"] = by.get("sdpa-flash", {}).get("host_us_per_call")
        rows.append(row)
    return pd.DataFrame(rows)


def _range(values, fmt) -> str:
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not values:
        return NOT_RECORDED
    lo, hi = min(values), max(values)
    return fmt(lo) if fmt(lo) == fmt(hi) else f"{fmt(lo)}–{fmt(hi)}"


def recorded_values(df=None) -> dict:
    """The numbers the chapter's prose quotes from a ``gpu_ch9`` recording, as text; every one is
    ``NOT_RECORDED`` when ``df`` is None (no recording) or lacks it."""
    names = ("of_copy", "vs_flash", "vs_cudnn", "host_ours", "host_sdpa", "eager_ours", "eager_sdpa", "eager_worst",
             "paged_16", "paged_256", "paged_16_in_order", "paged_splits", "paged_16_key_order",
             "paged_16_in_order_key_order", "paged_16_vs_cudnn", "loop_us", "loop_key_order_us", "copy_tbs",
             "sweep")
    values = dict.fromkeys(names, NOT_RECORDED)
    if df is None or len(df) == 0:
        return values
    s = recorded_summary(df)
    contiguous = s[s["cache"] == "contiguous"]
    pct = lambda v: f"{v:.0%}"  # noqa: E731
    times = lambda v: f"{v:.2f}×"  # noqa: E731
    num = lambda col: [v for v in contiguous.get(col, []) if isinstance(v, (int, float))]  # noqa: E731
    values["of_copy"] = _range(num("of_copy"), pct)
    values["vs_flash"] = _range(num("vs_sdpa_flash"), times)
    values["vs_cudnn"] = _range(num("vs_sdpa_cudnn"), times)
    values["host_ours"] = _range(num("ours_host_us"), lambda v: f"{v:.0f} µs")
    values["host_sdpa"] = _range(num("sdpa_flash_host_us"), lambda v: f"{v:.0f} µs")
    dec = df[(df["section"] == "decode") & (df["status"] == "ok")]
    if "host_us_per_call" in dec:
        # eager wall time per call ÷ CUDA-graph GPU time: near 1 the GPU is the bottleneck, above 1 the host
        eager = dec.assign(ratio=dec["host_us_per_call"] / dec["gpu_us"]).dropna(subset=["ratio"])
        values["eager_ours"] = _range(eager[eager["impl"] == "triton_decode"]["ratio"].tolist(), times)
        values["eager_sdpa"] = _range(eager[eager["impl"] == "sdpa-flash"]["ratio"].tolist(), times)
        ours_eager = eager[eager["impl"] == "triton_decode"]
        if len(ours_eager):
            worst = ours_eager.loc[ours_eager["ratio"].idxmax()]
            values["eager_worst"] = f"{_shape(worst)} in {worst['dtype']} ({_layout(worst)} cache)"
    copies = dec[dec["impl"] == "copy"]["bandwidth"].tolist()
    values["copy_tbs"] = _range([c / 1e12 for c in copies], lambda v: f"{v:.2f} TB/s")
    placed = _placed(dec)
    ours = placed[placed["impl"] == "triton_decode"]
    contiguous_of = lambda impl, r: placed[(placed["impl"] == impl) & (placed["page_size"] == 0)  # noqa: E731
                                          & (placed["dtype"] == r["dtype"]) & (placed["batch"] == r["batch"])
                                          & (placed["n_k"] == r["n_k"])]["gpu_us"].tolist()
    # paged time ÷ our contiguous time, in the order ours chose and in key order
    for name, impl, page, placement in (
            ("paged_16", "triton_decode", 16, "scattered"), ("paged_256", "triton_decode", 256, "scattered"),
            ("paged_16_in_order", "triton_decode", 16, "allocator order"),
            ("paged_16_key_order", "triton_decode_key_order", 16, "scattered"),
            ("paged_16_in_order_key_order", "triton_decode_key_order", 16, "allocator order")):
        ratios = []
        for r in placed[(placed["impl"] == impl) & (placed["page_size"] == page)
                        & (placed["placement"] == placement)].to_dict("records"):
            same = contiguous_of("triton_decode", r)
            if same:
                ratios.append(r["gpu_us"] / same[0])
        values[name] = _range(ratios, times)
    # SDPA cuDNN on the contiguous cache ÷ ours on 16-token scattered pages (SDPA takes no paged cache)
    ratios = []
    for r in ours[(ours["page_size"] == 16) & (ours["placement"] == "scattered")].to_dict("records"):
        cudnn = contiguous_of("sdpa-cudnn", r)
        if cudnn:
            ratios.append(cudnn[0] / r["gpu_us"])
    values["paged_16_vs_cudnn"] = _range(ratios, times)
    # a decoding loop (lengths growing one key per call) on scattered pages: ours, and ours in key order
    loop = df[(df["section"] == "loop") & (df["status"] == "ok")]
    for name, impl in (("loop_us", "triton_decode"), ("loop_key_order_us", "triton_decode_key_order")):
        values[name] = _range(loop[loop["impl"] == impl]["gpu_us"].tolist(), lambda v: f"{v:.1f} µs")
    paged_splits = [int(v) for v in ours[(ours["page_size"] > 0) & (ours["placement"] == "scattered")].get("splits", [])
                    if v == v]
    values["paged_splits"] = _range(paged_splits, str)
    sweep = df[(df["section"] == "splits") & (df["status"] == "ok")]
    said = []
    for _, part in sweep.groupby(["dtype", "batch", "heads", "kv_heads", "n_q", "n_k", "head_dim"], sort=False):
        best = part.loc[part["gpu_us"].idxmin()]
        chosen = part[part["chosen"].astype(bool)]
        if len(chosen):
            c = chosen.iloc[0]
            said.append(f"at {_shape(c)} the heuristic's S = {int(c['num_splits'])} took "
                        f"{c['gpu_us'] / best['gpu_us']:.2f}× the time of the fastest, S = {int(best['num_splits'])}")
    if said:
        values["sweep"] = "; ".join(said)
    return values


def recorded_bandwidth(df, *, label: str = "", theme: str = "light") -> Figure:
    """Bytes of K and V read per second by each implementation, beside the measured copy bandwidth."""
    th = palette(theme)
    dec = df[(df["section"] == "decode") & (df["status"] == "ok")]
    groups = list(dict.fromkeys(f"{r['dtype']} {_shape(r)} {_layout(r)}" for r in dec.to_dict("records")))
    fig, ax = new_plot(th, (11.5, 1.4 + 0.75 * max(len(groups), 1)))
    impls = [i for i in (*IMPLS, "copy") if i in set(dec["impl"])]
    height = 0.8 / max(len(impls), 1)
    for k, impl in enumerate(impls):
        ys, xs = [], []
        for g, group in enumerate(groups):
            r = [r for r in dec[dec["impl"] == impl].to_dict("records") if f"{r['dtype']} {_shape(r)} {_layout(r)}"
                 == group]
            if r:
                ys.append(g - 0.4 + (k + 0.5) * height)
                xs.append(r[0]["bandwidth"] / 1e12)
        hue = CYCLE[k % len(CYCLE)] if impl != "copy" else "line"
        ax.barh(ys, xs, height=height * 0.9, color=tint(th, hue, th.strong) if impl != "copy" else th.line,
                edgecolor=getattr(th, hue), label="device-to-device copy" if impl == "copy" else impl)
    ax.set_yticks(range(len(groups)), groups)
    ax.invert_yaxis()
    style_axes(ax, th, xlabel="TB/s (bytes of K and V read ÷ GPU time; the copy: read + written)",
               title="decoding over a KV cache, recorded" + (f"\n{label}" if label else ""))
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=len(labels), fontsize=FONT_SIZE, facecolor=th.bg,
               edgecolor=th.line, labelcolor=th.ink)
    return fig


def recorded_splits(df, *, theme: str = "light") -> Figure:
    """GPU time of ours against the number of splits (the recording's ``splits`` section), the heuristic's
    choice marked."""
    th = palette(theme)
    sweep = df[(df["section"] == "splits") & (df["status"] == "ok")]
    fig, ax = new_plot(th, (7.5, 3.4))
    for k, (key, part) in enumerate(sweep.groupby(["dtype", "batch", "n_k"], sort=False)):
        part = part.sort_values("num_splits")
        hue = getattr(th, CYCLE[k % len(CYCLE)])
        r = part.iloc[0]
        ax.plot(part["num_splits"], part["gpu_us"], marker="o", color=hue,
                label=f"{r['dtype']} ({r['batch']}, {r['heads']}, {r['kv_heads']}, {r['n_q']}, {r['n_k']}, "
                      f"{r['head_dim']})")
        chosen = part[part["chosen"].astype(bool)]
        ax.plot(chosen["num_splits"], chosen["gpu_us"], marker="*", markersize=15, linestyle="none", color=hue)
    ax.set_xscale("log", base=2)
    ticks = sorted(t for t in set(sweep["num_splits"].astype(int)) if t & (t - 1) == 0)   # powers of two: apart
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    style_axes(ax, th, xlabel="num_splits (★: the heuristic's choice)", ylabel="GPU time (µs)",
               title="ours against the number of splits, recorded")
    add_legend(ax, th)
    return fig
