"""Chapter 10's figures and its recording read for the page: score modifications and masks.

Four pictures of ideas, each a new Figure in the book's style (``fa_lab.figures.style``):

* ``softcap_row``       — ``cap·tanh(s/cap)`` and its slope, and one row of scores before and after the cap;
* ``alibi_biases``      — ALiBi's bias ``-slope·|i + Nk - Nq - j|`` of a few heads, the causal mask over it;
* ``score_mod_cost``    — what one score costs the forward loop, per SM and clock, on each unit
                          (the Tensor Cores, the special-function unit, the FP32 pipe), from a device preset;
* ``block_mask_tiles``  — the tiles of a mask classified empty / partial / full, as a block mask does.

And the recording of ``scripts/bench_ch10.py`` (``gpu_ch10``) as the chapter shows it:
``recorded_summary`` (one row per problem), ``recorded_values`` (the numbers the prose quotes,
``"(not recorded)"`` when there is no recording) and ``recorded_tflops`` (its plot).
"""
from __future__ import annotations

import math

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from fa_lab.figures.style import CYCLE, add_legend, add_text, new_plot, palette, style_axes, tint

#: what the chapter says where a number would come from a recording that does not exist
NOT_RECORDED = "(not recorded)"

#: a row of scaled scores with two outliers (the picture's example)
EXAMPLE_SCORES = (3.0, -1.5, 8.0, 12.0, -6.0, 2.0, 64.0, 5.0, -3.0, 41.0, 0.5, 9.0, -12.0, 7.0, 1.0, 15.0)


def softcap(s, cap: float):
    """``cap·tanh(s/cap)`` (``cap = 0``: no cap)."""
    s = np.asarray(s, dtype=np.float64)
    return s if cap <= 0 else cap * np.tanh(s / cap)


def _softmax(s):
    e = np.exp(s - s.max())
    return e / e.sum()


# --------------------------------------------------------------------------- 1. the soft cap

def softcap_row(scores=EXAMPLE_SCORES, cap: float = 30.0, *, theme: str = "light") -> Figure:
    """Left: ``cap·tanh(s/cap)`` against ``s`` and its slope ``1 − tanh²``; right: one row of scores before
    and after the cap, and the softmax weights of each."""
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    th = palette(theme)
    s = np.asarray(scores, dtype=np.float64)
    fig, (left, right) = new_plot(th, (11.5, 4.2), ncols=2, width_ratios=(1, 1.35))
    x = np.linspace(-3 * cap, 3 * cap, 401)
    left.plot(x, x, color=th.line, linestyle=":", label="no cap: $s$")
    left.plot(x, softcap(x, cap), color=th.blue, linewidth=2.2, label=rf"$c = {cap:g}\,\tanh(s/{cap:g})$")
    for y in (cap, -cap):
        left.axhline(y, color=th.line, linewidth=0.8, linestyle="--")
    add_text(left, -2.9 * cap, cap * 1.12, f"+cap = {cap:g}", th, color="muted", ha="left")
    slope = left.twinx()
    slope.plot(x, 1 - np.tanh(x / cap) ** 2, color=th.purple, linewidth=1.6,
               label=r"slope $dc/ds = 1 - (c/\mathrm{cap})^2$")
    slope.set_ylim(0, 2.1)
    slope.tick_params(colors=th.purple)
    slope.set_ylabel("slope (the backward's factor)", color=th.purple)
    left.set_ylim(-2.1 * cap, 2.1 * cap)
    lines = left.get_lines()[:2] + slope.get_lines()
    left.legend(lines, [ln.get_label() for ln in lines], loc="upper left", fontsize=9, facecolor=th.bg,
                edgecolor=th.line, labelcolor=th.ink)
    style_axes(left, th, xlabel="scaled score s", ylabel="capped score c", title="the soft cap")
    for spine in slope.spines.values():
        spine.set_color(th.line)

    j = np.arange(s.size)
    capped = softcap(s, cap)
    right.bar(j - 0.2, s, width=0.4, color=tint(th, "orange", th.strong), edgecolor=th.orange, label="s (raw)")
    right.bar(j + 0.2, capped, width=0.4, color=tint(th, "blue", th.strong), edgecolor=th.blue,
              label=f"c (cap {cap:g})")
    right.axhline(cap, color=th.line, linewidth=0.8, linestyle="--")
    weights = right.twinx()
    p_raw, p_cap = _softmax(s), _softmax(capped)
    weights.plot(j, p_raw, "o", color=th.orange, markersize=6, label="softmax weight, raw")
    weights.plot(j, p_cap, "s", color=th.blue, markersize=5, label="softmax weight, capped")
    weights.set_ylim(0, 1.6)
    weights.set_ylabel("softmax weight", color=th.ink)
    weights.tick_params(colors=th.ink)
    for spine in weights.spines.values():
        spine.set_color(th.line)
    top = int(np.argmax(s))
    add_text(right, top + 0.45, s[top], f"largest weight\n{p_raw.max():.2f} → {p_cap.max():.2f}", th, ha="left",
             va="top")
    right.set_ylim(min(s.min(), 0) * 1.3, s.max() * 1.35)
    handles = right.containers[:2] + weights.get_lines()
    right.legend(handles, [h.get_label() for h in handles], loc="upper right", fontsize=9, ncols=2,
                 facecolor=th.bg, edgecolor=th.line, labelcolor=th.ink)
    style_axes(right, th, xlabel="key j", ylabel="score", title="one row of scores, before and after the cap")
    return fig


# --------------------------------------------------------------------------- 2. ALiBi

def alibi_bias_matrix(n_q: int, n_k: int, slope: float) -> np.ndarray:
    """``-slope·|i + Nk − Nq − j|``, shape ``(n_q, n_k)`` (bottom-right aligned, as the reference)."""
    i = np.arange(n_q)[:, None] + (n_k - n_q)
    j = np.arange(n_k)[None, :]
    return -slope * np.abs(i - j).astype(np.float64)


def alibi_biases(n_q: int = 10, n_k: int = 16, n_heads: int = 8, heads=(1, 4, 8), *, causal: bool = True,
                 theme: str = "light") -> Figure:
    """ALiBi's bias for a few heads (1-based ``heads`` of ``n_heads``, Press et al.'s slopes): one heat map
    each, the keys a causal row does not see left blank, each query's own position outlined."""
    from fa_lab.exercises.ch10 import slopes_list

    slopes = slopes_list(n_heads)
    if not heads or any(not 1 <= h <= n_heads for h in heads):
        raise ValueError(f"heads are 1-based head numbers in 1..{n_heads}, got {heads!r}")
    th = palette(theme)
    fig, axes = new_plot(th, (3.6 * len(heads) + 0.8, 3.9), ncols=len(heads))
    axes = np.atleast_1d(axes)
    for ax, h in zip(axes, heads):
        bias = alibi_bias_matrix(n_q, n_k, slopes[h - 1])
        if causal:
            hidden = np.arange(n_k)[None, :] > np.arange(n_q)[:, None] + (n_k - n_q)
            bias = np.where(hidden, np.nan, bias)
        image = ax.imshow(bias, cmap="viridis", vmin=-(n_k - 1) * slopes[0], vmax=0, aspect="auto")
        rows = np.arange(n_q)   # the key each query sits at: distance 0
        ax.plot(rows + (n_k - n_q), rows, "s", markerfacecolor="none", markeredgecolor=th.orange, markersize=6)
        style_axes(ax, th, xlabel="key j", ylabel="query i" if h == heads[0] else "",
                   title=f"head {h} of {n_heads}: slope 2^{math.log2(slopes[h - 1]):.3g} = {slopes[h - 1]:.3g}")
    colorbar = fig.colorbar(image, ax=list(axes), shrink=0.85)
    colorbar.set_label("bias added to the score", color=th.ink)
    colorbar.ax.tick_params(colors=th.ink)
    add_text(axes[0], -0.5, n_q + 1.4, f"Nq = {n_q}, Nk = {n_k}: query i sits at key i + {n_k - n_q} (squares)", th,
             color="muted", ha="left", va="top")
    return fig


# --------------------------------------------------------------------------- 3. what a score costs

#: instructions per score of the forward loop besides the two products, by where they run: the special-function
#: unit (exp2, tanh, reciprocal) and the FP32 pipe (multiply, add, max, compare, convert); estimates from the
#: loop body, the same for every head dim
SCORE_WORK = {
    "none": dict(sfu=1, fp32=4, words="exp2; scale-and-subtract FMA, row max, row sum, P to 16 bits"),
    "ALiBi": dict(sfu=1, fp32=7, words="+ the distance: subtract, absolute value, multiply-add"),
    "softcap, tanh.approx": dict(sfu=2, fp32=6, words="+ one hardware tanh, two multiplies"),
    "softcap, exp2 + reciprocal": dict(sfu=3, fp32=8, words="+ tanh(x) = 1 − 2/(1 + 2^(2x·log2 e))"),
}


def score_costs(head_dim: int = 128, device: str = "H100_80GB", dtype: str = "bf16") -> list[dict]:
    """Clock cycles one SM spends per score on each unit, for each variant of ``SCORE_WORK``.

    Tensor Cores: the ``4·D`` FLOPs of ``S = QKᵀ`` and ``PV`` at the preset's peak per SM and clock; the
    special-function unit at ``sfu_per_clk_per_sm``; the FP32 pipe at half the CUDA-core FLOP/s (an FMA is 2).
    ``bound`` is the busiest unit (the units overlap at best), ``vs_none`` its ratio to the plain loop's.
    """
    from fa_lab.perf.devices import get_device

    dev = get_device(device)
    per_clk = dev.sm_count * dev.boost_clock_mhz * 1e6
    tensor = 4 * head_dim / (dev.tensor_flops[dtype] / per_clk)
    fp32_rate = dev.cuda_flops["fp32"] / 2 / per_clk
    rows = []
    for name, work in SCORE_WORK.items():
        units = dict(tensor=tensor, sfu=work["sfu"] / dev.sfu_per_clk_per_sm, fp32=work["fp32"] / fp32_rate)
        rows.append(dict(variant=name, head_dim=head_dim, **units, bound=max(units, key=units.get),
                         cycles=max(units.values()), words=work["words"]))
    base = rows[0]["cycles"]
    for r in rows:
        r["vs_none"] = r["cycles"] / base
    return rows


def score_mod_cost(head_dims=(64, 128), device: str = "H100_80GB", *, theme: str = "light") -> Figure:
    """Per score and SM: cycles on the Tensor Cores, the special-function unit and the FP32 pipe, per variant."""
    from fa_lab.perf.devices import get_device

    th = palette(theme)
    fig, axes = new_plot(th, (5.2 * len(head_dims) + 0.6, 3.8), ncols=len(head_dims), sharey=True)
    axes = np.atleast_1d(axes)
    units = (("tensor", "Tensor Cores: 4·D FLOPs", "green"), ("sfu", "special-function unit", "purple"),
             ("fp32", "FP32 pipe", "sky"))
    for ax, d in zip(axes, head_dims):
        rows = score_costs(d, device)
        y = np.arange(len(rows))
        for k, (key, label, hue) in enumerate(units):
            ax.barh(y + (k - 1) * 0.26, [r[key] for r in rows], height=0.24, color=tint(th, hue, th.strong),
                    edgecolor=getattr(th, hue), label=label)
        for yy, r in zip(y, rows):
            add_text(ax, r["cycles"] * 1.04, yy, f"{r['vs_none']:.2f}×", th, ha="left", color="muted")
        ax.set_yticks(y, [r["variant"] for r in rows])
        ax.invert_yaxis()
        ax.set_xlim(0, max(r["cycles"] for r in rows) * 1.3)
        style_axes(ax, th, xlabel="clock cycles per score per SM", title=f"D = {d}: busiest unit vs the plain loop")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncols=3, fontsize=10,
               facecolor=th.bg, edgecolor=th.line, labelcolor=th.ink)
    fig.suptitle(f"what one score costs the forward loop, per SM ({get_device(device).name}, datasheet rates)",
                 color=th.ink, fontsize=10)
    return fig


# --------------------------------------------------------------------------- 4. block masks

EMPTY, PARTIAL, FULL = 0, 1, 2


def classify_blocks(mask_mod, n_q: int, n_k: int, block_m: int, block_n: int) -> np.ndarray:
    """``(cdiv(n_q, block_m), cdiv(n_k, block_n))`` ints: ``EMPTY`` (no visible pair: skipped), ``FULL`` (every
    pair of the tile, inside the problem, visible: no mask needed) or ``PARTIAL``; ``mask_mod(i, j)`` takes
    broadcastable integer arrays and says which pairs are visible."""
    i = np.arange(n_q)[:, None]
    j = np.arange(n_k)[None, :]
    ok = np.broadcast_to(np.asarray(mask_mod(i, j), dtype=bool), (n_q, n_k))
    rows, cols = math.ceil(n_q / block_m), math.ceil(n_k / block_n)
    out = np.empty((rows, cols), dtype=np.int64)
    for r in range(rows):
        for c in range(cols):
            tile = ok[r * block_m:(r + 1) * block_m, c * block_n:(c + 1) * block_n]
            out[r, c] = FULL if tile.all() else PARTIAL if tile.any() else EMPTY
    return out


def _document_mod(lengths):
    doc = np.repeat(np.arange(len(lengths)), lengths)
    return lambda i, j: (doc[i] == doc[j]) & (j <= i)


def block_mask_tiles(n: int = 256, block: int = 32, window: int = 64, documents=(96, 40, 120), *,
                     theme: str = "light") -> Figure:
    """Three masks on an ``n × n`` problem in ``block × block`` tiles: causal, a causal sliding window, causal
    documents packed back to back; each tile empty (skipped), partial (mask computed) or full (no mask)."""
    if sum(documents) != n:
        raise ValueError(f"the documents' lengths must add up to n = {n}, got {documents!r}")
    th = palette(theme)
    masks = [("causal", lambda i, j: j <= i),
             (f"sliding window of {window}", lambda i, j: (j <= i) & (j >= i - window)),
             (f"documents {', '.join(map(str, documents))}, causal", _document_mod(documents))]
    fig, axes = new_plot(th, (12.5, 5.3), ncols=3)
    colours = {EMPTY: th.bg, PARTIAL: tint(th, "orange", th.strong), FULL: tint(th, "green", th.strong)}
    for ax, (title, mod) in zip(axes, masks):
        kinds = classify_blocks(mod, n, n, block, block)
        i, j = np.arange(n)[:, None], np.arange(n)[None, :]
        ax.imshow(np.asarray(mod(i, j), dtype=float), cmap="Greys", vmin=0, vmax=3, extent=(0, n, n, 0))
        for r in range(kinds.shape[0]):
            for c in range(kinds.shape[1]):
                ax.add_patch(Rectangle((c * block, r * block), block, block, facecolor=colours[kinds[r, c]],
                                       edgecolor=th.line, linewidth=0.6, alpha=0.6))
        counts = {k: int((kinds == k).sum()) for k in (EMPTY, PARTIAL, FULL)}
        ax.set(xlim=(0, n), ylim=(n, 0))
        style_axes(ax, th, xlabel="key j", ylabel="query i" if ax is axes[0] else "",
                   title=f"{title}\n{counts[FULL]} full, {counts[PARTIAL]} partial, {counts[EMPTY]} skipped "
                         f"of {kinds.size} tiles")
    handles = [Patch(facecolor=colours[FULL], edgecolor=th.line, label="full: no mask_mod"),
               Patch(facecolor=colours[PARTIAL], edgecolor=th.line, label="partial: mask_mod on every score"),
               Patch(facecolor=colours[EMPTY], edgecolor=th.line, label="empty: never loaded")]
    fig.legend(handles=handles, loc="outside lower center", ncols=3, fontsize=10, facecolor=th.bg,
               edgecolor=th.line, labelcolor=th.ink)
    return fig


# --------------------------------------------------------------------------- the recording

#: implementations of a recording, in the order the chapter shows them
IMPLS = ("triton_varlen", "flash_triton", "flex-attention", "sdpa")
MODS = ("none", "softcap", "alibi")


def recorded_summary(df):
    """One row per (mode, causal, modification) of a ``gpu_ch10`` recording: each implementation's TFLOP/s
    (or its status), the time of ours relative to ours without a modification, and ours over each peer."""
    import pandas as pd

    rows = []
    ok = df[df["status"] == "ok"]
    for (mode, causal, mod), part in df.groupby(["mode", "causal", "mod"], sort=False):
        by = {r["impl"]: r for r in part.to_dict("records")}
        row = dict(mode=mode, causal=bool(causal), mod=mod)
        for impl in IMPLS:
            r = by.get(impl)
            if r is None:
                continue
            row[impl] = r["tflops"] if r.get("status") == "ok" else str(r.get("status")).split(":")[0]
        ours = by.get("triton_varlen", {})
        base = ok[(ok["impl"] == "triton_varlen") & (ok["mode"] == mode) & (ok["causal"] == causal)
                  & (ok["mod"] == "none")]
        if ours.get("status") == "ok" and len(base):
            row["time vs none"] = ours["ms"] / base["ms"].iloc[0]
        for impl in IMPLS[1:]:
            r = by.get(impl, {})
            if ours.get("status") == "ok" and r.get("status") == "ok":
                row[f"ours / {impl}"] = r["ms"] / ours["ms"]
        flex = by.get("flex-attention", {})
        if flex.get("compile_s") is not None:
            row["flex compile (s)"] = flex["compile_s"]
        rows.append(row)
    return pd.DataFrame(rows)


def _range(values, fmt) -> str:
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not values:
        return NOT_RECORDED
    lo, hi = min(values), max(values)
    return fmt(lo) if fmt(lo) == fmt(hi) else f"{fmt(lo)}–{fmt(hi)}"


def recorded_values(df=None) -> dict:
    """The numbers the chapter's prose quotes from a ``gpu_ch10`` recording, as text; every one is
    ``NOT_RECORDED`` when ``df`` is None (no recording) or lacks it.

    ``<mod>_<mode>``: the time of ours with the modification over ours without (``softcap_fwd``, ...);
    ``vs_flex_<mode>``, ``vs_sdpa_alibi_<mode>``: the peer's time over ours; ``ours_tflops``: ours, forward,
    every modification; ``flex_compile``: seconds to compile FlexAttention's kernels; ``part1_vs_varlen``:
    chapter 4's kernel's time over ours with no modification (forward).
    """
    names = [f"{m}_{x}" for m in ("softcap", "alibi") for x in ("fwd", "fwdbwd")]
    names += [f"{p}_{x}" for p in ("vs_flex", "vs_sdpa_alibi") for x in ("fwd", "fwdbwd")]
    names += ["ours_tflops", "flex_compile", "part1_vs_varlen"]
    values = dict.fromkeys(names, NOT_RECORDED)
    if df is None or len(df) == 0:
        return values
    s = recorded_summary(df)
    times = lambda v: f"{v:.2f}×"  # noqa: E731
    for mode, key in (("fwd", "fwd"), ("fwd+bwd", "fwdbwd")):
        part = s[s["mode"] == mode]
        for mod in ("softcap", "alibi"):
            values[f"{mod}_{key}"] = _range(part[part["mod"] == mod].get("time vs none", []), times)
        values[f"vs_flex_{key}"] = _range(part.get("ours / flex-attention", []), times)
        values[f"vs_sdpa_alibi_{key}"] = _range(part[part["mod"] == "alibi"].get("ours / sdpa", []), times)
    ok = df[(df["status"] == "ok") & (df["impl"] == "triton_varlen") & (df["mode"] == "fwd")]
    values["ours_tflops"] = _range(ok["tflops"].tolist(), lambda v: f"{v:.0f} TFLOP/s")
    if "compile_s" in df:
        values["flex_compile"] = _range(df["compile_s"].dropna().tolist(), lambda v: f"{v:.0f} s")
    fwd_none = s[(s["mode"] == "fwd") & (s["mod"] == "none")]
    values["part1_vs_varlen"] = _range(fwd_none.get("ours / flash_triton", []), times)
    return values


def recorded_tflops(df, *, label: str = "", theme: str = "light") -> Figure:
    """TFLOP/s of each implementation per modification, one panel per (mode, mask)."""
    th = palette(theme)
    ok = df[df["status"] == "ok"]
    panels = list(dict.fromkeys((r["mode"], bool(r["causal"])) for r in df.to_dict("records")))
    fig, axes = new_plot(th, (4.2 * max(len(panels), 1) + 0.6, 3.8), ncols=max(len(panels), 1), sharey=True)
    axes = np.atleast_1d(axes)
    impls = [i for i in IMPLS if i in set(df["impl"])]
    width = 0.8 / max(len(impls), 1)
    for ax, (mode, causal) in zip(axes, panels):
        part = ok[(ok["mode"] == mode) & (ok["causal"] == causal)]
        for k, impl in enumerate(impls):
            xs, ys = [], []
            for m, mod in enumerate(MODS):
                r = part[(part["impl"] == impl) & (part["mod"] == mod)]
                if len(r):
                    xs.append(m - 0.4 + (k + 0.5) * width)
                    ys.append(float(r["tflops"].iloc[0]))
            hue = CYCLE[k % len(CYCLE)]
            ax.bar(xs, ys, width=width * 0.9, color=tint(th, hue, th.strong), edgecolor=getattr(th, hue),
                   label=impl if ax is axes[0] else None)
        ax.set_xticks(range(len(MODS)), MODS)
        style_axes(ax, th, xlabel="score modification", ylabel="TFLOP/s" if ax is axes[0] else "",
                   title=f"{mode}, {'causal' if causal else 'no mask'}")
    if impls:
        add_legend(axes[0], th, loc="lower left")
    fig.suptitle("score modifications, recorded" + (f": {label}" if label else ""), color=th.ink, fontsize=10)
    return fig
