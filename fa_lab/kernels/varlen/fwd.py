"""``varlen_forward``: check a packed call, build the work table, launch the forward kernel."""
from __future__ import annotations

import torch

from fa_lab.core.world import ON_GPU
from fa_lab.kernels.triton.kernel import LOG2E
from fa_lab.kernels.varlen.checks import VarlenProblem, check_varlen
from fa_lab.kernels.varlen.configs import block_d, forward_config
from fa_lab.kernels.varlen.fwd_kernel import varlen_fwd
from fa_lab.kernels.varlen.schedule import cached_schedule, n_programs


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernels compute in: bfloat16 is fp32 in the CPU world (the interpreter has no bf16 math)."""
    return torch.float32 if (not ON_GPU and dtype == torch.bfloat16) else dtype


def score_constants(p: VarlenProblem, scale: float) -> tuple[float, float, torch.Tensor | None]:
    """``(qk_scale, softcap, slopes)`` in the log2 units of ``tiles.modified_scores``."""
    if p.softcap > 0:
        qk_scale, softcap = scale / p.softcap, p.softcap * LOG2E
    else:
        qk_scale, softcap = scale * LOG2E, 0.0
    slopes = None if p.alibi_slopes is None else (p.alibi_slopes * LOG2E).contiguous()
    return qk_scale, softcap, slopes


def precision(dtype: torch.dtype) -> str | None:
    """fp32 products stay exact fp32 ("ieee"): a plain fp32 ``tl.dot`` is TF32 on a GPU."""
    return "ieee" if dtype == torch.float32 else None


def forward(q, k, v, cu_seqlens_q, cu_seqlens_k, p: VarlenProblem, config=None):
    """The forward of a checked problem: ``(o, lse)``.  ``config`` overrides ``forward_config``."""
    dtype, work = q.dtype, work_dtype(q.dtype)
    if p.total_q == 0 or p.total_k == 0:   # nothing to launch: no key anywhere gives zeros and lse = -inf
        return (torch.zeros((p.total_q, p.heads, p.head_dim), dtype=dtype, device=q.device),
                torch.full((p.heads, p.total_q), float("-inf"), dtype=torch.float32, device=q.device))
    # every row is written by the program of its block
    o = torch.empty((p.total_q, p.heads, p.head_dim), dtype=work, device=q.device)
    lse = torch.empty((p.heads, p.total_q), dtype=torch.float32, device=q.device)
    scale = p.scale
    if scale < 0:   # the kernel's hot loop takes the row max of q·k before scaling: it needs scale >= 0
        q, scale = -q, -scale
    q, k, v = (t if t.dtype == work else t.to(work) for t in (q, k, v))
    qk_scale, softcap, slopes = score_constants(p, scale)
    bm, bn, warps, stages = config or forward_config(p.head_dim, work, p.max_seqlen_q)
    programs = n_programs(p.total_q, p.batch, bm)
    schedule = cached_schedule(cu_seqlens_q, cu_seqlens_k, bm, programs, left=p.left, right=p.right)
    slope_args = (slopes, *slopes.stride()) if slopes is not None else (lse, 0, 0)
    varlen_fwd[(programs, p.heads)](
        q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, schedule, slope_args[0],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), o.stride(0), o.stride(1),
        *slope_args[1:], p.total_q, programs, p.group, max(p.left, 0), max(p.right, 0), qk_scale, softcap,
        HEAD_DIM=p.head_dim, BLOCK_D=block_d(p.head_dim), BLOCK_M=bm, BLOCK_N=bn,
        HAS_LEFT=p.left >= 0, HAS_RIGHT=p.right >= 0, SOFTCAP=p.softcap > 0, ALIBI=slopes is not None,
        PRECISION=precision(work), num_warps=warps, num_stages=stages)
    return (o if o.dtype == dtype else o.to(dtype)), lse


def varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, scale, left=-1, right=-1,
                   softcap=0.0, alibi_slopes=None):
    """Packed variable-length attention forward (flash-attn 2.x varlen layout).

    q ``(total_q, H, D)``, k and v ``(total_k, Hkv, D)``; sequence ``b`` owns the query rows
    ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and the key rows ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``
    (int32 ``(B + 1,)`` tensors on q's device).  Per sequence, bottom-right aligned: query ``i`` sees
    key ``j`` iff ``j`` is in ``[i + Lk - Lq - left, i + Lk - Lq + right]`` (-1: unbounded).
    Scores ``q·k·scale``, then ``softcap·tanh(s / softcap)`` if ``softcap > 0``, then
    ``- alibi_slopes[b, h]·|i + Lk - Lq - j|`` if slopes are given (float32 ``(H,)`` or ``(B, H)``).

    Returns o ``(total_q, H, D)`` in q's dtype and lse ``(H, total_q)`` float32 (natural log);
    a row that sees no key gives zeros and ``lse = -inf``.
    """
    p = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, left, right, softcap,
                     alibi_slopes)
    return forward(q, k, v, cu_seqlens_q, cu_seqlens_k, p)
