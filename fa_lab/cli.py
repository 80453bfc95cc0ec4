"""The ``fa-lab`` command (also ``python -m fa_lab``).  Each subcommand lives in its own module,
which provides ``configure(parser)`` (add its arguments) and ``run(args) -> int``.

Subcommands that describe an attention problem (``bench``, ``correlate``) take the same flags,
added by ``add_problem_arguments``: ``--batch --heads --kv-heads --seq-len --seq-len-k
--head-dim --mask {none,causal,window} --window LEFT RIGHT --dtype``.
"""
from __future__ import annotations

import argparse
import importlib
import sys

#: subcommand name → module providing configure(parser) and run(args)
SUBCOMMANDS = {
    "info": "fa_lab.core.info",
    "grade": "fa_lab.exercises.grade",
    "bench": "fa_lab.bench.cli",
    "correlate": "fa_lab.perf.cli",
}
#: the package's mask vocabulary (``fa_lab.core.registry.ALL_MASKS``)
MASKS = ("none", "causal", "window")


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


def build_parser() -> argparse.ArgumentParser:
    from fa_lab import __version__

    parser = argparse.ArgumentParser(prog="fa-lab", description="FlashAttention Lab: kernels, benchmarks, grading")
    parser.add_argument("--version", action="version", version=f"fa-lab {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in SUBCOMMANDS.items():
        mod = importlib.import_module(module)
        p = sub.add_parser(name, help=(mod.__doc__ or "").strip().splitlines()[0])
        mod.configure(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args._argv = list(sys.argv[1:] if argv is None else argv)  # recorded with results (fa-lab bench --out)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
