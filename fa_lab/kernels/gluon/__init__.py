"""Chapter 11's kernels in Gluon, Triton's lower-level language, for Hopper.

=================  ===========================================================================
``problems``       which problems they take (``gluon_limits``), decided without Triton
``copies``         what the passes share: TMA descriptors and copies, the consumers' registers
``fwd``            ``gluon_forward``: a loader warp and two consumer warpgroups
``bwd``            ``gluon_backward``: the two deterministic passes of chapter 5, laid out alike
``registered``     forward and backward registered as ``flash_gluon``
=================  ===========================================================================
"""
from fa_lab.core.world import HAS_TRITON, TRITON_MISSING

#: why the Gluon kernels cannot run in this process (None: they can)
GLUON_MISSING = None if HAS_TRITON else TRITON_MISSING
if HAS_TRITON:
    try:
        from fa_lab.kernels.gluon.bwd import gluon_backward
        from fa_lab.kernels.gluon.fwd import gluon_forward
    except ImportError as exc:   # a Triton release without Gluon (before 3.5)
        GLUON_MISSING = f"the Gluon kernels need Triton 3.5 or later with triton.experimental.gluon ({exc})"

if GLUON_MISSING is not None:
    def gluon_forward(*args, **kwargs):
        raise RuntimeError(GLUON_MISSING)

    gluon_backward = gluon_forward

__all__ = ["GLUON_MISSING", "gluon_backward", "gluon_forward"]
