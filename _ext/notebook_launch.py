"""Launch buttons (Binder, Colab) only on pages that are notebooks in the repository.

sphinx-book-theme offers them on every page with a kernel, MyST Markdown pages included
(``status.md``): Binder would open a Markdown file and Colab cannot open one at all.  This
extension runs after the theme has built a page's header buttons and takes the launch group
off every page whose source is not an ``.ipynb`` file.
"""
from __future__ import annotations

from pathlib import Path


def _drop_launch_buttons(app, pagename, templatename, context, doctree) -> None:
    if doctree is None or pagename not in app.env.all_docs:
        return
    if Path(app.env.doc2path(pagename)).suffix == ".ipynb":
        return
    buttons = context.get("header_buttons")
    if buttons:
        buttons[:] = [b for b in buttons if b.get("label") != "launch-buttons"]


def setup(app):
    # the theme adds the launch group at priority 501: run after it
    app.connect("html-page-context", _drop_launch_buttons, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
