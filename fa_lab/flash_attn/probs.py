"""The attention probabilities P that ``return_attn_probs=True`` returns, recomputed in plain PyTorch.

flash-attn returns the kernel's own P (with dropout encoded in its sign) for testing.  The kernels
behind fa_lab's interface never write P; this recomputes it, in float32, from q and k with the same
mask and score modifications: ``P = softmax(mask(alibi(softcap(scale · q kᵀ))))``, rows that see no
key all zeros.  It costs ``B·H·Nq·Nk`` floats: a testing aid, as flash-attn says of its own.
"""
from __future__ import annotations

import torch

from fa_lab.core.masks import visible
from fa_lab.flash_attn.checks import ScoreArgs


def sequence_probs(q, k, args: ScoreArgs, slopes) -> torch.Tensor:
    """P for one sequence: q ``(Nq, H, D)``, k ``(Nk, Hkv, D)``, slopes ``(H,)`` or None -> ``(H, Nq, Nk)``."""
    n_q, heads, _ = q.shape
    n_k, kv_heads, _ = k.shape
    q32 = q.detach().float().transpose(0, 1)                                   # (H, Nq, D)
    k32 = k.detach().float().transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)
    s = torch.matmul(q32, k32.transpose(-1, -2)) * args.scale
    if args.softcap > 0:
        s = args.softcap * torch.tanh(s / args.softcap)
    if slopes is not None:
        i = torch.arange(n_q, device=q.device, dtype=torch.float32)[:, None]
        j = torch.arange(n_k, device=q.device, dtype=torch.float32)[None, :]
        s = s - slopes.float()[:, None, None] * (i + (n_k - n_q) - j).abs()
    ok = visible(n_q, n_k, args.left, args.right, device=q.device)
    s = s.masked_fill(~ok, float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.where(ok.any(dim=-1, keepdim=True), p, torch.zeros_like(p))   # no key: 0, not NaN


def fixed_length_probs(q, k, args: ScoreArgs) -> torch.Tensor:
    """q ``(B, Nq, H, D)``, k ``(B, Nk, Hkv, D)`` -> P ``(B, H, Nq, Nk)`` in q's dtype."""
    slopes = args.alibi_slopes
    p = [sequence_probs(q[b], k[b], args, None if slopes is None else slopes[b]) for b in range(q.shape[0])]
    return torch.stack(p).to(q.dtype)


def varlen_probs(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, args: ScoreArgs) -> torch.Tensor:
    """Packed q ``(total_q, H, D)`` and k -> P ``(B, H, max_seqlen_q, max_seqlen_k)``, zero past each length."""
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    lengths_q = [b - a for a, b in zip(starts_q, starts_q[1:])]
    lengths_k = [b - a for a, b in zip(starts_k, starts_k[1:])]
    rows, cols = max(max_seqlen_q, *lengths_q), max(max_seqlen_k, *lengths_k)
    p = torch.zeros(len(lengths_q), q.shape[1], rows, cols, dtype=torch.float32, device=q.device)
    for b, (n_q, n_k) in enumerate(zip(lengths_q, lengths_k)):
        if n_q and n_k:
            slopes = None if args.alibi_slopes is None else args.alibi_slopes[b]
            q_b, k_b = q[starts_q[b]:starts_q[b] + n_q], k[starts_k[b]:starts_k[b] + n_k]
            p[b, :, :n_q, :n_k] = sequence_probs(q_b, k_b, args, slopes)
    return p.to(q.dtype)
