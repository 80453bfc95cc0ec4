"""Recorded GPU benchmark results shipped with the package, for every chapter to show.

The files are ``fa_lab/data/gpu_bench_<device>_<suite>.json`` (plus a ``.csv`` twin),
written by ``scripts/record_gpu_bench.py`` on a GPU: ``{"meta": {...}, "records": [...]}``,
the format of ``fa_lab.bench.records``.  A chapter that times something live on a laptop can
show, beside it, what the same implementations did on a real GPU::

    from fa_lab.bench import load_recorded, recorded_table
    df = load_recorded("seed-table")                 # every device that recorded it
    recorded_table("sweep", impls=["triton", "sdpa-flash"], value="tflops",
                   where=dict(dtype="bfloat16", head_dim=128))
"""
from __future__ import annotations

import json
from pathlib import Path

from fa_lab.core.data import DATA_DIR

PREFIX = "gpu_bench_"


def available() -> list[str]:
    """Stems of the recorded benchmark files, e.g. ``gpu_bench_h100_seed-table``."""
    return sorted(p.stem for p in DATA_DIR.glob(f"{PREFIX}*.json"))


def _files(name: str, device: str | None):
    stems = available()
    if name in stems or f"{PREFIX}{name}" in stems:
        stem = name if name in stems else f"{PREFIX}{name}"
        return [DATA_DIR / f"{stem}.json"]
    return [DATA_DIR / f"{s}.json" for s in stems
            if s.endswith(f"_{name}") and (device is None or s.startswith(f"{PREFIX}{device.lower()}_"))]


def load_recorded(name: str = "seed-table", *, device: str | None = None):
    """Recorded results of suite ``name`` ('seed-table', 'sweep', 'latency', ...) as a DataFrame.

    ``name`` may also be a file stem (``h100_seed-table``).  ``device`` ('h100', 'h200')
    keeps one device.  Every row carries ``device``; ``df.attrs["meta"]`` lists each
    file's meta (driver, versions, date, command) and ``df.attrs["label"]`` a caption.
    An empty DataFrame (with ``attrs["label"] = 'no recorded GPU data'``) if none exists.
    """
    import pandas as pd

    from fa_lab.bench.records import label

    frames, metas = [], []
    for path in _files(name, device):
        blob = json.loads(path.read_text())
        df = pd.DataFrame.from_records(blob["records"])
        df["source"] = path.name
        frames.append(df)
        metas.append(blob["meta"])
    df = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    df.attrs["meta"] = metas
    df.attrs["label"] = " | ".join(label(m) for m in metas) if metas else "no recorded GPU data"
    return df


def recorded_table(name: str = "seed-table", *, impls=None, value: str = "tflops", where: dict | None = None,
                   device: str | None = None, index=("shape", "dtype", "mode")):
    """Pivot of recorded ``value`` (``tflops``, ``ms``, ``speedup``, …): one row per shape, one column
    per implementation; non-``ok`` cases show their status instead of a number."""
    df = load_recorded(name, device=device)
    if df.empty:
        return df
    if where:
        for k, v in where.items():
            df = df[df[k].isin(v if isinstance(v, (list, tuple)) else [v])]
    if impls is not None:
        df = df[df["impl"].isin(list(impls))]
    if df.empty:
        return df
    order = list(dict.fromkeys(df["impl"]))
    cell = df.apply(lambda r: round(r[value], 3) if r["status"] == "ok" and r[value] == r[value]
                    else r["status"].split(":")[0], axis=1)
    index = [c for c in index if c in df and df[c].nunique() > 1] or ["shape"]
    pivot = df.assign(_cell=cell).pivot_table(index=index, columns="impl", values="_cell", aggfunc="first",
                                              sort=False)
    pivot = pivot[[c for c in order if c in pivot.columns]]
    pivot.columns.name = f"{value} — {df.attrs.get('label', '')}"
    return pivot
