"""Give every notebook a first code cell that installs fa_lab where it is missing.

A notebook opened from the book's launch buttons runs on a machine that has only the notebook:
Binder builds its environment from ``binder/`` (fa_lab included), Colab has nothing but its own
CUDA torch.  The first code cell therefore starts with a few lines that pip-install fa_lab from
the repository when it cannot be imported (pip keeps an installed torch that satisfies
fa_lab's range, so Colab's CUDA build stays) and do nothing, in microseconds, when it can.

The lines go at the top of the notebook's first code cell, the one that imports fa_lab and
prints the world banner, so that the banner stays the first output.  The cell is tagged
``hide-input``: the book shows the banner and folds the code away.  Running this script again
replaces the lines with the current ones (the repository URL comes from ``_config.yml``)::

    python scripts/notebook_setup_cell.py book/*.ipynb exercises/*.ipynb
    python scripts/notebook_setup_cell.py --check book/*.ipynb     # exit 1 if any is not up to date
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
#: the first line of the block; everything up to the first blank line after it belongs to it
MARK = "# install fa_lab where it is missing (Binder, Colab); a no-op where it is installed"
TAG = "hide-input"


def repository_url() -> str:
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    url = (config.get("repository") or {}).get("url", "").rstrip("/")
    if not url.startswith("https://"):
        raise SystemExit(f"_config.yml: repository.url must be the repository's https address, got {url!r}")
    return url


def setup_lines(url: str) -> list[str]:
    return [
        MARK,
        "import importlib.util, subprocess, sys",
        'if importlib.util.find_spec("fa_lab") is None:',
        f'    repo = "git+{url}"',
        '    subprocess.run([sys.executable, "-m", "pip", "install", "-q", f"fa_lab @ {repo}"], check=True)',
        "    importlib.invalidate_caches()",
        "",
    ]


def _source(cell) -> list[str]:
    src = cell["source"]
    return ("".join(src) if isinstance(src, list) else src).split("\n")


def without_block(lines: list[str]) -> list[str]:
    """The cell's lines with an earlier setup block (and the blank line after it) taken out."""
    if not lines or lines[0] != MARK:
        while lines and lines[0] == "":   # a leading blank line left by hand
            lines = lines[1:]
        return lines
    end = lines.index("") if "" in lines else len(lines)
    return lines[end + 1:]


def update(nb: dict, url: str) -> bool:
    """Put the current block at the top of the first code cell and tag it; True if ``nb`` changed."""
    cell = next((c for c in nb["cells"] if c["cell_type"] == "code"), None)
    if cell is None:
        raise ValueError("the notebook has no code cell")
    before = (list(_source(cell)), list(cell.get("metadata", {}).get("tags", [])))
    lines = setup_lines(url) + without_block(_source(cell))
    text = "\n".join(lines).rstrip("\n")
    cell["source"] = [line + "\n" for line in text.split("\n")[:-1]] + [text.split("\n")[-1]]
    tags = cell.setdefault("metadata", {}).setdefault("tags", [])
    if TAG not in tags:
        tags.append(TAG)
    return (_source(cell), tags) != before


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("notebooks", nargs="+", type=Path)
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a notebook is not up to date")
    args = ap.parse_args(argv)
    url = repository_url()
    stale = []
    for path in args.notebooks:
        nb = json.loads(path.read_text(encoding="utf-8"))
        if not update(nb, url):
            continue
        stale.append(path)
        if not args.check:
            path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    for path in stale:
        print(("not up to date: " if args.check else "updated: ") + str(path))
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
