"""Timing, benchmarks (``fa-lab bench``, chapter 7) and the recorded GPU results.

* ``timer`` — the one timer: ``time_fn``, ``time_interleaved``, ``balanced_orders``;
* ``measure`` — ``benchmark`` (one record per call: time, TFLOP/s, memory, error), ``sweep``,
  ``to_frame``, ``plot``: what every chapter times with;
* ``records`` — recordings (``{"meta", "records"}`` JSON) and the GPU ones shipped in ``fa_lab/data``;
* ``configs`` — named shapes, the seed table, the sweep;
* ``peers`` — PyTorch SDPA backends and the flash-attn package, measured beside our kernels;
* ``runner`` — ``run_suite`` → records → CSV/JSON, a table, plots; ``report`` — chapter 7's summaries.

The chapters import from here: ``from fa_lab.bench import benchmark, records, sweep, time_fn, to_frame``.
"""
from __future__ import annotations

import importlib

#: public name -> the module that defines it; loaded on first use, so that ``fa_lab.bench.timer``
#: (which the kernels' autotuner imports) does not pull in the whole benchmark suite
_EXPORTS = {
    "fa_lab.bench.timer": ("balanced_orders", "time_fn", "time_interleaved"),
    "fa_lab.bench.measure": ("benchmark", "plot", "sweep", "to_frame"),
    "fa_lab.bench.records": ("available", "load_recorded", "recorded_table"),
    "fa_lab.bench.configs": ("CONFIGS", "LATENCY", "NAMED", "SEED_TABLE", "Shape", "shapes"),
    "fa_lab.bench.peers": ("PEERS", "get_peer", "peer_names", "raw_call"),
    "fa_lab.bench.runner": ("COLUMNS", "default_impls", "known_impls", "plot_suite", "run_suite", "save", "table"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
_SUBMODULES = ("timer", "measure", "records", "configs", "peers", "runner", "report", "cli")


def __getattr__(name):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"fa_lab.bench.{name}")
    raise AttributeError(f"module 'fa_lab.bench' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_WHERE) | set(_SUBMODULES))


__all__ = sorted(_WHERE) + ["records"]
