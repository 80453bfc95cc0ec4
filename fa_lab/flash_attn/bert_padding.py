"""Between padded batches and packed tokens: flash-attn's ``flash_attn.bert_padding``, in plain PyTorch.

A padded batch ``(batch, seqlen, ...)`` with an attention mask ``(batch, seqlen)`` becomes the packed
``(total_nnz, ...)`` that the variable-length functions take (``unpad_input``), and back
(``pad_input``).  The two index operations are autograd Functions whose backward is the other one:
gathering rows forward scatters their gradients back, and the reverse.
"""
from __future__ import annotations

import torch

__all__ = ["index_first_axis", "index_put_first_axis", "pad_input", "unpad_input",
           "unpad_input_for_concatenated_sequences"]


def _check_indices(indices) -> None:
    if not isinstance(indices, torch.Tensor) or indices.dim() != 1 or indices.is_floating_point():
        raise TypeError("indices must be a 1-dim integer tensor")


class IndexFirstAxis(torch.autograd.Function):
    """``input[indices]`` along the first axis; the backward adds each row's gradient back at its index."""

    @staticmethod
    def forward(ctx, input, indices):
        if not isinstance(input, torch.Tensor) or input.dim() < 2:
            raise ValueError("index_first_axis needs a tensor with at least 2 dims (first axis, features...)")
        _check_indices(indices)
        ctx.save_for_backward(indices)
        ctx.first_axis_dim = input.shape[0]
        return input.index_select(0, indices)

    @staticmethod
    def backward(ctx, grad_output):
        (indices,) = ctx.saved_tensors
        grad_input = grad_output.new_zeros(ctx.first_axis_dim, *grad_output.shape[1:])
        # index_add: a row gathered twice gets both gradients
        return grad_input.index_add_(0, indices, grad_output), None


index_first_axis = IndexFirstAxis.apply


class IndexPutFirstAxis(torch.autograd.Function):
    """Zeros of first dim ``first_axis_dim`` with ``values`` written at ``indices``; the backward gathers."""

    @staticmethod
    def forward(ctx, values, indices, first_axis_dim):
        if not isinstance(values, torch.Tensor) or values.dim() < 2:
            raise ValueError("index_put_first_axis needs values with at least 2 dims (first axis, features...)")
        _check_indices(indices)
        if indices.numel() != values.shape[0]:
            raise ValueError(f"{indices.numel()} indices for {values.shape[0]} rows of values")
        ctx.save_for_backward(indices)
        output = values.new_zeros(first_axis_dim, *values.shape[1:])
        output[indices] = values
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (indices,) = ctx.saved_tensors
        return grad_output[indices], None, None


index_put_first_axis = IndexPutFirstAxis.apply


def _check_padded(hidden_states, mask, name: str) -> None:
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() < 2:
        raise ValueError("hidden_states must be a tensor (batch, seqlen, ...)")
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(hidden_states.shape[:2]):
        raise ValueError(f"{name} must be (batch, seqlen) = {tuple(hidden_states.shape[:2])}, "
                         f"got {tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__}")


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """Pack the tokens a mask keeps.

    hidden_states ``(batch, seqlen, ...)``; attention_mask ``(batch, seqlen)``, bool or int, nonzero = a
    real token; unused_mask (optional, same shape): tokens that are allocated but unused, packed too.
    Returns ``(hidden_states (total_nnz, ...), indices (total_nnz,) into the flattened (batch·seqlen),
    cu_seqlens int32 (batch + 1,), max_seqlen_in_batch int, seqused int32 (batch,))``: ``seqused`` counts
    the tokens of attention_mask alone, cu_seqlens those of both masks.
    """
    _check_padded(hidden_states, attention_mask, "attention_mask")
    all_masks = attention_mask
    if unused_mask is not None:
        _check_padded(hidden_states, unused_mask, "unused_mask")
        all_masks = attention_mask.bool() | unused_mask.bool()
    seqlens = all_masks.sum(dim=-1, dtype=torch.int32)
    seqused = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = int(seqlens.max().item()) if seqlens.numel() else 0
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    if flat.dim() == 1:   # (batch, seqlen) of scalars: index a feature axis of 1
        return (index_first_axis(flat[:, None], indices)[:, 0], indices, cu_seqlens, max_seqlen_in_batch, seqused)
    return index_first_axis(flat, indices), indices, cu_seqlens, max_seqlen_in_batch, seqused


def unpad_input_for_concatenated_sequences(hidden_states, attention_mask_in_length):
    """Pack rows that each hold several sequences back to back.

    attention_mask_in_length ``(batch, seqlen)``: row ``b`` lists the lengths of the sequences it holds,
    then zeros (``[2, 3, 0, 0, 0, 0]``: a sequence of 2 tokens, then one of 3, then padding).  Returns
    ``(hidden_states (total_nnz, ...), indices, cu_seqlens int32 (num_sequences + 1,), max_seqlen_in_batch)``:
    one entry of cu_seqlens per sequence, so that no sequence attends to its neighbours.
    """
    _check_padded(hidden_states, attention_mask_in_length, "attention_mask_in_length")
    length = attention_mask_in_length.sum(dim=-1)
    seqlen = attention_mask_in_length.shape[-1]
    kept = torch.arange(seqlen, device=length.device)[None, :] < length[:, None]
    flat_lengths = attention_mask_in_length.flatten()
    seqlens = flat_lengths[flat_lengths != 0].to(torch.int32)
    indices = torch.nonzero(kept.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = int(seqlens.max().item()) if seqlens.numel() else 0
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return index_first_axis(flat, indices), indices, cu_seqlens, max_seqlen_in_batch


def pad_input(hidden_states, indices, batch, seqlen):
    """Unpack: ``(total_nnz, ...)`` tokens back to ``(batch, seqlen, ...)`` with zeros where padding was."""
    output = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return output.reshape(batch, seqlen, *hidden_states.shape[1:])
