"""``glue(name, value)``: a number computed in a cell, quoted in the prose with ``{glue:text}`name```.

The book's prose never types a measured number: a cell computes it from the recorded data and
glues it (myst-nb stores it in the notebook's outputs, and the rendered page puts it in the text).
Where myst-nb is not installed (a notebook opened on Colab, or JupyterLab without the book's
tools) the value is shown, so the cell still runs and says what the prose will quote.
"""
from __future__ import annotations

try:
    from myst_nb import glue as _myst_glue
except ImportError:  # no book tools here: nothing renders the prose's {glue} roles anyway
    _myst_glue = None


def glue(name: str, value, display: bool = False) -> None:
    """myst-nb's ``glue`` where the book is built; elsewhere, show ``name = value`` when asked to display."""
    if _myst_glue is not None:
        _myst_glue(name, value, display=display)
    elif display:
        print(f"{name} = {value}")
