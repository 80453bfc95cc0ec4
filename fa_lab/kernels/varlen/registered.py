"""The packed kernels behind the registry's fixed-length interface, registered as ``triton_varlen``.

A ``(B, H, N, D)`` batch is a packed batch whose sequences all have the same length: the
adapter views it as ``(B·N, H, D)`` (no copy where the layout allows it), with uniform
``cu_seqlens``, and views the results back.  Everything that iterates the registry (the tests
against the reference, the benchmarks, ``fa-lab info``) then runs the varlen kernels too, and
gradients flow through ``VarlenAttention``.
"""
from __future__ import annotations

import functools

import torch

from fa_lab.core.registry import register
from fa_lab.core.world import HAS_TRITON, TRITON_MISSING
from fa_lab.kernels.varlen import VarlenAttention


def _packed(t: torch.Tensor) -> torch.Tensor:
    """``(B, H, N, D)`` as ``(B·N, H, D)``; copied only where the layout asks for it."""
    B, H, N, D = t.shape
    t = t.transpose(1, 2).reshape(B * N, H, D)
    return t if t.stride(-1) == 1 or D == 1 else t.contiguous()


@functools.lru_cache(maxsize=64)
def _uniform_cu_seqlens(batch: int, n: int, device: torch.device) -> torch.Tensor:
    """``[0, n, 2n, ..., batch·n]``: one tensor per shape, so that its work tables are built once."""
    return torch.arange(batch + 1, dtype=torch.int32, device=device) * n


def triton_varlen(q, k, v, spec):
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    o, lse = VarlenAttention.apply(
        _packed(q), _packed(k), _packed(v), _uniform_cu_seqlens(B, Nq, q.device), _uniform_cu_seqlens(B, Nk, q.device),
        Nq, Nk, spec.scale, spec.left, spec.right, spec.softcap, spec.alibi_slopes)
    return o.view(B, Nq, H, D).transpose(1, 2), lse.view(H, B, Nq).transpose(0, 1)


def varlen_limits(spec) -> str | None:
    """Why the varlen kernels cannot run ``spec`` beyond the registry's own checks (None if they can)."""
    return None if HAS_TRITON else TRITON_MISSING


register(
    "triton_varlen", chapter=8,
    description="packed variable-length FlashAttention-2 (Triton), forward and backward",
    dtypes=(torch.float16, torch.bfloat16, torch.float32), masks=("none", "causal", "window"), head_dims=(1, 256),
    backward=True, backend="triton", score_mods=("softcap", "alibi"), limits=varlen_limits,
    extra_memory=lambda s: 4 * s.batch * s.heads * s.n_q,   # lse (the backward adds delta: as much again)
    tags=("triton", "tensor-cores", "varlen"),
)(triton_varlen)
