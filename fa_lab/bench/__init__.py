"""``fa-lab bench``: the benchmark suite (chapter 7) and the recorded GPU results.

* ``configs`` — named shapes, the seed table, the sweep;
* ``peers`` — PyTorch SDPA backends and the flash-attn package, measured beside our kernels;
* ``runner`` — ``run_suite`` → records → CSV/JSON, a table, plots;
* ``recorded`` — ``load_recorded(name)``: the GPU results shipped in ``fa_lab/data``.
"""
from fa_lab.bench.configs import CONFIGS, LATENCY, NAMED, SEED_TABLE, Shape, shapes
from fa_lab.bench.peers import PEERS, get_peer, peer_names
from fa_lab.bench.shipped import available, load_recorded, recorded_table
from fa_lab.bench.runner import COLUMNS, default_impls, known_impls, plot, run_suite, save, table, to_frame

__all__ = ["CONFIGS", "LATENCY", "NAMED", "SEED_TABLE", "Shape", "shapes", "PEERS", "get_peer", "peer_names",
           "available", "load_recorded", "recorded_table", "COLUMNS", "default_impls", "known_impls", "plot",
           "run_suite", "save", "table", "to_frame"]
