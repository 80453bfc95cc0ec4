"""Execute every notebook of the book at full size and record what happened (driven by gpu_run_notebooks.sh).

Writes, into the output folder:
  gpu_notebooks.json   fa_lab.bench.records format: meta (device, versions, date, command, test-suite result)
                       and one record per notebook (status, wall time, cells, images, slowest cells,
                       a short summary of its text outputs); rewritten after every notebook, so a run
                       cut short still leaves what it finished
  executed/            the executed notebooks, outputs included (for reading; not part of the repository)

Copy gpu_notebooks.json into fa_lab/data/: the status page of the book shows it.
"""
from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import fa_lab  # first: it picks the world before numba or triton is imported
from fa_lab.bench import records as recorded

ROOT = Path(__file__).resolve().parents[1]
MAX_TEXT = 240      # characters kept from one output
MAX_OUTPUTS = 30    # outputs kept per notebook


def toc_notebooks() -> list[Path]:
    """The .ipynb files named in _toc.yml, in reading order (MyST .md pages are not notebooks to run)."""
    import yaml

    names: list[str] = []

    def walk(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("file", "root") and isinstance(value, str):
                    names.append(value)
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(yaml.safe_load((ROOT / "_toc.yml").read_text()))
    paths = [(ROOT / n).with_suffix(".ipynb") for n in names]
    return [p for p in paths if p.exists()]


def summarize(nb) -> dict:
    """Cells, images, the slowest cells and a short text of each output of an executed notebook."""
    code = [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    images, texts, timings = 0, [], []
    for i, cell in code:
        t = cell.metadata.get("execution", {})
        start, end = t.get("iopub.execute_input"), t.get("shell.execute_reply")
        if start and end:
            from datetime import datetime
            seconds = (datetime.fromisoformat(end.replace("Z", "+00:00"))
                       - datetime.fromisoformat(start.replace("Z", "+00:00"))).total_seconds()
            timings.append({"cell": i, "s": round(seconds, 2)})
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            images += sum(1 for k in data if k.startswith("image/"))
            if out.get("name") == "stderr":
                continue  # progress bars and warnings
            text = out.get("text") or data.get("text/plain") or ""
            text = "".join(text) if isinstance(text, list) else text
            text = re.sub(r"\x1b\[[0-9;]*m", "", text).strip()
            if re.match(r"(<Figure|<[\w.]+( object)? at 0x|def |@|class )", text):
                continue  # a figure's or Styler's repr, or kernel source printed by inspect.getsource
            if text and len(texts) < MAX_OUTPUTS:
                texts.append({"cell": i, "text": text[:MAX_TEXT]})
    timings.sort(key=lambda r: -r["s"])
    return {"cells": len(nb.cells), "code_cells": len(code), "images": images,
            "slowest_cells": timings[:3], "outputs": texts}


def run_notebook(path: Path, timeout: int, out_dir: Path) -> dict:
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=False,
                            resources={"metadata": {"path": str(path.parent)}})
    record = {"notebook": path.relative_to(ROOT).as_posix(), "status": "ok", "error": None}
    t0 = time.perf_counter()
    try:
        client.execute()
    except CellTimeoutError as exc:
        record.update(status="timeout", error=str(exc).strip().splitlines()[-1][:MAX_TEXT])
    except CellExecutionError as exc:
        lines = [ln for ln in re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).splitlines() if ln.strip()]
        record.update(status="error", error=(lines[-1] if lines else repr(exc))[:MAX_TEXT],
                      traceback="\n".join(lines[-12:])[-1500:])
    except Exception as exc:  # a kernel that died is a result to record, not a reason to stop the run
        record.update(status="error", error=f"{type(exc).__name__}: {exc}"[:MAX_TEXT])
    record["wall_s"] = round(time.perf_counter() - t0, 2)
    record.update(summarize(nb))
    dest = out_dir / "executed" / record["notebook"]
    dest.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, dest)
    return record


def merge_into_earlier(earlier: Path, now: Path) -> None:
    """A partial re-run: its records replace the same notebooks' records of an earlier full run.

    The earlier run's meta stays (it describes most records); each replaced record carries the
    date of the run that made it, and ``meta["reruns"]`` lists the re-runs.
    """
    (old_meta, old_records), (new_meta, new_records) = recorded.read(earlier), recorded.read(now)
    fresh = {r["notebook"]: dict(r, date=new_meta["date"]) for r in new_records}
    records = [fresh.pop(r["notebook"], r) for r in old_records] + list(fresh.values())
    meta = dict(old_meta)
    meta["reruns"] = meta.get("reruns", []) + [{"date": new_meta["date"], "device": new_meta.get("device"),
                                                 "command": new_meta.get("command"),
                                                 "notebooks": [r["notebook"] for r in new_records]}]
    recorded.write(now, records, meta)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="folder for gpu_notebooks.json and executed/")
    ap.add_argument("--cell-timeout", type=int, default=600, help="seconds one cell may take")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for the whole run: no notebook is started after it is spent")
    ap.add_argument("--tests", default=None, help="test-suite summary line to record in meta")
    ap.add_argument("--allow-cpu", action="store_true", help="dry run in the CPU world (not a GPU recording)")
    ap.add_argument("--update", type=Path, default=None,
                    help="an earlier gpu_notebooks.json: the notebooks run now replace their records in it "
                         "(each marked with this run's date), the others keep theirs; written to --out")
    ap.add_argument("notebooks", nargs="*", type=Path, help="default: every .ipynb in _toc.yml")
    args = ap.parse_args(argv)

    fa_lab.banner()
    if not fa_lab.ON_GPU and not args.allow_cpu:
        print("not on a GPU: this run would not be a GPU recording (use --allow-cpu for a dry run)")
        return 2
    paths = [p.resolve() for p in args.notebooks] or toc_notebooks()
    command = "bash scripts/gpu_run_notebooks.sh"
    start, records = time.perf_counter(), []
    for path in paths:
        if args.budget is not None and time.perf_counter() - start > args.budget:
            records.append({"notebook": path.relative_to(ROOT).as_posix(), "status": "skipped",
                            "error": "time budget of this run spent", "wall_s": None})
        else:
            print(f"--- {path.relative_to(ROOT)}", flush=True)
            # on record before it starts: a run killed from outside still says which notebook it was in
            unfinished = {"notebook": path.relative_to(ROOT).as_posix(), "status": "killed",
                          "error": "the run was stopped while this notebook executed", "wall_s": None}
            recorded.save("gpu_notebooks", records + [unfinished], command=command, directory=args.out,
                          tests=args.tests)
            records.append(run_notebook(path, args.cell_timeout, args.out))
            r = records[-1]
            print(f"    {r['status']} in {r['wall_s']} s, {r['images']} images"
                  + (f": {r['error']}" if r["error"] else ""), flush=True)
        recorded.save("gpu_notebooks", records, command=command, directory=args.out, tests=args.tests)
    if args.update is not None:
        merge_into_earlier(args.update, args.out / "gpu_notebooks.json")
    failed = [r["notebook"] for r in records if r["status"] != "ok"]
    print(f"{len(records) - len(failed)} of {len(records)} notebooks ran clean"
          + (f"; not clean: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
