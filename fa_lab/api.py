"""``fa_lab.attention``: the one entry point every chapter, test and benchmark calls."""
from __future__ import annotations

import torch

from fa_lab.core import registry
from fa_lab.core.spec import make_spec
from fa_lab.core.world import WORLD


def attention(q, k, v, *, impl: str = "reference", causal: bool = False, window=(-1, -1),
              scale=None, return_lse: bool = False):
    """Scaled dot-product attention with the conventions of DESIGN.md.

    q ``(B, H, Nq, D)``; k, v ``(B, Hkv, Nk, D)`` with ``H % Hkv == 0``.
    Returns o ``(B, H, Nq, D)`` in q's dtype, and with ``return_lse=True`` also the
    natural-log log-sum-exp of the scaled, masked scores, ``(B, H, Nq)`` float32.
    """
    implementation = registry.get(impl)
    spec = make_spec(q, k, v, causal=causal, window=window, scale=scale)
    why = implementation.unsupported(spec, WORLD)
    if why:
        raise ValueError(why)
    o, lse = implementation.fn(q, k, v, spec)
    if o.dtype != q.dtype:  # checked first: at small sizes every host microsecond shows
        o = o.to(q.dtype)
    if return_lse:
        return o, lse.to(torch.float32)
    return o
