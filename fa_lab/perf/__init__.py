"""Chapter 6: a performance model of attention — count FLOPs and HBM bytes, predict a roofline time,
and correlate it with what the GPU measures (``fa-lab correlate``).

* ``devices`` — GPU presets (datasheet peaks) and ``Device.with_ceilings`` for measured ones;
* ``model`` — the problem, and counts for naive attention, the FlashAttention forward and backward;
* ``roofline`` — ``predict``: a time from the counts on a device; ``attainable``: the roofline itself;
* ``hardware`` — measuring ceilings and kernels on a GPU (SDPA backends or any registered kernel);
* ``correlate`` — calibration shapes, report shapes, and the predicted-vs-measured table.

Chapter 11 reads what the GPU did: ``ncu`` runs Nsight Compute and reads its CSV pages, ``sass`` finds a
kernel's hot loop in its machine code (both imported by name: ``from fa_lab.perf import ncu, sass``).
"""
from fa_lab.perf.devices import DEVICES, Device, device_names, get_device, select, sim_device_names
from fa_lab.perf.model import (
    ALGORITHMS,
    MASKS,
    Counts,
    Problem,
    count,
    flash_backward_counts,
    flash_forward_counts,
    naive_counts,
    tiles,
    visible_pairs,
)
from fa_lab.perf.roofline import Prediction, attainable, predict

__all__ = ["DEVICES", "Device", "device_names", "get_device", "select", "sim_device_names", "ALGORITHMS", "MASKS",
           "Counts", "Prediction", "Problem", "attainable", "count", "flash_backward_counts", "flash_forward_counts",
           "naive_counts", "predict", "tiles", "visible_pairs"]
