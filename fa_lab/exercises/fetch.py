"""Copy the exercise notebooks into a folder of your own (fa-lab exercises fetch DIR).

    fa-lab exercises fetch my-exercises        # then: jupyter lab my-exercises
    fa-lab grade my-exercises                  # your score, exercise by exercise

The notebooks ship inside the installed package (``fa_lab/exercises/notebooks``, copied there
from the clone's ``exercises/`` when the wheel is built); in a clone installed in editable mode
they are read from ``exercises/`` itself.  A notebook already in DIR is never overwritten
(it may hold your answers) unless ``--force`` says so.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path


def notebooks_dir() -> Path:
    """Where this installation keeps the exercise notebooks."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "notebooks", here.parents[1] / "exercises"):
        if any(candidate.glob("*.ipynb")):
            return candidate
    raise FileNotFoundError(f"no exercise notebooks in {here / 'notebooks'} (an installed package) or "
                            f"{here.parents[1] / 'exercises'} (a clone): reinstall fa_lab")


def notebooks() -> list[Path]:
    """The exercise notebooks, in the book's order (their names start with the chapter number)."""
    return sorted(notebooks_dir().glob("*.ipynb"))


def fetch(target, *, force: bool = False) -> tuple[list[Path], list[Path]]:
    """Copy every exercise notebook into ``target`` (created if needed); returns ``(copied, kept)``,
    ``kept`` being the notebooks already there and left alone."""
    target = Path(target)
    target.mkdir(parents=True, exist_ok=True)
    copied, kept = [], []
    for nb in notebooks():
        dest = target / nb.name
        if dest.exists() and not force:
            kept.append(dest)
            continue
        shutil.copyfile(nb, dest)
        copied.append(dest)
    return copied, kept


def configure(parser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="{fetch}")
    p = actions.add_parser("fetch", help="copy the exercise notebooks into DIR",
                           description="Copy the exercise notebooks into DIR (created if needed).")
    p.add_argument("dir", metavar="DIR", help="the folder to copy them into")
    p.add_argument("--force", action="store_true", help="overwrite notebooks already in DIR (your answers too)")


def run(args) -> int:
    try:
        copied, kept = fetch(args.dir, force=args.force)
    except OSError as exc:
        print(f"fa-lab exercises fetch: error: {exc}", file=sys.stderr)
        return 1
    for path in copied:
        print(f"copied {path}")
    for path in kept:
        print(f"kept   {path} (already there; --force overwrites it)")
    print(f"next: jupyter lab {args.dir}    then: fa-lab grade {args.dir}")
    return 0
