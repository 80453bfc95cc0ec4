"""Serve MathJax from the book itself, so that formulas render without a network.

Sphinx points pages at MathJax on a CDN; a book opened from ``_build/html`` on a laptop offline (or
built in CI, which has no network) then shows raw TeX.  The ``django-static-mathjax`` wheel
(requirements.txt) ships MathJax 3's files; this extension copies what a page needs into
``_static/mathjax`` and points ``mathjax_path`` there.  Without that package the CDN default stays.
"""
from __future__ import annotations

import shutil
from pathlib import Path

#: the TeX/MathML -> HTML bundle, the TeX extensions its `autoload` may fetch, the menu, the
#: accessibility helpers and the web fonts (not the 20 MB of speech-rule data it never loads here)
PARTS = ("tex-mml-chtml.js", "input/tex/extensions", "output/chtml/fonts/woff-v2", "ui", "a11y")
BUNDLE = "mathjax/" + PARTS[0]


def _es5() -> Path | None:
    try:
        import mathjax  # the django-static-mathjax wheel: MathJax's files as package data
    except ImportError:
        return None
    root = Path(mathjax.__file__).parent / "static" / "mathjax" / "es5"
    return root if (root / PARTS[0]).is_file() else None


def _use_local_copy(app, config) -> None:
    if _es5() is not None:
        config.mathjax_path = BUNDLE  # relative: under _static/


def _copy_files(app) -> None:
    es5 = _es5()
    if es5 is None or app.builder.format != "html":
        return
    dest = Path(app.outdir) / "_static" / "mathjax"
    for part in PARTS:
        src = es5 / part
        if src.is_dir():
            shutil.copytree(src, dest / part, dirs_exist_ok=True)
        elif src.is_file():
            (dest / part).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / part)


def setup(app):
    app.connect("config-inited", _use_local_copy)
    app.connect("builder-inited", _copy_files)  # before pages are written: they checksum the bundle
    return {"parallel_read_safe": True, "parallel_write_safe": True}
