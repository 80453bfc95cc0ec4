"""Chapter 5: FlashAttention-2 forward *and backward* in tiles, with plain PyTorch ops.

The backward pass keeps only ``Q, K, V, O`` and the log-sum-exp ``lse`` of each row
(linear memory) and recomputes the probabilities tile by tile:

    P  = exp(S - lse)            S = scale · Q Kᵀ, recomputed from Q, K and the saved lse
    D  = rowsum(dO ∘ O)          one number per query row (equal to rowsum(P ∘ dP))
    dV = Pᵀ dO
    dP = dO Vᵀ
    dS = P ∘ (dP - D)
    dQ = scale · dS K
    dK = scale · dSᵀ Q

``fa_lab.autograd.Recompute`` is the ``torch.autograd.Function`` that every chapter-5 engine
plugs into: this module's tiles in PyTorch, and the Triton kernels of ``fa_lab.kernels.triton``;
``fa_lab.autograd`` registers them (``torch_tiled``, ``flash_triton``).

Also here: ``dense_backward``, the same formulas on whole (Nq, Nk) matrices, and its
``torch.compile``d version — the intermediate step a course assignment takes before
writing backward kernels by hand.
"""
from __future__ import annotations

import os

import torch

from fa_lab.core.masks import block_key_range, key_range, tile_visible, visible
from fa_lab.core.world import ON_GPU, pick


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the tiles compute in: float32 for fp16/bf16/fp32 inputs, float64 stays float64."""
    return torch.promote_types(dtype, torch.float32)


def block_query_range(n_start: int, n_end: int, n_q: int, n_k: int, left: int, right: int) -> tuple[int, int]:
    """Query rows ``[lo, hi)`` that see *any* key of ``[n_start, n_end)``: the K/V-stationary loop's bounds.

    Row ``i`` sees key ``j`` when ``j - right <= i + Nk - Nq <= j + left`` (bottom-right alignment).
    """
    shift = n_k - n_q
    lo = 0 if right < 0 else max(0, n_start - shift - right)
    hi = n_q if left < 0 else min(n_q, n_end - 1 - shift + left + 1)
    return lo, max(lo, hi)


def tile_mask(m0: int, m1: int, n0: int, n1: int, spec, device) -> torch.Tensor | None:
    """Which entries of the tile rows ``[m0, m1)`` × keys ``[n0, n1)`` are visible; None if all are."""
    first_row_lo, first_row_hi = key_range(m0, spec.n_q, spec.n_k, spec.left, spec.right)
    last_row_lo, _ = key_range(m1 - 1, spec.n_q, spec.n_k, spec.left, spec.right)
    # key ranges only move right as the row grows, so the corners decide
    if last_row_lo <= n0 and first_row_hi >= n1:
        return None
    return tile_visible(m0, m1, n0, n1, spec.n_q, spec.n_k, spec.left, spec.right, device=device)


def _group_view(q, spec):
    """q (B, H, N, D) as (B, Hkv, G, N, D): the G query heads that share one K/V head side by side."""
    return q.reshape(spec.batch, spec.kv_heads, spec.group, *q.shape[2:])


def tiled_forward(q, k, v, spec, block_m: int | None = None, block_n: int | None = None):
    """FlashAttention-2's forward in tiles: the online softmax over key tiles, one query tile at a time.

    Returns ``o`` (q's dtype) and ``lse`` (float32; float64 for float64 input), ``-inf`` for rows
    that see no key.  Only ``(block_m, block_n)`` scores exist at any time.
    """
    block_m = block_m or pick(16, 128)
    block_n = block_n or pick(16, 128)
    work = work_dtype(q.dtype)
    Q = _group_view(q, spec)                       # (B, Hkv, G, Nq, D)
    K, V = k.unsqueeze(2), v.unsqueeze(2)          # (B, Hkv, 1, Nk, D): broadcast over the group, no copy
    o = torch.zeros(Q.shape, dtype=work, device=q.device)
    lse = torch.full(Q.shape[:-1], float("-inf"), dtype=work, device=q.device)
    for m0 in range(0, spec.n_q, block_m):
        m1 = min(m0 + block_m, spec.n_q)
        q_i = Q[..., m0:m1, :].to(work)
        m_i = torch.full(q_i.shape[:-1], float("-inf"), dtype=work, device=q.device)
        l_i = torch.zeros_like(m_i)
        acc = torch.zeros_like(q_i)
        lo, hi = block_key_range(m0, m1, spec.n_q, spec.n_k, spec.left, spec.right)
        for n0 in range(lo - lo % block_n, hi, block_n):   # tiles outside [lo, hi) are fully masked: skipped
            n1 = min(n0 + block_n, spec.n_k)
            s = (q_i @ K[..., n0:n1, :].to(work).transpose(-1, -2)) * spec.scale
            mask = tile_mask(m0, m1, n0, n1, spec, q.device)
            if mask is not None:
                s = s.masked_fill(~mask, float("-inf"))
            m_new = torch.maximum(m_i, s.amax(dim=-1))
            m_safe = torch.where(torch.isinf(m_new), 0.0, m_new)   # a row that has seen no key yet
            alpha = torch.exp(m_i - m_safe)                          # rescales what came before
            p = torch.exp(s - m_safe.unsqueeze(-1))
            l_i = l_i * alpha + p.sum(dim=-1)
            acc = acc * alpha.unsqueeze(-1) + p @ V[..., n0:n1, :].to(work)
            m_i = m_new
        empty = l_i == 0
        o[..., m0:m1, :] = acc / torch.where(empty, 1.0, l_i).unsqueeze(-1)
        lse[..., m0:m1] = torch.where(empty, float("-inf"), m_i + torch.log(torch.where(empty, 1.0, l_i)))
    return o.reshape(q.shape).to(q.dtype), lse.reshape(q.shape[:-1])


def _delta(o, do, dlse, work):
    """D = rowsum(dO ∘ O); a gradient on lse enters as dS += P ∘ dlse, i.e. D -= dlse."""
    d = (do.to(work) * o.to(work)).sum(dim=-1)
    return d if dlse is None else d - dlse.to(work)


def _p_lse(lse):
    """The saved lse, with rows that see no key at +inf so that exp(S - lse) is 0 there, not NaN."""
    return torch.where(torch.isneginf(lse), float("inf"), lse)


def tiled_backward(q, k, v, o, lse, do, spec, dlse=None, block_m: int | None = None, block_n: int | None = None):
    """FlashAttention-2's backward in tiles: K/V-stationary outer loop, recomputing P from lse.

    For each key tile ``j`` (dK_j and dV_j stay in "registers"), walk the query tiles that
    see it; dQ is accumulated in memory.  The query heads of a GQA group are summed into
    their shared dK/dV here, inside the loop.  Returns ``dq, dk, dv`` in the inputs' dtypes.
    """
    block_m = block_m or pick(16, 128)
    block_n = block_n or pick(16, 128)
    work = work_dtype(q.dtype)
    Q, dO = _group_view(q, spec), _group_view(do, spec)
    L = _group_view(_p_lse(lse).to(work).unsqueeze(-1), spec)[..., 0]       # (B, Hkv, G, Nq)
    Dl = _group_view(_delta(o, do, dlse, work).unsqueeze(-1), spec)[..., 0]
    dq = torch.zeros(Q.shape, dtype=work, device=q.device)
    dk = torch.zeros(k.shape, dtype=work, device=q.device)
    dv = torch.zeros(v.shape, dtype=work, device=q.device)
    for n0 in range(0, spec.n_k, block_n):
        n1 = min(n0 + block_n, spec.n_k)
        k_j = k[:, :, None, n0:n1].to(work)                # (B, Hkv, 1, bn, D)
        v_j = v[:, :, None, n0:n1].to(work)
        dk_j = torch.zeros(k_j.shape, dtype=work, device=q.device)
        dv_j = torch.zeros_like(dk_j)
        lo, hi = block_query_range(n0, n1, spec.n_q, spec.n_k, spec.left, spec.right)
        for m0 in range(lo - lo % block_m, hi, block_m):
            m1 = min(m0 + block_m, spec.n_q)
            q_i, do_i = Q[..., m0:m1, :].to(work), dO[..., m0:m1, :].to(work)
            s = (q_i @ k_j.transpose(-1, -2)) * spec.scale
            p = torch.exp(s - L[..., m0:m1, None])
            mask = tile_mask(m0, m1, n0, n1, spec, q.device)
            if mask is not None:
                p = p.masked_fill(~mask, 0.0)
            dv_j += (p.transpose(-1, -2) @ do_i).sum(dim=2, keepdim=True)      # summed over the group
            dp = do_i @ v_j.transpose(-1, -2)
            ds = p * (dp - Dl[..., m0:m1, None])
            dq[..., m0:m1, :] += spec.scale * (ds @ k_j)
            dk_j += spec.scale * (ds.transpose(-1, -2) @ q_i).sum(dim=2, keepdim=True)
        dk[:, :, n0:n1] = dk_j[:, :, 0]
        dv[:, :, n0:n1] = dv_j[:, :, 0]
    return dq.reshape(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def dense_backward(q, k, v, o, lse, do, scale: float, left: int, right: int, dlse=None):
    """The backward formulas on whole matrices (P is (Nq, Nk) per head: quadratic, but only here).

    Plain tensor arguments (no spec) so that ``torch.compile`` can trace it.  GQA: the
    query heads of a group are summed into their K/V head.
    """
    B, H, Nq, Dh = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    work = work_dtype(q.dtype)
    Q = q.reshape(B, Hkv, H // Hkv, Nq, Dh).to(work)
    dO = do.reshape(Q.shape).to(work)
    K, V = k.unsqueeze(2).to(work), v.unsqueeze(2).to(work)
    L = _p_lse(lse).reshape(Q.shape[:-1]).to(work)
    Dl = _delta(o, do, dlse, work).reshape(Q.shape[:-1])
    s = (Q @ K.transpose(-1, -2)) * scale
    p = torch.exp(s - L.unsqueeze(-1))
    p = p.masked_fill(~visible(Nq, Nk, left, right, device=q.device), 0.0)
    dv = (p.transpose(-1, -2) @ dO).sum(dim=2)
    ds = p * (dO @ V.transpose(-1, -2) - Dl.unsqueeze(-1))
    dq = scale * (ds @ K)
    dk = scale * (ds.transpose(-1, -2) @ Q).sum(dim=2)
    return dq.reshape(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


#: Compile on the GPU; in the CPU world (CI, laptops) torch.compile needs a C++ toolchain and
#: minutes of compiling, so the same function runs eagerly unless FA_LAB_COMPILE=1 asks for it.
COMPILE = ON_GPU or os.environ.get("FA_LAB_COMPILE", "0") == "1"
_compiled = None


def compiled_dense_backward():
    """``torch.compile(dense_backward)`` where compiling is on (see ``COMPILE``), else ``dense_backward``."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(dense_backward, dynamic=False) if COMPILE else dense_backward
    return _compiled


def compiled_backward(q, k, v, o, lse, do, spec, dlse=None):
    """An engine backward (``Recompute``'s signature) that runs ``dense_backward`` through torch.compile."""
    return compiled_dense_backward()(q, k, v, o, lse, do, spec.scale, spec.left, spec.right, dlse)

