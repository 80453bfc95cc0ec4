"""``flash_attn_with_kvcache``'s work: rotate, append to the cache in place, attend over the cache.

One decoding step of flash-attn's contract, in order:

1. with ``rotary_cos/sin``, the new keys turn at their positions ``cache_seqlens[b] + t``; the queries at
   ``cache_seqlens[b] + i`` when the mask is causal or local, else all at ``cache_seqlens[b]`` (they are
   taken to be one position);
2. the new keys and values are written into the cache at ``cache_seqlens[b]..`` (in place; the caller
   advances ``cache_seqlens``);
3. the queries attend over the first ``cache_seqlens[b] + seqlen_new`` keys of sequence ``b``, masks
   aligned bottom-right.

The decode kernels (``fa_lab.kernels.decode``) do 2 and 3; the rotation is plain PyTorch.
"""
from __future__ import annotations

import torch

from fa_lab.flash_attn.checks import check_same, check_tensor, is_int, score_args
from fa_lab.flash_attn.engine import last_dim_contiguous
from fa_lab.flash_attn.layers.rotary import apply_rotary_emb

BSHD = "batch_size, seqlen, nheads, headdim"


def _capacity(q, k_cache, block_table) -> int:
    """The most keys one sequence's cache holds: its row, or its blocks (paged, with ``block_table``)."""
    if not isinstance(k_cache, torch.Tensor) or k_cache.dim() != 4:
        raise ValueError("k_cache must be (batch_size_cache, seqlen_cache, nheads_k, headdim), or with block_table "
                         "(num_blocks, page_block_size, nheads_k, headdim)")
    if block_table is None:
        return k_cache.shape[1]
    if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2 or block_table.shape[0] != q.shape[0]:
        raise ValueError(f"block_table must be an int32 tensor (batch_size={q.shape[0]}, max_num_blocks_per_seq)")
    return block_table.shape[1] * k_cache.shape[1]


def _cache_seqlens(cache_seqlens, q, new: int):
    """``cache_seqlens`` as the kernels take it: int32 ``(B,)`` (an int is every sequence's), or None (all)."""
    if cache_seqlens is None:
        if new:
            raise ValueError("cache_seqlens must be given with k and v: it says where the new keys go")
        return None
    if is_int(cache_seqlens):
        if cache_seqlens < 0:
            raise ValueError(f"cache_seqlens must be >= 0, got {cache_seqlens}")
        return torch.full((q.shape[0],), int(cache_seqlens), dtype=torch.int32, device=q.device)
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"cache_seqlens must be an int or an int32 tensor (batch_size,), "
                        f"got {type(cache_seqlens).__name__}")
    return cache_seqlens


def _rotate(q, k, rotary_cos, rotary_sin, cache_seqlens, interleaved: bool, per_row: bool):
    """New keys at ``cache_seqlens[b] + t``; queries per row (causal or local), else all at ``cache_seqlens[b]``."""
    if not isinstance(interleaved, bool):
        raise TypeError(f"rotary_interleaved must be a bool, got {type(interleaved).__name__}")
    k = apply_rotary_emb(k, rotary_cos, rotary_sin, interleaved, seqlen_offsets=cache_seqlens)
    if per_row:
        return apply_rotary_emb(q, rotary_cos, rotary_sin, interleaved, seqlen_offsets=cache_seqlens), k
    B, n_q, H, D = q.shape
    one_position = q.reshape(B, 1, n_q * H, D)
    q = apply_rotary_emb(one_position, rotary_cos, rotary_sin, interleaved, seqlen_offsets=cache_seqlens)
    return q.reshape(B, n_q, H, D), k


def kvcache_attention(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                      cache_leftpad, block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved,
                      alibi_slopes, num_splits):
    """``(out (B, Nq, H, D), softmax_lse (B, H, Nq) float32)`` for ``flash_attn_with_kvcache``'s arguments."""
    if cache_leftpad is not None:
        raise NotImplementedError("cache_leftpad is not implemented in fa_lab's flash_attn_with_kvcache: keep each "
                                  "sequence's keys from position 0 of its cache (cache_leftpad=None)")
    check_tensor("q", q, BSHD)
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v)):
        raise ValueError("flash_attn_with_kvcache has no backward pass, but q, k or v requires grad: call it under "
                         "torch.no_grad() or on detached tensors")
    capacity = _capacity(q, k_cache, block_table)
    check_same(q, k_cache, v_cache, names=("q", "k_cache", "v_cache"))
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (new keys and values to append), or neither")
    new = 0
    if k is not None:
        check_tensor("k", k, BSHD)
        check_tensor("v", v, BSHD)
        check_same(q, k, v)
        if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2] != k_cache.shape[2]:
            raise ValueError(f"k and v must be (batch_size={q.shape[0]}, seqlen_new, nheads_k={k_cache.shape[2]}, "
                             f"headdim), got {tuple(k.shape)} and {tuple(v.shape)}")
        new = k.shape[1]
    if not is_int(num_splits) or num_splits < 0:   # checked before the cache is written to
        raise ValueError(f"num_splits must be an int >= 0 (0: chosen by a heuristic), got {num_splits!r}")
    args = score_args(q.transpose(1, 2), k_cache.shape[2], softmax_scale=softmax_scale, causal=causal,
                      window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)
    cache_seqlens = _cache_seqlens(cache_seqlens, q, new)
    if block_table is None and cache_batch_idx is None and k_cache.shape[0] > q.shape[0]:
        # flash-attn lets sequence b use row b of a larger cache: say so to the kernels
        cache_batch_idx = torch.arange(q.shape[0], dtype=torch.int32, device=q.device)
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together, or neither")
    if rotary_cos is not None:
        if k is None:
            raise ValueError("rotary_cos/rotary_sin turn the new keys: they need k and v")
        if not isinstance(rotary_cos, torch.Tensor) or rotary_cos.dim() != 2 or rotary_cos.shape[0] < capacity:
            raise ValueError(f"rotary_cos/rotary_sin must be (seqlen_ro, rotary_dim / 2) tensors with a row for each "
                             f"of the cache's {capacity} positions, got "
                             f"{tuple(rotary_cos.shape) if isinstance(rotary_cos, torch.Tensor) else rotary_cos!r}")
        # flash-attn's rule: a window wider than the cache is no window, and then q is one position
        local = 0 <= args.left < capacity or 0 <= args.right < capacity
        q, k = _rotate(q, k, rotary_cos, rotary_sin, cache_seqlens, rotary_interleaved, args.causal or local)

    from fa_lab.kernels.decode import append_kv, decode_forward  # loads Triton: on first use

    q = last_dim_contiguous(q)
    seen = cache_seqlens
    if k is not None:
        append_kv(k_cache, v_cache, k, v, cache_seqlens, block_table=block_table, cache_batch_idx=cache_batch_idx)
        seen = cache_seqlens + new
    return decode_forward(q, k_cache, v_cache, cache_seqlens=seen, block_table=block_table,
                          cache_batch_idx=cache_batch_idx, scale=args.scale, left=args.left, right=args.right,
                          softcap=args.softcap, alibi_slopes=args.alibi_slopes, num_splits=num_splits)
