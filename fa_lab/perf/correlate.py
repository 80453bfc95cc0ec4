"""Predicted against measured: the shapes, the model of each kernel, calibration and the error table.

The recipe keeps the model honest.  Each kernel gets two numbers, fitted on the *calibration*
shapes only: its compute efficiency (the fraction of the peak its compute term reaches) and a
fixed cost per program, in tiles of its own work (loading Q, filling and draining the software
pipeline, the epilogue).  Whether its softmax overlaps its matmuls (time = max instead of sum) is
chosen the same way, by which fits the calibration shapes better.  The error is reported on the
*report* shapes, which share none of their sequence lengths with the calibration set.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from fa_lab.bench.peers import canonical_name
from fa_lab.perf.devices import Device
from fa_lab.perf.model import MASK_ALIASES, Problem, count
from fa_lab.perf.roofline import predict

#: 16k tokens per batch and a model width of 2048, as in the FlashAttention papers' benchmarks
TOKENS, WIDTH = 16384, 2048


def _square(n, d, mask, **kw):
    return dict(batch=max(1, TOKENS // n), heads=WIDTH // d, n_q=n, n_k=n, head_dim=d, mask=mask, **kw)


#: shapes the model of each kernel is fitted on
CALIBRATION = [_square(n, d, m) for n in (1024, 4096) for d in (64, 128) for m in ("none", "causal")]
#: shapes the error is reported on (N >= 2k, none of the calibration lengths)
REPORT = ([_square(n, d, m) for n in (2048, 8192, 16384) for d in (64, 128) for m in ("none", "causal")]
          + [dict(batch=2, heads=16, n_q=1024, n_k=8192, head_dim=128, mask=m) for m in ("none", "causal")]
          + [dict(batch=2, heads=16, n_q=8192, n_k=8192, head_dim=128, mask="window", window=1024)])


@dataclass(frozen=True)
class KernelModel:
    """How the model sees one hardware kernel (the structure; the calibration adds the numbers)."""

    algorithm: str = "flash_fwd"
    block_m: int | None = 128
    block_n: int | None = 64
    unit: str = "auto"                # 'tensor' / 'cuda' / 'auto' (CUDA cores for fp32)
    compute_dtype: str | None = None  # the dtype its matmuls run in, if not the inputs'
    skip_masked: bool = True          # skips tiles the mask hides (False: computes all, masks elementwise)
    mask_bytes: int = 0               # bytes per (query, key) of a mask tensor it reads
    score_bytes: int | None = None    # naive only: element size of S and P
    note: str = ""

    def blocks(self) -> dict:
        if self.algorithm == "naive":
            return dict(score_bytes=self.score_bytes)
        return dict(block_m=self.block_m, block_n=self.block_n, skip_masked=self.skip_masked,
                    mask_bytes=self.mask_bytes)


#: hardware kernels by their benchmark names (``fa_lab.bench.peers``, the registry)
_KERNELS = {
    "sdpa-flash": KernelModel(note="FlashAttention-2 (SDPA flash backend), 128x64 tiles"),
    "sdpa-cudnn": KernelModel(block_m=128, block_n=128, note="cuDNN fused attention (tiles assumed 128x128)"),
    "sdpa-efficient": KernelModel(block_m=64, block_n=64,
                                  note="memory-efficient attention (CUTLASS), 64x64 tiles assumed"),
    "sdpa-math": KernelModel("naive", None, None, unit="cuda", compute_dtype="fp32", score_bytes=4,
                             note="SDPA math backend: fp16/bf16 upcast to fp32 (CUDA-core SGEMM), S and P in fp32"),
    "naive_torch": KernelModel("naive", None, None, score_bytes=4, note="chapter 1: S and P in fp32"),
    "numba_naive": KernelModel("naive", None, None, unit="cuda", score_bytes=4,
                               note="chapter 1: three Numba kernels, fp32 on CUDA cores"),
    "numba_tiled": KernelModel(block_m=64, block_n=64, unit="cuda", note="chapter 3: tiled fp32 on CUDA cores"),
    "triton": KernelModel(block_m=128, block_n=64, note="chapter 4: Triton forward on Tensor Cores (autotuned tiles)"),
}


def kernel_model(kernel: str) -> KernelModel:
    """The model of a hardware kernel (SDPA backend or registered fa_lab implementation)."""
    return _KERNELS.get(canonical_name(kernel), KernelModel(note="unknown kernel: a FlashAttention-2 forward assumed"))


def problem_of(rec: dict) -> Problem:
    """The Problem a measurement record describes."""
    window = rec.get("window")
    if isinstance(window, float):     # through a DataFrame: NaN for none, 1024.0 for W
        window = None if math.isnan(window) else int(window)
    mask = MASK_ALIASES.get(rec["mask"], rec["mask"])
    return Problem(batch=int(rec["batch"]), heads=int(rec["heads"]), n_q=int(rec["n_q"]), n_k=int(rec["n_k"]),
                   head_dim=int(rec["head_dim"]), head_dim_v=int(rec.get("head_dim_v") or rec["head_dim"]),
                   kv_heads=int(rec.get("kv_heads") or rec["heads"]), mask=mask,
                   window=window if mask == "window" else None, dtype=rec["dtype"])


def record_model(rec: dict) -> KernelModel:
    """The kernel's model for one measurement: the tile sizes it recorded (autotuned kernels pick their
    own), and no tile skipping where SDPA had to be given the mask as a tensor."""
    km = kernel_model(rec["kernel"])
    if km.algorithm == "naive":
        return km
    bm, bn = rec.get("block_m"), rec.get("block_n")
    ok = lambda x: x is not None and not (isinstance(x, float) and math.isnan(x))  # noqa: E731
    km = dataclasses.replace(km, block_m=int(bm) if ok(bm) else km.block_m, block_n=int(bn) if ok(bn) else km.block_n)
    if canonical_name(rec["kernel"]) in ("sdpa-efficient", "sdpa-math") and \
            MASK_ALIASES.get(rec["mask"], rec["mask"]) == "window":
        km = dataclasses.replace(km, skip_masked=False, mask_bytes=1)   # a dense bool attn_mask (peers.bind)
    return km


@dataclass(frozen=True)
class Calibration:
    """A kernel's fitted numbers: ``t = max(compute · (1 + overhead_tiles · programs/tiles) / eff, memory)``."""

    eff: float = 1.0
    overhead_tiles: float = 0.0
    exp_overlap: bool = False
    calibration_error: float = float("nan")   # mean |relative error| on the calibration shapes
    shapes: int = 0

    def predict_kw(self) -> dict:
        return dict(eff_compute=self.eff, overhead_tiles=self.overhead_tiles, exp_overlap=self.exp_overlap)


def ideal(rec: dict, device: Device, *, exp_overlap: bool = False, **predict_kw):
    """Counts and the uncalibrated (eff = 1, no overhead) prediction of a record."""
    km = record_model(rec)
    c = count(km.algorithm, problem_of(rec), **km.blocks())
    return c, predict(c, device, unit=km.unit, compute_dtype=km.compute_dtype, exp_overlap=exp_overlap, **predict_kw)


def _fit(rows: list, device: Device, exp_overlap: bool) -> Calibration:
    """Least squares in relative error: measured ≈ a·compute + b·compute·programs/tiles, a, b >= 0."""
    x, y = [], []
    for rec in rows:
        c, pr = ideal(rec, device, exp_overlap=exp_overlap)
        ph = c.phases[0]
        x.append((pr.t_compute, pr.t_compute * ph.programs / ph.tiles if ph.tiles else 0.0))
        y.append(rec["ms"] * 1e-3)
    x, y = np.array(x), np.array(y)
    A = x / y[:, None]
    (a, b), *_ = np.linalg.lstsq(A, np.ones(len(y)), rcond=None)
    if b < 0 or a <= 0:                          # no overhead term: the geometric-mean fit of `a` alone
        a, b = float(np.exp(np.mean(np.log(y / x[:, 0])))), 0.0
    eff = min(1.5, 1.0 / a)
    cal = Calibration(eff=eff, overhead_tiles=float(b / a), exp_overlap=exp_overlap, shapes=len(rows))
    errs = [predict_record(rec, device, cal)["error"] for rec in rows]
    return dataclasses.replace(cal, calibration_error=float(np.mean(np.abs(errs))))


def calibrate(records, device: Device, *, which: str = "calibration") -> dict:
    """``{kernel: Calibration}`` fitted on the ``which`` shapes of each (flash-type) kernel.

    For each kernel, the efficiency and the per-program overhead are fitted twice — softmax
    after the matmuls (sum) and overlapped with them (max) — and the variant with the smaller
    calibration error is kept.  Naive kernels are not calibrated (they are shown, not predicted).
    """
    by_kernel: dict = {}
    for rec in records:
        if rec.get("status") == "ok" and rec.get("set") == which and kernel_model(rec["kernel"]).algorithm != "naive":
            by_kernel.setdefault(canonical_name(rec["kernel"]), []).append(rec)
    return {k: min((_fit(rows, device, ov) for ov in (False, True)), key=lambda c: c.calibration_error)
            for k, rows in by_kernel.items()}


def _calibration(cal) -> Calibration:
    if cal is None:
        return Calibration()
    if isinstance(cal, Calibration):
        return cal
    if isinstance(cal, dict):                  # as stored in a recording's meta
        return Calibration(**{k: v for k, v in cal.items() if k in Calibration.__dataclass_fields__})
    return Calibration(eff=float(cal))         # a bare efficiency factor


def predict_record(rec: dict, device: Device, cal=None) -> dict:
    """The model's view of one successful measurement: counts, prediction, TFLOP/s and error.

    ``cal`` is a :class:`Calibration` (or its dict, or a bare efficiency); ``error = predicted /
    measured - 1`` (positive: the model expected it slower).
    """
    cal = _calibration(cal)
    km = record_model(rec)
    c = count(km.algorithm, problem_of(rec), **km.blocks())
    pred = predict(c, device, unit=km.unit, compute_dtype=km.compute_dtype, **cal.predict_kw())
    ms = rec["ms"]
    return dict(predicted_ms=pred.time_s * 1e3, error=pred.time_s * 1e3 / ms - 1, eff=cal.eff,
                overhead_tiles=cal.overhead_tiles, exp_overlap=cal.exp_overlap,
                tflops=c.flops / (ms * 1e-3) / 1e12, tflops_executed=c.flops_executed / (ms * 1e-3) / 1e12,
                intensity=c.intensity, intensity_dram=c.flops_executed / pred.dram_bytes, bound=pred.bound,
                t_mma_ms=pred.t_mma * 1e3, t_exp_ms=pred.t_exp * 1e3, t_memory_ms=pred.t_memory * 1e3,
                algorithm=km.algorithm, unit=pred.unit, block_m=km.block_m, block_n=km.block_n,
                programs=c.programs, tiles=c.tiles)


def table(records, device: Device, calibration: dict | None = None):
    """A DataFrame: every successful measurement with its prediction (:func:`predict_record`)."""
    import pandas as pd

    keep = ("kernel", "set", "dtype", "batch", "heads", "n_q", "n_k", "head_dim", "mask", "window")
    rows = []
    for rec in records:
        if rec.get("status") != "ok":
            continue
        row = {k: rec.get(k) for k in keep}
        row["measured_ms"] = rec["ms"]
        row.update(predict_record(rec, device, (calibration or {}).get(canonical_name(rec["kernel"]))))
        rows.append(row)
    return pd.DataFrame(rows)


def calibration_frame(calibration: dict):
    """The fitted numbers, one row per kernel."""
    import pandas as pd

    return pd.DataFrame({k: dataclasses.asdict(_calibration(v)) for k, v in calibration.items()}).T


def summary(tab, which: str = "report"):
    """Per kernel: shapes, mean |error|, worst error, share within ±25% (on ``which`` shapes)."""
    part = tab[tab["set"] == which]
    g = part.groupby("kernel")["error"]
    return g.agg(shapes="count", mean_abs_error=lambda e: e.abs().mean(), worst=lambda e: e.abs().max(),
                 within_25=lambda e: (e.abs() <= 0.25).mean())
