"""Show the world (GPU or CPU simulator) and every registered implementation."""
from __future__ import annotations


def configure(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")


def run(args) -> int:
    import json

    import fa_lab
    from fa_lab.core.registry import table

    if args.json:
        info = fa_lab.describe()
        info["implementations"] = table().reset_index().to_dict(orient="records")
        print(json.dumps(info, indent=2, default=str))
        return 0
    fa_lab.banner()
    with __import__("pandas").option_context("display.width", 200, "display.max_colwidth", 60):
        print(table().drop(columns=["description"]))
    return 0
