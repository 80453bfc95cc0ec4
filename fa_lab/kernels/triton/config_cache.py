"""The tuned launch configurations, kept per device and key in two JSON files.

``fa_lab/data/triton_fwd_configs.json`` ships with the package (tuned on the GPUs the book was
recorded on); the user file (``$FA_LAB_CACHE_DIR`` or ``~/.cache/fa_lab``) collects what this
machine tuned, so that a notebook re-run does not tune again.  Both hold
``{"configs": {device: {key: config}}}``; the shipped file also names each device's compute
capability (``{"devices": {device: [major, minor]}}``), so that a GPU with no entries of its own
takes the entries tuned on another GPU of its architecture (an H200 those of an H100: the same SM,
the same shared memory and registers per program, which is what a tile configuration depends on).

Several processes may tune at once (a test run beside a notebook): a write takes a file lock,
reads what the others wrote meanwhile, merges, and replaces the file through a temporary file
of its own, so no entry is lost and a reader never sees half a file.
"""
from __future__ import annotations

import json
import os
import tempfile
import threading
import warnings
from pathlib import Path

from filelock import FileLock, Timeout

from fa_lab.core.data import DATA_DIR
from fa_lab.kernels.triton.configs import CONFIG_KEYS

#: what a usable entry must hold (the rest of CONFIG_KEYS is optional)
REQUIRED_KEYS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")
#: seconds to wait for another process's write before giving up on persisting this one
LOCK_TIMEOUT_S = 60.0


def read_configs(path: Path) -> dict:
    """``{device: {key: config}}`` from one cache file; a missing file is empty.

    A file that is not JSON, or JSON of another shape, is treated as empty (and entries that
    are not configurations are dropped) with a ``RuntimeWarning`` naming the file: a damaged
    cache costs a re-tune, never a crash.
    """
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        warnings.warn(f"tuned-config cache {path} cannot be read ({exc}): treated as empty", RuntimeWarning,
                      stacklevel=2)
        return {}
    try:
        blob = json.loads(text)
    except ValueError as exc:
        warnings.warn(f"tuned-config cache {path} is not valid JSON ({exc}): treated as empty", RuntimeWarning,
                      stacklevel=2)
        return {}
    configs = blob.get("configs") if isinstance(blob, dict) else None
    if not isinstance(configs, dict):
        warnings.warn(f"tuned-config cache {path} does not hold {{'configs': {{device: {{key: config}}}}}} "
                      f"(got {type(blob).__name__}): treated as empty", RuntimeWarning, stacklevel=2)
        return {}
    out, dropped = {}, 0
    for device, table in configs.items():
        if not isinstance(table, dict):
            dropped += 1
            continue
        for key, cfg in table.items():
            if isinstance(cfg, dict) and all(isinstance(cfg.get(k), int) for k in REQUIRED_KEYS):
                out.setdefault(device, {})[key] = cfg
            else:
                dropped += 1
    if dropped:
        warnings.warn(f"tuned-config cache {path}: {dropped} entries that are not launch configurations "
                      f"(each needs integer {', '.join(REQUIRED_KEYS)}) were ignored", RuntimeWarning, stacklevel=2)
    return out


def read_capabilities(path: Path) -> dict[str, tuple[int, int]]:
    """``{device: (major, minor)}`` from a cache file's ``devices`` table (empty where it has none)."""
    try:
        blob = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}   # read_configs has warned about this file already
    table = blob.get("devices") if isinstance(blob, dict) else None
    return {device: tuple(cap) for device, cap in (table or {}).items()
            if isinstance(cap, list) and len(cap) == 2 and all(isinstance(c, int) for c in cap)}


class ConfigCache:
    """Winning launch configs per device and key: the user's file first, then the shipped one."""

    SHIPPED = DATA_DIR / "triton_fwd_configs.json"

    def __init__(self):
        cache_dir = os.environ.get("FA_LAB_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "fa_lab")
        self.user_path = Path(cache_dir) / "triton_fwd_configs.json"
        self.lock_path = self.user_path.with_name(self.user_path.name + ".lock")
        self._lock = threading.Lock()  # the file lock orders processes, this one the threads of one
        self._shipped = read_configs(self.SHIPPED)
        self._shipped_capability = read_capabilities(self.SHIPPED)
        self._user = read_configs(self.user_path)
        self._warned_unwritable = False

    def tables(self, device: str, capability: tuple[int, int] | None = None) -> list[dict]:
        """``{key: config}`` tables to look a key up in for ``device``, first to last: this machine's,
        the shipped one, then (given the device's ``capability``, only when it has no shipped entries
        of its own) the shipped tables of the devices of the same capability, by name."""
        out = [self._user.get(device, {}), self._shipped.get(device, {})]
        if capability is not None and device not in self._shipped:
            out += [self._shipped[other] for other in sorted(self._shipped)
                    if self._shipped_capability.get(other) == tuple(capability)]
        return out

    def _entry(self, device: str, key: str, capability) -> dict | None:
        return next((t[key] for t in self.tables(device, capability) if key in t), None)

    def get(self, device: str, key: str, capability: tuple[int, int] | None = None) -> dict | None:
        """The config tuned for ``key`` on ``device`` (without its timing), or None; with the
        device's ``capability``, a shipped entry of a device of the same architecture stands in."""
        cfg = self._entry(device, key, capability)
        return None if cfg is None else {k: cfg[k] for k in CONFIG_KEYS if k in cfg}

    def search(self, device: str, key: str, capability: tuple[int, int] | None = None) -> str | None:
        """How ``key``'s entry was chosen: ``"full"`` (the whole search; every shipped entry) or
        ``"quick"`` (among the winners of nearby keys, on a miss), None if there is no entry."""
        cfg = self._entry(device, key, capability)
        return None if cfg is None else cfg.get("search", "full")

    def put(self, device: str, key: str, cfg: dict) -> None:
        """Remember ``cfg`` for ``key`` here and in the user file (merged with what others wrote)."""
        with self._lock:
            self._user.setdefault(device, {})[key] = dict(cfg)
            try:
                self.user_path.parent.mkdir(parents=True, exist_ok=True)
                with FileLock(str(self.lock_path), timeout=LOCK_TIMEOUT_S):
                    merged = read_configs(self.user_path)
                    for dev, table in self._user.items():  # what only this process knows fills the gaps
                        for k, c in table.items():
                            merged.setdefault(dev, {}).setdefault(k, c)
                    merged[device][key] = dict(cfg)
                    self._write(merged)
                self._user = merged
            except (OSError, Timeout) as exc:
                if not self._warned_unwritable:  # a read-only home: the result still lives for this process
                    warnings.warn(f"tuned configs are not saved to {self.user_path} ({exc})", RuntimeWarning,
                                  stacklevel=2)
                    self._warned_unwritable = True

    def _write(self, configs: dict) -> None:
        # a temporary file of this writer's own, then an atomic rename: readers see the old file or the new
        fd, tmp = tempfile.mkstemp(dir=self.user_path.parent, prefix=self.user_path.name + ".", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"configs": configs}, f, indent=1, sort_keys=True)
            os.replace(tmp, self.user_path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def user_entries(self) -> dict:
        """``{device: {key: config}}`` tuned on this machine (the user file and this process)."""
        return self._user

    def shipped_entries(self) -> dict:
        """``{device: {key: config}}`` shipped with the package."""
        return self._shipped


CACHE = ConfigCache()
