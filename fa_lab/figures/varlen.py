"""Chapter 8's figures, its length distribution and its recording read for the page: packing, not padding.

The numbers of the chapter's batch:

* ``chapter_lengths`` — the 16 lengths the chapter and ``scripts/bench_ch8.py`` use (``draw_lengths``:
  log-uniform in 128..8192, a fixed seed, written out as ``CHAPTER_LENGTHS``);
* ``padding_ratios`` — what a zero-padded batch computes per unit of real work: tokens
  ``B·max L / Σ L`` and attention ``B·max L² / Σ L²``.

Three pictures of ideas, each a new Figure in the book's style (``fa_lab.figures.style``):

* ``packed_batch``     — a padded batch beside the same sequences packed back to back, with
  ``cu_seqlens`` and the programs (query blocks) that work on each sequence;
* ``block_schedule``   — the schedule: blocks per sequence, their running total, and which program
  owns which block (an empty sequence owns none; the programs past the last block have no work);
* ``attention_waste``  — the score matrices a padded batch computes (``B`` squares of ``max L``)
  against the packed batch's block diagonal (``Σ L²``).

And the recording of ``scripts/bench_ch8.py`` (``gpu_ch8``) as the chapter shows it:
``recorded_summary`` (one row per mask and pass), ``recorded_values`` (the numbers the prose
quotes, ``"(not recorded)"`` without a recording) and ``recorded_times`` (its plot).
"""
from __future__ import annotations

import math

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from fa_lab.figures.style import CYCLE, add_legend, add_text, new_canvas, new_plot, palette, style_axes, tint

#: what the chapter says where a number would come from a recording that does not exist
NOT_RECORDED = "(not recorded)"

#: the chapter's batch: how many sequences, the range of their lengths, the seed of the draw
BATCH, SHORTEST, LONGEST, SEED = 16, 128, 8192, 0
#: ``draw_lengths()``, written out: the batch stays the same whatever NumPy draws on another version
CHAPTER_LENGTHS = (1809, 393, 151, 137, 3768, 5699, 1595, 2659, 1227, 6253, 3808, 129, 4527, 147, 2661, 265)


def draw_lengths(n: int = BATCH, lo: int = SHORTEST, hi: int = LONGEST, seed: int = SEED) -> list[int]:
    """``n`` sequence lengths drawn log-uniformly from ``[lo, hi]``: as many sequences of a few hundred
    tokens as of a few thousand, the long tail of a real corpus, reproducible from ``seed``."""
    rng = np.random.default_rng(seed)
    return [int(x) for x in np.exp(rng.uniform(math.log(lo), math.log(hi), n)).astype(np.int64)]


def chapter_lengths() -> list[int]:
    """The chapter's 16 lengths (``CHAPTER_LENGTHS``), the ones ``scripts/bench_ch8.py`` records."""
    return list(CHAPTER_LENGTHS)


def padding_ratios(lengths) -> dict:
    """``tokens``: positions a batch padded to the longest sequence holds per real token, ``B·max L / Σ L``;
    ``attention``: the same for the score matrices, ``B·max L² / Σ L²`` (both 1.0 when all lengths agree)."""
    lengths = [int(n) for n in lengths]
    if not lengths or sum(lengths) == 0:
        raise ValueError(f"need at least one real token, got lengths {lengths}")
    longest = max(lengths)
    return dict(tokens=len(lengths) * longest / sum(lengths),
                attention=len(lengths) * longest ** 2 / sum(n * n for n in lengths))


def _hue(th, b: int) -> str:
    return CYCLE[b % len(CYCLE)]


# --------------------------------------------------------------------------- 1. padded and packed

def packed_batch(lengths=(6, 13, 0, 9, 3), block_m: int = 4, *, theme: str = "light") -> Figure:
    """The same sequences as a padded ``(B, max L)`` batch and packed as ``(total, ...)`` with ``cu_seqlens``;
    below the packed rows, the programs of ``block_m`` rows each and the sequence each one works on."""
    lengths = [int(n) for n in lengths]
    if block_m < 1 or not lengths or min(lengths) < 0 or sum(lengths) == 0:
        raise ValueError(f"need block_m >= 1 and lengths >= 0 with a real token, got {lengths}, {block_m}")
    th = palette(theme)
    B, longest, total = len(lengths), max(lengths), sum(lengths)
    cu = [0, *np.cumsum(lengths).tolist()]
    cell = min(0.55, 16.0 / max(total, 1))
    width = max(3.2 + total * cell, 3.2 + longest * 0.55) + 0.6
    top = 1.2
    height = top + B * 0.6 + 4.6
    fig, ax = new_canvas(th, width, height)
    add_text(ax, 0.2, 0.45, f"padded: B × max L = {B} × {longest} = {B * longest} positions for {total} tokens",
             th, ha="left", fontweight="bold")
    for b, n in enumerate(lengths):
        y = top + b * 0.6
        add_text(ax, 2.9, y + 0.25, f"seq {b}  (L = {n})", th, ha="right")
        for t in range(longest):
            real = t < n
            ax.add_patch(Rectangle((3.2 + t * 0.55, y), 0.5, 0.5, linewidth=0.8,
                                   facecolor=tint(th, _hue(th, b), th.strong) if real else th.bg,
                                   edgecolor=getattr(th, _hue(th, b)) if real else th.line,
                                   hatch=None if real else "///"))
    y0 = top + B * 0.6 + 0.7
    add_text(ax, 0.2, y0, f"packed: (total, H, D) with total = Σ L = {total}; cu_seqlens = {cu}", th, ha="left",
             fontweight="bold")
    y1 = y0 + 0.5
    for b, n in enumerate(lengths):
        for t in range(n):
            ax.add_patch(Rectangle((3.2 + (cu[b] + t) * cell, y1), cell * 0.92, 0.5, linewidth=0.6,
                                   facecolor=tint(th, _hue(th, b), th.strong), edgecolor=getattr(th, _hue(th, b))))
    for c in sorted(set(cu)):   # one tick per distinct offset: an empty sequence shares its neighbour's
        x = 3.2 + c * cell
        ax.plot([x, x], [y1 - 0.1, y1 + 0.65], color=th.ink, linewidth=1)
        repeats = cu.count(c)
        add_text(ax, x, y1 + 0.95, f"{c}" + (f" (×{repeats})" if repeats > 1 else ""), th, fontsize=9)
    add_text(ax, 2.9, y1 + 0.95, "cu_seqlens", th, ha="right")
    add_text(ax, 2.9, y1 + 0.25, "tokens", th, ha="right")
    y2 = y1 + 1.55
    add_text(ax, 2.9, y2 + 0.25, f"programs (BLOCK_M = {block_m})", th, ha="right")
    pid = 0
    for b, n in enumerate(lengths):
        for m0 in range(0, n, block_m):
            rows = min(block_m, n - m0)
            ax.add_patch(Rectangle((3.2 + (cu[b] + m0) * cell, y2), rows * cell - 0.06, 0.5, linewidth=1.0,
                                   facecolor=tint(th, _hue(th, b)), edgecolor=getattr(th, _hue(th, b))))
            add_text(ax, 3.2 + (cu[b] + m0 + rows / 2) * cell, y2 + 0.25, f"p{pid}", th, fontsize=8)
            pid += 1
    add_text(ax, 0.2, y2 + 1.05, f"{pid} programs, one per block of each sequence: a sequence's last block is "
             "partly empty, an empty sequence has none, no block spans two sequences", th, color="muted", ha="left")
    return fig


# --------------------------------------------------------------------------- 2. the schedule

def block_schedule(lengths=(40, 9, 0, 33, 16), block_m: int = 16, *, theme: str = "light") -> Figure:
    """Blocks per sequence, their running total ``cu_blocks`` and the program ids it hands out; the
    grid's bound ``(Σ L + B·(BLOCK_M − 1)) // BLOCK_M`` leaves a few programs with no work."""
    lengths = [int(n) for n in lengths]
    if block_m < 1 or not lengths or min(lengths) < 0:
        raise ValueError(f"need block_m >= 1 and lengths >= 0, got {lengths}, {block_m}")
    th = palette(theme)
    B = len(lengths)
    blocks = [-(-n // block_m) for n in lengths]
    cu_blocks = [0, *np.cumsum(blocks).tolist()]
    programs = (sum(lengths) + B * (block_m - 1)) // block_m
    col = 1.25
    width = 4.2 + max(B + 1, programs) * col + 0.4
    fig, ax = new_canvas(th, width, 8.4)
    add_text(ax, 0.2, 0.45, f"the schedule: one program per block of BLOCK_M = {block_m} rows", th, ha="left",
             fontweight="bold")
    rows = (("sequence b", [f"{b}" for b in range(B)]), ("length L_b", [f"{n}" for n in lengths]),
            ("blocks ⌈L_b / BLOCK_M⌉", [f"{k}" for k in blocks]))
    for r, (name, cells) in enumerate(rows):
        y = 1.1 + r * 0.75
        add_text(ax, 3.9, y + 0.3, name, th, ha="right")
        for b, text in enumerate(cells):
            ax.add_patch(Rectangle((4.2 + b * col, y), col - 0.1, 0.6, facecolor=tint(th, _hue(th, b)),
                                   edgecolor=getattr(th, _hue(th, b)), linewidth=1,
                                   linestyle="--" if lengths[b] == 0 else "-"))
            add_text(ax, 4.2 + b * col + (col - 0.1) / 2, y + 0.3, text, th)
    y = 1.1 + 3 * 0.75
    add_text(ax, 4.2 - col / 2 - 0.15, y + 0.3, "cu_blocks", th, ha="right")
    for i, c in enumerate(cu_blocks):
        ax.add_patch(Rectangle((4.2 + i * col - col / 2 + 0.05, y), col - 0.1, 0.6, facecolor=th.bg,
                               edgecolor=th.ink, linewidth=1))
        add_text(ax, 4.2 + i * col, y + 0.3, f"{c}", th)
    yp = 5.3
    add_text(ax, 3.9, yp + 0.3, "program id p", th, ha="right")
    add_text(ax, 3.9, yp + 1.05, "(sequence, block)", th, ha="right")
    for p in range(programs):
        x = 4.2 + p * col
        if p < cu_blocks[-1]:
            b = max(i for i in range(B) if cu_blocks[i] <= p)
            hue, label = _hue(th, b), f"({b}, {p - cu_blocks[b]})"
            ax.add_patch(Rectangle((x, yp), col - 0.1, 0.6, facecolor=tint(th, hue, th.strong),
                                   edgecolor=getattr(th, hue), linewidth=1))
        else:
            label = "(−1, ·)"
            ax.add_patch(Rectangle((x, yp), col - 0.1, 0.6, facecolor=th.bg, edgecolor=th.line, linewidth=1,
                                   hatch="///"))
        add_text(ax, x + (col - 0.1) / 2, yp + 0.3, f"{p}", th)
        add_text(ax, x + (col - 0.1) / 2, yp + 1.05, label, th, fontsize=8)
    for b in range(B):   # each sequence's first program: cu_blocks[b]
        if blocks[b]:
            first = 4.2 + cu_blocks[b] * col + (col - 0.1) / 2
            ax.annotate("", xy=(first, yp - 0.05), xytext=(4.2 + b * col, y + 0.65),
                        arrowprops=dict(arrowstyle="-|>", color=getattr(th, _hue(th, b)), linewidth=1.1,
                                        shrinkA=0, shrinkB=0))
    add_text(ax, 0.2, 7.3, "program p works on sequence b = the last b with cu_blocks[b] ≤ p (an empty sequence "
             "is skipped: the next one starts at the same id), block p − cu_blocks[b]", th, ha="left")
    add_text(ax, 0.2, 7.9, f"grid: (Σ L + B·(BLOCK_M − 1)) // BLOCK_M = {programs} programs ≥ Σ blocks = "
             f"{cu_blocks[-1]}, known without reading the lengths; the rest return at once", th, color="muted",
             ha="left")
    return fig


# --------------------------------------------------------------------------- 3. the quadratic waste

def attention_waste(lengths=None, *, theme: str = "light") -> Figure:
    """Left: the ``B`` score matrices of a batch padded to ``max L`` (the real ``L_b × L_b`` corner coloured).
    Right: the packed batch's block diagonal, one ``L_b × L_b`` block per sequence, nothing else computed."""
    lengths = [int(n) for n in (chapter_lengths() if lengths is None else lengths)]
    th = palette(theme)
    B, longest, total = len(lengths), max(lengths), sum(lengths)
    r = padding_ratios(lengths)
    fig, (left, right) = new_plot(th, (10.5, 5.0), ncols=2)
    cols = math.ceil(math.sqrt(B))
    rows_ = math.ceil(B / cols)
    gap = 0.08 * longest
    for b, n in enumerate(lengths):
        x0, y0 = (b % cols) * (longest + gap), (b // cols) * (longest + gap)
        left.add_patch(Rectangle((x0, y0), longest, longest, facecolor=th.bg, edgecolor=th.line, hatch="///",
                                 linewidth=0.6))
        left.add_patch(Rectangle((x0, y0), n, n, facecolor=tint(th, _hue(th, b), th.strong),
                                 edgecolor=getattr(th, _hue(th, b)), linewidth=0.8))
    left.set(xlim=(-gap, cols * (longest + gap)), ylim=(rows_ * (longest + gap), -gap), aspect="equal")
    left.set_xticks([])
    left.set_yticks([])
    style_axes(left, th, title=f"padded: {B} × max L² (hatched: padding)")
    start = 0
    for b, n in enumerate(lengths):
        right.add_patch(Rectangle((start, start), n, n, facecolor=tint(th, _hue(th, b), th.strong),
                                  edgecolor=getattr(th, _hue(th, b)), linewidth=0.8))
        start += n
    right.add_patch(Rectangle((0, 0), total, total, facecolor="none", edgecolor=th.line, linewidth=0.8))
    right.set(xlim=(0, total), ylim=(total, 0), aspect="equal")
    right.set_xticks([0, total], ["0", f"{total}"])
    right.set_yticks([0, total], ["0", f"{total}"])
    style_axes(right, th, xlabel="packed keys", ylabel="packed queries", title="packed: Σ L² on the diagonal")
    fig.suptitle(f"{B} sequences, L from {min(lengths)} to {longest}: tokens × {r['tokens']:.2f}, "
                 f"scores × {r['attention']:.2f} when padded", color=th.ink, fontsize=10)
    return fig


# --------------------------------------------------------------------------- the recording, read for the chapter

#: implementations of a recording's ``step`` section, in the order the chapter shows them
IMPLS = ("varlen", "sdpa-flash-padded", "sdpa-nested", "flash_triton-fixed", "varlen-fixed")


def recorded_summary(df):
    """One row per (dtype, causal, mode) of a ``gpu_ch8`` recording's ``step`` section.

    Columns: ``dtype``, ``causal``, ``mode``, each implementation's time (``<impl>_ms``, or its status),
    ``varlen_tflops`` on the real FLOPs, ``padded_tflops`` (the padded SDPA on the FLOPs it computes),
    ``vs_padded`` and ``vs_nested`` (their time over ours), ``fixed_tflops`` (our fixed-length kernel at
    its comparable shape) and ``of_fixed`` (ours over it).
    """
    import pandas as pd

    rows = []
    step = df[df["section"] == "step"]
    for key, part in step.groupby(["dtype", "causal", "mode"], sort=False):
        by = {r["impl"]: r for r in part.to_dict("records")}
        ok = {n: r for n, r in by.items() if r.get("status") == "ok"}
        row = dict(zip(("dtype", "causal", "mode"), key))
        for impl in IMPLS:
            r = by.get(impl)
            row[f"{impl}_ms"] = r["ms"] if impl in ok else (r.get("status") if r else "not run")
        ours = ok.get("varlen")
        if ours:
            row["varlen_tflops"] = ours["tflops"]
        if "sdpa-flash-padded" in ok:
            row["padded_tflops"] = ok["sdpa-flash-padded"]["tflops_computed"]
        if ours and "sdpa-flash-padded" in ok:
            row["vs_padded"] = ok["sdpa-flash-padded"]["ms"] / ours["ms"]
        if ours and "sdpa-nested" in ok:
            row["vs_nested"] = ok["sdpa-nested"]["ms"] / ours["ms"]
        if "flash_triton-fixed" in ok:
            row["fixed_tflops"] = ok["flash_triton-fixed"]["tflops"]
            if ours:
                row["of_fixed"] = ours["tflops"] / ok["flash_triton-fixed"]["tflops"]
        rows.append(row)
    return pd.DataFrame(rows)


def _range(values, fmt) -> str:
    values = [v for v in values if isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v))]
    if not values:
        return NOT_RECORDED
    lo, hi = min(values), max(values)
    return fmt(lo) if fmt(lo) == fmt(hi) else f"{fmt(lo)}–{fmt(hi)}"


def recorded_values(df=None) -> dict:
    """The numbers the chapter's prose quotes from a ``gpu_ch8`` recording, as text; every one is
    ``NOT_RECORDED`` when ``df`` is None (no recording) or lacks it.  Training steps (``fwd+bwd``) only."""
    names = ("vs_padded", "vs_nested", "varlen_tflops", "fixed_tflops", "of_fixed", "padded_tflops",
             "nested_causal")
    values = dict.fromkeys(names, NOT_RECORDED)
    if df is None or len(df) == 0 or "section" not in df:
        return values
    s = recorded_summary(df)
    if len(s) == 0:
        return values
    train = s[s["mode"] == "fwd+bwd"]
    times = lambda v: f"{v:.2f}×"  # noqa: E731
    rate = lambda v: f"{v:.0f} TFLOP/s"  # noqa: E731
    col = lambda name: list(train[name]) if name in train else []  # noqa: E731
    values["vs_padded"] = _range(col("vs_padded"), times)
    values["vs_nested"] = _range(col("vs_nested"), times)
    values["varlen_tflops"] = _range(col("varlen_tflops"), rate)
    values["fixed_tflops"] = _range(col("fixed_tflops"), rate)
    values["of_fixed"] = _range(col("of_fixed"), lambda v: f"{v:.0%}")
    values["padded_tflops"] = _range(col("padded_tflops"), rate)
    nested = df[(df["section"] == "step") & (df["impl"] == "sdpa-nested") & (df["causal"].astype(bool))]
    if len(nested):
        statuses = set(nested["status"])
        values["nested_causal"] = "ran" if statuses == {"ok"} else "was refused"
    return values


def recorded_times(df, *, label: str = "", theme: str = "light") -> Figure:
    """Time of one training step (and forward) of each implementation on the chapter's batch, recorded."""
    th = palette(theme)
    step = df[(df["section"] == "step") & (df["status"] == "ok") & (df["impl"].isin(IMPLS[:3]))]
    groups = list(dict.fromkeys(f"{r['mode']}, {'causal' if r['causal'] else 'no mask'}"
                                for r in step.to_dict("records")))
    fig, ax = new_plot(th, (10.5, 0.9 + 0.8 * max(len(groups), 1)))
    impls = [i for i in IMPLS[:3] if i in set(step["impl"])]
    height = 0.8 / max(len(impls), 1)
    words = {"varlen": "packed (ours)", "sdpa-flash-padded": "SDPA flash, zero-padded", "sdpa-nested":
             "SDPA on nested (jagged) tensors"}
    for k, impl in enumerate(impls):
        ys, xs = [], []
        for g, group in enumerate(groups):
            r = [r for r in step[step["impl"] == impl].to_dict("records")
                 if f"{r['mode']}, {'causal' if r['causal'] else 'no mask'}" == group]
            if r:
                ys.append(g - 0.4 + (k + 0.5) * height)
                xs.append(r[0]["ms"])
        hue = CYCLE[k % len(CYCLE)]
        ax.barh(ys, xs, height=height * 0.9, color=tint(th, hue, th.strong), edgecolor=getattr(th, hue),
                label=words.get(impl, impl))
    ax.set_yticks(range(len(groups)), groups)
    ax.invert_yaxis()
    style_axes(ax, th, xlabel="ms (median of interleaved rounds)",
               title="the chapter's batch, recorded" + (f": {label}" if label else ""))
    add_legend(ax, th, loc="center left", bbox_to_anchor=(1.01, 0.5))   # beside the bars, never over them
    return fig
