"""Chapter 5's autograd layer: attention you can call ``.backward()`` through.

* ``Recompute``: the one ``torch.autograd.Function`` every engine of the chapter plugs into
  (a forward that returns ``(o, lse)`` and a backward that recomputes P from them).  Its
  backward is not itself differentiable: second derivatives raise instead of coming out wrong.
* ``FlashAttentionPyTorch`` and ``FlashAttentionTriton``: ``torch.autograd.Function``s in
  the shape course assignments expect — ``Fn.apply(Q, K, V, is_causal)`` with Q/K/V
  ``(batch, seq, d)`` or ``(batch, heads, seq, d)``, returning O.  The forward saves
  Q, K, V, O and exactly one more tensor, shaped like Q without its last dim: the lse.

Registered here: ``torch_tiled`` (the PyTorch tiles of ``fa_lab.kernels.torch_tiled``),
``flash_triton`` (chapter 4's Triton forward, Triton backward kernels) and ``torch_compile_bwd``
(the backward as whole-matrix PyTorch through ``torch.compile``: the intermediate step).
The public, checked entry point is ``fa_lab.flash_attention`` (``fa_lab.api``).
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from fa_lab.core import registry
from fa_lab.core.world import pick
from fa_lab.kernels.torch_tiled import compiled_backward, tiled_backward, tiled_forward
from fa_lab.kernels.triton import HEAD_DIMS, SUPPORTED_DTYPES, triton_backward, triton_forward, triton_limits


class Recompute(torch.autograd.Function):
    """Attention whose backward recomputes P: saves exactly ``q, k, v, o, lse``.

    ``Recompute.apply(q, k, v, spec, forward, backward)`` with ``forward(q, k, v, spec) -> (o, lse)``
    and ``backward(q, k, v, o, lse, do, spec, dlse) -> (dq, dk, dv)``: one Function for every
    engine of the chapter (PyTorch tiles, torch.compile, Triton kernels).  Returns ``(o, lse)``;
    both are differentiable, once.
    """

    @staticmethod
    def forward(ctx, q, k, v, spec, forward, backward):
        o, lse = forward(q, k, v, spec)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.spec, ctx.engine_backward = spec, backward
        ctx.set_materialize_grads(False)   # a None gradient is skipped, not a tensor of zeros
        return o, lse

    @staticmethod
    @once_differentiable   # the engines' backward is not differentiable: a second derivative must raise
    def backward(ctx, do, dlse):
        q, k, v, o, lse = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(o)
        dq, dk, dv = ctx.engine_backward(q, k, v, o, lse, do.contiguous(), ctx.spec, dlse)
        return dq, dk, dv, None, None, None


def _as_4d(Q, K, V):
    """(batch, seq, d) inputs get a heads axis of 1; (batch, heads, seq, d) pass through."""
    for name, t in (("Q", Q), ("K", K), ("V", V)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() not in (3, 4) or t.dim() != Q.dim():
            raise ValueError(f"Q, K, V must all be (batch, seq, d) or all (batch, heads, seq, d); "
                             f"got Q {tuple(Q.shape)}, K {tuple(K.shape)}, V {tuple(V.shape)}")
    return (Q, K, V) if Q.dim() == 4 else (Q.unsqueeze(1), K.unsqueeze(1), V.unsqueeze(1))


def _course_forward(ctx, Q, K, V, is_causal, impl, engine_forward):
    """The course shape around an engine: (batch, seq, d) or (batch, heads, seq, d) in, O out."""
    q, k, v = _as_4d(Q, K, V)
    _, spec = registry.checked_spec(impl, q, k, v, causal=is_causal)
    o, lse = engine_forward(q, k, v, spec)
    if Q.dim() == 3:
        o, lse = o.squeeze(1), lse.squeeze(1)
    ctx.save_for_backward(Q, K, V, o, lse)   # lse: Q's shape without its last dim
    ctx.spec = spec
    return o


def _course_backward(ctx, dO, engine_backward):
    Q, K, V, O, L = ctx.saved_tensors
    lift = (lambda t: t.unsqueeze(1)) if Q.dim() == 3 else (lambda t: t)
    grads = engine_backward(lift(Q), lift(K), lift(V), lift(O), lift(L), lift(dO).contiguous(), ctx.spec)
    if Q.dim() == 3:
        grads = tuple(g.squeeze(1) for g in grads)
    return (*grads, None)


class FlashAttentionPyTorch(torch.autograd.Function):
    """FlashAttention-2 in PyTorch tiles (``fa_lab.kernels.torch_tiled``):
    ``FlashAttentionPyTorch.apply(Q, K, V, is_causal)``."""

    @staticmethod
    def forward(ctx, Q, K, V, is_causal=False):
        return _course_forward(ctx, Q, K, V, is_causal, "torch_tiled", tiled_forward)

    @staticmethod
    @once_differentiable   # the engine's backward is not differentiable: a second derivative must raise
    def backward(ctx, dO):
        return _course_backward(ctx, dO, tiled_backward)


class FlashAttentionTriton(torch.autograd.Function):
    """FlashAttention-2 in Triton (chapter 4's forward, this chapter's backward kernels):
    ``FlashAttentionTriton.apply(Q, K, V, is_causal)``."""

    @staticmethod
    def forward(ctx, Q, K, V, is_causal=False):
        return _course_forward(ctx, Q, K, V, is_causal, "flash_triton", triton_forward)

    @staticmethod
    @once_differentiable
    def backward(ctx, dO):
        return _course_backward(ctx, dO, triton_backward)


def torch_tiled(q, k, v, spec):
    return Recompute.apply(q, k, v, spec, tiled_forward, tiled_backward)


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
    "torch_tiled", chapter=5,
    description="FlashAttention-2 forward and backward in tiles, plain PyTorch ops (autograd.Function, recomputes P)",
    dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float64),
    backward=True, any_device=True,
    # one (block_m, block_n) tile of S and P, in the work dtype, per (batch, head)
    extra_memory=lambda s: 2 * 4 * s.batch * s.heads * min(s.n_q, pick(16, 128)) * min(s.n_k, pick(16, 128)),
)(torch_tiled)

# both run chapter 4's Triton forward (so share its dtypes, head dims and limits) and have a backward
_ON_TRITON_FORWARD = dict(chapter=5, dtypes=SUPPORTED_DTYPES, head_dims=HEAD_DIMS, backward=True, backend="triton",
                          limits=triton_limits)

registry.register(
    "flash_triton", **_ON_TRITON_FORWARD,
    description="FlashAttention-2 forward (chapter 4's Triton kernel) and backward: Triton kernels for D, "
                "dK/dV (K/V-stationary) and dQ (Q-stationary), no atomics: deterministic",
    extra_memory=lambda s: 4 * s.batch * s.heads * s.n_q,   # lse (the backward adds D: as much again)
    tags=("triton", "tensor-cores"),
)(flash_triton)

registry.register(
    "torch_compile_bwd", **_ON_TRITON_FORWARD,
    description="chapter 4's Triton forward; backward on whole (Nq, Nk) matrices in PyTorch through "
                "torch.compile (on the CPU: eager unless FA_LAB_COMPILE=1) — the intermediate step",
    # the backward's S/P, dP and dS in float32
    extra_memory=lambda s: 3 * 4 * s.batch * s.heads * s.n_q * s.n_k,
    step_of="flash_triton",
)(triton_compiled_backward)
