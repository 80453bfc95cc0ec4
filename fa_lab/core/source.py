"""Showing a kernel's source in a chapter: the whole function, or one marked region of it.

A chapter prints the code that runs rather than a second copy of it.  To show part of a
function, the function marks it with comment lines::

    # region: key-ranges
    ...
    # endregion: key-ranges

``show(obj, region)`` displays those lines (highlighted in a notebook), ``source_text``
returns them.  Marker lines never appear in what is shown.  Works for plain functions,
classes and ``@triton.jit`` functions (GPU and interpreter alike).
"""
from __future__ import annotations

import inspect
import re
import textwrap

_MARKER = re.compile(r"^\s*#\s*(region|endregion):\s*(\S+)\s*$")


def _python_object(obj):
    # a @triton.jit function wraps the Python function it was written as (.fn), in both worlds
    while not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.ismethod(obj)) and hasattr(obj, "fn"):
        obj = obj.fn
    return inspect.unwrap(obj) if inspect.isfunction(obj) else obj


def _name(obj) -> str:
    return getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or repr(obj)


def source_text(obj, region: str | None = None) -> str:
    """The source of ``obj`` without marker lines, or only the lines of its ``region`` (dedented).

    Raises ``ValueError`` naming the regions ``obj`` has when ``region`` is not one of them, and
    ``TypeError`` when ``obj`` has no Python source.
    """
    target = _python_object(obj)
    try:
        lines = inspect.getsource(target).splitlines()
    except (OSError, TypeError) as exc:
        raise TypeError(f"no Python source for {_name(obj)}: {exc}") from None
    if region is None:
        return "\n".join(line for line in lines if not _MARKER.match(line)) + "\n"
    found = [(i, m.group(1)) for i, m in ((i, _MARKER.match(line)) for i, line in enumerate(lines))
             if m and m.group(2) == region]
    starts = [i for i, kind in found if kind == "region"]
    ends = [i for i, kind in found if kind == "endregion"]
    if len(starts) != 1 or len(ends) != 1 or ends[0] < starts[0]:
        names = sorted({m.group(2) for m in map(_MARKER.match, lines) if m and m.group(1) == "region"})
        if not starts and not ends:
            raise ValueError(f"{_name(target)} has no region {region!r}; its regions: {names or 'none'}")
        raise ValueError(f"region {region!r} of {_name(target)} needs exactly one '# region: {region}' line "
                         f"followed by one '# endregion: {region}' line")
    body = [line for line in lines[starts[0] + 1:ends[0]] if not _MARKER.match(line)]
    return textwrap.dedent("\n".join(body)) + "\n"


def show(obj, region: str | None = None) -> None:
    """Display ``source_text(obj, region)``: highlighted Python in a notebook, printed elsewhere."""
    text = source_text(obj, region)
    try:
        from IPython import get_ipython
        from IPython.display import Code, display
    except ImportError:
        get_ipython = None
    shell = get_ipython() if get_ipython is not None else None
    if shell is not None and type(shell).__name__ == "ZMQInteractiveShell":  # a Jupyter kernel
        display(Code(text, language="python"))
    else:
        print(text, end="")
