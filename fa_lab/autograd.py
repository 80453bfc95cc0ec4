"""Chapter 5's public entry points: attention you can call ``.backward()`` through.

* ``FlashAttentionPyTorch`` and ``FlashAttentionTriton``: ``torch.autograd.Function``s in
  the shape course assignments expect — ``Fn.apply(Q, K, V, is_causal)`` with Q/K/V
  ``(batch, seq, d)`` or ``(batch, heads, seq, d)``, returning O.  The forward saves
  Q, K, V, O and exactly one more tensor, shaped like Q without its last dim: the lse.
* ``flash_attention(q, k, v, *, causal, window, scale)``: the full contract of DESIGN.md
  (bottom-right causal, sliding windows, GQA, any scale), differentiable, Triton on a GPU
  and the Triton interpreter on the CPU.

Registered here (the forward is chapter 4's Triton kernel): ``flash_triton`` (Triton
backward kernels) and ``torch_compile_bwd`` (the backward as whole-matrix PyTorch through
``torch.compile``: the intermediate step).
"""
from __future__ import annotations

import torch

from fa_lab.core import registry
from fa_lab.core.spec import make_spec
from fa_lab.kernels.torch_tiled import Recompute, compiled_backward, tiled_backward, tiled_forward
from fa_lab.kernels.triton.bwd import triton_backward
from fa_lab.kernels.triton.fwd import HEAD_DIMS, SUPPORTED_DTYPES, check_supported, triton_forward
from fa_lab.core.world import WORLD


def _as_4d(Q, K, V):
    """(batch, seq, d) inputs get a heads axis of 1; (batch, heads, seq, d) pass through."""
    for name, t in (("Q", Q), ("K", K), ("V", V)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() not in (3, 4) or t.dim() != Q.dim():
            raise ValueError(f"Q, K, V must all be (batch, seq, d) or all (batch, heads, seq, d); "
                             f"got Q {tuple(Q.shape)}, K {tuple(K.shape)}, V {tuple(V.shape)}")
    return (Q, K, V) if Q.dim() == 4 else (Q.unsqueeze(1), K.unsqueeze(1), V.unsqueeze(1))


def _checked_spec(impl: str, q, k, v, **mask):
    spec = make_spec(q, k, v, **mask)
    why = registry.get(impl).unsupported(spec, WORLD)
    if why:
        raise ValueError(why)
    if impl != "torch_tiled":
        check_supported(spec, q.dtype)   # the Triton forward's own limits (e.g. D a multiple of 8)
    return spec


def _course_forward(ctx, Q, K, V, is_causal, impl, forward):
    q, k, v = _as_4d(Q, K, V)
    spec = _checked_spec(impl, q, k, v, causal=bool(is_causal))
    o, lse = forward(q, k, v, spec)
    if Q.dim() == 3:
        o, lse = o.squeeze(1), lse.squeeze(1)
    ctx.save_for_backward(Q, K, V, o, lse)   # lse: Q's shape without its last dim
    ctx.spec = spec
    return o


def _course_backward(ctx, dO, backward):
    Q, K, V, O, L = ctx.saved_tensors
    lift = (lambda t: t.unsqueeze(1)) if Q.dim() == 3 else (lambda t: t)
    grads = backward(lift(Q), lift(K), lift(V), lift(O), lift(L), lift(dO).contiguous(), ctx.spec)
    if Q.dim() == 3:
        grads = tuple(g.squeeze(1) for g in grads)
    return (*grads, None)


class FlashAttentionPyTorch(torch.autograd.Function):
    """FlashAttention-2 in PyTorch tiles (``fa_lab.kernels.torch_tiled``): ``FlashAttentionPyTorch.apply(Q, K, V, is_causal)``."""

    @staticmethod
    def forward(ctx, Q, K, V, is_causal=False):
        return _course_forward(ctx, Q, K, V, is_causal, "torch_tiled", tiled_forward)

    @staticmethod
    def backward(ctx, dO):
        return _course_backward(ctx, dO, tiled_backward)


class FlashAttentionTriton(torch.autograd.Function):
    """FlashAttention-2 in Triton (chapter 4's forward, this chapter's backward kernels):
    ``FlashAttentionTriton.apply(Q, K, V, is_causal)``."""

    @staticmethod
    def forward(ctx, Q, K, V, is_causal=False):
        return _course_forward(ctx, Q, K, V, is_causal, "flash_triton", triton_forward)

    @staticmethod
    def backward(ctx, dO):
        return _course_backward(ctx, dO, triton_backward)


def flash_attention(q, k, v, *, causal: bool = False, window=(-1, -1), scale=None, return_lse: bool = False):
    """Differentiable FlashAttention-2: Triton forward and backward, deterministic gradients.

    q ``(B, H, Nq, D)``; k, v ``(B, Hkv, Nk, D)`` with ``H % Hkv == 0``; fp16, bf16 or fp32.
    Returns o (and with ``return_lse=True`` the float32 lse, also differentiable).
    """
    spec = _checked_spec("flash_triton", q, k, v, causal=causal, window=window, scale=scale)
    o, lse = flash_triton(q, k, v, spec)
    return (o, lse) if return_lse else o


def flash_triton(q, k, v, spec):
    return Recompute.apply(q, k, v, spec, triton_forward, triton_backward)


def triton_compiled_backward(q, k, v, spec):
    return Recompute.apply(q, k, v, spec, triton_forward, compiled_backward)


def saved_for_backward(fn, *args, **kwargs) -> list[tuple[tuple, torch.dtype, int]]:
    """``(shape, dtype, bytes)`` of every tensor autograd keeps between ``fn(*args)``'s forward and backward.

    The memory a backward pass costs: a naive attention keeps S and P (quadratic in N),
    a recomputing one only Q, K, V, O and the lse (linear).
    """
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype, t.numel() * t.element_size()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args, **kwargs)
    return saved


registry.register(
    "flash_triton", chapter=5,
    description="FlashAttention-2 forward (chapter 4's Triton kernel) and backward: Triton kernels for D, "
                "dK/dV (K/V-stationary) and dQ (Q-stationary), no atomics: deterministic",
    dtypes=SUPPORTED_DTYPES, head_dims=HEAD_DIMS, backward=True,
    extra_memory=lambda s: 4 * s.batch * s.heads * s.n_q,   # lse (the backward adds D: as much again)
    tags=("triton", "tensor-cores"),
)(flash_triton)

registry.register(
    "torch_compile_bwd", chapter=5,
    description="chapter 4's Triton forward; backward on whole (Nq, Nk) matrices in PyTorch through "
                "torch.compile (on the CPU: eager unless FA_LAB_COMPILE=1) — the intermediate step",
    dtypes=SUPPORTED_DTYPES, head_dims=HEAD_DIMS, backward=True,
    # the backward's S/P, dP and dS in float32
    extra_memory=lambda s: 3 * 4 * s.batch * s.heads * s.n_q * s.n_k,
    step_of="flash_triton",
)(triton_compiled_backward)
