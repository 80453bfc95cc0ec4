"""The shapes the benchmark suite runs: named configs, the seed table, the sweep.

A *shape* is one ``(batch, heads, kv_heads, n_q, n_k, head_dim)``; a config is a
list of shapes plus the mask it is meant for (the sweep is causal, as in the
FlashAttention-2 paper's figures).  ``shapes(...)`` turns a config name and any
explicit ``--batch/--heads/--seq-len/--head-dim`` overrides into the list to run.
"""
from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Shape:
    batch: int
    heads: int
    n_q: int
    head_dim: int
    kv_heads: int | None = None   # None: same as heads
    n_k: int | None = None        # None: same as n_q

    @property
    def label(self) -> str:
        """'(B, H, N, D)' as the seed table prints it, with Hkv and Nk when they differ."""
        kv = "" if self.kv_heads in (None, self.heads) else f"/{self.kv_heads}"
        nk = "" if self.n_k in (None, self.n_q) else f"x{self.n_k}"
        return f"({self.batch}, {self.heads}{kv}, {self.n_q}{nk}, {self.head_dim})"

    def kwargs(self) -> dict:
        """Keyword arguments of ``fa_lab.bench.measure.benchmark``."""
        d = asdict(self)
        return dict(batch=d["batch"], heads=d["heads"], seq_len=d["n_q"], seq_len_k=d["n_k"],
                    head_dim=d["head_dim"], kv_heads=d["kv_heads"])


#: small named configs (B, H, N, D): a laptop runs all of them in the CPU world
NAMED = {
    "tiny": Shape(2, 4, 8, 64),
    "small": Shape(2, 4, 64, 64),
    "medium": Shape(2, 8, 128, 64),
    "llama_small": Shape(1, 12, 256, 64),
    "llama_med": Shape(1, 32, 512, 128),
}

#: the FlashAttention-2 paper's table: ~16k tokens per batch, hidden 2048 (16 heads of 128)
SEED_TABLE = [Shape(32, 16, 512, 128), Shape(16, 16, 1024, 128), Shape(8, 16, 2048, 128),
              Shape(4, 16, 4096, 128), Shape(2, 16, 8192, 128), Shape(1, 16, 16384, 128)]

#: the sweep: batch 1, 16 heads, causal, N = 128 … 65536 (powers of two) × D = 16 … 128
SWEEP_SEQ_LENS = [2 ** p for p in range(7, 17)]
SWEEP_HEAD_DIMS = [16, 32, 64, 128]
SWEEP_HEADS = 16
SWEEP_DTYPES = ["bf16", "fp32"]

#: the small-shape latency question: is a custom kernel worth it here?
LATENCY = Shape(1, 8, 512, 64)

#: config name -> (shapes, default mask, default dtypes or None)
CONFIGS = {
    **{name: ([s], "none", None) for name, s in NAMED.items()},
    "seed-table": (SEED_TABLE, "none", None),
    # largest head dim first: the headline numbers come first when a run is cut short
    "sweep": ([Shape(1, SWEEP_HEADS, n, d) for d in reversed(SWEEP_HEAD_DIMS) for n in SWEEP_SEQ_LENS],
              "causal", SWEEP_DTYPES),
    "latency": ([LATENCY], "none", None),
}


def config_names() -> list[str]:
    return list(CONFIGS)


def shapes(config: str | None = None, *, batch=None, heads=None, seq_len=None, head_dim=None,
           kv_heads=None, seq_len_k=None) -> list[Shape]:
    """The shapes of ``config``, with any given dimension replaced.

    Each override may be an int or a list of ints; lists multiply out (a grid).  With no
    config, every dimension needs a value except ``kv_heads`` and ``seq_len_k``.
    """
    def as_list(x):
        return None if x is None else (list(x) if isinstance(x, (list, tuple)) else [x])

    over = dict(batch=as_list(batch), heads=as_list(heads), n_q=as_list(seq_len),
                head_dim=as_list(head_dim), kv_heads=as_list(kv_heads), n_k=as_list(seq_len_k))
    if config is None:
        missing = [k for k in ("batch", "heads", "n_q", "head_dim") if over[k] is None]
        if missing:
            names = {"n_q": "--seq-len", "head_dim": "--head-dim"}
            raise ValueError("without --config, give " + ", ".join(names.get(m, f"--{m}") for m in missing))
        base = [Shape(1, 1, 1, 1)]
    else:
        if config not in CONFIGS:
            raise ValueError(f"unknown config {config!r}; known: {', '.join(CONFIGS)}")
        base = CONFIGS[config][0]
    out, seen = [], set()
    for s in base:
        fields = asdict(s)
        axes = [[(k, v) for v in over[k]] if over[k] is not None else [(k, fields[k])] for k in fields]
        for combo in itertools.product(*axes):
            shape = Shape(**dict(combo))
            if shape not in seen:
                seen.add(shape)
                out.append(shape)
    for s in out:
        if min(s.batch, s.heads, s.n_q, s.head_dim) < 1 or (s.kv_heads is not None and s.kv_heads < 1) \
                or (s.n_k is not None and s.n_k < 1):
            raise ValueError(f"every dimension must be >= 1, got {s}")
    return out


def default_mask(config: str | None) -> str:
    return CONFIGS[config][1] if config in CONFIGS else "none"


def default_dtypes(config: str | None):
    return CONFIGS[config][2] if config in CONFIGS else None
