"""Conceptual figures for the book: the GPU's memory and threads, online softmax, FlashAttention-2's dataflow.

Every function builds and returns a new :class:`matplotlib.figure.Figure` without pyplot: nothing is drawn
or kept at import, and a notebook cell that ends with the call shows the figure once. ``theme="light"``
draws on an opaque white card that stays legible on a dark page; ``theme="dark"`` draws for a dark page.
One palette, one font size, and a colour means the same thing in every figure:

* orange: HBM and the traffic to and from it,
* blue: shared memory (SRAM) and the tiles that live in it,
* green: registers, accumulators and the matrix multiplies on the Tensor Cores,
* purple: the softmax's elementwise work (exponentials, rescaling).

The package: ``style`` (the palette, the font size, the drawing helpers), ``gpu`` (the memory hierarchy,
grids and warps, the pipelining and ping-pong timelines) and ``attention`` (online softmax, the
dataflow of FlashAttention-2, causal pairing).
"""
from __future__ import annotations

from fa_lab.figures.attention import (
    EXAMPLE_ROW,
    causal_pairing,
    fa2_backward_dataflow,
    fa2_forward_dataflow,
    online_softmax_rescaling,
    online_softmax_steps,
    warp_specialized_dkdv,
)
from fa_lab.figures.gpu import (
    grid_block_warp,
    memory_hierarchy,
    pingpong_schedule,
    pingpong_timeline,
    pipeline_schedule,
    pipelining_timeline,
)
from fa_lab.figures.style import CYCLE, FONT_SIZE, THEMES, figure_to_png, figure_to_svg, palette, tint

#: every figure of this module by name, for a chapter or a test that wants them all
FIGURES = {f.__name__: f for f in (memory_hierarchy, grid_block_warp, online_softmax_rescaling, fa2_forward_dataflow,
                                   fa2_backward_dataflow, pipelining_timeline, pingpong_timeline, causal_pairing,
                                   warp_specialized_dkdv)}

__all__ = ["FONT_SIZE", "THEMES", "CYCLE", "figure_to_png", "figure_to_svg", "palette", "tint", "memory_hierarchy",
           "grid_block_warp", "EXAMPLE_ROW", "online_softmax_steps", "online_softmax_rescaling",
           "fa2_forward_dataflow", "fa2_backward_dataflow", "pipeline_schedule", "pipelining_timeline",
           "pingpong_schedule", "pingpong_timeline", "causal_pairing", "warp_specialized_dkdv", "FIGURES"]
