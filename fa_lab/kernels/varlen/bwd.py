"""``varlen_backward``: check a packed backward call, build the work tables, launch the two kernels."""
from __future__ import annotations

import torch

from fa_lab.kernels.varlen.bwd_kernel import varlen_bwd_dkdv, varlen_bwd_dq
from fa_lab.kernels.varlen.checks import VarlenProblem, check_backward, check_varlen
from fa_lab.kernels.varlen.configs import backward_configs, block_d
from fa_lab.kernels.varlen.fwd import precision, score_constants, work_dtype
from fa_lab.kernels.varlen.schedule import cached_schedule, n_programs


def backward(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, p: VarlenProblem, dlse=None, configs=None):
    """``(dq, dk, dv)`` of a checked problem.  ``configs`` overrides ``backward_configs``: ``(dkdv, dq)``."""
    dtype = q.dtype
    if p.total_q == 0 or p.total_k == 0:   # no row sees a key: every gradient is 0
        return (torch.zeros((p.total_q, p.heads, p.head_dim), dtype=dtype, device=q.device),
                *(torch.zeros((p.total_k, p.kv_heads, p.head_dim), dtype=dtype, device=q.device) for _ in "kv"))
    work = work_dtype(dtype)
    # the kernels read every tensor's features at stride 1; an upstream gradient may come strided
    # (the gradient of a transposed output), and only its first two strides reach the kernels
    q, k, v, o, do = (t if t.dtype == work and t.stride(-1) == 1 else t.to(work).contiguous()
                      for t in (q, k, v, o, do))
    # every row is written by exactly one program (a key block no query sees stores zeros)
    dq = torch.empty((p.total_q, p.heads, p.head_dim), dtype=work, device=q.device)
    dk = torch.empty((p.total_k, p.kv_heads, p.head_dim), dtype=work, device=q.device)
    dv = torch.empty_like(dk)
    qk_scale, softcap, slopes = score_constants(p, p.scale)
    D, BD = p.head_dim, block_d(p.head_dim)
    consts = dict(HEAD_DIM=D, BLOCK_D=BD, HAS_LEFT=p.left >= 0, HAS_RIGHT=p.right >= 0, SOFTCAP=p.softcap > 0,
                  ALIBI=slopes is not None, PRECISION=precision(work))

    # delta = rowsum(dO ∘ O) (- dlse) and the base-2 lse, (H, total_q) each: written by the dQ pass
    lse = lse.detach().to(torch.float32).contiguous()
    delta = torch.empty_like(lse)
    lse2 = torch.empty_like(lse)
    dlse_arg = dlse.detach().to(torch.float32).contiguous() if dlse is not None else delta

    slope_args = (slopes, *slopes.stride()) if slopes is not None else (lse, 0, 0)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
               do.stride(0), do.stride(1))
    scalars = (max(p.left, 0), max(p.right, 0), qk_scale, softcap, p.scale)
    cfg_kv, cfg_q = configs or backward_configs(D, work)

    # 1. dQ, first: one program per query block and query head; it also writes delta and lse2
    bm, bn, warps, stages = cfg_q
    programs = n_programs(p.total_q, p.batch, bm)
    schedule = cached_schedule(cu_seqlens_q, cu_seqlens_k, bm, programs, left=p.left, right=p.right)
    varlen_bwd_dq[(programs, p.heads)](
        q, k, v, do, lse2, delta, dq, o, lse, dlse_arg, cu_seqlens_q, cu_seqlens_k, schedule, slope_args[0],
        *strides, dq.stride(0), dq.stride(1), o.stride(0), o.stride(1), *slope_args[1:], p.total_q, programs,
        p.group, *scalars, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages,
        HAS_DLSE=dlse is not None, **consts)

    # 2. dK, dV: one program per key block and K/V head
    bm, bn, warps, stages = cfg_kv
    programs = n_programs(p.total_k, p.batch, bn)
    # heaviest first: the key blocks seen by the most query rows (the window's sides swap)
    schedule = cached_schedule(cu_seqlens_k, cu_seqlens_q, bn, programs, left=p.right, right=p.left)
    varlen_bwd_dkdv[(programs, p.kv_heads)](
        q, k, v, do, lse2, delta, dk, dv, cu_seqlens_q, cu_seqlens_k, schedule, slope_args[0], *strides,
        dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), *slope_args[1:], p.total_q, programs, p.group,
        *scalars, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, **consts)
    return tuple(g if g.dtype == dtype else g.to(dtype) for g in (dq, dk, dv))


def varlen_backward(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, scale, left=-1,
                    right=-1, softcap=0.0, alibi_slopes=None):
    """``(dq, dk, dv)`` of ``varlen_forward`` from its inputs, its ``(o, lse)`` and the incoming ``do``.

    Same arguments as ``varlen_forward``, plus dO and O ``(total_q, H, D)`` in q's dtype and the
    forward's lse ``(H, total_q)``.  Deterministic (no atomics): the same inputs give bit-identical
    gradients.  ALiBi slopes get no gradient.
    """
    p = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, left, right, softcap,
                     alibi_slopes)
    check_backward(p, q, do, o, lse)
    return backward(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, p)
