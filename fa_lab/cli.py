"""The ``fa-lab`` command.  Each subcommand lives in its own module, which provides
``configure(parser)`` (add its arguments) and ``run(args) -> int``.
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fa-lab", description="FlashAttention Lab: kernels, benchmarks, grading")
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
