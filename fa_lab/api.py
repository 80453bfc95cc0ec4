"""The public entry points: ``fa_lab.attention`` and ``fa_lab.flash_attention``.

Layering: private kernels (``fa_lab.kernels``) -> one autograd Function
(``fa_lab.autograd.Recompute``) -> these two functions.  Both check their input through
``registry.checked_spec``, the package's one input check.
"""
from __future__ import annotations

import torch

from fa_lab.core import registry


def attention(q, k, v, *, impl: str = "reference", causal: bool = False, window=(-1, -1),
              scale=None, return_lse: bool = False, softcap: float = 0.0, alibi_slopes=None):
    """Scaled dot-product attention with the conventions of DESIGN.md.

    q ``(B, H, Nq, D)``; k, v ``(B, Hkv, Nk, D)`` with ``H % Hkv == 0``.
    Returns o ``(B, H, Nq, D)`` in q's dtype, and with ``return_lse=True`` also the
    natural-log log-sum-exp of the scaled, masked scores, ``(B, H, Nq)`` float32.
    ``softcap`` and ``alibi_slopes`` modify the scores (Part II; implementations that apply them
    list them in their ``score_mods``).
    """
    mods = {}
    if softcap:
        mods["softcap"] = softcap
    if alibi_slopes is not None:
        mods["alibi_slopes"] = alibi_slopes
    implementation, spec = registry.checked_spec(impl, q, k, v, causal=causal, window=window, scale=scale, **mods)
    o, lse = implementation.fn(q, k, v, spec)
    if o.dtype != q.dtype:  # checked first: at small sizes every host microsecond shows
        o = o.to(q.dtype)
    if return_lse:
        return o, lse.to(torch.float32)
    return o


def flash_attention(q, k, v, *, causal: bool = False, window=(-1, -1), scale=None, return_lse: bool = False):
    """Differentiable FlashAttention-2: Triton forward and backward, deterministic gradients.

    The full contract of DESIGN.md (bottom-right causal, sliding windows, GQA, any scale);
    Triton on a GPU and the Triton interpreter on the CPU.  q ``(B, H, Nq, D)``; k, v
    ``(B, Hkv, Nk, D)`` with ``H % Hkv == 0``; fp16, bf16 or fp32.  Returns o (and with
    ``return_lse=True`` the float32 lse, also differentiable).  Gradients are first order:
    differentiating the backward again raises.
    """
    return attention(q, k, v, impl="flash_triton", causal=causal, window=window, scale=scale,
                     return_lse=return_lse)
