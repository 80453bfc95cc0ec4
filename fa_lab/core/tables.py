"""One way to show a table of results, in the book and in the CLI.

Measurements arrive as records or DataFrames with machine columns (``ms``, ``tflops``,
``peak_extra_bytes``, ``status``).  ``frame`` turns them into a table a reader can take in::

    from fa_lab.core.tables import table
    table(records)                      # a pandas Styler: the notebook shows it
    table(pivot, values="tflops")       # every value column is TFLOP/s (a pivot's columns are names)

* units go into the column names, scaled per column (``time (µs)``, ``TFLOP/s``, ``peak extra (MiB)``);
* numbers keep 3 significant figures (errors in scientific notation);
* a missing number says why: the row's short status (``OOM``, ``unsupported``, ``error``) when it
  failed, ``—`` when it ran and simply has no such number;
* the index becomes ordinary columns (a pivot's row labels) or goes (a plain row count);
* a column with one value in every row is dropped and said once, in the caption;
* configurations read as short labels (``64×128 w4 s1``), dtypes as ``fp32``.

``rich_table`` renders the same table for a terminal (``fa-lab`` commands).
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping

#: machine column name -> (label, kind); the kind decides the unit and how a value is written
COLUMNS = {
    "impl": ("implementation", "text"), "kernel": ("kernel", "text"),
    "batch": ("B", "int"), "heads": ("H", "int"), "kv_heads": ("Hkv", "int"),
    "n_q": ("Nq", "int"), "n_k": ("Nk", "int"), "head_dim": ("D", "int"), "N": ("N", "int"),
    "dtype": ("dtype", "dtype"),
    "ms": ("time", "ms"), "ms_p10": ("p10", "ms"), "ms_p90": ("p90", "ms"),
    "ms_back_to_back": ("back to back", "ms"), "measured_ms": ("measured", "ms"),
    "predicted_ms": ("predicted", "ms"), "ideal_ms": ("ideal", "ms"),
    "tflops": ("", "tflops"), "tflops_executed": ("executed", "tflops"),
    "flops": ("work", "flops"), "flops_visible": ("visible work", "flops"),
    "flops_executed": ("executed work", "flops"),
    "peak_extra_bytes": ("peak extra", "bytes"), "saved_bytes": ("saved", "bytes"),
    "hbm_bytes": ("HBM traffic", "bytes"), "compulsory_bytes": ("compulsory traffic", "bytes"),
    "io_bytes": ("q, k, v, o", "bytes"), "shared_bytes": ("shared memory", "bytes"),
    "max_abs_err": ("max error", "error"), "max_abs_err_grad": ("max error of grads", "error"),
    "memory_source": ("memory from", "text"), "timer": ("timer", "text"), "world": ("world", "text"),
    "status": ("status", "status"), "speedup": ("speedup", "ratio"),
    "gpu_us": ("GPU time", "us"), "back_to_back_us": ("per call, back to back", "us"),
    "host_overhead_us": ("host overhead", "us"), "host_us_per_call": ("host, per call", "us"),
    "gpu_us_cudagraph": ("GPU alone (CUDA graph)", "us"), "mem_vs_naive": ("memory of naive ÷ this", "ratio"),
}

#: (unit, factor) from the largest unit down, per kind: a column takes the first unit in which
#: its largest value is at least 1
UNITS = {
    "s": [("s", 1.0), ("ms", 1e3), ("µs", 1e6)],
    "ms": [("s", 1e-3), ("ms", 1.0), ("µs", 1e3), ("ns", 1e6)],
    "us": [("s", 1e-6), ("ms", 1e-3), ("µs", 1.0), ("ns", 1e3)],
    "bytes": [("GiB", 2.0**-30), ("MiB", 2.0**-20), ("KiB", 2.0**-10), ("B", 1.0)],
    "GB": [("GB", 1.0), ("MB", 1e3), ("kB", 1e6)],
    "tflops": [("PFLOP/s", 1e-3), ("TFLOP/s", 1.0), ("GFLOP/s", 1e3), ("MFLOP/s", 1e6), ("kFLOP/s", 1e9)],
    "flops": [("PFLOP", 1e-15), ("TFLOP", 1e-12), ("GFLOP", 1e-9), ("MFLOP", 1e-6), ("kFLOP", 1e-3), ("FLOP", 1.0)],
}
#: kinds written as right-aligned numbers
NUMERIC = {"int", "float", "error", "ratio", "percent", *UNITS}
MISSING = "—"
#: text cells up to this many characters are kept on one line in the book
SHORT = 32
#: how a failed run's status starts (``fa_lab.bench``: 'oom', 'unsupported: why', ...)
STATUS_WORDS = ("oom", "unsupported", "error", "skipped", "missing", "not ")


# ----------------------------------------------------------------------------- single values

def sig(x, digits: int = 3) -> str:
    """``x`` to ``digits`` significant figures: ``5.43``, ``0.0123``, ``12,300``, ``5.40e-07``."""
    if _missing(x):
        return MISSING
    x = float(x)
    if math.isinf(x):
        return "∞" if x > 0 else "−∞"
    if x == 0:
        return "0"
    exponent = math.floor(math.log10(abs(x)))
    rounded = round(x, digits - 1 - exponent)
    if math.floor(math.log10(abs(rounded))) > exponent:   # 0.99996 rounds up to 1.00
        exponent += 1
    if exponent < -3 or exponent >= 6:
        return f"{x:.{digits - 1}e}"
    return f"{rounded:,.{max(0, digits - 1 - exponent)}f}"


def sci(x, digits: int = 3) -> str:
    """Scientific notation with ``digits`` significant figures (errors: ``1.19e-07``), ``0`` for zero."""
    if _missing(x):
        return MISSING
    return "0" if float(x) == 0 else f"{float(x):.{digits - 1}e}"


def config_label(obj) -> str:
    """A launch configuration or shape as a short label.

    Triton's launch dicts read ``64×128 w4 s1`` (BLOCK_M×BLOCK_N, warps, stages, then flags such
    as ``ws``); the tiled Numba kernel's ``TileConfig`` reads ``64×32 t16×8`` (the block's tile,
    its threads; then ``shared K/V`` and a register cap ``r128``); a benchmark ``Shape`` its
    ``(B, H, N, D)`` label; other dataclasses ``k=v``.
    """
    if hasattr(obj, "label") and isinstance(getattr(type(obj), "label", None), property):
        return obj.label
    fields = dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) and not isinstance(obj, type) else obj
    if isinstance(fields, Mapping):
        if "BLOCK_M" in fields and "BLOCK_N" in fields:
            label = f"{fields['BLOCK_M']}×{fields['BLOCK_N']}"
            if fields.get("num_warps") is not None:
                label += f" w{fields['num_warps']}"
            if fields.get("num_stages") is not None:
                label += f" s{fields['num_stages']}"
            flags = [k for k in ("ws", "paired", "emu") if fields.get(k)]
            return " ".join([label, *flags])
        if {"block_m", "block_n", "threads_m", "threads_n"} <= set(fields):
            label = f"{fields['block_m']}×{fields['block_n']} t{fields['threads_m']}×{fields['threads_n']}"
            label += " shared K/V" if fields.get("share_kv") else ""
            label += f" r{fields['max_registers']}" if fields.get("max_registers") else ""
            return label
        return " ".join(f"{k}={_text(v)}" for k, v in fields.items() if v is not None)
    return _text(obj)


def _missing(x) -> bool:
    if x is None:
        return True
    try:
        import pandas as pd

        return bool(pd.isna(x)) if not isinstance(x, (list, tuple, dict)) else False
    except (TypeError, ValueError):
        return False


def _text(x) -> str:
    if _missing(x):
        return MISSING
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return str(int(x)) if x.is_integer() else sig(x)
    if isinstance(x, tuple):
        return "(" + ", ".join(_text(v) for v in x) + ")"
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return config_label(x)
    if isinstance(x, Mapping):
        return config_label(x) if x else MISSING
    if type(x).__module__ == "torch" and type(x).__name__ == "dtype":
        return _dtype(x)
    return str(x)


def _dtype(x) -> str:
    from fa_lab.core.dtypes import short_name

    try:
        return short_name(x)
    except (TypeError, ValueError):
        return _text(x) if not isinstance(x, str) else x


def short_status(status) -> str:
    """``'ok'``, ``'OOM'``, ``'unsupported'``, ``'error'`` (the message after the colon left out)."""
    if _missing(status):
        return MISSING
    head = str(status).split(":")[0].strip()
    return "OOM" if head.lower().startswith("oom") else head


# ----------------------------------------------------------------------------- columns

def _kind(name: str, series) -> tuple[str, str]:
    """(label without unit, kind) of one column, from its name, else from its values."""
    import pandas as pd

    if name in COLUMNS:
        return COLUMNS[name]
    low = name.lower()
    for suffix, kind in (("_ms", "ms"), ("_us", "us"), (" µs", "us"), ("_bytes", "bytes"), ("_gb", "GB"),
                         ("_tflops", "tflops")):
        if low.endswith(suffix):
            return name[: -len(suffix)].replace("_", " ").strip(), kind
    for prefix, words in (("max_abs_err_", "max error of "), ("max_err_", "max error of "), ("err_", "error of ")):
        if low.startswith(prefix):   # max_err_dQ -> "max error of dQ"
            return words + name[len(prefix):].replace("_", " "), "error"
    if low.startswith(("max_err", "max_abs_err")) or low.endswith(("_err", "_error")):
        return name.replace("_", " "), "error"
    if low.startswith(("ratio", "vs_", "speedup")) or " / " in name:
        return name.replace("_", " "), "ratio"
    if pd.api.types.is_bool_dtype(series):
        return name.replace("_", " "), "text"
    if pd.api.types.is_integer_dtype(series):
        return name.replace("_", " "), "int"
    if pd.api.types.is_float_dtype(series):
        finite = series.dropna()
        integral = len(finite) > 0 and bool((finite == finite.round()).all()) and bool((finite.abs() < 1e15).all())
        return name.replace("_", " "), "int" if integral else "float"
    return name.replace("_", " "), "text"


def _mixed(series) -> bool:
    """Numbers, with a status where a run failed (``report.seed_table``'s cells), or only statuses."""
    cells = [v for v in series if not _missing(v)]
    return bool(cells) and all(_number(v) or (isinstance(v, str) and v.lower().startswith(STATUS_WORDS))
                               for v in cells)


def _pick_unit(values, kind: str) -> tuple[str, float]:
    units = UNITS[kind]
    finite = [abs(float(v)) for v in values if _number(v) and math.isfinite(float(v)) and float(v) != 0]
    if not finite:
        return units[1] if len(units) > 1 else units[0]
    # the largest unit in which the column's largest value reads at least 1: 815 ms beside 0.177 ms
    # rather than 815,000 µs beside 177 µs
    largest = max(finite)
    for unit, factor in units:
        if largest * factor >= 1:
            return unit, factor
    return units[-1]


def _number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _format_column(series, kind: str, digits: int, unit=None) -> tuple[list[str], str]:
    """The column's cells as text, and its unit ('' when it has none); ``unit``: (name, factor) to use.

    A text cell in a numeric column (a pivot that holds a failed run's status) reads as that status.
    """
    if kind not in NUMERIC:
        if kind == "dtype":
            return [MISSING if _missing(v) else _dtype(v) for v in series], ""
        if kind == "status":
            return [short_status(v) for v in series], ""
        return [_text(v) for v in series], ""
    numbers = [v for v in series if not isinstance(v, str)]
    if kind in UNITS:
        unit, factor = unit or _pick_unit(numbers, kind)
        write = lambda v: sig(float(v) * factor, digits)  # noqa: E731
    else:
        unit = ""
        write = {"int": lambda v: f"{int(v)}", "float": lambda v: sig(v, digits), "error": lambda v: sci(v, digits),
                 "ratio": lambda v: sig(v, digits) + "×",
                 "percent": lambda v: sig(100 * float(v), digits) + "%"}[kind]   # a fraction: 0.076 -> 7.6%
    return [short_status(v) if isinstance(v, str) else MISSING if _missing(v) else write(v) for v in series], unit


def _with_unit(label: str, unit: str) -> str:
    if not unit:
        return label
    return f"{label} ({unit})" if label else unit


# ----------------------------------------------------------------------------- tables

def _as_frame(data):
    import pandas as pd

    if isinstance(data, pd.DataFrame):
        df = data.copy()
    else:
        df = pd.DataFrame.from_records(list(data.values()) if isinstance(data, Mapping) else list(data))
    if isinstance(df.columns, pd.MultiIndex):   # a pivot over several keys: one header row
        df.columns = [" · ".join(_header(part, level) for part, level in zip(col, df.columns.names) if str(part))
                      for col in df.columns]
    else:
        df.columns = [_header(c, df.columns.name) for c in df.columns]
    named = any(n is not None for n in df.index.names)
    if named or not isinstance(df.index, pd.RangeIndex):
        df.index.names = [n if n is not None else "" for n in df.index.names]
        df = df.reset_index()
    return df.reset_index(drop=True)


def _header(value, level) -> str:
    # a pivot on a flag (causal) names it: "causal" / "not causal" rather than "yes" / "no"
    if isinstance(value, bool) and level:
        return str(level) if value else f"not {level}"
    return _text(value)


def frame(data, *, columns=None, rename: Mapping | None = None, kinds: Mapping | None = None,
          values: str | None = None, keep=(), caption: str | None = None, digits: int = 3,
          drop_constant: bool = True):
    """A display-ready DataFrame of text (units in the column names); its caption in ``.attrs["caption"]``.

    ``data``: a DataFrame (its index kept as columns when it has names) or records (dicts).
    ``columns``: which machine columns to show, in order (default: all).  ``rename``: labels
    for machine columns (the unit is still appended).  ``kinds``: a kind per column where the
    name does not say it: ``"s"``, ``"ms"``, ``"us"``, ``"bytes"``, ``"GB"``, ``"tflops"``, ``"flops"``,
    ``"error"``, ``"ratio"``, ``"percent"`` (of a fraction), ``"int"``, ``"float"``, ``"text"``.
    ``values``: the kind of every column that is not in the vocabulary (a pivot's value
    columns), or the machine column they hold (``"ms"``, ``"peak_extra_bytes"``); their unit
    goes to the caption.  ``keep``: columns never dropped as constant.
    """
    df = _as_frame(data)
    status = df["status"] if "status" in df.columns else None   # used even when not shown
    if columns is not None:
        missing = [c for c in columns if c not in df.columns]
        if missing:
            raise KeyError(f"no column {missing} in the table; it has {list(df.columns)}")
        df = df[list(columns)]
    failed = [short_status(s) if not _missing(s) and short_status(s) != "ok" else None
              for s in (status if status is not None else [None] * len(df))]
    rename, kinds = dict(rename or {}), dict(kinds or {})
    # values: a kind ("ms"), or a machine column whose kind and label it takes ("peak_extra_bytes")
    values_label, values = COLUMNS[values] if values in COLUMNS else ("", values)

    out, labels, shared_units, numeric = {}, [], [], []
    plan = {}
    for name in df.columns:
        label, kind = _kind(name, df[name])
        if name in kinds:
            kind = kinds[name]
        elif values is not None and name not in COLUMNS and (kind in ("int", "float") or _mixed(df[name])):
            kind, label = values, name
            plan[name] = (label, kind, True)
            continue
        plan[name] = (label, kind, False)
    # a pivot's value columns share one unit, named once in the caption
    shared = [name for name, (_, _, is_value) in plan.items() if is_value]
    shared_unit = (_pick_unit([v for name in shared for v in df[name]], values)
                   if shared and values in UNITS else None)
    for name, (label, kind, is_value) in plan.items():
        cells, unit = _format_column(df[name], kind, digits, shared_unit if is_value else None)
        if is_value:
            shared_units.append(unit)
            unit = ""
        if kind in NUMERIC:   # a failed row says why it has no number, instead of a dash
            cells = [f if c == MISSING and f else c for c, f in zip(cells, failed)]
        label = _with_unit(rename.get(name, label), unit)
        base, n = label, 2
        while label in labels:   # two machine columns can land on one label
            label, n = f"{base} {n}", n + 1
        labels.append(label)
        out[label] = cells
        if kind in NUMERIC:
            numeric.append(label)

    import pandas as pd

    shown = pd.DataFrame(out, columns=labels, dtype=object)
    notes = []
    if shared_units and len(set(shared_units)) == 1 and shared_units[0]:   # "time (ms)", "TFLOP/s"
        notes.append(_with_unit(values_label, shared_units[0]))
    if drop_constant and len(shown) > 1:
        keep_labels = {labels[list(df.columns).index(c)] for c in keep if c in df.columns}
        for name, label in zip(list(df.columns), labels):
            # a failed row's gaps do not make a column vary (a skipped run records only what it skipped)
            seen = ({c for c, f in zip(shown[label], failed) if name == "status" or not (f and c in (MISSING, f))}
                    or {MISSING})
            if label in keep_labels or len(seen) != 1 or len(shown.columns) == 1:
                continue
            value = seen.pop()
            if not (value == MISSING or (name == "status" and value == "ok")):
                notes.append(f"{label}: {value}")
            shown = shown.drop(columns=label)
            if label in numeric:
                numeric.remove(label)
    text = " · ".join(p for p in [caption, *notes] if p)
    shown.attrs.update(caption=text, numeric=numeric)
    return shown


def table(data, caption: str | None = None, **options):
    """``frame(data, ...)`` as a pandas Styler: no index, numbers right-aligned, the caption above.

    ``caption`` starts the caption (what was constant follows it); ``options`` are ``frame``'s.
    The book's stylesheet (``_static/book.css``) pads every cell of a ``results-table``.
    """
    shown = frame(data, caption=caption, **options)
    styler = shown.style.hide(axis="index").set_table_attributes('class="results-table dataframe"')
    numeric = set(shown.attrs.get("numeric", []))
    # a number or a short label (64×128 w4 s1) never breaks across lines; a sentence may
    nowrap = {"selector": "td", "props": [("white-space", "nowrap")]}
    right = {"selector": "td, th", "props": [("text-align", "right")]}
    styles = {label: [right, nowrap] if label in numeric else [nowrap] for label in shown.columns
              if label in numeric or shown[label].str.len().max() <= SHORT}
    styler = styler.set_table_styles(styles)
    if shown.attrs.get("caption"):
        styler = styler.set_caption(shown.attrs["caption"])
    return styler


def show(data, **options) -> None:
    """Display ``table(data, ...)`` in a notebook; print ``rich_table(data, ...)`` elsewhere."""
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        get_ipython = None
    shell = get_ipython() if get_ipython is not None else None
    if shell is not None and type(shell).__name__ == "ZMQInteractiveShell":
        display(table(data, **options))
    else:
        from rich.console import Console

        Console(width=200).print(rich_table(data, **options))


def rich_table(data, *, title: str | None = None, **options):
    """The same table for a terminal: a ``rich.table.Table`` (caption under it, failed rows dimmed)."""
    from rich.table import Table

    shown = frame(data, **options)
    numeric = set(shown.attrs.get("numeric", []))
    t = Table(title=title, title_justify="left", caption=shown.attrs.get("caption") or None,
              caption_justify="left")
    for label in shown.columns:
        t.add_column(label, justify="right" if label in numeric else "left")
    status = shown["status"] if "status" in shown.columns else None
    for i, row in enumerate(shown.itertuples(index=False)):
        dim = status is not None and status.iloc[i] not in ("ok", MISSING)
        t.add_row(*row, style="dim" if dim else None)
    return t
