"""The shipped GPU recordings describe the code as it is: none older than the kernel it measures.

Each recording stores a fingerprint of the sources it measures (``fa_lab.bench.records.SOURCES``);
a kernel edited since its recording fails here until the recording is made again with the command
stored in its meta.  The chapters' recordings come from one kind of GPU, so no two chapters
compare numbers from different machines.
"""
import pytest

from fa_lab.bench import records
from fa_lab.core.data import DATA_DIR

TIED = sorted(p.stem for p in DATA_DIR.glob("*.json") if records.sources_of(p.stem) is not None)


def test_there_are_recordings():
    assert {"gpu_ch1_2", "gpu_ch3", "gpu_ch4", "gpu_ch5", "gpu_ch6"} <= set(TIED)


@pytest.mark.parametrize("name", TIED)
def test_recording_is_not_older_than_its_code(name):
    meta, _ = records.read(DATA_DIR / f"{name}.json")
    assert meta.get("sources") == records.fingerprint(name), (
        f"{name}.json was recorded before {', '.join(records.sources_of(name))} last changed: "
        f"record it again on a GPU with `{meta.get('command')}`")


def test_chapters_are_recorded_on_one_kind_of_gpu():
    devices = {name: records.read(DATA_DIR / f"{name}.json")[0].get("device") for name in TIED}
    assert len(set(devices.values())) == 1, devices


def test_the_chapters_name_the_gpu_of_the_recordings():
    from fa_lab.bench import recordings
    from fa_lab.perf import devices

    meta, _ = records.read(DATA_DIR / f"{TIED[0]}.json")
    assert recordings.recorded_gpu() == meta["device"]
    # the chapters set recorded numbers against this datasheet: it must be the recording GPU's own
    assert recordings.recorded_device() is devices.preset_for(meta["device"])
    assert records.gpu_name(meta) == recordings.recorded_device().short


def test_gpu_name_of_a_recording():
    assert records.gpu_name({"device": "NVIDIA H100 80GB HBM3"}) == "H100"
    assert records.gpu_name({"device": "NVIDIA H200"}) == "H200"
    assert records.gpu_name({"device": "NVIDIA B200"}) == "B200"   # no preset: the driver's name
    assert records.gpu_name(None) == "GPU"


def test_fingerprint_follows_the_source(tmp_path, monkeypatch):
    before = records.fingerprint("gpu_ch1_2")
    assert before == records.fingerprint("gpu_ch1_2") and len(before) == 16
    assert records.fingerprint("gpu_notebooks") is None
    # one suite's parts measure the same kernels; the sweep times forwards alone, so the backward is not in it
    assert records.fingerprint("gpu_bench_h100_seed-table") == records.fingerprint("gpu_bench_h100_latency")
    assert records.fingerprint("gpu_bench_h100_sweep") != records.fingerprint("gpu_bench_h100_latency")


def test_a_recording_of_forwards_alone_leaves_the_backward_out(monkeypatch):
    assert [n for n in ("gpu_ch4", "gpu_ch5", "gpu_first_call", "gpu_cudnn_gap", "gpu_bench_h200_sweep",
                        "gpu_bench_h200_seed-table") if records.forward_only(n)] == [
        "gpu_ch4", "gpu_first_call", "gpu_bench_h200_sweep"]
    before = {n: records.fingerprint(n) for n in ("gpu_ch4", "gpu_ch5")}
    # counting the backward's files in changes the forward recording's fingerprint, and only that one
    monkeypatch.setattr(records, "BACKWARD_FILES", ())
    assert records.fingerprint("gpu_ch4") != before["gpu_ch4"]
    assert records.fingerprint("gpu_ch5") == before["gpu_ch5"]


@pytest.mark.parametrize("name", TIED)
def test_each_recording_was_made_by_the_script_named_for_it(name):
    meta, _ = records.read(DATA_DIR / f"{name}.json")
    assert records.command(meta).split()[:2] == records.made_by(name).split()[:2]


def test_fa_lab_recordings_names_the_stale_ones_and_their_commands(monkeypatch, capsys):
    from fa_lab import cli

    # a fresh name, so that the missing row is there whatever has been recorded by now
    monkeypatch.setitem(records.MADE_BY, "gpu_never", "python scripts/make_never.py")
    assert cli.main(["recordings"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in TIED) and "stale" not in listed
    assert cli.main(["recordings", "--stale"]) == 0
    out = capsys.readouterr().out.splitlines()
    missing = [line.split()[0] for line in out if " missing " in line]
    assert "gpu_never" in missing and "  python scripts/make_never.py" in out
    assert set(missing) == {n for n in records.MADE_BY if n != records.SUITE_PREFIX} - set(TIED)
    assert not any(" current " in line and "(partial)" not in line for line in out)   # only unfinished ones

    current = records.fingerprint
    monkeypatch.setattr(records, "fingerprint", lambda name: "edited" if name == "gpu_ch5" else current(name))
    assert cli.main(["recordings", "--stale"]) == 0
    out = capsys.readouterr().out
    meta, _ = records.read(DATA_DIR / "gpu_ch5.json")
    assert " stale " in next(line for line in out.splitlines() if line.startswith("gpu_ch5 "))
    assert f"  {records.command(meta)}" in out.splitlines() and "gpu_ch4 " not in out


def test_fa_lab_recordings_says_when_all_are_current(monkeypatch, capsys):
    from fa_lab import cli
    from fa_lab.bench import recordings

    made = set(TIED) | {records.SUITE_PREFIX}
    monkeypatch.setattr(records, "MADE_BY", {k: v for k, v in records.MADE_BY.items() if k in made})
    shipped = recordings.rows
    monkeypatch.setattr(recordings, "rows", lambda: [dict(r, finish=None) for r in shipped()])   # all complete
    assert cli.main(["recordings", "--stale"]) == 0
    assert capsys.readouterr().out.strip() == "every recording is current and complete"


def test_fa_lab_recordings_says_how_to_finish_a_partial_recording(monkeypatch, capsys):
    from fa_lab import cli
    from fa_lab.bench import recordings

    suite = "gpu_bench_h200_seed-table"
    assert recordings.finish_command(suite, {"part": "seed-table", "partial": True}) == (
        f"python scripts/record_gpu_bench.py --part seed-table --resume fa_lab/data/{suite}.json")
    # the other options of the command that made it come along; where it wrote and what it resumed do not
    made = ("python scripts/record_gpu_bench.py --part seed-table latency --impl triton sdpa-flash "
            "--resume fa_lab/data/old.json --out-dir /root/out --baseline sdpa-math")
    assert recordings.finish_command(suite, {"part": "seed-table", "command": made}) == (
        "python scripts/record_gpu_bench.py --part seed-table --impl triton sdpa-flash --baseline sdpa-math "
        f"--resume fa_lab/data/{suite}.json")
    meta, _ = records.read(DATA_DIR / "gpu_ch5.json")
    assert recordings.finish_command("gpu_ch5", dict(meta, partial=True)) == records.command(meta)   # made again

    partial = dict(row(suite, "current", "GPU 1", "2026-11-29T05:00"), partial=True,
                   finish=recordings.finish_command(suite, {"part": "seed-table"}))
    monkeypatch.setattr(recordings, "rows", lambda: [row("a", "current", "GPU 1", "2026-11-29T05:00"), partial])
    assert cli.main(["recordings", "--stale"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(suite) and "(partial)" in out[0] and not any(line.startswith("a ") for line in out)
    assert out[-1] == f"  {partial['finish']}" and "partial" in out[-2]


def row(name, status, device, date, seconds=None):
    return dict(name=name, status=status, partial=False, records=1, device=device, date=date, seconds=seconds,
                command=f"python scripts/make_{name}.py", finish=None)


def test_recordings_of_the_kind_before_are_listed_as_other_gpu(monkeypatch, capsys):
    from fa_lab import cli
    from fa_lab.bench import recordings

    table = [row("a", "current", "GPU 1", "2026-11-25T10:00"), row("b", "current", "GPU 2", "2026-11-29T05:00", 120),
             row("c", "stale", "GPU 1", "2026-11-24T08:00", 60), row("d", "untied", "GPU 1", "2026-11-30T00:00"),
             row("e", "missing", "-", "")]
    recordings.mark_other_gpus(table)
    # the newest tied recording (b, not the untied d) sets the kind; a stale one stays stale
    assert [r["status"] for r in table] == ["other-gpu", "current", "stale", "untied", "missing"]
    monkeypatch.setattr(recordings, "rows", lambda: table)
    assert cli.main(["recordings", "--stale"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out[:3]] == ["a", "c", "e"]
    assert out[5:8] == ["  python scripts/make_a.py", "  python scripts/make_c.py", "  python scripts/make_e.py"]
    assert out[8] == "(1 of these 3 recordings say how long they took: 1 min of GPU time together)"
