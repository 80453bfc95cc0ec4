"""The figures' one style: the palette of both themes, one font size, and the drawing helpers.

Every figure starts from ``new_canvas`` (a diagram) or ``new_plot`` (axes with data): a Figure that
shows itself in Jupyter without pyplot.  The helpers draw in the colours of ``palette(theme)`` and at
``FONT_SIZE``, so that a colour means the same thing in every figure.
"""
from __future__ import annotations

import io
from types import SimpleNamespace

import numpy as np
from matplotlib.colors import to_hex, to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

FONT_SIZE = 10
#: ``tint`` and ``strong``: how much of a hue a light and a strong fill mix into the background
THEMES = {
    "light": dict(bg="#ffffff", ink="#1a1a1a", muted="#595959", line="#8c8c8c", tint=0.25, strong=0.5,
                  orange="#d55e00", blue="#0072b2", green="#009e73", purple="#cc79a7", sky="#56b4e9",
                  yellow="#e69f00"),
    "dark": dict(bg="#14181e", ink="#ececec", muted="#a9a9a9", line="#7d7d7d", tint=0.25, strong=0.4,
                 orange="#f28c45", blue="#5aa9e6", green="#3dc79b", purple="#e394c4", sky="#8fd3f7",
                 yellow="#f2c14e"),
}
#: the hues a figure cycles through when it needs several of one kind (the pairs of causal_pairing)
CYCLE = ("blue", "orange", "green", "purple", "sky", "yellow")


class _BookFigure(Figure):
    """A Figure that shows itself in Jupyter without pyplot: a PNG at twice the resolution, shown at 1x."""

    def _repr_png_(self):
        width, height = self.get_size_inches() * self.dpi
        return figure_to_png(self, dpi=2 * self.dpi), {"width": int(width), "height": int(height)}


def figure_to_png(fig: Figure, dpi: float = 150) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def figure_to_svg(fig: Figure) -> str:
    """The figure as an SVG document (its text drawn as paths: it looks the same without the fonts)."""
    buf = io.StringIO()
    fig.savefig(buf, format="svg")
    return buf.getvalue()


# --------------------------------------------------------------------------- drawing helpers

def palette(theme: str = "light") -> SimpleNamespace:
    """The colours of one theme: ``bg``, ``ink``, ``muted``, ``line``, the hues, and the fill amounts."""
    if theme not in THEMES:
        raise ValueError(f"theme must be one of {sorted(THEMES)}, got {theme!r}")
    return SimpleNamespace(name=theme, **THEMES[theme])


def tint(th, hue: str, amount: float | None = None) -> str:
    """The hue named ``hue`` mixed into the background: a fill the ink stays legible on."""
    a = th.tint if amount is None else amount
    return to_hex(a * np.array(to_rgb(getattr(th, hue))) + (1 - a) * np.array(to_rgb(th.bg)))


def new_canvas(th, width: float, height: float, scale: float = 0.7):
    """A figure that one axes fills, in units of ``scale`` inches either way, y growing down."""
    fig = _BookFigure(figsize=(width * scale, height * scale), facecolor=th.bg)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set(xlim=(0, width), ylim=(height, 0), aspect="equal")
    ax.axis("off")
    return fig, ax


def new_plot(th, size, **subplots):
    fig = _BookFigure(figsize=size, facecolor=th.bg, layout="constrained")
    return fig, fig.subplots(**subplots)


def style_axes(ax, th, xlabel: str = "", ylabel: str = "", title: str = ""):
    """Colours and the one font size on a plotting axes."""
    ax.set_facecolor(th.bg)
    for spine in ax.spines.values():
        spine.set_color(th.line)
    ax.tick_params(colors=th.ink, labelsize=FONT_SIZE)
    ax.set_xlabel(xlabel, color=th.ink, fontsize=FONT_SIZE)
    ax.set_ylabel(ylabel, color=th.ink, fontsize=FONT_SIZE)
    ax.set_title(title, color=th.ink, fontsize=FONT_SIZE, fontweight="bold", loc="left")


def add_legend(ax, th, **kw):
    ax.legend(fontsize=FONT_SIZE, facecolor=th.bg, edgecolor=th.line, labelcolor=th.ink, **kw)


def add_text(ax, x, y, s, th, color=None, **kw):
    return ax.text(x, y, s, **(dict(ha="center", va="center", fontsize=FONT_SIZE,
                                    color=getattr(th, color or "ink")) | kw))


def add_box(ax, x, y, w, h, th, hue, label=None, amount=None, dashed=False, fill=True, **text_kw):
    """A rounded box with its top-left corner at (x, y) (y down), an edge in ``hue`` and a tinted fill."""
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0,rounding_size=0.08",
                                facecolor=tint(th, hue, amount) if fill else "none",
                                edgecolor=getattr(th, hue), linewidth=1.3, linestyle="--" if dashed else "-"))
    if label is not None:
        add_text(ax, x + (0.15 if text_kw.get("ha") == "left" else w / 2), y + h / 2, label, th, **text_kw)


def add_arrow(ax, start, end, th, hue="line", label=None):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=12, linewidth=1.3,
                                 color=getattr(th, hue), shrinkA=0, shrinkB=0))
    if label:
        add_text(ax, (start[0] + end[0]) / 2, (start[1] + end[1]) / 2 - 0.18, label, th, color="muted")
