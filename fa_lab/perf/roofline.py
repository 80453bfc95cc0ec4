"""A roofline time for the counts of ``fa_lab.perf.model`` on a GPU of ``fa_lab.perf.devices``.

Per phase (kernel) of an algorithm, time is ``max(compute, memory)``: compute is the executed
matmul FLOPs at the Tensor Core (or CUDA core) peak plus the exponentials at the special-function
rate; memory is the DRAM bytes at the HBM bandwidth, where DRAM bytes lie between the compulsory
traffic and the no-cache stream depending on whether the K/V the programs share stay in L2.
Efficiency factors and a per-program overhead, fitted by ``fa_lab.perf.correlate``, scale it to
what a given kernel reaches.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from fa_lab.perf.devices import Device, canonical_dtype
from fa_lab.perf.model import Counts, Phase


@dataclass
class Prediction:
    """A roofline time for ``Counts`` on a ``Device``; every term in seconds."""

    device: str
    dtype: str
    unit: str
    peak_flops: float
    bandwidth: float
    exp_rate: float
    eff_compute: float
    eff_memory: float
    exp_overlap: bool
    overhead_tiles: float
    t_mma: float
    t_exp: float
    t_compute: float
    t_memory: float
    time_s: float
    bound: str
    dram_bytes: float
    clock_mhz: float
    cycles: float
    phases: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def l2_miss_fraction(working_set: float, l2_bytes: float) -> float:
    """Share of re-reads that miss L2: 0 while the shared working set fits, then growing towards 1."""
    if working_set <= 0:
        return 1.0
    return float(min(1.0, max(0.0, (working_set - l2_bytes) / working_set)))


def l2_working_set(phase: Phase, device: Device) -> float:
    """Bytes in flight that programs re-read: one head's working set times the heads running at once.

    Programs are launched head by head (query blocks fastest), so with one program per SM about
    ``SMs / programs_per_head`` heads run together.
    """
    heads_in_flight = max(1, -(-device.sm_count // max(1, phase.programs_per_head)))
    heads_total = max(1, phase.programs // max(1, phase.programs_per_head))
    return phase.l2_working_set * min(heads_in_flight, heads_total)


def predict(counts: Counts, device: Device, *, unit: str = "auto", eff_compute: float = 1.0,
            eff_memory: float = 1.0, exp_overlap: bool = False, overhead_tiles: float = 0.0,
            bytes_model: str = "l2", compute_dtype: str | None = None, clock_mhz: float | None = None) -> Prediction:
    """Roofline time: per phase ``max(compute, memory)``, summed over phases.

    compute = ``(t_mma + t_exp) · (1 + overhead_tiles · programs / tiles) / eff_compute`` — MMA at the
    peak of ``compute_dtype`` (default the problem's dtype) plus one exponential per computed score at
    the special-function rate; ``exp_overlap=True`` takes ``max`` instead of the sum (a kernel that
    overlaps the softmax with the matmuls).  ``overhead_tiles`` charges every program a fixed cost
    worth that many tiles of its own work (loading Q, filling and draining the software pipeline,
    the epilogue), which is what makes short sequences slow.
    memory = DRAM bytes / (bandwidth × ``eff_memory``), where DRAM bytes are ``'streamed'``
    (no cache), ``'compulsory'`` (perfect cache) or ``'l2'`` (compulsory + the re-reads that miss
    an L2 too small for the K/V of the heads in flight).  Efficiency factors are fractions of the
    device's peaks (datasheet or measured, see ``Device.with_ceilings``); calibrate them on other shapes.
    """
    if bytes_model not in ("streamed", "compulsory", "l2"):
        raise ValueError(f"bytes_model must be 'streamed', 'compulsory' or 'l2', got {bytes_model!r}")
    if not (0 < eff_compute <= 1.5 and 0 < eff_memory <= 1.5):
        raise ValueError(f"efficiency factors must be in (0, 1.5], got {eff_compute}, {eff_memory}")
    if overhead_tiles < 0:
        raise ValueError(f"overhead_tiles must be >= 0, got {overhead_tiles}")
    dtype = canonical_dtype(compute_dtype or counts.problem.dtype)
    peak = device.peak_flops(dtype, unit)
    unit_used = unit if unit != "auto" else ("cuda" if dtype == "fp32" else "tensor")
    bw = device.hbm_bandwidth
    total = t_mma = t_exp = t_comp = t_mem = dram = 0.0
    phases = []
    for ph in counts.phases:
        if bytes_model == "streamed":
            b = ph.hbm_bytes
        elif bytes_model == "compulsory":
            b = ph.compulsory_bytes
        else:
            b = ph.compulsory_bytes + l2_miss_fraction(l2_working_set(ph, device), device.l2_bytes) * (
                ph.hbm_bytes - ph.compulsory_bytes)
        mma, ex = ph.flops / peak, ph.exps / device.exp_rate
        overhead = 1 + overhead_tiles * ph.programs / ph.tiles if ph.tiles else 1.0
        comp = (max(mma, ex) if exp_overlap else mma + ex) * overhead / eff_compute
        mem = b / (bw * eff_memory)
        t = max(comp, mem)
        phases.append(dict(name=ph.name, t_mma=mma, t_exp=ex, t_compute=comp, t_memory=mem, time_s=t,
                           dram_bytes=b, bound="compute" if comp >= mem else "memory"))
        total += t
        t_mma += mma
        t_exp += ex
        t_comp += comp
        t_mem += mem
        dram += b
    # the phase that takes the most time names the bound
    main = max(phases, key=lambda d: d["time_s"])
    clock = float(clock_mhz or device.boost_clock_mhz)
    return Prediction(device.name, dtype, unit_used, peak, bw, device.exp_rate, eff_compute, eff_memory,
                      exp_overlap, overhead_tiles, t_mma, t_exp, t_comp, t_mem, total, main["bound"], dram, clock,
                      total * clock * 1e6, phases)


def attainable(intensity, device: Device, dtype: str = "fp16", unit: str = "auto"):
    """The roofline: attainable FLOP/s at an arithmetic intensity (FLOP per byte)."""
    return np.minimum(device.peak_flops(dtype, unit), np.asarray(intensity, dtype=float) * device.hbm_bandwidth)


__all__ = ["Prediction", "predict", "attainable", "l2_miss_fraction", "l2_working_set"]
