"""Running Nsight Compute and reading its reports (chapter 11): the recorded CSVs as tidy tables.

``scripts/profile_ncu.py`` profiles the book's kernels with ``ncu`` and keeps, in ``fa_lab/data/ncu/``:

* ``details.csv`` — ``ncu --csv --page details``: one row per (launch, section, metric), the numbers of
  ncu's report pages, and one row per piece of advice from its rules;
* ``raw.csv`` — ``ncu --csv --page raw`` cut to the metrics the chapter reads: a row of units, then one
  row per launch, one column per metric;
* ``sass_counts.csv`` and ``sass_*.txt`` — instruction counts of each kernel and its hot loop
  (``fa_lab.perf.sass``), and the loop's instructions;

and ``fa_lab/data/gpu_profile.json`` (``fa_lab.bench.records``): what each launch computed (case,
problem, launch configuration), the ncu version and the command.  Reading::

    from fa_lab.perf import ncu
    profile = ncu.load()            # None until recorded
    profile.launches()              # one row per launch: case, time, SOL %, bytes, L2 hit rate, registers, occupancy
    profile.stalls()                # cycles per issued instruction by warp stall reason, per launch

On the GPU machine, ``find_ncu``, ``run``, ``available_sections``/``available_metrics`` and ``export``
are the pieces ``scripts/profile_ncu.py`` runs ncu with.
"""
from __future__ import annotations

import csv
import io
import math
import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from fa_lab.core.data import DATA_DIR

RECORDING = "gpu_profile"
SUBDIR = "ncu"
DETAILS, RAW, SASS_COUNTS = "details.csv", "raw.csv", "sass_counts.csv"
NOT_RECORDED = "(not recorded)"

#: ncu's units with a prefix -> (base unit, factor); ncu's prefixes are decimal (1 Kbyte = 1000 bytes)
_PREFIX = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_TIME = {"nsecond": 1e-9, "usecond": 1e-6, "msecond": 1e-3, "second": 1.0, "ns": 1e-9, "us": 1e-6,
         "ms": 1e-3, "s": 1.0}


def to_base(value: float, unit: str) -> tuple[float, str]:
    """``(value, unit)`` in base units: byte (and byte/second, byte/block...), second, hz; others unchanged."""
    u = (unit or "").strip()
    if u in _TIME:
        return value * _TIME[u], "second"
    m = re.fullmatch(r"([KMGT]?)(?:byte|B)(/\w+)?", u)
    if m:
        per = {"/s": "/second"}.get(m.group(2), m.group(2)) or ""
        return value * _PREFIX[m.group(1)], f"byte{per}"
    m = re.fullmatch(r"cycle/([num]?)second", u)
    if m:
        return value / {"": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}[m.group(1)], "hz"
    m = re.fullmatch(r"([KMGT]?)hz", u, re.I)
    if m:
        return value * _PREFIX[m.group(1).upper()], "hz"
    return value, u


def number(text) -> float:
    """A metric value as ncu prints it (``1,234,567.8``, ``n/a``, ``(128, 1, 1)``) -> float (NaN if none)."""
    t = str(text).strip().replace(",", "")
    try:
        return float(t)
    except ValueError:
        return math.nan


def short_name(kernel: str) -> str:
    """``attn_fwd`` for ``attn_fwd``, ``flash_attention_fwd`` for Numba's
    ``cudapy::fa_lab::...::flash_attention_fwd[abi:v1,...](Array<float, 4, C, ...>, ...)`` and for its
    mangled form ``_ZN6cudapy6fa_lab...19flash_attention_fwdB2v1...E...``."""
    name = str(kernel).strip()
    if name.startswith("_ZN"):            # Itanium mangling: length-prefixed parts up to an ABI tag or E
        parts, i = [], 3
        while i < len(name) and name[i].isdigit():
            j = i
            while j < len(name) and name[j].isdigit():
                j += 1
            n = int(name[i:j])
            parts.append(name[j:j + n])
            i = j + n
        return parts[-1] if parts else name
    name = name.split("(", 1)[0]
    name = re.sub(r"\[[^\]]*\]$", "", name)
    name = re.sub(r"<[^<>]*>$", "", name)      # a template's arguments
    return name.rsplit("::", 1)[-1].strip()


def csv_table(source) -> tuple[list[str], list[list[str]]]:
    """The header and rows of ncu's ``--csv`` output (text or a path), without the ``==PROF==`` lines around it."""
    text = Path(source).read_text(encoding="utf-8") if isinstance(source, Path) else str(source)
    m = re.search(r'^"ID",', text, re.M)
    if m is None:
        raise ValueError("no ncu CSV in this text: expected a header line starting with \"ID\"")
    rows = list(csv.reader(io.StringIO(text[m.start():])))
    header = rows[0]
    # ncu 2025 ends a metric row after its value: the rule columns of the header are left out, not empty
    least = header.index("Metric Value") + 1 if "Metric Value" in header else len(header)
    return header, [r + [""] * (len(header) - len(r)) for r in rows[1:] if least <= len(r) <= len(header)]


_LAUNCH_COLUMNS = {"ID": "id", "Kernel Name": "kernel_name", "Block Size": "block", "Grid Size": "grid",
                   "Device": "device", "CC": "cc"}


def _details_frame(source) -> pd.DataFrame:
    header, rows = csv_table(source)
    df = pd.DataFrame(rows, columns=header)
    for col in ("Rule Name", "Rule Type", "Rule Description", "Estimated Speedup Type", "Estimated Speedup"):
        if col not in df:
            df[col] = ""
    df = df.rename(columns=_LAUNCH_COLUMNS)
    df["id"] = df["id"].astype(int)
    df["kernel"] = df["kernel_name"].map(short_name)
    return df


def read_details(source) -> pd.DataFrame:
    """ncu's details page: one row per (launch, section, metric) with ``id``, ``kernel``, ``section``,
    ``metric``, ``unit`` and ``value`` in base units (NaN where the value is text: kept in ``text``)."""
    df = _details_frame(source)
    df = df[df["Metric Name"] != ""].copy()
    raw_value = df["Metric Value"].map(number)
    based = [to_base(v, u) for v, u in zip(raw_value, df["Metric Unit"])]
    out = df[["id", "kernel", "kernel_name", "block", "grid", "device", "cc"]].copy()
    out["section"] = df["Section Name"].values
    out["metric"] = df["Metric Name"].values
    out["unit"] = [u for _, u in based]
    out["value"] = [v for v, _ in based]
    out["text"] = df["Metric Value"].values
    return out.reset_index(drop=True)


def read_rules(source) -> pd.DataFrame:
    """The advice of ncu's rules in a details page: ``id``, ``kernel``, ``section``, ``rule``, ``type``
    (OPT, WRN, INF), ``description`` and the ``speedup`` ncu estimates (percent, NaN if none)."""
    df = _details_frame(source)
    df = df[df["Rule Name"] != ""]
    return pd.DataFrame(dict(id=df["id"].values, kernel=df["kernel"].values, section=df["Section Name"].values,
                             rule=df["Rule Name"].values, type=df["Rule Type"].values,
                             description=df["Rule Description"].values,
                             speedup=df["Estimated Speedup"].map(number).values))


def read_raw(source) -> pd.DataFrame:
    """ncu's raw page (a units row, then one row per launch) in long form: ``id``, ``kernel``,
    ``metric``, ``unit``, ``value`` (base units)."""
    header, rows = csv_table(source)
    units = rows[0] if rows and rows[0][0] == "" else [""] * len(header)
    launches = [r for r in rows if r[0] != ""]
    first = header.index("CC") + 1 if "CC" in header else next(i for i, h in enumerate(header) if "__" in h)
    out = []
    for r in launches:
        for name, unit, text in zip(header[first:], units[first:], r[first:]):
            value, base = to_base(number(text), unit)
            out.append(dict(id=int(r[0]), kernel=short_name(r[header.index("Kernel Name")]), metric=name,
                            unit=base, value=value))
    return pd.DataFrame(out, columns=["id", "kernel", "metric", "unit", "value"])


#: headline metrics of a details page: column -> (words in the section's name, metric name)
HEADLINE = {
    "duration_s": ("speed of light", "Duration"),
    "sm_clock_hz": ("speed of light", "SM Frequency"),
    "sm_pct": ("speed of light", "Compute (SM) Throughput"),
    "memory_pct": ("speed of light", "Memory Throughput"),
    "dram_pct": ("speed of light", "DRAM Throughput"),
    "l1_pct": ("speed of light", "L1/TEX Cache Throughput"),
    "l2_pct": ("speed of light", "L2 Cache Throughput"),
    "l2_hit_pct": ("memory workload", "L2 Hit Rate"),
    "l1_hit_pct": ("memory workload", "L1/TEX Hit Rate"),
    "mem_pipes_pct": ("memory workload", "Mem Pipes Busy"),
    "ipc": ("compute workload", "Executed Ipc Active"),
    "issue_busy_pct": ("compute workload", "Issue Slots Busy"),
    "warp_cycles_per_issue": ("warp state", "Warp Cycles Per Issued Instruction"),
    "eligible_warps": ("scheduler", "Eligible Warps Per Scheduler"),
    "no_eligible_pct": ("scheduler", "No Eligible"),
    "registers": ("launch", "Registers Per Thread"),
    "threads": ("launch", "Block Size"),
    "blocks": ("launch", "Grid Size"),
    "waves": ("launch", "Waves Per SM"),
    "smem_dynamic": ("launch", "Dynamic Shared Memory Per Block"),
    "smem_static": ("launch", "Static Shared Memory Per Block"),
    "sms": ("launch", "# SMs"),
    "limit_registers": ("occupancy", "Block Limit Registers"),
    "limit_shared": ("occupancy", "Block Limit Shared Mem"),
    "limit_warps": ("occupancy", "Block Limit Warps"),
    "limit_sm": ("occupancy", "Block Limit SM"),
    "theoretical_occupancy_pct": ("occupancy", "Theoretical Occupancy"),
    "achieved_occupancy_pct": ("occupancy", "Achieved Occupancy"),
    "achieved_warps": ("occupancy", "Achieved Active Warps Per SM"),
}
#: headline metrics of the raw page: column -> metric
RAW_HEADLINE = {"dram_read_bytes": "dram__bytes_read.sum", "dram_write_bytes": "dram__bytes_write.sum",
                "l2_bytes": "lts__t_bytes.sum", "xu_instructions": "sm__inst_executed_pipe_xu.sum",
                "tensor_pipe_pct": "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
                "fma_pipe_pct": "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active",
                "smem_config": "launch__shared_mem_config_size",
                "smem_driver": "launch__shared_mem_per_block_driver"}
#: the resources that can cap resident blocks per SM (ncu's "Block Limit ..." rows)
LIMITS = {"limit_registers": "registers", "limit_shared": "shared memory", "limit_warps": "warps",
          "limit_sm": "blocks per SM"}


def headline(details: pd.DataFrame, raw: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per launch (``id``, ``kernel``, ``grid``, ``block``) with the ``HEADLINE`` and
    ``RAW_HEADLINE`` columns (NaN where the report lacks one), ``dram_bytes`` (read + write) and
    ``blocks_per_sm`` / ``limiter``: the tightest of the block limits and what sets it."""
    launches = details.drop_duplicates("id")[["id", "kernel", "grid", "block"]].set_index("id")
    section = details["section"].str.lower()
    for col, (words, metric) in HEADLINE.items():
        hit = details[section.str.contains(words, regex=False) & (details["metric"] == metric)]
        launches[col] = hit.drop_duplicates("id").set_index("id")["value"]
    if raw is not None and len(raw):
        wide = raw.pivot_table(index="id", columns="metric", values="value", aggfunc="first")
        for col, metric in RAW_HEADLINE.items():
            if metric in wide:
                launches[col] = wide[metric]
    for col in RAW_HEADLINE:
        if col not in launches:
            launches[col] = math.nan
    launches["dram_bytes"] = launches["dram_read_bytes"] + launches["dram_write_bytes"]
    limits = launches[list(LIMITS)]
    launches["blocks_per_sm"] = limits.min(axis=1)
    launches["limiter"] = [" and ".join(LIMITS[c] for c in LIMITS if row[c] == row.min()) if row.notna().any()
                           else "" for _, row in limits.iterrows()]
    return launches.reset_index()


def bound(sm_pct: float, memory_pct: float, threshold: float = 60.0) -> str:
    """What limits a launch by its speed-of-light numbers: 'compute' or 'memory' when the busier side
    reaches ``threshold`` percent of its peak, else 'latency' (neither unit is kept busy)."""
    if max(sm_pct, memory_pct) < threshold:
        return "latency"
    return "compute" if sm_pct >= memory_pct else "memory"


_STALL = re.compile(r"^smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$")
_SAMPLE = re.compile(r"^smsp__pcsamp_warps_issue_stalled_(\w+)$")


def stall_reasons(raw: pd.DataFrame) -> pd.DataFrame:
    """Per launch and stall reason: ``cycles`` (of the warp cycles between two issued instructions, how
    many it spends in that state; ncu's Warp State Statistics) and ``share`` of their sum.  From the
    sampled counts (``smsp__pcsamp_warps_issue_stalled_*``) where the ratios are missing."""
    rows = []
    for pattern, kind in ((_STALL, "ratio"), (_SAMPLE, "samples")):
        for r in raw.itertuples():
            m = pattern.match(r.metric)
            if m and not m.group(1).endswith("not_issued") and not math.isnan(r.value):
                rows.append(dict(id=r.id, kernel=r.kernel, reason=m.group(1), cycles=r.value, kind=kind))
        if rows:
            break
    df = pd.DataFrame(rows, columns=["id", "kernel", "reason", "cycles", "kind"])
    df["share"] = df["cycles"] / df.groupby("id")["cycles"].transform("sum")
    return df.sort_values(["id", "cycles"], ascending=[True, False]).reset_index(drop=True)


def assign_cases(launches, plan) -> dict:
    """Which case and kernel of the plan each profiled launch is: ``{id: (case, kernel)}``.  ``launches``:
    ``(id, kernel name as ncu reports it)`` in launch order; ``plan``: ``(case, kernel, optional)`` in the
    order the profiled program launches them.  Raises ValueError when the launches do not follow the plan
    (a kernel missing, extra or out of order)."""
    out, i = {}, 0
    for launch_id, kernel in launches:
        name = short_name(kernel)
        while i < len(plan) and plan[i][1] != name and plan[i][2]:
            i += 1
        if i == len(plan) or plan[i][1] != name:
            raise ValueError(f"launch {launch_id} ({name}) does not follow the plan "
                             f"{[(c, k) for c, k, _ in plan]}")
        out[launch_id] = plan[i][:2]
        i += 1
    missing = [f"{c}/{k}" for c, k, optional in plan[i:] if not optional]
    if missing:
        raise ValueError(f"no profiled launch of {missing}")
    return out


# ----------------------------------------------------------------------------- running ncu (GPU machine)

def find_ncu() -> str | None:
    """The ``ncu`` on PATH, or in the CUDA toolkit's usual places; None if there is none."""
    return shutil.which("ncu") or next((p for p in ("/usr/local/cuda/bin/ncu", "/opt/nvidia/nsight-compute/ncu")
                                        if Path(p).exists()), None)


def run(cmd, timeout: float) -> subprocess.CompletedProcess:
    """``cmd`` with its output captured; past ``timeout`` seconds its whole process group is ended (ncu and
    the program it profiles) and ``subprocess.TimeoutExpired`` raised."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def version(tool: str) -> str:
    """``2025.1.1.0 (build 35528883)``, from ``ncu --version``."""
    out = run([tool, "--version"], 60).stdout
    m = re.search(r"Version\s+([\w.\-]+(?:\s+\(build\s+\d+\))?)", out)
    return m.group(1) if m else (out.strip().splitlines() or ["unknown"])[-1]


def available_sections(tool: str, wanted) -> list[str]:
    """The sections of ``wanted`` this ncu has (``--list-sections``); all of them where it cannot say."""
    try:
        listed = set(re.findall(r"^\s*(\w+)\s", run([tool, "--list-sections"], 120).stdout, re.M))
    except (OSError, subprocess.SubprocessError):
        return list(wanted)
    return [s for s in wanted if s in listed] if listed & set(wanted) else list(wanted)


def available_metrics(tool: str, wanted, fallback=()) -> list[str]:
    """The metrics of ``wanted`` this GPU has (``--query-metrics``: an unknown name makes ncu refuse the
    whole run); where ncu cannot list them, those of ``wanted`` in ``fallback``."""
    try:
        listed = set(re.findall(r"^\s*([a-z0-9]+__\w+)", run([tool, "--query-metrics"], 180).stdout, re.M))
    except (OSError, subprocess.SubprocessError):
        listed = set()
    if not listed:
        return [m for m in wanted if m in fallback]
    return [m for m in wanted if m.split(".", 1)[0] in listed]


def export(tool: str, report: Path, page: str) -> str:
    """``ncu -i REPORT --csv --page PAGE --print-units base``: the report's ``details`` or ``raw`` page."""
    out = run([tool, "-i", str(report), "--csv", "--page", page, "--print-units", "base"], 300)
    if out.returncode != 0:
        raise RuntimeError(f"ncu --page {page} rc={out.returncode}: {out.stderr[-500:]}")
    return out.stdout


def cut_raw(text: str, keep=(), patterns=()) -> str:
    """A raw page with only its launch columns and the metrics named in ``keep`` or matching ``patterns``."""
    header, rows = csv_table(text)
    first = header.index("CC") + 1 if "CC" in header else 0
    wanted = [i for i, h in enumerate(header) if i < first or h in keep or any(re.match(p, h) for p in patterns)]
    buf = io.StringIO()
    writer = csv.writer(buf, quoting=csv.QUOTE_ALL, lineterminator="\n")
    for r in [header, *rows]:
        writer.writerow([r[i] for i in wanted])
    return buf.getvalue()


def cut_details(text: str) -> str:
    """A details page without the rules' descriptions (ncu's paragraphs of advice, which the chapter does not
    read); every other field, and each rule's name, type and estimated speed-up, as ncu wrote them."""
    lines = text.splitlines(keepends=True)
    rows = list(csv.reader(io.StringIO(text)))
    if len(rows) != len(lines) or not rows or "Rule Description" not in rows[0]:
        raise ValueError("not an ncu details page of one line per row with a \"Rule Description\" column")
    column = rows[0].index("Rule Description")
    buf = io.StringIO()
    writer = csv.writer(buf, quoting=csv.QUOTE_ALL, lineterminator="\n")
    for i, (line, row) in enumerate(zip(lines, rows)):
        if i > 0 and len(row) > column and row[column]:
            row[column] = ""
            writer.writerow(row)
        else:
            buf.write(line)
    return buf.getvalue()


# ----------------------------------------------------------------------------- one recording

@dataclass
class Profile:
    """One recording: its ``meta`` and ``records`` (gpu_profile.json) and the tables read from ncu's CSVs."""

    meta: dict
    records: pd.DataFrame
    details: pd.DataFrame
    rules: pd.DataFrame
    raw: pd.DataFrame
    sass: pd.DataFrame
    directory: Path

    def launches(self) -> pd.DataFrame:
        """The headline table, one row per profiled launch, with the case and problem of each."""
        head = headline(self.details, self.raw).drop(columns=["kernel"])   # the plan's names, not ncu's
        keep = [c for c in self.records.columns if c not in head.columns or c == "id"]
        return self.records[keep].merge(head, on="id", how="inner")

    def stalls(self) -> pd.DataFrame:
        """``stall_reasons`` of every labelled launch, with its ``case``."""
        df = stall_reasons(self.raw).drop(columns=["kernel"])
        return df.merge(self.records[["id", "case", "kernel"]], on="id", how="inner")

    def launch(self, case: str, kernel: str) -> pd.Series | None:
        """The headline row of one case's kernel, or None."""
        df = self.launches()
        hit = df[(df["case"] == case) & (df["kernel"] == kernel)]
        return hit.iloc[0] if len(hit) else None

    def sass_text(self, case: str, kernel: str) -> str | None:
        path = self.directory / SUBDIR / f"sass_{case}_{kernel}.txt"
        return path.read_text(encoding="utf-8") if path.exists() else None


def load(directory=None) -> Profile | None:
    """The recording in ``directory`` (default ``fa_lab/data``), or None if it was never made, or holds
    no ncu report or no launch it could label (a run whose profiling failed records only its status)."""
    from fa_lab.bench import records as recorded

    base = Path(directory) if directory is not None else DATA_DIR
    index, folder = base / f"{RECORDING}.json", base / SUBDIR
    if not index.exists() or not (folder / DETAILS).exists():
        return None
    meta, recs = recorded.read(index)
    recs = [r for r in recs if r.get("id") is not None]
    if not recs:                # profiled, but no launch could be labelled: its status is in the meta
        return None
    raw = read_raw(folder / RAW) if (folder / RAW).exists() else pd.DataFrame(columns=["id", "kernel", "metric",
                                                                                         "unit", "value"])
    sass = pd.read_csv(folder / SASS_COUNTS) if (folder / SASS_COUNTS).exists() else pd.DataFrame()
    records = pd.DataFrame.from_records(recs)
    return Profile(meta, records, read_details(folder / DETAILS), read_rules(folder / DETAILS), raw, sass, base)


__all__ = ["RECORDING", "SUBDIR", "DETAILS", "RAW", "SASS_COUNTS", "NOT_RECORDED", "HEADLINE", "RAW_HEADLINE",
           "LIMITS", "to_base", "number", "short_name", "csv_table", "read_details", "read_rules", "read_raw",
           "headline", "bound", "stall_reasons", "assign_cases", "find_ncu", "run", "version", "available_sections",
           "available_metrics", "export", "cut_raw", "cut_details", "Profile", "load"]
