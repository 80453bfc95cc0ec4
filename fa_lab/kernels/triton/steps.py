"""Chapter 4's steps, from the FlashAttention-2 loop in ~40 lines to the tuned kernel.

Each step is a registered implementation, so the book, the tests and the benchmark treat
it like any other kernel, and each adds one idea to the one before:

=====================  ==================================================================
``triton_minimal``     the FA2 loop: pointer arithmetic, masked loads, ``exp``, every key
                       block visited and masked; one fixed tile size, no pipelining
``triton_desc``        tiles fetched through tensor descriptors (TMA on Hopper): bounds
                       and padding handled by the copy engine (``fa_lab.kernels.triton.kernel``)
``triton_exp2``        the softmax scale folded into ``exp2``
``triton_skip``        loop bounds per query block: fully masked blocks are never
                       loaded, masks are computed only on boundary blocks
``triton_autotuned``   tile sizes and warps tuned per (head dim, length bucket, dtype, mask)
``triton``             + software pipelining (``num_stages``): the final kernel
=====================  ==================================================================
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fa_lab.core.registry import register
from fa_lab.core.world import ON_GPU
from fa_lab.kernels.triton.configs import CPU_CONFIG, FIXED_CONFIG, Variant, head_dim_pad
from fa_lab.kernels.triton.fwd import triton_forward
from fa_lab.kernels.triton.launch import HEAD_DIMS, check_supported, prepare_inputs, triton_limits

STEP_DTYPES = (torch.float16, torch.bfloat16)


@triton.jit
def minimal_kernel(Q, K, V, O, LSE, scale, n_q, n_k, heads, kv_heads, left, right, head_dim,
                   D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Step 1: the FlashAttention-2 loop with pointers and masks (grid: query blocks, batch · heads)."""
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // heads, pid_bh % heads
    kv_row = (b * kv_heads + h // (heads // kv_heads)) * n_k  # GQA: index the shared K/V head
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)  # D padded to a power of two; the pad columns load as 0
    q_rows = pid_bh * n_q + offs_m
    q = tl.load(Q + q_rows[:, None] * head_dim + offs_d[None, :],
                mask=(offs_m[:, None] < n_q) & (offs_d[None, :] < head_dim), other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    diag = offs_m + n_k - n_q  # bottom-right: query i sits at key i + Nk - Nq
    for start_n in range(0, n_k, BLOCK_N):
        # region: kv-loads
        cols = start_n + offs_n
        kv_ptrs = (kv_row + cols)[:, None] * head_dim + offs_d[None, :]
        kv_ok = (cols[:, None] < n_k) & (offs_d[None, :] < head_dim)
        k = tl.load(K + kv_ptrs, mask=kv_ok, other=0.0)
        v = tl.load(V + kv_ptrs, mask=kv_ok, other=0.0)
        # endregion: kv-loads
        s = tl.dot(q, tl.trans(k)) * scale  # S = Q Kᵀ on the Tensor Cores
        keep = ((cols[None, :] < n_k) & ((left < 0) | (cols[None, :] >= diag[:, None] - left))
                & ((right < 0) | (cols[None, :] <= diag[:, None] + right)))
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key seen yet: 0, not NaN
        p = tl.exp(s - m_sub[:, None])
        alpha = tl.exp(m_i - m_sub)  # rescale what was accumulated under the old max
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)  # acc += P V, Tensor Cores again
        m_i = m_new
    # l_i != 0 rather than > 0: a NaN row stays NaN (NaN in, NaN out) instead of reading as empty
    seen = l_i != 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    tl.store(LSE + q_rows, tl.where(seen, m_i + tl.log(l_safe), float("-inf")), mask=offs_m < n_q)
    tl.store(O + q_rows[:, None] * head_dim + offs_d[None, :], (acc / l_safe[:, None]).to(O.dtype.element_ty),
             mask=(offs_m[:, None] < n_q) & (offs_d[None, :] < head_dim))


def triton_minimal(q, k, v, spec):
    """Step 1: the minimal FA2 forward (one fixed tile size, no pipelining)."""
    check_supported(spec, q.dtype)
    q_, k_, v_, scale, work = prepare_inputs(q, k, v, spec)
    B, H, Nq, Nk, D = spec.batch, spec.heads, spec.n_q, spec.n_k, spec.head_dim
    cfg = FIXED_CONFIG if ON_GPU else CPU_CONFIG
    o = torch.empty((B, H, Nq, D), dtype=work, device=q.device)
    lse = torch.empty((B, H, Nq), dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(Nq, cfg["BLOCK_M"]), B * H)
    minimal_kernel[grid](q_, k_, v_, o, lse, scale, Nq, Nk, H, spec.kv_heads, spec.left, spec.right, D,
                         D_PAD=head_dim_pad(D), BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                         num_warps=cfg["num_warps"], num_stages=1)
    return o.to(q.dtype), lse


#: the steps after the minimal kernel: the final kernel with some of its ideas switched off
VARIANTS = {
    "triton_desc": Variant("triton_desc", exp2=False, skip_masked=False, space="fixed"),
    "triton_exp2": Variant("triton_exp2", exp2=True, skip_masked=False, space="fixed"),
    "triton_skip": Variant("triton_skip", exp2=True, skip_masked=True, space="fixed"),
    "triton_autotuned": Variant("triton_autotuned", exp2=True, skip_masked=True, space="tuned"),
}

#: (registered name, what the step adds), in the chapter's order
STEPS = [
    ("triton_minimal", "minimal FA2 loop: pointers + masks, exp, all blocks masked, 64×64 tiles, 1 stage"),
    ("triton_desc", "tensor descriptors (TMA): bounds and D padding by the copy engine"),
    ("triton_exp2", "scale folded into exp2 (one FMA per score)"),
    ("triton_skip", "loop bounds per query block: masked blocks skipped, masks only on boundaries"),
    ("triton_autotuned", "autotuned BLOCK_M, BLOCK_N, warps (still 1 stage)"),
    ("triton", "software pipelining: num_stages tuned too (the final kernel)"),
]


def _variant_fn(variant: Variant):
    def run(q, k, v, spec):
        return triton_forward(q, k, v, spec, variant=variant)

    run.__name__ = variant.name
    run.__doc__ = f"Chapter 4 step {variant.name}: {variant}"
    return run


_COMMON = dict(chapter=4, dtypes=STEP_DTYPES, head_dims=HEAD_DIMS, extra_memory=lambda s: 4 * s.batch * s.heads * s.n_q,
               tags=("triton",), step_of="triton",
               limits=triton_limits)

register("triton_minimal", description=STEPS[0][1], **_COMMON)(triton_minimal)
for _name, _what in STEPS[1:-1]:
    register(_name, description=_what, **_COMMON)(_variant_fn(VARIANTS[_name]))
