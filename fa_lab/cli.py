"""The ``fa-lab`` command (also ``python -m fa_lab``).  Each subcommand lives in its own module,
which provides ``configure(parser)`` (add its arguments) and ``run(args) -> int``.

Subcommands that describe an attention problem (``bench``, ``correlate``) take the same flags,
added by ``add_problem_arguments``: ``--batch --heads --kv-heads --seq-len --seq-len-k
--head-dim --mask {none,causal,window} --window LEFT RIGHT --dtype``.

``--help`` answers at once: a subcommand module imports only the standard library at its top
(torch, numba and triton inside its functions), and only the chosen subcommand is configured.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path

#: subcommand name → module providing configure(parser) and run(args)
SUBCOMMANDS = {
    "info": "fa_lab.core.info",
    "grade": "fa_lab.exercises.grade",
    "exercises": "fa_lab.exercises.fetch",
    "bench": "fa_lab.bench.cli",
    "correlate": "fa_lab.perf.cli",
    "tune": "fa_lab.bench.tune",
    "recordings": "fa_lab.bench.recordings",
}
#: the package's mask vocabulary (``fa_lab.core.registry.ALL_MASKS``)
MASKS = ("none", "causal", "window")
#: the exit status of a command stopped by Ctrl-C (128 + SIGINT), as a shell reports it
INTERRUPTED = 130


def positive_int(text: str) -> int:
    """argparse type: an int >= 1, with a message that says so."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def add_problem_arguments(parser, *, grid: bool, defaults: dict | None = None):
    """The flags that describe an attention problem, the same in every subcommand.

    ``grid=True``: each dimension, ``--mask`` and ``--dtype`` take several values (a benchmark grid);
    otherwise one each.  ``defaults`` maps a destination (``seq_len``, ``mask``, ...) to its default.
    Returns the argument group.
    """
    d = dict(defaults or {})
    many = dict(nargs="+") if grid else {}
    g = parser.add_argument_group("problem")
    dims = (("--batch", "batch size B"), ("--heads", "query heads H"),
            ("--kv-heads", "key/value heads (grouped-query attention; default = --heads)"),
            ("--seq-len", "query length Nq"), ("--seq-len-k", "key length Nk (default = --seq-len)"),
            ("--head-dim", "head dim D of q, k and v"))
    for flag, what in dims:
        dest = flag[2:].replace("-", "_")
        default = d.get(dest)
        g.add_argument(flag, type=positive_int, metavar="N", default=default, **many,
                       help=what + (f" (default {default})" if default is not None else ""))
    g.add_argument("--mask", choices=MASKS, default=d.get("mask"), **many,
                   help="none, causal (bottom-right aligned) or window (with --window)")
    g.add_argument("--window", nargs=2, type=int, metavar=("LEFT", "RIGHT"), default=d.get("window"),
                   help="sliding window: query i sees keys i-LEFT .. i+RIGHT (-1 unbounded); implies --mask window")
    g.add_argument("--dtype", metavar="DTYPE", default=d.get("dtype"), **many,
                   help="fp16, bf16, fp32, fp64 (or float16, bfloat16, ...)")
    return g


def subcommand_module(module: str):
    """A subcommand's module, without running its package's ``__init__`` first when that is not loaded yet.

    ``fa_lab.exercises``' ``__init__`` loads torch and the grader: seconds before ``fa-lab grade --help``
    could answer.  The module's file is executed under its own name instead; its package is imported
    as usual as soon as the module's functions import from it.
    """
    package = module.rpartition(".")[0]
    if module in sys.modules or package in sys.modules:
        return importlib.import_module(module)
    path = Path(__file__).parent.joinpath(*module.split(".")[1:]).with_suffix(".py")
    spec = importlib.util.spec_from_file_location(module, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[module] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[module]
        raise
    return mod


def build_parser(argv=None) -> argparse.ArgumentParser:
    """The whole parser; given ``argv``, only the subcommand it names is configured (the others get
    their one-line help), which keeps ``fa-lab --help`` and ``fa-lab X --help`` fast."""
    from fa_lab import __version__

    chosen = None
    if argv is not None:
        chosen = next((a for a in argv if not a.startswith("-")), "")
    parser = argparse.ArgumentParser(prog="fa-lab", description="FlashAttention Lab: kernels, benchmarks, grading")
    parser.add_argument("--version", action="version", version=f"fa-lab {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for name, module in SUBCOMMANDS.items():
        mod = subcommand_module(module)
        summary = (mod.__doc__ or "").strip().splitlines()[0]
        p = sub.add_parser(name, help=summary, description=summary)
        if chosen is None or chosen == name:
            mod.configure(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    args._argv = argv  # recorded with results (fa-lab bench --out)
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:   # a command that keeps partial results (bench) handles Ctrl-C itself
        print(f"fa-lab {args.command}: interrupted (Ctrl-C)", file=sys.stderr)
        return INTERRUPTED
    except BrokenPipeError:     # `fa-lab info | head`: the reader has gone, nothing more to say
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
