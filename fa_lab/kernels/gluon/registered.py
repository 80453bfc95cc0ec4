"""The Gluon forward and backward registered as ``flash_gluon`` (chapter 11)."""
from __future__ import annotations

from fa_lab.autograd import Recompute
from fa_lab.core.registry import register
from fa_lab.kernels.gluon import GLUON_MISSING, gluon_backward, gluon_forward
from fa_lab.kernels.gluon.problems import BACKWARD_HEAD_DIMS, DTYPES, HEAD_DIMS, MASKS, gluon_limits
from fa_lab.kernels.triton import triton_backward, triton_forward

#: head dims at which ``flash_gluon`` runs chapter 4's Triton forward instead: at D = 64 its programs of one
#: warpgroup, three to a multiprocessor, measured faster than the Gluon layout (docs/decisions/gluon-forward.md)
TRITON_FORWARD_HEAD_DIMS = (64,)


def forward(q, k, v, spec):
    """``(o, lse)`` from the faster of the two forwards at this head dim."""
    if spec.head_dim in TRITON_FORWARD_HEAD_DIMS:
        return triton_forward(q, k, v, spec)
    return gluon_forward(q, k, v, spec)


def backward(q, k, v, o, lse, do, spec, dlse=None):
    """``(dq, dk, dv)`` from the Gluon passes at the head dims they are built for; the others, and a gradient on the
    lse (``dlse``), from chapter 5's Triton backward."""
    if dlse is not None or spec.head_dim not in BACKWARD_HEAD_DIMS:
        return triton_backward(q, k, v, o, lse, do, spec, dlse=dlse)
    return gluon_backward(q, k, v, o, lse, do, spec)


def flash_gluon(q, k, v, spec):
    """The Gluon forward (chapter 4's at D = 64) and chapter 5's deterministic two-pass backward, in Gluon too at
    D = 64 and 128."""
    return Recompute.apply(q, k, v, spec, forward, backward)


def limits(spec) -> str | None:
    """``gluon_limits``, and first whether this process can run Gluon kernels at all."""
    return GLUON_MISSING or gluon_limits(spec)


register(
    "flash_gluon", chapter=11,
    description="FlashAttention-3's layout in Gluon on Hopper: a TMA loader warp and two consumer "
                "warpgroups that overlap softmax and Tensor Core products; forward and chapter 5's two-pass "
                "backward (deterministic)",
    dtypes=DTYPES, masks=MASKS, head_dims=(min(HEAD_DIMS), max(HEAD_DIMS)), worlds=("gpu",),
    backward=True, backend="triton", limits=limits,
    extra_memory=lambda s: 4 * s.batch * s.heads * s.n_q,   # lse (the backward adds D: as much again)
    notes="Hopper (sm_90) only; D = 64, 128 or 256 (the forward at D = 64 is chapter 4's Triton kernel, the "
          "backward at D = 256 chapter 5's Triton one), "
          "Nq = Nk a multiple of 128, no mask or causal.",
    tags=("gluon", "tensor-cores", "warp-specialized"),
)(flash_gluon)
