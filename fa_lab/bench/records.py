"""Recordings: measurements saved with the facts of the machine, and the GPU results shipped in ``fa_lab/data``.

A recording is one JSON file, ``{"meta": {...}, "records": [...]}``: ``meta`` holds the
device, driver, versions, date and the command that made it; ``records`` are dicts, one per
measurement (``fa_lab.bench.measure.benchmark``'s, the suite's, or a script's own).  This
module is the one writer (``write``/``save``) and the one reader (``read``) of that format;
so that the book can show real GPU numbers anywhere, the chapters load the shipped ones::

    from fa_lab.bench import records
    meta, df = records.load("gpu_ch4")               # one recording; (None, None) if absent
    records.label(meta)                              # 'NVIDIA H100 80GB HBM3 · torch 2.11 · ...'
    records.load_recorded("seed-table")              # a benchmark suite, every device that ran it
    records.recorded_table("sweep", impls=["triton", "sdpa-flash"], value="tflops",
                           where=dict(dtype="bfloat16", head_dim=128))

Peers are read under one naming scheme (``sdpa-flash``, ``sdpa-cudnn``, …), whatever spelling
(``sdpa_flash``) the recording used.
"""
from __future__ import annotations

import datetime
import json
import math
import re
import subprocess
from pathlib import Path

from fa_lab.core.data import DATA_DIR

#: the benchmark suite's recordings: ``gpu_bench_<device>_<suite>.json``
SUITE_PREFIX = "gpu_bench_"
NO_DATA = "no recorded GPU data"


# ----------------------------------------------------------------------------- writing

def driver() -> str | None:
    """The NVIDIA driver version, or None where there is no ``nvidia-smi``."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def metadata(command: str | None = None, **extra) -> dict:
    """The facts of this machine that travel with every recording."""
    from fa_lab.core.world import ON_GPU, describe

    meta = describe()
    meta.update(driver=driver() if ON_GPU else None,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                command=command, **extra)
    return meta


def _jsonable(r: dict) -> dict:
    # NaN/inf are not JSON: write null
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in r.items()}


def write(path, records, meta: dict) -> Path:
    """Write ``{"meta", "records"}`` to ``path``, one record a line (diffable)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    head = json.dumps(meta, indent=1, default=str)
    rows = ",\n".join(json.dumps(_jsonable(r), default=str) for r in records)
    path.write_text(f'{{"meta": {head},\n"records": [\n{rows}\n]}}\n')
    return path


#: Part I's kernels (chapters 1-7), in the order a sorted walk of ``kernels/`` meets them; Part II's
#: kernels are separate modules, so adding one leaves Part I's recordings current
PART_ONE_KERNELS = ("kernels/__init__.py", "kernels/naive.py", "kernels/numba", "kernels/online.py",
                    "kernels/softmax.py", "kernels/torch_tiled.py", "kernels/triton")

#: what a call of ``fa_lab.attention`` runs before the kernel: chapter 4's host rows and the first call time it
HOST_PATH = ("api.py", "core/registry.py", "core/spec.py")

#: what each recording measures, as paths inside the package: a recording is out of date once any of
#: these files changes (``tests/test_recordings.py``); the benchmark suites measure every Part I kernel
SOURCES = {
    "gpu_ch1_2": ("kernels/naive.py", "kernels/softmax.py", "kernels/online.py", "kernels/numba/naive.py"),
    "gpu_ch3": ("kernels/numba",),
    "gpu_ch4": ("kernels/triton", *HOST_PATH),
    "gpu_ch5": ("kernels/triton", "kernels/torch_tiled.py", "autograd.py"),
    "gpu_ch6": (*PART_ONE_KERNELS, "perf/model.py"),
    "gpu_ch6_ceilings": ("perf/hardware.py",),
    "gpu_ch8": ("kernels/varlen", "kernels/triton", "flash_attn"),
    # what decode_forward runs (the recording never appends to a cache: cache.py is not in it)
    "gpu_ch9": tuple(f"kernels/decode/{f}.py" for f in ("checks", "combine", "configs", "forward", "kernel",
                                                         "launching", "pool_order")),
    "gpu_ch10": ("kernels/varlen", "kernels/triton", "flash_attn"),
    "gpu_first_call": ("kernels/triton", *HOST_PATH),
    "gpu_cudnn_gap": ("kernels/triton", "kernels/gluon", "autograd.py", "bench/peers.py"),
    SUITE_PREFIX: (*PART_ONE_KERNELS, "bench/peers.py"),
}


#: the Part I backward's own files: a recording that times forwards alone never runs them
BACKWARD_FILES = ("kernels/triton/bwd.py", "kernels/triton/bwd_ws.py")
#: the recordings that time forwards alone (a benchmark suite by its part): their fingerprints leave
#: ``BACKWARD_FILES`` out, so that a change to the backward leaves them current
FORWARD_ONLY = ("gpu_ch4", "gpu_ch6", "gpu_first_call", "sweep")


def forward_only(name: str) -> bool:
    """Whether recording ``name`` times forwards alone (``FORWARD_ONLY``)."""
    if name.startswith(SUITE_PREFIX):   # gpu_bench_<tag>_<part>, the tag may hold "_" too
        return any(name.endswith(f"_{part}") for part in FORWARD_ONLY)
    return name in FORWARD_ONLY


#: the script that makes each recording of ``SOURCES`` (a recording stores its full command in its meta;
#: this names it for one that was never made)
MADE_BY = {
    "gpu_ch1_2": "python scripts/bench_ch1_2.py",
    "gpu_ch3": "python scripts/bench_ch3.py",
    "gpu_ch4": "python scripts/bench_ch4.py",
    "gpu_ch5": "python scripts/bench_ch5.py",
    "gpu_ch6": "python scripts/correlate_gpu.py",
    "gpu_ch6_ceilings": "python scripts/correlate_gpu.py",
    "gpu_ch8": "python scripts/bench_ch8.py",
    "gpu_ch9": "python scripts/bench_ch9.py",
    "gpu_ch10": "python scripts/bench_ch10.py",
    "gpu_first_call": "python scripts/bench_first_call.py",
    "gpu_cudnn_gap": "python scripts/bench_cudnn_gap.py",
    SUITE_PREFIX: "python scripts/record_gpu_bench.py",
}


def _entry(table: dict, name: str):
    """``table``'s entry for recording ``name``: its own, else the suites' for a suite file (else None)."""
    if name in table:
        return table[name]
    return table[SUITE_PREFIX] if name.startswith(SUITE_PREFIX) else None


def sources_of(name: str) -> tuple | None:
    """The package paths recording ``name`` measures (None: not tied to source files)."""
    return _entry(SOURCES, name)


def made_by(name: str) -> str | None:
    """The script that makes recording ``name`` (``MADE_BY``; None for one not tied to source files)."""
    return _entry(MADE_BY, name)


def _syntax(node) -> str:
    """The syntax tree of ``node`` as text, the same on every Python from 3.9 on.

    ``ast.dump`` is not: 3.12 adds ``type_params=[]`` to every function and class, 3.13 leaves
    empty fields out.  Here fields that are empty (None or []) are always left out.
    """
    import ast

    if isinstance(node, ast.AST):
        fields = ((f, getattr(node, f, None)) for f in node._fields)
        inner = ",".join(f"{f}={_syntax(v)}" for f, v in fields if v is not None and v != [])
        return f"{type(node).__name__}({inner})"
    if isinstance(node, list):
        return "[" + ",".join(_syntax(x) for x in node) + "]"
    return repr(node)


def fingerprint(name: str) -> str | None:
    """A hash of the sources recording ``name`` measures, as they are now (None if it measures none).

    A recording of forwards alone leaves the backward's files out (``forward_only``).  It hashes the
    code's syntax tree, so comments and layout (a ``# region:`` marker for the
    book) leave it unchanged; any change to what the code does changes it.  The same code gives
    the same fingerprint on the GPU machine that records and on the machine that checks.
    """
    import ast
    import hashlib

    paths = sources_of(name)
    if paths is None:
        return None
    root = Path(__file__).resolve().parent.parent
    skip = BACKWARD_FILES if forward_only(name) else ()
    digest = hashlib.sha256()
    for rel in paths:
        target = root / rel
        for f in sorted(target.rglob("*.py")) if target.is_dir() else [target]:
            path = f.relative_to(root).as_posix()
            if path in skip:
                continue
            digest.update(path.encode())
            digest.update(_syntax(ast.parse(f.read_text(encoding="utf-8"))).encode())
    return digest.hexdigest()[:16]


def save(name: str, records, *, command: str, directory: Path | None = None, **extra) -> Path:
    """Write ``records`` with the facts of this machine to ``<directory>/<name>.json`` (default ``fa_lab/data``).

    ``meta["sources"]`` fingerprints the code the recording measures (see ``SOURCES``).
    """
    sources = fingerprint(name)
    if sources is not None:
        extra.setdefault("sources", sources)
    return write(Path(directory or DATA_DIR) / f"{name}.json", list(records), metadata(command, **extra))


# ----------------------------------------------------------------------------- reading

def _canonical_peers(records: list) -> list:
    from fa_lab.bench.peers import canonical_name

    for r in records:
        for key in ("impl", "kernel"):
            if key in r:
                r[key] = canonical_name(r[key])
    return records


def read(path) -> tuple[dict, list]:
    """``(meta, records)`` of a recording file; peers under their ``sdpa-flash`` names."""
    blob = json.loads(Path(path).read_text())
    return blob["meta"], _canonical_peers(blob["records"])


def available(prefix: str = "") -> list[str]:
    """Stems of the recordings in ``fa_lab/data`` whose name starts with ``prefix``."""
    return sorted(p.stem for p in DATA_DIR.glob(f"{prefix}*.json"))


def load(name: str):
    """``(meta, DataFrame)`` of recording ``fa_lab/data/<name>.json``, or ``(None, None)`` if it was never recorded."""
    import pandas as pd

    path = DATA_DIR / f"{name}.json"
    if not path.exists():
        return None, None
    meta, records = read(path)
    return meta, pd.DataFrame.from_records(records)


def label(meta) -> str:
    """'NVIDIA H100 80GB HBM3 · torch 2.11 · triton 3.6 · 2026-11-21' — how the book captions recorded data."""
    if not meta:
        return NO_DATA
    return (f"{meta.get('device')} · torch {meta.get('torch')} · triton {meta.get('triton')} · "
            f"{str(meta.get('date'))[:10]}")


def gpu_name(meta) -> str:
    """How prose names the GPU a recording comes from: 'H200' (the driver's name for a GPU without a preset)."""
    from fa_lab.perf.devices import preset_for

    device = str((meta or {}).get("device") or "GPU")
    preset = preset_for(device)
    return preset.short if preset is not None else device.removeprefix("NVIDIA ")


def command(meta) -> str:
    """The command that made a recording, without the recording machine's output folder (``--out DIR``)."""
    return re.sub(r"\s--out(-dir)?\s+\S+", "", str((meta or {}).get("command") or ""))


# ----------------------------------------------------------------------------- the benchmark suite's recordings

def _suite_files(name: str, device: str | None) -> list[Path]:
    stems = available(SUITE_PREFIX)
    for stem in (name, f"{SUITE_PREFIX}{name}"):
        if stem in stems:
            return [DATA_DIR / f"{stem}.json"]
    return [DATA_DIR / f"{s}.json" for s in stems
            if s.endswith(f"_{name}") and (device is None or s.startswith(f"{SUITE_PREFIX}{device.lower()}_"))]


def load_recorded(name: str = "seed-table", *, device: str | None = None):
    """Recorded results of suite ``name`` ('seed-table', 'sweep', 'latency', ...) as a DataFrame.

    ``name`` may also be a file stem (``h100_seed-table``).  ``device`` ('h100', 'h200')
    keeps one device.  Every row carries ``source`` (its file); ``df.attrs["meta"]`` lists each
    file's meta (driver, versions, date, command) and ``df.attrs["label"]`` a caption.
    An empty DataFrame (with ``attrs["label"] = 'no recorded GPU data'``) if none exists.
    """
    import pandas as pd

    frames, metas = [], []
    for path in _suite_files(name, device):
        meta, records = read(path)
        frames.append(pd.DataFrame.from_records(records).assign(source=path.name))
        metas.append(meta)
    df = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    df.attrs["meta"] = metas
    df.attrs["label"] = " | ".join(label(m) for m in metas) if metas else NO_DATA
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
