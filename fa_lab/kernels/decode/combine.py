"""Merging the splits of split-KV decoding: the second kernel of flash-decoding.

Each split ``s`` of a query row's keys produced a normalised partial output ``o_s`` and the
log-sum-exp ``lse_s`` of its scores.  The softmax over all keys weighs split ``s`` by the
share of the total mass it holds, ``exp(lse_s - lse)``, where ``lse = log Σ_s exp(lse_s)``:

    lse = logsumexp_s(lse_s),    o = Σ_s exp(lse_s - lse) · o_s

computed around the largest ``lse_s`` so that no exponential overflows.  A split that saw no
key (``lse_s = -inf``) weighs exactly 0; a row whose splits are all empty gives zeros and
``lse = -inf``, never NaN.  A NaN in a split's partials stays NaN in the row.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fa_lab.kernels.decode.configs import COMBINE_STAGES, COMBINE_WARPS, head_dim_block, next_power_of_2
from fa_lab.kernels.decode.launching import Launch, run


@triton.jit
def combine_kernel(O_PART, LSE_PART, O, LSE, n_splits, head_dim, rows_1, rows_2,
                   stride_o0, stride_o1, stride_o2, stride_od, stride_l0, stride_l1, stride_l2,
                   BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per output row; the rows are indexed ``(r0, r1, r2)``, flattened in that order."""
    row = tl.program_id(0).to(tl.int64)
    r0 = row // (rows_1 * rows_2)
    r1 = (row // rows_2) % rows_1
    r2 = row % rows_2
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < n_splits
    d_ok = offs_d < head_dim

    # region: combine
    lse_s = tl.load(LSE_PART + row * n_splits + offs_s, mask=s_ok, other=float("-inf"))
    lse_max = tl.max(lse_s, 0)
    m = tl.where(lse_max == float("-inf"), 0.0, lse_max)   # all empty: exp(-inf - 0) = 0, not NaN
    w = tl.exp(lse_s - m)                                  # 0 for an empty split
    l = tl.sum(w, 0)
    o_s = tl.load(O_PART + (row * n_splits + offs_s)[:, None] * head_dim + offs_d[None, :],
                  mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    o = tl.sum(w[:, None] * o_s, 0)
    seen = l != 0.0   # NaN counts as seen: NaN in, NaN out
    o = o / tl.where(seen, l, 1.0)
    lse = tl.where(seen, m + tl.log(tl.where(seen, l, 1.0)), float("-inf"))
    # endregion: combine

    tl.store(O + r0 * stride_o0 + r1 * stride_o1 + r2 * stride_o2 + offs_d * stride_od,
             o.to(O.dtype.element_ty), mask=d_ok)
    tl.store(LSE + r0 * stride_l0 + r1 * stride_l1 + r2 * stride_l2, lse)


def _rows3(t: torch.Tensor, n_rows_dims: int):
    """Shape and strides of ``t``'s first ``n_rows_dims`` dims, padded in front to three."""
    pad = 3 - n_rows_dims
    return (1,) * pad + tuple(t.shape[:n_rows_dims]), (0,) * pad + tuple(t.stride()[:n_rows_dims])


def combine_splits(o_parts: torch.Tensor, lse_parts: torch.Tensor, *, o: torch.Tensor | None = None,
                   lse: torch.Tensor | None = None):
    """Merge split partials: ``o_parts (*rows, S, D)`` and ``lse_parts (*rows, S)``, float32, contiguous.

    Returns ``(o, lse)``: ``o (*rows, D)`` (float32, or written into ``o``, any float dtype and
    strides), ``lse (*rows)`` float32 (or written into ``lse``).  ``rows`` has 1 to 3 dims.
    """
    if not isinstance(o_parts, torch.Tensor) or not isinstance(lse_parts, torch.Tensor):
        raise TypeError("o_parts and lse_parts must be torch.Tensors")
    if o_parts.dtype != torch.float32 or lse_parts.dtype != torch.float32:
        raise TypeError(f"o_parts and lse_parts must be float32, got {o_parts.dtype} and {lse_parts.dtype}")
    n_rows_dims = lse_parts.dim() - 1
    if not 1 <= n_rows_dims <= 3 or o_parts.dim() != n_rows_dims + 2 or o_parts.shape[:-1] != lse_parts.shape:
        raise ValueError(f"o_parts must be (*rows, splits, D) and lse_parts (*rows, splits) with 1 to 3 row dims, "
                         f"got {tuple(o_parts.shape)} and {tuple(lse_parts.shape)}")
    if o_parts.device != lse_parts.device:
        raise ValueError(f"o_parts and lse_parts must be on one device, got {o_parts.device} and {lse_parts.device}")
    o_parts, lse_parts = o_parts.contiguous(), lse_parts.contiguous()
    *rows, n_splits, head_dim = o_parts.shape
    if o is None:
        o = torch.empty((*rows, head_dim), dtype=torch.float32, device=o_parts.device)
    if lse is None:
        lse = torch.empty(rows, dtype=torch.float32, device=o_parts.device)
    if tuple(o.shape) != (*rows, head_dim) or tuple(lse.shape) != tuple(rows) or lse.dtype != torch.float32:
        raise ValueError(f"o must be {(*rows, head_dim)} and lse {tuple(rows)} float32, got {tuple(o.shape)} and "
                         f"{tuple(lse.shape)} {lse.dtype}")
    n_rows = math.prod(rows)
    if n_rows == 0:
        return o, lse
    run(combine_launch(o_parts.shape, o, lse), (o_parts, lse_parts, o, lse))
    return o, lse


def combine_launch(parts_shape, o: torch.Tensor, lse: torch.Tensor) -> Launch:
    """The launch of ``combine_kernel`` for partials of shape ``(*rows, S, D)`` into ``o`` and ``lse``
    (checked by ``combine_splits``; a caller that repeats a problem keeps it)."""
    *rows, n_splits, head_dim = parts_shape
    n_rows_dims = len(rows)
    (_, rows_1, rows_2), o_strides = _rows3(o, n_rows_dims)
    _, l_strides = _rows3(lse, n_rows_dims)
    return Launch(combine_kernel, (math.prod(rows),),
                  (n_splits, head_dim, rows_1, rows_2, *o_strides, o.stride(-1), *l_strides),
                  dict(BLOCK_S=next_power_of_2(n_splits), BLOCK_D=head_dim_block(head_dim)),
                  COMBINE_WARPS, COMBINE_STAGES)
