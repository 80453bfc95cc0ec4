"""flash-attn 2.x's Python interface on fa_lab's kernels: ``import fa_lab.flash_attn as flash_attn``.

The seven functions of ``flash_attn.flash_attn_interface`` (2.7), with flash-attn's argument names,
order and defaults, its layout ``(batch, seqlen, nheads, headdim)`` (``(total, nheads, headdim)`` for
the variable-length ones) and its return values.  Conventions shared by all of them:

* Grouped-query attention: k and v may have fewer heads; query head ``h`` reads k/v head
  ``h // (nheads // nheads_k)``.
* ``causal=True`` aligns the mask bottom-right: query ``i`` sees key ``j`` when
  ``j <= i + seqlen_k - seqlen_q``.  ``window_size=(left, right)`` lets it see keys
  ``[i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right]``, ``-1`` unbounded.  A row that
  sees no key comes out zero.
* ``softcap > 0`` caps the scaled scores at ``softcap·tanh(s / softcap)``; ``alibi_slopes`` (float32
  ``(nheads,)`` or ``(batch_size, nheads)``) then adds ``-slope·|i + seqlen_k - seqlen_q - j|``.
* ``softmax_scale`` defaults to ``1 / sqrt(headdim)``.

Where fa_lab differs from flash-attn:

* ``dropout_p > 0`` raises NotImplementedError: there is no dropout.
* ``return_attn_probs=True`` returns ``(out, softmax_lse, S_dmask)`` with ``S_dmask`` the attention
  probabilities ``(batch_size, nheads, seqlen_q, seqlen_k)`` recomputed in plain PyTorch (see
  ``fa_lab.flash_attn.probs``), not the kernel's internal buffer; ``softmax_lse`` and ``S_dmask``
  carry no gradient.  A row that sees no key has ``softmax_lse = -inf`` (flash-attn writes ``+inf``).
* The backward is always deterministic; ``deterministic`` is accepted and changes nothing.
* Inputs may be float16, bfloat16 or float32, head dims 1..256 (flash-attn: fp16/bf16, CUDA).
* ``block_table`` in ``flash_attn_varlen_func`` and ``cache_leftpad`` in ``flash_attn_with_kvcache``
  raise NotImplementedError.  Paged caches may use any page size (flash-attn: multiples of 256).
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from fa_lab.flash_attn.checks import (
    check_cu_seqlens,
    check_dropout,
    check_flag,
    check_max_seqlen,
    check_packed,
    check_same,
    check_tensor,
    score_args,
)
from fa_lab.flash_attn.engine import fixed_length_attention, varlen_kernel
from fa_lab.flash_attn.kvcache import kvcache_attention
from fa_lab.flash_attn.probs import fixed_length_probs, varlen_probs

__all__ = [
    "flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache",
]

BSHD = "batch_size, seqlen, nheads, headdim"
THD = "total, nheads, headdim"


def _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
               return_attn_probs, names=("q", "k", "v")):
    """The fixed-length functions, once q, k and v are apart and each has its layout checked."""
    check_dropout(dropout_p)
    check_flag("deterministic", deterministic)
    probs = check_flag("return_attn_probs", return_attn_probs)
    check_same(q, k, v, names)
    if not (q.shape[0] == k.shape[0] == v.shape[0]) or k.shape[1] != v.shape[1]:
        raise ValueError(f"{', '.join(names)} must share batch_size, and {names[1]} and {names[2]} seqlen_k; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    args = score_args(q.transpose(1, 2), k.shape[2], softmax_scale=softmax_scale, causal=causal,
                      window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)
    out, lse = fixed_length_attention(q, k, v, args)
    if not probs:
        return out
    return out, lse.detach(), fixed_length_probs(q, k, args)


def _varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                      causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                      names=("q", "k", "v"), cu_names=("cu_seqlens_q", "cu_seqlens_k"),
                      max_names=("max_seqlen_q", "max_seqlen_k")):
    """The variable-length functions, once q, k and v are apart and each has its layout checked."""
    check_dropout(dropout_p)
    check_flag("deterministic", deterministic)
    probs = check_flag("return_attn_probs", return_attn_probs)
    check_same(q, k, v, names)
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"{names[1]} and {names[2]} must have the same number of tokens, got {k.shape[0]} and "
                         f"{v.shape[0]}")
    batch = check_cu_seqlens(cu_names[0], cu_seqlens_q, q.device)
    if check_cu_seqlens(cu_names[1], cu_seqlens_k, q.device) != batch:
        raise ValueError(f"{cu_names[0]} and {cu_names[1]} must describe the same number of sequences, got shapes "
                         f"{tuple(cu_seqlens_q.shape)} and {tuple(cu_seqlens_k.shape)}")
    max_seqlen_q = check_max_seqlen(max_names[0], max_seqlen_q)
    max_seqlen_k = check_max_seqlen(max_names[1], max_seqlen_k)
    # q's own (1, H, N, D) view (one token at least) carries the shapes for the argument check
    probe = q[:1] if q.shape[0] else q.new_empty(1, *q.shape[1:])
    args = score_args(probe.transpose(0, 1).unsqueeze(0), k.shape[1], softmax_scale=softmax_scale, causal=causal,
                      window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, batch=batch)
    out, lse = varlen_kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, args)
    if not probs:
        return out
    return out, lse.detach(), varlen_probs(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, args)


def flash_attn_qkvpacked_func(
    qkv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # <=0.0 means deactivate
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """Attention of q, k and v stacked in one tensor; gradients land in ``qkv``.

    qkv: ``(batch_size, seqlen, 3, nheads, headdim)``.  The other arguments and the return value are
    ``flash_attn_func``'s (the mask is square: ``seqlen_q == seqlen_k``).
    """
    check_packed("qkv", qkv, 2, 3, "batch_size, seqlen, 3, nheads, headdim")
    q, k, v = qkv.unbind(dim=2)
    return _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                      return_attn_probs, names=("qkv[:, :, 0]", "qkv[:, :, 1]", "qkv[:, :, 2]"))


def flash_attn_kvpacked_func(
    q,
    kv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """Attention with k and v stacked in one tensor; their gradients land in ``kv``.

    q: ``(batch_size, seqlen_q, nheads, headdim)``; kv: ``(batch_size, seqlen_k, 2, nheads_k, headdim)``.
    The other arguments and the return value are ``flash_attn_func``'s.
    """
    check_tensor("q", q, BSHD)
    check_packed("kv", kv, 2, 2, "batch_size, seqlen_k, 2, nheads_k, headdim")
    k, v = kv.unbind(dim=2)
    return _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                      return_attn_probs, names=("q", "kv[:, :, 0]", "kv[:, :, 1]"))


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """Attention of a batch of equal-length sequences, differentiable in q, k and v.

    Arguments:
        q: ``(batch_size, seqlen_q, nheads, headdim)``.
        k, v: ``(batch_size, seqlen_k, nheads_k, headdim)``; ``nheads % nheads_k == 0``.
        dropout_p: must be 0.0 (dropout is not implemented).
        softmax_scale: the scale of ``q kᵀ``; None is ``1 / sqrt(headdim)``.
        causal: bottom-right aligned causal mask.
        window_size: ``(left, right)`` sliding window, ``-1`` unbounded.
        softcap: ``> 0`` caps the scores at ``softcap·tanh(s / softcap)``.
        alibi_slopes: float32 ``(nheads,)`` or ``(batch_size, nheads)``.
        deterministic: accepted; the backward is always deterministic.
        return_attn_probs: also return the lse and the attention probabilities.
    Returns:
        out ``(batch_size, seqlen_q, nheads, headdim)``; with ``return_attn_probs``
        ``(out, softmax_lse (batch_size, nheads, seqlen_q) float32, S_dmask (batch_size, nheads, seqlen_q,
        seqlen_k))``, S_dmask recomputed in plain PyTorch.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, BSHD)
    return _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                      return_attn_probs)


def flash_attn_varlen_qkvpacked_func(
    qkv,
    cu_seqlens,
    max_seqlen,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """Variable-length attention of q, k and v stacked in one tensor; gradients land in ``qkv``.

    qkv: ``(total, 3, nheads, headdim)``; cu_seqlens: int32 ``(batch_size + 1,)``; max_seqlen: int.
    The other arguments and the return value are ``flash_attn_varlen_func``'s.
    """
    check_packed("qkv", qkv, 1, 3, "total, 3, nheads, headdim")
    q, k, v = qkv.unbind(dim=1)
    return _varlen_attention(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                             causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                             names=("qkv[:, 0]", "qkv[:, 1]", "qkv[:, 2]"), cu_names=("cu_seqlens", "cu_seqlens"),
                             max_names=("max_seqlen", "max_seqlen"))


def flash_attn_varlen_kvpacked_func(
    q,
    kv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """Variable-length attention with k and v stacked in one tensor; their gradients land in ``kv``.

    q: ``(total_q, nheads, headdim)``; kv: ``(total_k, 2, nheads_k, headdim)``.  The other arguments and
    the return value are ``flash_attn_varlen_func``'s.
    """
    check_tensor("q", q, THD)
    check_packed("kv", kv, 1, 2, "total_k, 2, nheads_k, headdim")
    k, v = kv.unbind(dim=1)
    return _varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                             softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                             return_attn_probs, names=("q", "kv[:, 0]", "kv[:, 1]"))


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """Attention of a batch of sequences of different lengths packed back to back, differentiable in q, k, v.

    Arguments:
        q: ``(total_q, nheads, headdim)``, the queries of every sequence, one after the other.
        k, v: ``(total_k, nheads_k, headdim)``.
        cu_seqlens_q, cu_seqlens_k: int32 ``(batch_size + 1,)``, where each sequence starts (0 first);
            sequence ``b`` is rows ``cu_seqlens[b]:cu_seqlens[b + 1]``.  Sequences may be empty.
        max_seqlen_q, max_seqlen_k: int, at least the longest sequence.
        block_table: must be None (a paged k/v is not implemented here; see flash_attn_with_kvcache).
        The mask (bottom-right, per sequence) and the other arguments are ``flash_attn_func``'s.
    Returns:
        out ``(total_q, nheads, headdim)``; with ``return_attn_probs`` ``(out, softmax_lse (nheads, total_q)
        float32, S_dmask (batch_size, nheads, max_seqlen_q, max_seqlen_k))``, S_dmask zero past each
        sequence's lengths (``max_seqlen_*`` must then cover the longest sequence).
    """
    if block_table is not None:
        raise NotImplementedError("block_table (a paged k/v) is not implemented in fa_lab's flash_attn_varlen_func; "
                                  "pass contiguous k and v, or use flash_attn_with_kvcache for a paged cache")
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, THD)
    return _varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                             softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                             return_attn_probs)


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens: Optional[Union[(int, torch.Tensor)]] = None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
):
    """One decoding step over a KV cache: append the new keys and values in place, then attend.

    Arguments:
        q: ``(batch_size, seqlen_q, nheads, headdim)``.
        k_cache, v_cache: ``(batch_size_cache, seqlen_cache, nheads_k, headdim)``, or with ``block_table``
            a paged cache ``(num_blocks, page_block_size, nheads_k, headdim)`` (any page size).
        k, v: optional ``(batch_size, seqlen_new, nheads_k, headdim)``, written into the cache at
            ``cache_seqlens[b]..`` in place (``cache_seqlens`` itself is not advanced).
        rotary_cos, rotary_sin: optional ``(seqlen_ro, rotary_dim / 2)`` tables (``seqlen_ro`` at least the
            cache's length), only with k and v: k turns at positions ``cache_seqlens[b] + t``; q at
            ``cache_seqlens[b] + i`` when causal or local, else every query at ``cache_seqlens[b]``.
        cache_seqlens: int, or int32 ``(batch_size,)``: the keys already in each sequence's cache
            (None: the whole cache; required with k and v).
        cache_batch_idx: int32 ``(batch_size,)``, the cache row of each sequence (not with block_table).
        cache_leftpad: must be None (not implemented).
        block_table: int32 ``(batch_size, max_num_blocks_per_seq)``, the blocks of each sequence in order.
        rotary_interleaved: pair features ``2i, 2i + 1`` (True) or ``i, i + rotary_dim / 2`` (False).
        num_splits: how many parts the keys are split into (0: a heuristic decides; 1: none).
        return_softmax_lse: also return the lse.
        The mask, softmax_scale, softcap and alibi_slopes are ``flash_attn_func``'s, over the
        ``cache_seqlens[b] + seqlen_new`` keys of each sequence.
    Returns:
        out ``(batch_size, seqlen_q, nheads, headdim)``; with ``return_softmax_lse`` ``(out, softmax_lse
        (batch_size, nheads, seqlen_q) float32)``.  No backward pass: q, k and v must not require grad.
    """
    out, lse = kvcache_attention(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                                 cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
                                 rotary_interleaved, alibi_slopes, num_splits)
    return (out, lse) if check_flag("return_softmax_lse", return_softmax_lse) else out
