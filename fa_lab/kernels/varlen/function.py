"""``VarlenAttention``: the packed kernels as a ``torch.autograd.Function``, differentiable once."""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from fa_lab.kernels.varlen.bwd import backward
from fa_lab.kernels.varlen.checks import check_varlen
from fa_lab.kernels.varlen.fwd import forward


class VarlenAttention(torch.autograd.Function):
    """``VarlenAttention.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, left,
    right, softcap, alibi_slopes) -> (o, lse)``.

    Saves exactly ``q, k, v, o, lse`` (and the two small cu_seqlens tables); the backward recomputes P.
    Both outputs are differentiable in q, k and v: a gradient on the lse enters as ``dS += P·dlse``.
    A second derivative raises (the backward kernels are not differentiable).
    """

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, left=-1, right=-1,
                softcap=0.0, alibi_slopes=None):
        p = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, left, right, softcap,
                         alibi_slopes)
        o, lse = forward(q, k, v, cu_seqlens_q, cu_seqlens_k, p)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.cu_seqlens = (cu_seqlens_q, cu_seqlens_k)   # int32 (B + 1,): constants, not saved activations
        ctx.problem = p
        ctx.set_materialize_grads(False)   # a missing gradient is skipped, not a tensor of zeros
        return o, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, do, dlse):
        q, k, v, o, lse = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(o)
        dq, dk, dv = backward(do, q, k, v, o, lse, *ctx.cu_seqlens, ctx.problem, dlse=dlse)
        return dq, dk, dv, *(None,) * 9
