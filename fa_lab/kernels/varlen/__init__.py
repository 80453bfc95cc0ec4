"""Packed variable-length FlashAttention-2 in Triton: forward and deterministic backward.

The flash-attn 2.x varlen layout: sequences of different lengths packed back to back, q
``(total_q, H, D)``, k and v ``(total_k, Hkv, D)``, and int32 ``cu_seqlens_q`` / ``cu_seqlens_k``
``(B + 1,)`` saying where each sequence starts.  Nothing is padded: a work table maps every
program to one real block of one sequence.  The modules, one idea each:

=================  ===========================================================================
``schedule``       the work table: which (sequence, block) each program owns (built on the device)
``tiles``          tile loads, the mask and the modified scores (soft cap, ALiBi) the kernels share
``fwd_kernel``     the forward kernel (@triton.jit)
``bwd_kernel``     the backward kernels: dQ (with delta and the base-2 lse), then dK/dV
``configs``        launch configurations by head dim and dtype, in one place
``checks``         what the entry points check before any launch
``fwd``, ``bwd``   ``varlen_forward`` and ``varlen_backward``
``function``       ``VarlenAttention``, the autograd Function
``registered``     the fixed-length adapter, registered as ``triton_varlen``
=================  ===========================================================================
"""
from fa_lab.core.world import HAS_TRITON, TRITON_MISSING

if HAS_TRITON:
    from fa_lab.kernels.varlen.bwd import varlen_backward
    from fa_lab.kernels.varlen.function import VarlenAttention
    from fa_lab.kernels.varlen.fwd import varlen_forward
else:
    # Triton publishes wheels for Linux only: without it the names exist and refuse every call
    def varlen_forward(*args, **kwargs):
        raise RuntimeError(TRITON_MISSING)

    varlen_backward = varlen_forward

    class VarlenAttention:
        @staticmethod
        def apply(*args, **kwargs):
            raise RuntimeError(TRITON_MISSING)

__all__ = ["VarlenAttention", "varlen_backward", "varlen_forward"]
