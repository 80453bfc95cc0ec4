"""``triton_decode``: the decoding kernels behind the registry's fixed-length interface.

``fn(q, k, v, spec)`` with q ``(B, H, Nq, D)`` and k, v ``(B, Hkv, Nk, D)``: k and v are read as
a contiguous cache whose every sequence holds all ``Nk`` keys.  The transposes are views (the
kernel takes strides), and o is written straight into a ``(B, H, Nq, D)`` tensor.
"""
from __future__ import annotations

import torch

from fa_lab.core.registry import register
from fa_lab.core.world import HAS_TRITON, TRITON_MISSING
from fa_lab.kernels.decode import DTYPES, HEAD_DIMS, decode_forward


def triton_decode(q, k, v, spec):
    """``(o, lse)`` for a validated ``spec``: o ``(B, H, Nq, D)`` in q's dtype, lse ``(B, H, Nq)`` float32."""
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _, lse = decode_forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=spec.scale,
                            left=spec.left, right=spec.right, softcap=spec.softcap,
                            alibi_slopes=spec.alibi_slopes, out=o.transpose(1, 2))
    return o, lse


def decode_limits(spec) -> str | None:
    """Why ``triton_decode`` cannot run ``spec`` (None if it can)."""
    return TRITON_MISSING if not HAS_TRITON else None


register(
    "triton_decode", chapter=9,
    description="split-KV decoding (flash-decoding) over a KV cache, Triton; forward only",
    dtypes=DTYPES, masks=("none", "causal", "window"), head_dims=HEAD_DIMS, backend="triton",
    score_mods=("softcap", "alibi"), limits=decode_limits,
    extra_memory=lambda s: 4 * s.batch * s.heads * s.n_q,   # lse; the splits' partials come and go
    tags=("triton", "decoding"),
)(triton_decode)
