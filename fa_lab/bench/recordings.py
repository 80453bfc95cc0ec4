"""List the shipped GPU recordings: device, date, complete or partial, current or stale, and how to remake them.

A recording is stale once the code it measures has changed (``records.SOURCES``, the fingerprint in its
meta); ``tests/test_recordings.py`` fails until it is made again.  A recording the chapters can show
but that was never made is 'missing'.  The recordings tied to code come from one kind of GPU: while some
are made on another kind, the ones still from the kind before are 'other-gpu' (the newest recording's
device is the one they follow).  After a kernel change, ``fa-lab recordings --stale`` prints the
commands to run on a GPU, one per stale, missing or other-gpu recording, and how long they took before; a
current recording that a time limit left partial gets the command that finishes it.
"""
from __future__ import annotations

#: the statuses whose recordings are to be made on a GPU
TO_RECORD = ("stale", "missing", "other-gpu")


def configure(parser) -> None:
    parser.add_argument("--stale", action="store_true",
                        help="only the stale, missing and other-gpu recordings, and their commands")


def status(name: str, meta: dict) -> str:
    """'current', 'stale' (its code changed since) or 'untied' (it measures no source file of the package)."""
    from fa_lab.bench import records

    expected = records.fingerprint(name)
    if expected is None:
        return "untied"
    return "current" if meta.get("sources") == expected else "stale"


def _newest_device(tied: list[dict]) -> str | None:
    """The device of the newest of ``tied`` (rows or metas with ``date`` and ``device``)."""
    return max(tied, key=lambda r: str(r.get("date") or ""))["device"] if tied else None


def mark_other_gpus(table: list[dict]) -> None:
    """Mark 'other-gpu' the current tied rows whose device is not the newest tied row's."""
    newest = _newest_device([r for r in table if r["status"] in ("current", "stale")])
    for r in table:
        if r["status"] == "current" and r["device"] != newest:
            r["status"] = "other-gpu"


def recorded_gpu() -> str | None:
    """The GPU the recordings tied to code come from, as its driver names it (None without any).

    Reads only the recordings' meta: whether each is current is ``rows()``'s (slower) question."""
    from fa_lab.bench import records
    from fa_lab.core.data import DATA_DIR

    return _newest_device([records.read(DATA_DIR / f"{name}.json")[0] for name in records.available()
                           if records.sources_of(name) is not None])


def recorded_device():
    """The datasheet preset (``fa_lab.perf.devices``) of :func:`recorded_gpu`; the H100's without one,
    so that the chapters' datasheet figures are those of the GPU their recorded numbers come from."""
    from fa_lab.perf import devices

    return devices.preset_for(recorded_gpu() or "") or devices.get_device("H100")


#: ``record_gpu_bench.py``'s options that ``finish_command`` sets itself, and how many values each takes
#: (``None``: every value up to the next option)
_RESUME_SETS = {"--part": None, "--resume": 1}


def _without_options(words: list[str], options: dict) -> list[str]:
    """``words`` of a command line without the ``options`` named and their values."""
    kept, left = [], 0
    for word in words:
        if word in options:
            left = options[word]
        elif left != 0 and not word.startswith("--"):
            left = None if left is None else left - 1     # a value of the option just dropped
        else:
            left = 0
            kept.append(word)
    return kept


def finish_command(name: str, meta: dict) -> str:
    """The command that completes partial recording ``name``: a benchmark suite's part resumes where it
    stopped (``record_gpu_bench.py --resume``), with the other options of the command that made it
    (``--impl``, ``--baseline``...); any other recording is made again with its own command."""
    import shlex

    from fa_lab.bench import records

    if not (name.startswith(records.SUITE_PREFIX) and meta.get("part")):
        return records.command(meta)
    # "python scripts/record_gpu_bench.py ...", its output folder already left out by records.command
    options = _without_options(shlex.split(records.command(meta))[2:], _RESUME_SETS)
    return shlex.join(["python", "scripts/record_gpu_bench.py", "--part", str(meta["part"]), *options,
                       "--resume", f"fa_lab/data/{name}.json"])


def rows() -> list[dict]:
    """One row per recording in ``fa_lab/data`` (name, status, partial, device, date, command), then one
    per recording of ``records.MADE_BY`` never made (status 'missing', its script as the command)."""
    from fa_lab.bench import records
    from fa_lab.core.data import DATA_DIR

    out = []
    for name in records.available():
        try:
            meta, recs = records.read(DATA_DIR / f"{name}.json")
        except (KeyError, TypeError):   # tuned launch configurations live there too: not a recording
            continue
        out.append(dict(name=name, status=status(name, meta), partial=bool(meta.get("partial")),
                        records=len(recs), device=meta.get("device") or "?", date=str(meta.get("date") or ""),
                        command=records.command(meta), seconds=meta.get("seconds"),
                        finish=finish_command(name, meta) if meta.get("partial") else None))
    mark_other_gpus(out)
    made = {r["name"] for r in out}
    for name, command in records.MADE_BY.items():
        if name != records.SUITE_PREFIX and name not in made:
            out.append(dict(name=name, status="missing", partial=False, records=0, device="-", date="-",
                            command=command))
    return out


def run(args) -> int:
    table = [r for r in rows() if r["status"] in TO_RECORD or r.get("finish") or not args.stale]
    if not table:
        print("every recording is current and complete" if args.stale else "no recordings")
        return 0
    width = max(len(r["name"]) for r in table)
    status_width = max(len(r["status"]) for r in table)
    for r in table:
        extent = f"{r['records']} records{' (partial)' if r['partial'] else ''}"
        print(f"{r['name']:<{width}}  {r['status']:<{status_width}}  {r['date'][:10]}  {r['device']}  {extent}")
    to_record = [r for r in table if r["status"] in TO_RECORD]
    if to_record:
        print("\nto record, on a GPU, from the repository root:")
        for command in dict.fromkeys(r["command"] for r in to_record):   # one line per command, in order
            print(f"  {command}")
        timed = [r["seconds"] for r in to_record if isinstance(r.get("seconds"), (int, float))]
        if timed:
            print(f"({len(timed)} of these {len(to_record)} recordings say how long they took: "
                  f"{sum(timed) / 60:.0f} min of GPU time together)")
    to_finish = [r for r in table if r.get("finish") and r["status"] not in TO_RECORD]
    if to_finish:
        print("\nto finish, on a GPU, from the repository root (current, but partial):")
        for r in to_finish:
            print(f"  {r['finish']}")
    return 0
