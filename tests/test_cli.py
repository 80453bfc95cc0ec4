"""The ``fa-lab`` command: its version, ``python -m fa_lab``, ``info``, and one set of problem flags."""
import subprocess
import sys

import pytest

import fa_lab
from fa_lab import cli


def _run(*argv, columns=80):
    env = dict(__import__("os").environ, COLUMNS=str(columns))
    return subprocess.run([sys.executable, "-m", "fa_lab", *argv], capture_output=True, text=True, env=env,
                          timeout=300)


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"fa-lab {fa_lab.__version__}"


def test_python_dash_m_is_the_same_command():
    done = _run("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"fa-lab {fa_lab.__version__}"
    bad = _run("no-such-command")
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


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
