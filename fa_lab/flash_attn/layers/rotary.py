"""Rotary position embeddings (RoPE) with flash-attn's ``flash_attn.layers.rotary`` interface, in plain PyTorch.

RoPE turns each pair of features of a query or key at position ``p`` by the angle ``p·θ_i``: with
``c = cos(p·θ_i)`` and ``s = sin(p·θ_i)`` the pair ``(x1, x2)`` becomes ``(x1·c - x2·s, x2·c + x1·s)``.
The tables ``cos`` and ``sin`` are ``(seqlen_rotary, rotary_dim / 2)``; only the first
``rotary_dim = 2·cos.shape[-1]`` features turn, the rest pass through.  Two pairings exist:

* ``interleaved=False`` (GPT-NeoX): feature ``i`` pairs with ``i + rotary_dim / 2``;
* ``interleaved=True`` (GPT-J): feature ``2i`` pairs with ``2i + 1``.

The rotation is computed in float32 and cast back.  Plain PyTorch ops: autograd differentiates it
(the gradient of a rotation is the opposite rotation).  Positions past the end of the tables (only
reachable through per-sequence tensor offsets) are left unrotated, as flash-attn's kernel does.
"""
from __future__ import annotations

import numbers
from typing import Optional, Union

import torch

__all__ = ["apply_rotary_emb", "apply_rotary_emb_func", "apply_rotary_emb_kv_", "apply_rotary_emb_qkv_",
           "apply_rotary_emb_torch", "rotate_half"]


def rotate_half(x, interleaved=False):
    """``(x1, x2) -> (-x2, x1)`` for every pair: the sine half of a rotation."""
    if not interleaved:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def _turn(x, cos, sin, interleaved: bool):
    """Rotate ``x (..., rotary_dim)`` by per-pair ``cos, sin (..., rotary_dim / 2)`` (all broadcast)."""
    if interleaved:
        cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    else:
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    return x * cos + rotate_half(x, interleaved) * sin


def apply_rotary_emb_torch(x, cos, sin, interleaved=False):
    """x ``(batch, seqlen, nheads, headdim)``, cos/sin ``(seqlen, rotary_dim / 2)``: position ``i`` is row ``i``."""
    ro_dim = 2 * cos.shape[-1]
    if ro_dim > x.shape[-1]:
        raise ValueError(f"rotary_dim ({ro_dim}) must be <= headdim ({x.shape[-1]})")
    n = x.shape[-3]
    turned = _turn(x[..., :ro_dim], cos[:n, None, :], sin[:n, None, :], interleaved)
    return torch.cat([turned, x[..., ro_dim:]], dim=-1)


def _check(x, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen) -> tuple[int, int]:
    """Check the arguments; return ``(rotary_dim, sequence length x is laid out for)``."""
    for name, t in (("x", x), ("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if cos.dim() != 2 or cos.shape != sin.shape:
        raise ValueError(f"cos and sin must both be (seqlen_rotary, rotary_dim / 2), got {tuple(cos.shape)} and "
                         f"{tuple(sin.shape)}")
    if cos.device != x.device or sin.device != x.device:
        raise ValueError(f"cos and sin must be on the device of x ({x.device}), got {cos.device} and {sin.device}")
    if cu_seqlens is None:
        if x.dim() != 4:
            raise ValueError(f"x must be (batch_size, seqlen, nheads, headdim), got shape {tuple(x.shape)}")
        batch, seqlen = x.shape[0], x.shape[1]
    else:
        if x.dim() != 3:
            raise ValueError(f"with cu_seqlens, x must be (total_seqlen, nheads, headdim), got {tuple(x.shape)}")
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError("cu_seqlens must be an integer tensor of shape (batch + 1,)")
        if not isinstance(max_seqlen, numbers.Integral):
            raise ValueError("with cu_seqlens, max_seqlen (int) must be given")
        batch, seqlen = cu_seqlens.numel() - 1, int(max_seqlen)
    ro_dim = 2 * cos.shape[1]
    if ro_dim > x.shape[-1]:
        raise ValueError(f"rotary_dim = 2 * cos.shape[-1] = {ro_dim} must be <= headdim ({x.shape[-1]})")
    if cos.shape[0] < seqlen:
        raise ValueError(f"cos and sin have {cos.shape[0]} positions, fewer than seqlen ({seqlen})")
    if isinstance(seqlen_offsets, torch.Tensor):
        if seqlen_offsets.shape != (batch,) or seqlen_offsets.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"seqlen_offsets must be an int or an int32/int64 tensor of shape ({batch},), got "
                             f"{seqlen_offsets.dtype} {tuple(seqlen_offsets.shape)}")
    elif isinstance(seqlen_offsets, numbers.Integral) and not isinstance(seqlen_offsets, bool):
        if seqlen_offsets < 0 or seqlen_offsets + seqlen > cos.shape[0]:
            raise ValueError(f"seqlen_offsets ({seqlen_offsets}) + seqlen ({seqlen}) must be within the "
                             f"{cos.shape[0]} positions of cos and sin")
    else:
        raise TypeError(f"seqlen_offsets must be an int or a tensor, got {type(seqlen_offsets).__name__}")
    return ro_dim, seqlen


def _positions(x, seqlen_offsets, cu_seqlens) -> torch.Tensor:
    """The position of every token of x: ``(batch, seqlen)``, or ``(total_seqlen,)`` with cu_seqlens."""
    device = x.device
    offsets = seqlen_offsets.to(device=device, dtype=torch.long) if isinstance(seqlen_offsets, torch.Tensor) \
        else torch.tensor([int(seqlen_offsets)], device=device)
    if cu_seqlens is None:
        pos = torch.arange(x.shape[1], device=device)[None, :]
        return pos + offsets[:, None]
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    token = torch.arange(x.shape[0], device=device)
    seq = torch.searchsorted(cu[1:], token, right=True)   # tokens past the last offset: seq == batch
    inside = seq < cu.numel() - 1
    seq = seq.clamp(max=cu.numel() - 2)
    pos = token - cu[seq] + (offsets[seq] if offsets.numel() > 1 else offsets)
    return torch.where(inside, pos, torch.full_like(pos, -1))   # -1: left as it is


def apply_rotary_emb(
    x,
    cos,
    sin,
    interleaved=False,
    inplace=False,
    seqlen_offsets: Union[int, torch.Tensor] = 0,
    cu_seqlens: Optional[torch.Tensor] = None,
    max_seqlen: Optional[int] = None,
):
    """Rotate the first ``rotary_dim = 2·cos.shape[-1]`` features of x by its tokens' positions.

    x: ``(batch_size, seqlen, nheads, headdim)``, or ``(total_seqlen, nheads, headdim)`` with ``cu_seqlens``
    ``(batch + 1,)`` and ``max_seqlen``.  cos, sin: ``(seqlen_rotary, rotary_dim / 2)``.  Token ``t`` of
    sequence ``b`` sits at position ``t + seqlen_offsets[b]`` (an int offset is the same for every
    sequence).  ``inplace=True`` writes the result into x and returns x.  Returns x's shape and dtype.
    """
    ro_dim, _ = _check(x, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen)
    pos = _positions(x, seqlen_offsets, cu_seqlens)
    inside = (pos >= 0) & (pos < cos.shape[0])
    row = pos.clamp(0, cos.shape[0] - 1)
    c = torch.where(inside[..., None], cos.float()[row], 1.0)[..., None, :]   # (..., 1, rotary_dim / 2)
    s = torch.where(inside[..., None], sin.float()[row], 0.0)[..., None, :]
    turned = _turn(x[..., :ro_dim].float(), c, s, interleaved).to(x.dtype)
    if inplace:
        x[..., :ro_dim] = turned
        return x
    return torch.cat([turned, x[..., ro_dim:]], dim=-1)


#: flash-attn's older name
apply_rotary_emb_func = apply_rotary_emb


def apply_rotary_emb_qkv_(qkv, cos, sin, cos_k=None, sin_k=None, interleaved=False,
                          seqlen_offsets: Union[int, torch.Tensor] = 0, num_heads_q: Optional[int] = None):
    """Rotate q and k of a packed qkv in place and return it.

    qkv: ``(batch_size, seqlen, 3, nheads, headdim)``, or ``(batch_size, seqlen, num_heads_q + 2·num_heads_k,
    headdim)`` with ``num_heads_q`` (grouped-query attention).  k turns by ``cos_k, sin_k`` where given.
    """
    cos_k = cos if cos_k is None else cos_k
    sin_k = sin if sin_k is None else sin_k
    if qkv.dim() == 5:
        if qkv.shape[2] != 3:
            raise ValueError(f"qkv must be (batch_size, seqlen, 3, nheads, headdim), got {tuple(qkv.shape)}")
        q, k = qkv[:, :, 0], qkv[:, :, 1]
    else:
        if num_heads_q is None or qkv.dim() != 4 or (qkv.shape[2] - num_heads_q) % 2:
            raise ValueError("a 4-dim qkv (batch_size, seqlen, num_heads_q + 2 * num_heads_k, headdim) needs "
                             f"num_heads_q, got shape {tuple(qkv.shape)} and num_heads_q={num_heads_q}")
        num_heads_k = (qkv.shape[2] - num_heads_q) // 2
        q, k = qkv[:, :, :num_heads_q], qkv[:, :, num_heads_q:num_heads_q + num_heads_k]
    apply_rotary_emb(q, cos, sin, interleaved, inplace=True, seqlen_offsets=seqlen_offsets)
    apply_rotary_emb(k, cos_k, sin_k, interleaved, inplace=True, seqlen_offsets=seqlen_offsets)
    return qkv


def apply_rotary_emb_kv_(kv, cos, sin, interleaved=False, seqlen_offsets: Union[int, torch.Tensor] = 0):
    """Rotate k of a packed kv ``(batch_size, seqlen, 2, nheads, headdim)`` in place and return kv."""
    if kv.dim() != 5 or kv.shape[2] != 2:
        raise ValueError(f"kv must be (batch_size, seqlen, 2, nheads, headdim), got {tuple(kv.shape)}")
    apply_rotary_emb(kv[:, :, 0], cos, sin, interleaved, inplace=True, seqlen_offsets=seqlen_offsets)
    return kv
