"""Writing new keys and values into a KV cache, contiguous or paged, in place.

``append_kv`` puts token ``t`` of sequence ``b`` at position ``cache_seqlens[b] + t``: in a
contiguous cache at that row of the sequence's cache row, in a paged one at row
``pos % page_size`` of block ``block_table[b, pos // page_size]`` (so an append may cross
into the next page).  One indexed write per tensor, no loop over the batch and no
synchronisation with the device; like flash-attn it leaves ``cache_seqlens`` as it is: the
caller then attends over ``cache_seqlens[b] + Nnew`` keys.
"""
from __future__ import annotations

import torch

from fa_lab.kernels.decode.checks import check_cache_tensors, check_layout


def _positions(k_cache, k_new, cache_seqlens, block_table, cache_batch_idx):
    """The (cache row or block, row in it) index pair of every new token, each (B, Nnew) int64."""
    B, n_new = k_new.shape[:2]
    pos = cache_seqlens.long()[:, None] + torch.arange(n_new, device=k_new.device)
    if block_table is None:
        rows = cache_batch_idx.long() if cache_batch_idx is not None else torch.arange(B, device=k_new.device)
        return rows[:, None].expand(B, n_new), pos
    page_size = k_cache.shape[1]
    # clamped into the table: a position past it is refused by the caller, not read out of bounds here
    pages = (pos // page_size).clamp_max(block_table.shape[1] - 1)
    return block_table.long().gather(1, pages), pos % page_size


def append_kv(k_cache, v_cache, k_new, v_new, cache_seqlens, *, block_table=None, cache_batch_idx=None) -> None:
    """Write ``k_new``/``v_new`` ``(B, Nnew, Hkv, D)`` into the cache at ``cache_seqlens[b] .. + Nnew``, in place.

    The cache is contiguous ``(B_cache, Nk_max, Hkv, D)`` (``cache_batch_idx`` (B,) int32 picks
    each sequence's row) or paged ``(num_blocks, page_size, Hkv, D)`` with ``block_table``
    (B, max_blocks) int32.  ``cache_seqlens`` (B,) int32 is not updated.  Positions past the
    cache's capacity, and rows or blocks outside the cache, raise a ValueError before anything is
    written.  On a GPU that check reads one flag back from the device (a wait for the work queued
    before it); while a CUDA graph is being captured it is left out, and the caller answers for
    the positions.
    """
    device = k_cache.device if isinstance(k_cache, torch.Tensor) else None
    check_cache_tensors(k_cache, v_cache, device, k_cache.dtype if device is not None else None)
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-dim tensor (batch, n_new, kv_heads, head_dim), got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if t.dtype != k_cache.dtype:
            raise TypeError(f"{name} must have the cache's dtype ({k_cache.dtype}), got {t.dtype}")
        if t.device != device:
            raise ValueError(f"{name} must be on the cache's device ({device}), got {t.device}")
    B, n_new, Hkv, D = k_new.shape
    if v_new.shape != k_new.shape or (Hkv, D) != tuple(k_cache.shape[2:]):
        raise ValueError(f"k_new and v_new must both be (batch, n_new, {k_cache.shape[2]}, {k_cache.shape[3]}) "
                         f"(the cache's kv_heads and head_dim), got {tuple(k_new.shape)} and {tuple(v_new.shape)}")
    if cache_seqlens is None:
        raise ValueError("cache_seqlens (batch,) int32 is required: it says where each sequence's new keys go")
    _, capacity = check_layout(B, k_cache, cache_seqlens, block_table, cache_batch_idx, device)
    if n_new == 0 or B == 0:
        return
    index = _positions(k_cache, k_new, cache_seqlens, block_table, cache_batch_idx)
    # one check on both worlds; on a GPU its one flag read back waits for the work queued before it (a write
    # past the cache would otherwise fault inside index_put_ on the device), so a graph capture leaves it out
    if device.type == "cpu" or not torch.cuda.is_current_stream_capturing():
        overflow = cache_seqlens.max() + n_new > capacity
        outside = (index[0] < 0) | (index[0] >= k_cache.shape[0])
        if bool(overflow | outside.any()):
            if bool(overflow):
                b = int(cache_seqlens.argmax())
                raise ValueError(f"appending {n_new} keys at position {int(cache_seqlens[b])} (sequence {b}) "
                                 f"overflows the cache's {capacity} keys per sequence")
            raise ValueError(f"the appended positions map to "
                             f"{'blocks' if block_table is not None else 'cache rows'} "
                             f"{index[0].unique().tolist()}, but the cache has 0..{k_cache.shape[0] - 1}")
    k_cache.index_put_(index, k_new)
    v_cache.index_put_(index, v_new)
