"""Chapter 11's reading of its Nsight Compute recording (``fa_lab.perf.ncu``), and its two figures.

* ``kernel_flops``     — the matrix-product FLOPs a launch's kernel does, in the book's convention;
* ``traffic``          — DRAM and L2 bytes measured beside chapter 6's counts for the same problem;
* ``naive_vs_tiled``   — chapter 3's measured DRAM bytes of ``numba_naive`` against ``numba_tiled``;
* ``roofline_points``  — each launch on the roofline: FLOPs per DRAM byte and per L2 byte, FLOP/s;
* ``sass_loops``       — the hot loop's Tensor Core instructions and exponentials against what the
  algorithm needs per iteration;
* ``roofline_figure``, ``stall_figure`` — the pictures;
* ``device_of``        — the device preset of the GPU the recording was made on;
* ``recorded_values``  — every number the prose quotes, as text, ``"(not recorded)"`` without a recording.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from fa_lab.figures.style import CYCLE, add_legend, add_text, new_plot, palette, style_axes, tint
from fa_lab.perf.ncu import NOT_RECORDED, bound

#: matrix products per (query, key) tile each kernel computes: S = QKᵀ and PV in a forward; the backward's
#: dK/dV kernel (plain or through descriptors) recomputes S and computes dP = dO Vᵀ, dV and dK, its dQ kernel
#: recomputes S and dP and computes dQ
MATMULS = {"attn_fwd": 2, "flash_attention_fwd": 2, "decode_split_kv": 2, "bwd_dkdv": 4, "bwd_dkdv_ws": 4,
           "bwd_dq": 3, "combine_kernel": 0}
#: the forward problem the chapter profiles, (B, H, N, D) in bf16 (``scripts/profile_ncu.py``'s ``fwd``)
FWD_SHAPE = (4, 16, 4096, 128)
#: how the chapter names each launch
LABELS = {("fwd", "attn_fwd"): "Triton forward", ("fwd_causal", "attn_fwd"): "Triton forward, causal",
          ("bwd_causal", "bwd_dkdv"): "backward dK/dV (plain), causal",
          ("bwd_causal", "bwd_dkdv_ws"): "backward dK/dV, causal",
          ("bwd_causal", "bwd_dq"): "backward dQ, causal",
          ("numba_tiled", "flash_attention_fwd"): "Numba tiled (fp32)", ("decode", "decode_split_kv"): "decode",
          ("decode", "combine_kernel"): "decode merge"}


def label(case: str, kernel: str) -> str:
    return LABELS.get((case, kernel), f"{case} {kernel}")


def config(row) -> dict:
    """A launch's configuration, as the recording stores it (JSON text)."""
    cfg = row.get("config") if hasattr(row, "get") else None
    try:
        return json.loads(cfg) if isinstance(cfg, str) else dict(cfg or {})
    except ValueError:
        return {}


def kernel_flops(row) -> float:
    """Matrix-product FLOPs of one launch: ``MATMULS`` products of ``2·Nq·Nk·D`` per (batch, head), halved
    under a causal mask with Nq = Nk (``fa_lab.core.flops``'s convention)."""
    from fa_lab.core.flops import attention_flops

    per_product = attention_flops(int(row["batch"]), int(row["heads"]), int(row["n_q"]), int(row["n_k"]),
                                  int(row["head_dim"]), causal=bool(row["causal"])) / 2
    return MATMULS.get(row["kernel"], 0) * per_product


def model_counts(row):
    """Chapter 6's counts (``fa_lab.perf.model``) for a forward launch, with its tile shape; None for the
    backward kernels (the model counts FlashAttention-2's one-kernel backward, not these two) and the merge."""
    from fa_lab.perf.model import Problem, flash_forward_counts

    cfg = config(row)
    blocks = {"attn_fwd": ("BLOCK_M", "BLOCK_N"), "flash_attention_fwd": ("block_m", "block_n"),
              "decode_split_kv": (None, "BLOCK_N")}.get(row["kernel"])
    if blocks is None:
        return None
    problem = Problem(int(row["batch"]), int(row["heads"]), int(row["n_q"]), int(row["n_k"]), int(row["head_dim"]),
                      kv_heads=int(row["kv_heads"]), mask="causal" if row["causal"] else "none", dtype=row["dtype"])
    block_m = int(cfg.get(blocks[0], 1)) if blocks[0] else max(1, int(row["n_q"]))
    return flash_forward_counts(problem, block_m=block_m, block_n=int(cfg.get(blocks[1], 64)))


def traffic(launches: pd.DataFrame, device) -> pd.DataFrame:
    """Per forward launch: bytes measured (DRAM read + written, through L2) beside chapter 6's counts —
    ``compulsory`` (each input read once, each output written once), ``streamed`` (every tile a program
    loads from DRAM: no cache) and ``predicted`` (``roofline.predict``'s L2 estimate between the two)."""
    from fa_lab.perf.roofline import predict

    rows = []
    for _, r in launches.iterrows():
        counts = model_counts(r)
        if counts is None:
            continue
        rows.append(dict(launch=label(r["case"], r["kernel"]), dram_bytes=r["dram_bytes"], l2_bytes=r["l2_bytes"],
                         l2_hit_pct=r["l2_hit_pct"], compulsory_bytes=counts.compulsory_bytes,
                         streamed_bytes=counts.hbm_bytes,
                         predicted_bytes=predict(counts, device, bytes_model="l2").dram_bytes,
                         dram_vs_compulsory=r["dram_bytes"] / counts.compulsory_bytes))
    return pd.DataFrame(rows)


def naive_vs_tiled(measured: pd.DataFrame | None) -> dict:
    """Chapter 3's measured DRAM bytes (``gpu_ch3_hbm``, no mask) of ``numba_naive``, which writes S and P to
    HBM, and of ``numba_tiled``, which does not: ``naive_gb``, ``tiled_gb`` and ``naive_x``, as text."""
    out = dict.fromkeys(("naive_gb", "tiled_gb", "naive_x"), NOT_RECORDED)
    if measured is None or "dram__bytes_read.sum" not in measured:
        return out
    full = measured[~measured["causal"].astype(bool)].set_index("impl")
    dram = full["dram__bytes_read.sum"] + full["dram__bytes_write.sum"]
    if {"numba_naive", "numba_tiled"} <= set(dram.index):
        naive, tiled = dram["numba_naive"], dram["numba_tiled"]
        out.update(naive_gb=f"{naive / 1e9:.0f} GB", tiled_gb=f"{tiled / 1e9:.2f} GB", naive_x=f"{naive / tiled:.0f}×")
    return out


def roofline_points(launches: pd.DataFrame) -> pd.DataFrame:
    """Per launch that multiplies matrices: its FLOPs, time, FLOP/s, and FLOPs per DRAM byte and per L2 byte."""
    rows = []
    for _, r in launches.iterrows():
        flops = kernel_flops(r)
        if flops <= 0 or not r["duration_s"] > 0:
            continue
        rows.append(dict(launch=label(r["case"], r["kernel"]), case=r["case"], kernel=r["kernel"], flops=flops,
                         duration_s=r["duration_s"], flop_rate=flops / r["duration_s"],
                         intensity_dram=flops / r["dram_bytes"], intensity_l2=flops / r["l2_bytes"],
                         unit="cuda" if r["dtype"] == "float32" else "tensor",
                         bound=bound(r["sm_pct"], r["memory_pct"])))
    return pd.DataFrame(rows)


def sass_loops(profile, launches: pd.DataFrame) -> pd.DataFrame:
    """The hot loop of each kernel whose SASS was kept: its instructions, Tensor Core instructions and
    exponentials per pass; for the forward, what one iteration needs — the FLOPs of ``S = QKᵀ`` and ``PV``
    for one warpgroup's rows, and one exponential per score element per thread — and so how many iterations
    a pass holds and the exponentials per score."""
    if profile is None or profile.sass.empty:
        return pd.DataFrame()
    rows = []
    for _, s in profile.sass.iterrows():
        hit = launches[(launches["case"] == s["case"]) & (launches["kernel"] == s["kernel"])]
        row = dict(launch=label(s["case"], s["kernel"]), loop_instructions=s["loop_instructions"],
                   hgmma=s["loop_hgmma"], mufu_ex2=s["loop_mufu_ex2"], ffma=s["loop_ffma"])
        cfg = config(hit.iloc[0]) if len(hit) else {}
        if s["kernel"] == "attn_fwd" and {"BLOCK_M", "BLOCK_N", "num_warps"} <= set(cfg):
            bm, bn, warps, d = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_warps"], int(hit.iloc[0]["head_dim"])
            rows_per_warpgroup = bm / max(1, warps // 4)
            row["mma_flops_needed"] = 2 * 2 * rows_per_warpgroup * bn * d
            row["mma_flops_issued"] = s["loop_mma_flops"]
            row["scores_per_thread"] = bm * bn / (32 * warps)
            # a loop body the compiler unrolled holds several iterations: its work is a whole multiple.
            # Anything else is a span over more than one loop (a causal kernel's unmasked and diagonal
            # loops have different tiles): no iteration count, nothing per score
            ratio = s["loop_mma_flops"] / row["mma_flops_needed"]
            whole = ratio >= 0.5 and abs(ratio - round(ratio)) < 0.01
            row["iterations"] = round(ratio) if whole else math.nan
            row["ex2_per_score"] = s["loop_mufu_ex2"] / (row["scores_per_thread"] * ratio) if whole else math.nan
            row["emu"] = bool(cfg.get("emu"))
        rows.append(row)
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------- figures

def roofline_figure(points: pd.DataFrame, device="H100", *, theme: str = "light") -> Figure:
    """The device's roofs (bf16 Tensor Cores, fp32 CUDA cores, HBM) with each launch at its measured FLOP/s:
    a filled marker at its FLOPs per DRAM byte, a hollow one at its FLOPs per byte through L2."""
    from fa_lab.perf.devices import get_device

    th, dev = palette(theme), get_device(device)
    tensor, cuda, bw = dev.tensor_flops["bf16"] / 1e12, dev.cuda_flops["fp32"] / 1e12, dev.hbm_bandwidth / 1e12
    fig, ax = new_plot(th, (8.6, 4.8))
    x = np.logspace(-1, 5, 300)
    ax.plot(x, np.minimum(tensor, bw * x), color=th.ink, linewidth=1.6)
    ax.plot(x[x * bw >= cuda], np.full((x * bw >= cuda).sum(), cuda), color=th.muted, linewidth=1.2, linestyle="--")
    add_text(ax, 0.13, tensor * 1.45, f"{dev.name}: {tensor:.0f} TFLOP/s bf16 Tensor Cores, {bw:.2f} TB/s HBM", th,
             color="muted", ha="left")
    add_text(ax, 2e4, cuda * 1.4, f"fp32 CUDA cores: {cuda:.0f} TFLOP/s", th, color="muted", ha="center")
    for k, p in enumerate(points.itertuples()):
        hue = getattr(th, CYCLE[k % len(CYCLE)])
        y = p.flop_rate / 1e12
        ax.plot([p.intensity_dram, p.intensity_l2], [y, y], color=hue, linewidth=1, alpha=0.7)
        ax.plot([p.intensity_dram], [y], "o", color=hue, markersize=8, label=p.launch)
        ax.plot([p.intensity_l2], [y], "o", markerfacecolor=tint(th, "bg", 1.0), markeredgecolor=hue, markersize=8)
    ax.set(xscale="log", yscale="log", xlim=(0.1, 1e5), ylim=(0.1, tensor * 3))
    style_axes(ax, th, xlabel="FLOP per byte (filled: DRAM bytes, hollow: bytes through L2)",
               ylabel="TFLOP/s measured", title="the profiled launches on the roofline")
    add_legend(ax, th, loc="lower right")
    return fig


def stall_figure(stalls: pd.DataFrame, *, top: int = 6, theme: str = "light") -> Figure:
    """Horizontal stacked bars, one per launch: how the warp cycles between two issued instructions split
    by stall reason (the ``top`` largest over all launches, the rest as 'other'), with their total."""
    th = palette(theme)
    stalls = stalls.assign(launch=[label(c, k) for c, k in zip(stalls["case"], stalls["kernel"])])
    order = stalls.groupby("reason")["share"].sum().sort_values(ascending=False).index[:top].tolist()
    table = stalls.assign(reason=stalls["reason"].where(stalls["reason"].isin(order), "other")) \
        .pivot_table(index="launch", columns="reason", values="cycles", aggfunc="sum", sort=False).fillna(0.0)
    table = table[[c for c in [*order, "other"] if c in table]]
    totals = table.sum(axis=1)
    fig, ax = new_plot(th, (8.6, 0.5 * len(table) + 2.4))
    left = np.zeros(len(table))
    for k, reason in enumerate(table.columns):
        share = (table[reason] / totals).to_numpy()
        hue = th.line if reason == "other" else getattr(th, CYCLE[k % len(CYCLE)])
        ax.barh(range(len(table)), share, left=left, color=hue, label=reason.replace("_", " "), height=0.6)
        left += share
    for i, total in enumerate(totals):
        add_text(ax, 1.02, i, f"{total:.1f} cycles", th, ha="left", color="muted")
    ax.set_yticks(range(len(table)), table.index)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.25)
    ax.set_xticks([0, 0.25, 0.5, 0.75, 1.0], ["0", "25%", "50%", "75%", "100%"])
    style_axes(ax, th, xlabel="share of the warp cycles between two issued instructions",
               title="where the warps' cycles go")
    add_legend(ax, th, loc="upper center", bbox_to_anchor=(0.45, -0.16), ncol=4)
    return fig


# --------------------------------------------------------------------------- the numbers the prose quotes

def _pct(v) -> str:
    """A percentage as the prose quotes it, rounded half up (12.5% reads 13%, as a reader rounds)."""
    return NOT_RECORDED if v is None or not math.isfinite(v) else f"{math.floor(v + 0.5):.0f}%"


#: the units the speed-of-light section reports apart, by their column
MEMORY_UNITS = {"dram_pct": "DRAM", "l2_pct": "L2", "l1_pct": "L1/TEX"}


def busiest_memory(row) -> str:
    """Which of DRAM, L2 and L1/TEX ran nearest its peak in a launch."""
    known = {name: row[col] for col, name in MEMORY_UNITS.items() if row[col] == row[col]}
    return max(known, key=known.get) if known else NOT_RECORDED


def scores(row) -> float:
    """Score elements a forward launch computes in the FLOP convention (half the matrix under a causal mask)."""
    return kernel_flops(row) / (MATMULS[row["kernel"]] * 2 * int(row["head_dim"]))


#: every name ``recorded_values`` gives, and so every number the chapter can quote
VALUES = ("label", "ncu_version", "fwd_time", "fwd_tflops", "fwd_sm", "fwd_mem", "fwd_dram", "fwd_l2", "fwd_bound",
          "fwd_bound_gap", "fwd_mem_unit", "fwd_tensor_pipe", "causal_bound", "bwd_bound", "bwd_sm", "bwd_mem",
          "dq_bound", "numba_bound", "numba_sm", "numba_mem_pipes", "numba_fma_pipe", "numba_mem_unit", "numba_l1",
          "numba_dram", "numba_tflops", "numba_of_peak", "decode_bound", "decode_dram", "decode_programs", "sms",
          "fwd_dram_mb", "fwd_compulsory_mb", "fwd_dram_x", "fwd_streamed_gb", "fwd_l2_gb", "fwd_l2_over_dram",
          "fwd_l2_of_streamed", "fwd_l2_hit", "fwd_resident", "fwd_resident_heads", "decode_dram_x", "decode_l2_hit",
          "fwd_intensity", "fwd_intensity_l2", "decode_intensity", "decode_intensity_l2", "ridge", "fwd_cpi",
          "fwd_top_reason", "fwd_top_share", "fwd_second_reason", "fwd_second_share", "fwd_issue", "fwd_eligible",
          "fwd_stages", "decode_cpi", "decode_top_reason", "decode_top_share", "decode_long_share", "decode_stages",
          "decode_warps", "numba_top_reason", "numba_second_reason", "numba_issue", "numba_eligible", "fwd_regs",
          "fwd_blocks", "fwd_limiter", "fwd_next_limit", "fwd_theoretical", "fwd_achieved", "bwd_regs",
          "bwd_warps", "bwd_blocks", "bwd_limiter", "bwd_theoretical", "fwd_hgmma", "fwd_mma_ratio", "fwd_ex2",
          "fwd_scores", "fwd_ex2_extra", "fwd_ex2_per_score", "causal_emu", "fwd_xu_per_score", "causal_xu_per_score",
          "fwd_fma_pipe", "causal_fma_pipe", "bwd_top_reason", "bwd_top_share", "bwd_loop_bar", "bwd_loop_tma")


def device_of(profile):
    """The device preset of the GPU ``profile`` was recorded on (``perf.devices``): its roofs and L2 are the
    ones the chapter compares the counters with.  The H100 where there is no recording or no preset."""
    from fa_lab.perf.devices import get_device, preset_for

    return (preset_for(profile.meta.get("device")) if profile is not None else None) or get_device("H100")


def _points(gap: float) -> str:
    """A gap between two percentages, in percentage points: '1 point', '9 points'."""
    return f"{gap:.0f} point{'' if round(gap) == 1 else 's'}"


def recorded_values(profile, device=None) -> dict:
    """Every number the chapter quotes, as text; ``NOT_RECORDED`` where the recording lacks it.  ``device``
    (a preset or its name) defaults to the recording's own (``device_of``)."""
    from fa_lab.perf.devices import get_device

    values = dict.fromkeys(VALUES, NOT_RECORDED)
    # the model's facts of the chapter's forward problem, recorded or not
    from fa_lab.perf.model import Problem, flash_forward_counts

    B, H, N, D = FWD_SHAPE
    dev = get_device(device or device_of(profile))
    kv_head = flash_forward_counts(Problem(B, H, N, head_dim=D, dtype="bf16")).phases[0].l2_working_set
    values["kv_head"] = f"{kv_head / 2**20:.0f} MiB"
    values["l2_size"] = f"{dev.l2_bytes / 2**20:.0f} MiB"
    values["ridge"] = f"{dev.ridge:.0f}"
    if profile is None:
        return values
    from fa_lab.bench import records as recorded

    launches = profile.launches()
    values["label"] = recorded.label(profile.meta)
    values["ncu_version"] = str(profile.meta.get("ncu_version") or NOT_RECORDED)

    def one(case, kernel, table=launches):
        """``table``'s row of one launch (the launches, or the SASS loop counts), None if it has none."""
        if table.empty:
            return None
        hit = table[(table["case"] == case) & (table["kernel"] == kernel)]
        return hit.iloc[0] if len(hit) else None

    fwd, causal = one("fwd", "attn_fwd"), one("fwd_causal", "attn_fwd")
    dkdv = one("bwd_causal", "bwd_dkdv_ws")
    dkdv = one("bwd_causal", "bwd_dkdv") if dkdv is None else dkdv
    numba, dec, dq = one("numba_tiled", "flash_attention_fwd"), one("decode", "decode_split_kv"), \
        one("bwd_causal", "bwd_dq")
    for key, r in (("fwd", fwd), ("causal", causal), ("bwd", dkdv), ("dq", dq), ("numba", numba), ("decode", dec)):
        if r is not None:
            values[f"{key}_bound"] = bound(r["sm_pct"], r["memory_pct"])
    for key, r in (("fwd", fwd), ("causal", causal)):
        if r is not None and r["xu_instructions"] == r["xu_instructions"]:
            # per thread: one warp instruction does the work of 32 threads
            values[f"{key}_xu_per_score"] = f"{r['xu_instructions'] * 32 / scores(r):.2f}"
        if r is not None:
            values[f"{key}_fma_pipe"] = _pct(r["fma_pipe_pct"])
    if causal is not None and config(causal):
        values["causal_emu"] = "on" if config(causal).get("emu") else "off"
    if fwd is not None:
        cfg = config(fwd)
        resident = fwd["blocks_per_sm"] * fwd["sms"]
        values.update(fwd_time=f"{fwd['duration_s'] * 1e6:.0f} µs",
                      fwd_tflops=f"{kernel_flops(fwd) / fwd['duration_s'] / 1e12:.0f} TFLOP/s",
                      fwd_sm=_pct(fwd["sm_pct"]), fwd_mem=_pct(fwd["memory_pct"]), fwd_dram=_pct(fwd["dram_pct"]),
                      fwd_l2=_pct(fwd["l2_pct"]), fwd_l2_hit=_pct(fwd["l2_hit_pct"]),
                      fwd_bound_gap=_points(abs(fwd["sm_pct"] - fwd["memory_pct"])),
                      fwd_mem_unit=busiest_memory(fwd), fwd_tensor_pipe=_pct(fwd["tensor_pipe_pct"]),
                      fwd_cpi=f"{fwd['warp_cycles_per_issue']:.1f}", fwd_regs=f"{fwd['registers']:.0f}",
                      fwd_blocks=f"{fwd['blocks_per_sm']:.0f}", fwd_limiter=fwd["limiter"] or NOT_RECORDED,
                      fwd_theoretical=_pct(fwd["theoretical_occupancy_pct"]),
                      fwd_achieved=_pct(fwd["achieved_occupancy_pct"]), fwd_issue=_pct(fwd["issue_busy_pct"]),
                      fwd_eligible=f"{fwd['eligible_warps']:.1f}", sms=f"{fwd['sms']:.0f}",
                      fwd_resident=f"{resident:.0f}")
        if "num_stages" in cfg:
            values["fwd_stages"] = str(cfg["num_stages"])
        if "BLOCK_M" in cfg:     # the query blocks of one head are next to each other in the grid
            values["fwd_resident_heads"] = f"{resident / (int(fwd['n_q']) / cfg['BLOCK_M']):.0f}"
        others = sorted((fwd[c], name) for c, name in (("limit_registers", "registers"),
                                                       ("limit_shared", "shared memory"), ("limit_warps", "warps"))
                        if fwd[c] == fwd[c] and fwd[c] > fwd["blocks_per_sm"])
        if others:
            values["fwd_next_limit"] = f"{others[0][1]} would allow {others[0][0]:.0f}"
    if numba is not None:
        values.update(numba_sm=_pct(numba["sm_pct"]), numba_mem_pipes=_pct(numba["mem_pipes_pct"]),
                      numba_fma_pipe=_pct(numba["fma_pipe_pct"]), numba_mem_unit=busiest_memory(numba),
                      numba_l1=_pct(numba["l1_pct"]), numba_dram=_pct(numba["dram_pct"]),
                      numba_issue=_pct(numba["issue_busy_pct"]), numba_eligible=f"{numba['eligible_warps']:.1f}")
        rate = kernel_flops(numba) / numba["duration_s"]
        values.update(numba_tflops=f"{rate / 1e12:.0f} TFLOP/s",
                      numba_of_peak=_pct(100 * rate / dev.cuda_flops["fp32"]))
    if dkdv is not None:
        values.update(bwd_regs=f"{dkdv['registers']:.0f}", bwd_warps=f"{dkdv['threads'] / 32:.0f}",
                      bwd_blocks=f"{dkdv['blocks_per_sm']:.0f}",
                      bwd_limiter=dkdv["limiter"] or NOT_RECORDED, bwd_sm=_pct(dkdv["sm_pct"]),
                      bwd_mem=_pct(dkdv["memory_pct"]), bwd_theoretical=_pct(dkdv["theoretical_occupancy_pct"]))
    if dec is not None:
        values.update(decode_dram=_pct(dec["dram_pct"]), decode_l2_hit=_pct(dec["l2_hit_pct"]),
                      decode_programs=f"{dec['blocks']:.0f}", decode_cpi=f"{dec['warp_cycles_per_issue']:.1f}",
                      decode_warps=f"{dec['achieved_warps']:.0f}")
        if "num_stages" in config(dec):
            values["decode_stages"] = str(config(dec)["num_stages"])
    moved = traffic(launches, dev).set_index("launch") if len(launches) else pd.DataFrame()
    if label("fwd", "attn_fwd") in moved.index:
        t = moved.loc[label("fwd", "attn_fwd")]
        values.update(fwd_dram_mb=f"{t['dram_bytes'] / 1e6:.0f} MB",
                      fwd_compulsory_mb=f"{t['compulsory_bytes'] / 1e6:.0f} MB",
                      fwd_dram_x=f"{t['dram_vs_compulsory']:.2f}×",
                      fwd_streamed_gb=f"{t['streamed_bytes'] / 1e9:.1f} GB", fwd_l2_gb=f"{t['l2_bytes'] / 1e9:.1f} GB",
                      fwd_l2_over_dram=f"{t['l2_bytes'] / t['dram_bytes']:.0f}×",
                      fwd_l2_of_streamed=f"{t['l2_bytes'] / t['streamed_bytes']:.2f}×")
    if label("decode", "decode_split_kv") in moved.index:
        values["decode_dram_x"] = f"{moved.loc[label('decode', 'decode_split_kv'), 'dram_vs_compulsory']:.2f}×"
    points = roofline_points(launches).set_index("launch") if len(launches) else pd.DataFrame()
    for key, case, kernel in (("fwd", "fwd", "attn_fwd"), ("decode", "decode", "decode_split_kv")):
        if label(case, kernel) in points.index:
            p = points.loc[label(case, kernel)]
            digits = 0 if p["intensity_l2"] >= 10 else 1
            values.update({f"{key}_intensity": f"{p['intensity_dram']:.{digits}f}",
                           f"{key}_intensity_l2": f"{p['intensity_l2']:.{digits}f}"})
    stalls = profile.stalls()
    for key, case, kernel in (("fwd", "fwd", "attn_fwd"), ("decode", "decode", "decode_split_kv"),
                              ("numba", "numba_tiled", "flash_attention_fwd"), ("bwd", "bwd_causal", "bwd_dkdv_ws")):
        s = stalls[(stalls["case"] == case) & (stalls["kernel"] == kernel)]     # sorted: the largest first
        for rank, name in enumerate(("top", "second")):
            if len(s) > rank and f"{key}_{name}_reason" in values:
                values[f"{key}_{name}_reason"] = s.iloc[rank]["reason"].replace("_", " ")
                if f"{key}_{name}_share" in values:
                    values[f"{key}_{name}_share"] = f"{s.iloc[rank]['share']:.0%}"
        if key == "decode" and len(s):
            values["decode_long_share"] = f"{s.loc[s['reason'] == 'long_scoreboard', 'share'].sum():.0%}"
    loops = sass_loops(profile, launches)
    name = label("fwd", "attn_fwd")
    if len(loops) and "ex2_per_score" in loops and name in set(loops["launch"]):
        r = loops.set_index("launch").loc[name]
        if r["ex2_per_score"] == r["ex2_per_score"]:
            values.update(fwd_hgmma=f"{r['hgmma']:.0f}",
                          fwd_mma_ratio=f"{r['mma_flops_issued'] / r['mma_flops_needed']:.2f}",
                          fwd_ex2=f"{r['mufu_ex2']:.0f}", fwd_scores=f"{r['scores_per_thread']:.0f}",
                          fwd_ex2_extra=f"{r['mufu_ex2'] - r['scores_per_thread'] * r['iterations']:.0f}",
                          fwd_ex2_per_score=f"{r['ex2_per_score']:.2f}")
    # the dK/dV loop's CTA-wide barriers and the TMA copies they guard, per pass of its hot loop
    ws = one("bwd_causal", "bwd_dkdv_ws", profile.sass)
    if ws is not None:
        values.update(bwd_loop_bar=f"{ws['loop_bar']:.0f}", bwd_loop_tma=f"{ws['loop_utmaldg']:.0f}")
    return values


# ----------------------------------------------------------------------------- the paged-cache study

#: the study's recording, a folder of ``fa_lab/data`` laid out as the chapter's (``scripts/profile_ncu.py``)
PAGED_STUDY_DIR = "profile_paged_decode"
#: the glue names ``paged_study`` fills (``ch11_`` in front)
PAGED_VALUES = ("paged_smem_first", "paged_smem_five", "paged_dram_first", "paged_dram_five", "paged_dram_shipped",
                "paged_us_first", "paged_us_five", "paged_us_shipped", "paged_inst_cut", "paged_time_cut")
_PAGED_ORDER = ("paged_3_stages_int64", "paged_5_stages_int64", "paged")


def paged_study(profile) -> tuple[pd.DataFrame | None, dict]:
    """The paged-cache study's three launches side by side, and the values the chapter quotes from them
    (``NOT_RECORDED`` each, and no table, without a recording)."""
    values = {k: NOT_RECORDED for k in PAGED_VALUES}
    if profile is None:
        return None, values
    df = profile.launches().set_index("case").reindex(list(_PAGED_ORDER)).dropna(subset=["id"])
    if len(df) < len(_PAGED_ORDER):
        return None, values
    inst = profile.raw[profile.raw["metric"] == "smsp__inst_executed.sum"].set_index("id")["value"]
    cfg = [config(r) for _, r in df.iterrows()]
    df = df.assign(stages=[c.get("num_stages") for c in cfg],
                   offsets=["int32" if c.get("int32_offsets") else "int64" for c in cfg],
                   smem_KiB=(df["smem_dynamic"].fillna(0) + df["smem_static"].fillna(0)) / 1024,
                   instructions=df["id"].map(inst), time_us=df["duration_s"] * 1e6, dram=df["dram_pct"] / 100)
    first, five, shipped = (df.loc[c] for c in _PAGED_ORDER)
    values.update(paged_smem_first=f"{first['smem_KiB']:.0f} KiB", paged_smem_five=f"{five['smem_KiB']:.0f} KiB",
                  paged_dram_first=_pct(first["dram_pct"]), paged_dram_five=_pct(five["dram_pct"]),
                  paged_dram_shipped=_pct(shipped["dram_pct"]), paged_us_first=f"{first['time_us']:.0f} µs",
                  paged_us_five=f"{five['time_us']:.0f} µs", paged_us_shipped=f"{shipped['time_us']:.0f} µs",
                  paged_inst_cut=_pct(100 * (1 - shipped["instructions"] / five["instructions"])),
                  paged_time_cut=_pct(100 * (1 - shipped["time_us"] / five["time_us"])))
    return df.reset_index(), values


__all__ = ["MATMULS", "FWD_SHAPE", "LABELS", "MEMORY_UNITS", "VALUES", "label", "config", "kernel_flops", "scores",
           "model_counts", "traffic", "naive_vs_tiled", "busiest_memory", "roofline_points", "sass_loops",
           "roofline_figure", "stall_figure", "device_of", "recorded_values", "PAGED_STUDY_DIR", "PAGED_VALUES",
           "paged_study"]
