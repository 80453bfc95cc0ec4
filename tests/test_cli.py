"""The ``fa-lab`` command and the first hour around it: the version, ``python -m fa_lab``, fast ``--help``,
``info`` and the bench table at the terminal's width, Ctrl-C during ``bench``, exit statuses, time units,
a machine without Triton, the exercises in an installed package, and the Makefile."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

import fa_lab
from fa_lab import cli

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "triton", "numba", "numba_cuda", "pandas", "rich")


def _env(**extra):
    env = dict(os.environ, **extra)
    for switch in ("NUMBA_ENABLE_CUDASIM", "TRITON_INTERPRET"):   # a child decides its world afresh
        env.pop(switch, None)
    return env


def _run(*argv, columns=80):
    return subprocess.run([sys.executable, "-m", "fa_lab", *argv], capture_output=True, text=True,
                          env=_env(COLUMNS=str(columns)), timeout=300, cwd=ROOT)


def _python(code, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(**env),
                          timeout=300, cwd=ROOT)


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"fa-lab {fa_lab.__version__}"


def test_python_dash_m_is_the_same_command():
    done = _run("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"fa-lab {fa_lab.__version__}"
    bad = _run("no-such-command")
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


# ---------------------------------------------------------------------------- --help

def test_help_of_every_subcommand_loads_no_torch_triton_or_numba():
    names = ["", *cli.SUBCOMMANDS, "exercises fetch"]
    code = ("import sys, time\n"
            "from fa_lab.cli import main\n"
            f"for argv in {[n.split() for n in names]!r}:\n"
            "    t = time.perf_counter()\n"
            "    try:\n"
            "        main([*argv, '--help'])\n"
            "    except SystemExit as exc:\n"
            "        assert exc.code == 0, (argv, exc.code)\n"
            f"print('LOADED', sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))\n")
    done = _python(code)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "LOADED []"
    for name in cli.SUBCOMMANDS:   # each subcommand's own flags, not only its name
        assert f"usage: fa-lab {name}" in done.stdout
    assert "--impl" in done.stdout and "--measure-hardware" in done.stdout and "--solutions" in done.stdout


def test_import_fa_lab_is_light_and_still_sets_the_switches_before_numba():
    code = ("import sys, os\n"
            "import fa_lab\n"
            "print('torch' in sys.modules)\n"
            "import numba\n"
            "print(fa_lab.WORLD, numba.config.ENABLE_CUDASIM, os.environ.get('TRITON_INTERPRET'))\n")
    done = _python(code, FA_LAB_WORLD="cpu")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["False", "cpu", "1", "1"]


def test_public_names_load_on_first_use():
    from fa_lab import api, core

    assert fa_lab.attention is api.attention and fa_lab.get_implementation("naive_torch").name == "naive_torch"
    assert core.registry is fa_lab.core.registry and set(fa_lab.__all__) <= set(dir(fa_lab))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        fa_lab.nope   # noqa: B018


# ---------------------------------------------------------------------------- info and tables

def test_info_is_not_cut_at_80_columns():
    done = _run("info", columns=80)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()[1:]           # the first is the world's banner
    assert max(len(line) for line in lines) <= 80
    assert "..." not in done.stdout
    text = " ".join(done.stdout.split())
    for name, impl in fa_lab.implementations().items():
        assert f"{name} (chapter {impl.chapter})" in text
        assert " ".join(impl.description.split()) in text          # whole, only wrapped
    assert "backward yes" in text and "masks none, causal, window" in text


@pytest.fixture(scope="module")
def suite_records():
    from fa_lab.bench import runner
    from fa_lab.bench.configs import Shape

    impls = ["naive_torch", "torch_tiled", "sdpa-cudnn" if not fa_lab.ON_GPU else "naive_numpy"]
    return runner.run_suite(impls, [Shape(1, 2, 8, 16), Shape(1, 2, 16, 16)], warmup=1, rep=2, progress=False)


@pytest.mark.parametrize("columns", [60, 80, 160])
def test_bench_table_takes_the_terminals_width(suite_records, columns, capsys, monkeypatch):
    from fa_lab.bench import runner

    monkeypatch.setenv("COLUMNS", str(columns))   # what rich's Console() reads where there is no terminal
    runner.table(suite_records)
    out = capsys.readouterr().out
    widths = [len(line) for line in out.splitlines()]
    assert max(widths) <= columns and "…" not in out and "nan" not in out.replace("naive", "")
    if columns > 120:   # a wide terminal is used: the title stays on one line
        assert max(widths) > 80 and f"fa-lab bench — {runner.device_name()}" in out
    if columns >= 80:   # the names whole (narrower, they fold over lines)
        assert "naive_torch" in out and "torch_tiled" in out and "FLOP/s" in out
    if not fa_lab.ON_GPU:   # the case that could not run is said once, with its reason, not as a row
        assert "not measured:" in out and "sdpa-cudnn (2 cases): unsupported" in out.replace("\n", " ")


def test_small_predicted_times_have_units(capsys):
    assert cli.main(["correlate", "--seq-len", "64", "--head-dim", "16"]) == 0
    out = capsys.readouterr().out
    ideal = next(line for line in out.splitlines() if line.startswith("ideal"))
    predicted = next(line for line in out.splitlines() if line.startswith("predicted"))
    assert not re.search(r"\b0\.0+ m?s\b", out), out
    assert re.match(r"predicted [1-9][\d.,]* (ns|µs)", predicted) and re.match(r"ideal +[1-9][\d.,]* ns", ideal)


# ---------------------------------------------------------------------------- exit statuses

def _flags(name):
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[name]
    return {s for a in sub._actions if a.help != "==SUPPRESS==" for s in a.option_strings}


def test_bench_and_correlate_share_the_problem_flags():
    problem = {"--batch", "--heads", "--kv-heads", "--seq-len", "--seq-len-k", "--head-dim", "--mask", "--window",
               "--dtype"}
    assert problem <= _flags("bench") and problem <= _flags("correlate")
    # the older correlate spellings are accepted but not shown
    assert not {"--seq-len-q", "--dim-qk", "--attention-mask", "--attention-window"} & _flags("correlate")


@pytest.mark.parametrize("sub", ["bench", "correlate"])
def test_mask_choices_are_the_package_vocabulary(sub, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main([sub, "--mask", "sliding_window"])
    assert exc.value.code == 2 and "none" in capsys.readouterr().err


def test_measure_hardware_without_a_gpu_is_an_error(capsys):
    rc = cli.main(["correlate", "--seq-len", "256", "--measure-hardware"])
    if fa_lab.ON_GPU:
        assert rc == 0
    else:
        assert rc != 0 and "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.skipif(fa_lab.ON_GPU, reason="sdpa-cudnn runs on a GPU")
def test_bench_exits_1_when_a_named_implementation_could_not_be_measured(capsys):
    rc = cli.main(["bench", "--impl", "naive_torch", "sdpa-cudnn", "--batch", "1", "--heads", "1", "--seq-len", "8",
                   "--head-dim", "16", "--warmup", "1", "--rep", "2", "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 1 and "could not measure" in captured.err and "sdpa-cudnn: unsupported" in captured.err
    assert "naive_torch" in captured.out     # what did run is still shown
    rc = cli.main(["bench", "--impl", "naive_torch", "--batch", "1", "--heads", "1", "--seq-len", "8",
                   "--head-dim", "16", "--warmup", "1", "--rep", "2", "--no-progress"])
    assert rc == 0 and "could not measure" not in capsys.readouterr().err


# ---------------------------------------------------------------------------- Ctrl-C during bench

def test_ctrl_c_keeps_and_writes_the_rows_finished_so_far(tmp_path, capsys):
    from fa_lab.bench import cli as bench_cli

    out = tmp_path / "r.csv"
    args = cli.build_parser().parse_args(["bench", "--impl", "naive_torch", "torch_tiled", "reference",
                                          "--batch", "1", "--heads", "1", "--seq-len", "8", "16",
                                          "--head-dim", "16", "--warmup", "1", "--rep", "2", "--no-progress",
                                          "--out", str(out)])
    seen = []

    def stop_after_three(record):
        seen.append(record["impl"])
        if len(seen) == 3:
            raise KeyboardInterrupt

    assert bench_cli.run(args, on_record=stop_after_three) == 130
    captured = capsys.readouterr()
    assert "interrupted after 3 cases (Ctrl-C): the rows finished so far are kept, written to" in captured.err
    blob = json.loads(out.with_suffix(".json").read_text())
    assert blob["meta"]["partial"] is True and [r["impl"] for r in blob["records"]] == seen
    assert len(out.read_text().strip().splitlines()) == 1 + 3
    assert "naive_torch" in captured.out and "reference" in captured.out   # the table of what was kept


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a child process")
def test_sigint_during_a_simulated_kernel_keeps_the_finished_rows(tmp_path):
    out = tmp_path / "r.csv"
    # naive_torch finishes at once; numba_naive runs thread by thread in the simulator when the signal comes
    cmd = [sys.executable, "-m", "fa_lab", "bench", "--impl", "naive_torch", "numba_naive", "--batch", "1",
           "--heads", "2", "--seq-len", "16", "--head-dim", "16", "--warmup", "1", "--rep", "3", "--out", str(out)]
    # TQDM_MININTERVAL=0: the progress bar shows every finished case, however quick.  The child gets Ctrl-C's
    # default action back: a test run started in the background (``make test &``) ignores SIGINT, and its
    # children inherit that
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
                            env=_env(FA_LAB_WORLD="cpu", TQDM_MININTERVAL="0"),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    progress, deadline = b"", time.monotonic() + 240
    while b" 1/2 " not in progress and time.monotonic() < deadline and proc.poll() is None:
        progress += os.read(proc.stderr.fileno(), 4096)   # the progress bar, on stderr
    assert b" 1/2 " in progress, progress[-2000:]
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    stderr = (progress + stderr).decode()
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    assert "interrupted after 1 case (Ctrl-C): the rows finished so far are kept, written to" in stderr
    assert "naive_torch" in stdout.decode()
    rows = out.read_text().strip().splitlines()
    assert len(rows) == 2 and rows[1].split(",")[1] == "naive_torch"


# ---------------------------------------------------------------------------- without Triton

BLOCK_TRITON = """
import importlib.abc, sys
class NoTriton(importlib.abc.MetaPathFinder):   # a machine where Triton has no wheels
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "triton":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoTriton())
"""


def test_fa_lab_runs_without_triton():
    code = BLOCK_TRITON + """
import fa_lab
from fa_lab import HAS_TRITON, TRITON_MISSING
from fa_lab.core.testing import random_qkv
names = [(n, i.chapter) for n, i in fa_lab.implementations().items()]
q, k, v = random_qkv(1, 2, 16, 16, 16, seed=3)
part_two = {}
for n in ("triton_varlen", "triton_decode"):   # Part II's Triton kernels: listed, and they say why not
    try:
        fa_lab.attention(q, k, v, impl=n)
        part_two[n] = None
    except ValueError as exc:
        part_two[n] = str(exc)
o = fa_lab.attention(q, k, v, impl="torch_tiled")
try:
    fa_lab.attention(q, k, v, impl="flash_triton")
    refused = None
except ValueError as exc:
    refused = str(exc)
print(repr((HAS_TRITON, TRITON_MISSING, names, tuple(o.shape), refused, part_two, "triton" in sys.modules)))
from fa_lab.cli import main
sys.exit(main(["info"]))
"""
    done = _python(code, FA_LAB_WORLD="cpu", COLUMNS="100")
    assert done.returncode == 0, done.stderr[-3000:]
    has, missing, named, shape, refused, part_two, imported = eval(done.stdout.splitlines()[0])
    names = [n for n, _ in named]
    assert has is False and imported is False and shape == (1, 2, 16, 16)
    for where in ("Linux", "WSL2", "Colab"):
        assert where in missing
    assert not [n for n, ch in named if n.startswith("triton") and ch == 4]   # chapter 4's kernels: not registered
    assert all(why is not None and missing in why for why in part_two.values()), part_two
    assert {"reference", "naive_torch", "numba_tiled", "torch_tiled"} <= set(names)
    assert refused is not None and missing in refused          # chapter 5's Triton engine says why
    assert "torch_tiled  (chapter 5)" in done.stdout            # `fa-lab info` still lists the rest


def test_has_triton_here():
    import importlib.util

    assert fa_lab.HAS_TRITON == (importlib.util.find_spec("triton") is not None)
    assert "triton" in fa_lab.implementations() if fa_lab.HAS_TRITON else True


# ---------------------------------------------------------------------------- exercises fetch

def test_exercises_fetch_copies_and_never_overwrites(tmp_path, capsys):
    shipped = sorted(p.name for p in (ROOT / "exercises").glob("*.ipynb"))
    target = tmp_path / "mine"
    assert cli.main(["exercises", "fetch", str(target)]) == 0
    assert sorted(p.name for p in target.glob("*.ipynb")) == shipped
    for name in shipped:
        assert (target / name).read_bytes() == (ROOT / "exercises" / name).read_bytes()
    answer = target / shipped[0]
    answer.write_text("my answers")
    capsys.readouterr()
    assert cli.main(["exercises", "fetch", str(target)]) == 0
    assert answer.read_text() == "my answers" and "kept" in capsys.readouterr().out
    assert cli.main(["exercises", "fetch", str(target), "--force"]) == 0
    assert answer.read_bytes() == (ROOT / "exercises" / shipped[0]).read_bytes()


@pytest.mark.slow
def test_the_wheel_carries_the_exercises(tmp_path):
    # build from a copy: setuptools writes build/ beside the sources
    src = tmp_path / "src"
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.nbi", "*.nbc", ".ipynb_checkpoints")
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    for name in ("fa_lab", "exercises"):
        shutil.copytree(ROOT / name, src / name, ignore=skip)
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(wheels), str(src)], check=True, capture_output=True, timeout=600)
    (wheel,) = wheels.glob("fa_lab-*.whl")
    inside = zipfile.ZipFile(wheel).namelist()
    shipped = sorted(p.name for p in (ROOT / "exercises").glob("*.ipynb"))
    assert sorted(Path(n).name for n in inside if n.startswith("fa_lab/exercises/notebooks/")) == shipped
    # installed (not editable) beside this environment's packages, it copies them out
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=300)
    bindir = venv / ("Scripts" if sys.platform == "win32" else "bin")
    subprocess.run([str(bindir / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True, timeout=600)
    target = tmp_path / "x"
    installed = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}   # the wheel's fa_lab, not a checkout's
    done = subprocess.run([str(bindir / "fa-lab"), "exercises", "fetch", str(target)], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path, env=installed)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in target.glob("*.ipynb")) == shipped
    assert str(venv) in subprocess.run([str(bindir / "python"), "-c", "import fa_lab; print(fa_lab.__file__)"],
                                       capture_output=True, text=True, cwd=tmp_path, timeout=300,
                                       env=installed).stdout


# ---------------------------------------------------------------------------- Makefile

MAKE = shutil.which("make")


def _make(*args, path=None):
    env = _env(PYTHON=sys.executable)
    if path is not None:
        env["PATH"] = f"{path}{os.pathsep}{env['PATH']}"
    return subprocess.run([MAKE, "--no-print-directory", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=120)


@pytest.mark.skipif(MAKE is None, reason="no make")
def test_make_alone_lists_the_targets_and_installs_nothing():
    dry = _make("-n")
    assert dry.returncode == 0 and "setup.sh" not in dry.stdout and "pip" not in dry.stdout
    done = _make()
    assert done.returncode == 0, done.stderr
    listed = re.findall(r"^  make (\S+)", done.stdout, re.M)
    assert listed[0] == "help" and {"book", "test", "test-fast", "lab", "lint", "setup", "clean"} <= set(listed)
    readme = (ROOT / "README.md").read_text()
    for target in listed:   # the README's table says the same
        assert f"| `make {target}` |" in readme


@pytest.mark.skipif(MAKE is None, reason="no make")
def test_setup_runs_once_per_environment(tmp_path):
    stamp = tmp_path / "stamp"
    first = _make("-n", "test-fast", f"STAMP={stamp}")
    assert "bash scripts/setup.sh" in first.stdout                   # no stamp: install first
    stamp.write_text(sys.prefix + "\n")
    again = _make("-n", "test-fast", f"STAMP={stamp}")
    assert "setup.sh" not in again.stdout and "pytest" in again.stdout
    stamp.write_text("/some/other/venv\n")
    assert "bash scripts/setup.sh" in _make("-n", "test-fast", f"STAMP={stamp}").stdout
    stamp.write_text(sys.prefix + "\n")
    os.utime(stamp, (1, 1))                                           # older than pyproject.toml
    assert "bash scripts/setup.sh" in _make("-n", "test-fast", f"STAMP={stamp}").stdout


@pytest.mark.skipif(MAKE is None or sys.platform == "win32", reason="no make")
@pytest.mark.parametrize("uid, flag", [("0", True), ("1000", False)])
def test_make_lab_as_root_and_as_a_user(tmp_path, uid, flag):
    stamp = tmp_path / "stamp"
    stamp.write_text(sys.prefix + "\n")
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "id").write_text(f"#!/bin/sh\necho {uid}\n")
    (fake / "id").chmod(0o755)
    done = _make("-n", "lab", f"STAMP={stamp}", path=fake)
    assert done.returncode == 0, done.stderr
    (line,) = [ln for ln in done.stdout.splitlines() if "jupyterlab" in ln]
    assert line.startswith(f"{sys.executable} -m jupyterlab") and ("--allow-root" in line) == flag


def test_exercises_without_triton_say_why():
    code = BLOCK_TRITON + """
from fa_lab.exercises import check, names
result = check("ch4_flash_kernel", lambda *a: None)
print(repr((sorted({n.split("_")[0] for n in names()}), result.passed, result.first_failure["message"])))
"""
    done = _python(code, FA_LAB_WORLD="cpu")
    assert done.returncode == 0, done.stderr[-3000:]
    chapters, passed, message = eval(done.stdout.splitlines()[0])
    # the PyTorch exercises stay (Part II's warm-ups too); the Triton kernels' chapters 4 and 5 go
    assert chapters == ["ch1", "ch10", "ch2", "ch3", "ch6", "ch8", "ch9"] and passed is False
    assert "Triton exercise" in message and "Linux" in message


def test_tune_plans_one_problem_per_key_and_needs_a_gpu(tmp_path, capsys):
    from fa_lab.bench import tune

    args = cli.build_parser(["tune"]).parse_args(["tune", "--head-dim", "64", "256", "--mask", "causal",
                                                  "--dtype", "bf16", "--seq-len", "512", "65536"])
    todo = tune.problems(args)
    assert [(p["shape"], p["causal"]) for p in todo] == [
        ((32, 16, 512, 64), True), ((1, 16, 65536, 64), True), ((32, 16, 512, 256), True), ((1, 16, 65536, 256), True)]
    assert {p["dtype"] for p in todo} == {torch.bfloat16}
    shipped = tmp_path / "shipped.json"
    shipped.write_text(json.dumps({"configs": {"GPU A": {"k1": {"BLOCK_M": 64}}}, "note": "kept"}))
    tune.ship("GPU A", {"k2": {"BLOCK_M": 128}}, shipped)
    tune.ship("GPU B", {"k1": {"BLOCK_M": 16}}, shipped)
    table = json.loads(shipped.read_text())
    assert table["note"] == "kept" and table["configs"] == {"GPU A": {"k1": {"BLOCK_M": 64}, "k2": {"BLOCK_M": 128}},
                                                            "GPU B": {"k1": {"BLOCK_M": 16}}}
    rc = cli.main(["tune", "--head-dim", "64", "--seq-len", "512"])
    if not fa_lab.ON_GPU:
        assert rc == 2 and "CUDA GPU" in capsys.readouterr().err
