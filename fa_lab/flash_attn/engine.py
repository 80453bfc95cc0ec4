"""Which kernel runs a flash-attn call, and the call in the kernel's layout.

Two differentiable kernels sit behind the interface:

* Part I's tuned FlashAttention-2 (``fa_lab.flash_attention``, layout ``(B, H, N, D)``): the faster one
  on a GPU, for the calls it supports (no softcap or ALiBi; its dtypes and head dims);
* the variable-length kernel (``fa_lab.kernels.varlen``): everything else, and every varlen call.
  A fixed-length batch is a variable-length one whose sequences all have one length.

Both are deterministic: ``deterministic=False`` changes nothing.
"""
from __future__ import annotations

import torch

from fa_lab.core.registry import get
from fa_lab.core.spec import make_spec
from fa_lab.core.world import WORLD
from fa_lab.flash_attn.checks import ScoreArgs


def _fixed_length_engine(q_bhnd, k_bhnd, v_bhnd, args: ScoreArgs) -> str:
    """``"flash_triton"`` where Part I's kernel supports the call, else ``"varlen"``."""
    if args.softcap > 0 or args.alibi_slopes is not None:   # score modifications are Part II's
        return "varlen"
    spec = make_spec(q_bhnd, k_bhnd, v_bhnd, causal=args.causal, window=args.window, scale=args.scale)
    return "flash_triton" if get("flash_triton").unsupported(spec, WORLD) is None else "varlen"


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """The kernels read a head's features at stride 1 (any strides elsewhere): copy only where they are not."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def varlen_kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, args: ScoreArgs):
    """The variable-length kernel: ``(o (total_q, H, D), lse (H, total_q))``, differentiable in q, k, v."""
    from fa_lab.kernels.varlen import VarlenAttention  # loads Triton: on first use, not at import

    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
    o, lse = VarlenAttention.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                   args.scale, args.left, args.right, args.softcap, args.alibi_slopes)
    return o, lse


def fixed_length_attention(q, k, v, args: ScoreArgs):
    """q ``(B, Nq, H, D)``, k and v ``(B, Nk, Hkv, D)`` -> o ``(B, Nq, H, D)``, lse ``(B, H, Nq)`` float32."""
    q_bhnd, k_bhnd, v_bhnd = (t.transpose(1, 2) for t in (q, k, v))
    if _fixed_length_engine(q_bhnd, k_bhnd, v_bhnd, args) == "flash_triton":
        from fa_lab.api import flash_attention

        o, lse = flash_attention(q_bhnd, k_bhnd, v_bhnd, causal=args.causal, window=args.window,
                                 scale=args.scale, return_lse=True)
        # flash-attn hands back a contiguous (B, N, H, D): callers .view() it
        return o.transpose(1, 2).contiguous(), lse
    B, n_q, H, D = q.shape
    n_k, kv_heads = k.shape[1], k.shape[2]
    cu_q = torch.arange(0, (B + 1) * n_q, n_q, dtype=torch.int32, device=q.device)
    cu_k = torch.arange(0, (B + 1) * n_k, n_k, dtype=torch.int32, device=q.device)
    # reshape is a view where the strides allow (a qkv-packed slice included), else a copy
    o, lse = varlen_kernel(q.reshape(B * n_q, H, D), k.reshape(B * n_k, kv_heads, D),
                           v.reshape(B * n_k, kv_heads, D), cu_q, cu_k, n_q, n_k, args)
    return o.view(B, n_q, H, D), lse.view(H, B, n_q).transpose(0, 1).contiguous()
