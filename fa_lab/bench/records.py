"""GPU results recorded in the repository, so the book can show real GPU numbers anywhere.

A recording is one JSON file in ``fa_lab/data/``: ``{"meta": {...}, "records": [...]}``
where ``meta`` holds the device, driver, versions, date and the command that made it,
and ``records`` are the dicts ``fa_lab.bench.timer.benchmark`` returns.
"""
from __future__ import annotations

import datetime
import json
import subprocess
from pathlib import Path

from fa_lab.core.data import DATA_DIR



def _driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def save(name: str, records, *, command: str, directory: Path | None = None, **extra) -> Path:
    """Write ``records`` with the facts of this machine to ``<directory>/<name>.json``."""
    from fa_lab.core.world import describe

    meta = describe()
    meta.update(driver=_driver(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                command=command, **extra)
    path = Path(directory or DATA_DIR) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "records": list(records)}, indent=1, default=str))
    return path


def available() -> list[str]:
    return sorted(p.stem for p in DATA_DIR.glob("*.json"))


def load(name: str):
    """``(meta, DataFrame)`` of a recording, or ``(None, None)`` if it was never recorded."""
    import pandas as pd

    path = DATA_DIR / f"{name}.json"
    if not path.exists():
        return None, None
    blob = json.loads(path.read_text())
    return blob["meta"], pd.DataFrame.from_records(blob["records"])


def label(meta) -> str:
    """'NVIDIA H100 80GB HBM3 · torch 2.11 · 2026-11-21' — how the book captions recorded data."""
    if not meta:
        return "no recorded GPU data"
    return f"{meta.get('device')} · torch {meta.get('torch')} · triton {meta.get('triton')} · {str(meta.get('date'))[:10]}"
