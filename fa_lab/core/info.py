"""Show the world (GPU or CPU simulator) and every registered implementation."""
from __future__ import annotations


def configure(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")


def listing(rows, width: int) -> str:
    """One block per implementation, wrapped to ``width`` columns: nothing is cut off."""
    import textwrap

    out = []
    for r in rows:
        out.append(f"{r['name']}  (chapter {r['chapter']})")
        facts = (f"dtypes {r['dtypes']} · masks {r['masks']} · head dims {r['head_dims']} · worlds {r['worlds']}"
                 f" · GQA {'yes' if r['gqa'] else 'no'} · backward {'yes' if r['backward'] else 'no'}")
        for text in (r["description"], facts):
            out += textwrap.wrap(text, width=max(40, width), initial_indent="    ", subsequent_indent="    ")
    return "\n".join(out)


def run(args) -> int:
    import json
    import shutil

    import fa_lab
    from fa_lab.core.registry import table

    rows = table().reset_index().to_dict(orient="records")
    if args.json:
        info = fa_lab.describe()
        info["implementations"] = rows
        print(json.dumps(info, indent=2, default=str))
        return 0
    fa_lab.banner()
    print()
    print(listing(rows, shutil.get_terminal_size((100, 24)).columns))
    return 0
