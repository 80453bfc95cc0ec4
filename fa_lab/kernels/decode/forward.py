"""``decode_forward``: attention of a few new queries over a KV cache, split-KV (flash-decoding).

The layout is flash-attn 2.x's ``flash_attn_with_kvcache``: q ``(B, Nq, H, D)``, the cache
contiguous ``(B_cache, Nk_max, Hkv, D)`` or paged ``(num_blocks, page_size, Hkv, D)`` with a
block table.  The first kernel (``kernel.py``) runs one program per (sequence, K/V head,
split, query tile); with more than one split the second (``combine.py``) merges them.

A decoding loop calls this once per generated token with the same shapes, and one call's GPU
time is tens of microseconds: the host time matters.  So the checks and the launch
arithmetic of a problem are done once and kept as a ``Plan``, found again by the call's
``signature`` (shapes, strides, dtypes, devices and the plain arguments).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from fa_lab.core.world import ON_GPU
from fa_lab.kernels.decode.checks import DecodeProblem, check_decode, check_out
from fa_lab.kernels.decode.combine import combine_launch
from fa_lab.kernels.decode.configs import (
    OFFS32_LIMIT,
    decode_config,
    head_dim_block,
    next_power_of_2,
    num_splits_heuristic,
    pool_order_wanted,
    query_block,
    sm_count,
)
from fa_lab.kernels.decode.kernel import LOG2E, PAGE_GATHER, decode_split_kv, layout_of
from fa_lab.kernels.decode.launching import Launch, run
from fa_lab.kernels.decode.pool_order import order_buffer

#: the largest grid size along CUDA's second and third axes (splits, query tiles)
GRID_LIMIT = 65535
#: the most plans kept (a new one past it replaces them all: a server sees few shapes)
MAX_PLANS = 1024


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernel computes in: bfloat16 is fp32 in the CPU world (the interpreter has no bf16 math)."""
    return torch.float32 if (not ON_GPU and dtype == torch.bfloat16) else dtype


class Plan(NamedTuple):
    """What a call's launches need besides its tensors: the same for every repeat of a problem."""

    problem: DecodeProblem
    splits: int
    split_kv: Launch
    combine: Launch | None         # None with one split
    split_key: tuple | None        # fast-launch keys (GPU only)
    combine_key: tuple | None
    order_rows: int                # programs that read their pages in pool order (0: key order)
    orders: dict                   # their buffers by CUDA stream (the key None in the CPU world)


#: call signature -> Plan
_PLANS: dict[tuple, Plan] = {}
#: arguments the signature keeps by value (any other type is checked on every call)
_PLAIN = (int, float, type(None))


def _tensor_signature(t):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.requires_grad)


def signature(q, k_cache, v_cache, cache_seqlens, block_table, cache_batch_idx, out, *numbers) -> tuple | None:
    """Everything the checks and the plan read from a call, or None where a repeat must be checked again:
    integer tensors on the CPU (the checks read their values there), arguments that are neither
    tensors nor plain numbers.  (The caller leaves out ALiBi slopes and config overrides: rare.)"""
    tensors = (q, k_cache, v_cache, cache_seqlens, block_table, cache_batch_idx, out)
    if not all(t is None or isinstance(t, torch.Tensor) for t in tensors):
        return None
    if any(t is not None and not t.is_cuda for t in (cache_seqlens, block_table, cache_batch_idx)):
        return None
    if not all(type(x) in _PLAIN for x in numbers):
        return None
    return (*map(_tensor_signature, tensors), *((type(x), x) for x in numbers), torch.is_grad_enabled())


def largest_offset(t: torch.Tensor) -> int:
    """The largest element offset from ``t``'s first element to any of its elements (from shape and strides)."""
    return sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()) if n > 0)


def plan_decode(p: DecodeProblem, q, k_cache, v_cache, o_work, lse, *, cache_seqlens, block_table, cache_batch_idx,
                slopes, config) -> Plan:
    """The launches of one checked problem, from the shapes and strides of its tensors (not their data)."""
    B, Nq, H, D = q.shape
    device = q.device
    work = o_work.dtype
    cfg = decode_config(D, work.itemsize, config, paged=p.paged)
    block_n = cfg["BLOCK_N"]
    layout = layout_of(p.page_size, block_n)
    rows = p.group * Nq
    block_m = query_block(rows, cfg["MAX_BLOCK_M"])
    m_tiles = math.ceil(rows / block_m)
    programs, sms = B * p.kv_heads * m_tiles, sm_count(device)
    # pages that tile a key tile may be read in any order when no key's position matters but the length's
    # (no ALiBi, no left window, and a right window that every key passes: one query)
    reorderable = (layout == PAGE_GATHER and block_n % p.page_size == 0 and p.left < 0 and slopes is None
                   and (p.right < 0 or Nq == 1))
    splits = p.num_splits or num_splits_heuristic(programs, p.max_keys, block_n, sms,
                                                  gather=layout == PAGE_GATHER and not reorderable)
    tiles = -(-p.max_keys // block_n)
    max_pages = max(next_power_of_2(-(-tiles // splits) * block_n // max(p.page_size, 1)), 1)
    ordered = reorderable and pool_order_wanted(programs, splits, max_pages, sms, cfg["POOL_ORDER"])
    if reorderable and not ordered and not p.num_splits:   # read in key order: the gathering rule
        splits = num_splits_heuristic(programs, p.max_keys, block_n, sms, gather=True)
    if max(splits, m_tiles) > GRID_LIMIT:
        raise ValueError(f"{splits} splits and {m_tiles} query tiles of {block_m} rows: a CUDA grid holds at most "
                         f"{GRID_LIMIT} of each (fewer splits, or fewer queries per call)")
    if p.softcap > 0:
        qk_scale, softcap_scale, softcap_log2 = 0.0, p.scale / p.softcap, p.softcap * LOG2E
    else:
        qk_scale, softcap_scale, softcap_log2 = p.scale * LOG2E, 0.0, 0.0
    scalars = (
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *o_work.stride(), *lse.stride(),
        block_table.stride(0) if block_table is not None else 0,
        *(slopes.stride() if slopes is not None else (0, 0)),
        Nq, p.capacity, H, p.kv_heads, p.left, p.right, qk_scale, softcap_scale, softcap_log2,
    )
    meta = dict(
        HEAD_DIM=D, BLOCK_D=head_dim_block(D), BLOCK_M=block_m, BLOCK_N=block_n,
        LAYOUT=layout, PAGE_SIZE=max(p.page_size, 1),
        HAS_SEQLENS=cache_seqlens is not None, HAS_BATCH_IDX=cache_batch_idx is not None,
        HAS_LEFT=p.left >= 0, HAS_RIGHT=p.right >= 0, HAS_SOFTCAP=p.softcap > 0, HAS_ALIBI=slopes is not None,
        SPLIT=splits > 1, PRECISION="ieee" if work == torch.float32 else None,
        OFFS32=max(largest_offset(k_cache), largest_offset(v_cache)) < OFFS32_LIMIT,
        KV_SAME=k_cache.stride() == v_cache.stride(),
        POOL_ORDER=ordered, MAX_PAGES=max_pages if ordered else 1,
    )
    split_kv = Launch(decode_split_kv, (B * p.kv_heads, splits, m_tiles), scalars, meta, cfg["num_warps"],
                      cfg["num_stages"])
    # the partials' rows are (b, i, h); lse is (B, H, Nq): written through its transposed view
    combine = combine_launch((B, Nq, H, splits, D), o_work, lse.transpose(1, 2)) if splits > 1 else None
    on_gpu = ON_GPU and device.type == "cuda"
    return Plan(p, splits, split_kv, combine, split_kv.key(device) if on_gpu else None,
                combine.key(device) if on_gpu and combine else None,
                programs * splits if ordered else 0, {})


def order_rows_of(plan: Plan, device) -> torch.Tensor:
    """The pool-order buffer of ``plan`` for the current stream (made on first use).  Two streams running the
    same plan at once would otherwise share rows; kernels on one stream run one after another."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
    buffer = plan.orders.get(stream)
    if buffer is None:
        buffer = plan.orders[stream] = order_buffer(plan.order_rows, plan.split_kv.meta["MAX_PAGES"], device)
    return buffer


def decode_plan(q, k_cache, v_cache, *, cache_seqlens=None, block_table=None, cache_batch_idx=None, scale=None,
                left=-1, right=-1, softcap=0.0, alibi_slopes=None, num_splits=0, config=None) -> Plan:
    """The plan ``decode_forward`` makes for these arguments (its split count, its launches), nothing run."""
    p = check_decode(q, k_cache, v_cache, cache_seqlens=cache_seqlens, block_table=block_table,
                     cache_batch_idx=cache_batch_idx, scale=scale, left=left, right=right, softcap=softcap,
                     alibi_slopes=alibi_slopes, num_splits=num_splits)
    B, Nq, H, _ = q.shape
    o_work = torch.empty(q.shape, dtype=work_dtype(q.dtype), device=q.device)
    lse = torch.empty((B, H, Nq), dtype=torch.float32, device=q.device)
    return plan_decode(p, q, k_cache, v_cache, o_work, lse, cache_seqlens=cache_seqlens, block_table=block_table,
                       cache_batch_idx=cache_batch_idx, slopes=p.alibi_slopes, config=config)


def decode_forward(q, k_cache, v_cache, *, cache_seqlens=None, block_table=None, cache_batch_idx=None, scale,
                   left=-1, right=-1, softcap=0.0, alibi_slopes=None, num_splits=0, out=None, config=None):
    """Attention of ``q (B, Nq, H, D)`` over the first ``cache_seqlens[b]`` keys of each sequence's cache.

    Returns ``(o, lse)``: o ``(B, Nq, H, D)`` in q's dtype (written into ``out`` if given), lse
    ``(B, H, Nq)`` float32 (natural log).  Query ``i`` sees key ``j`` when
    ``i + L - Nq - left <= j <= i + L - Nq + right`` (``-1``: unbounded; causal is ``right=0``).

    ``cache_seqlens`` (B,) int32: the valid keys ``L`` of each sequence (None: all of the cache).
    ``block_table`` (B, max_blocks) int32 makes the cache paged: key j of sequence b is row
    ``j % page_size`` of block ``block_table[b, j // page_size]``.  ``cache_batch_idx`` (B,)
    int32: the row of a contiguous cache each sequence uses.  ``scale`` (None: 1/sqrt(D)),
    ``softcap`` (> 0: scores ``softcap·tanh(s/softcap)``), ``alibi_slopes`` float32 (H,) or
    (B, H).  ``num_splits``: 0 picks by heuristic, 1 no split, n that many.  ``config``
    overrides the launch configuration (``configs.decode_config``'s keys).
    """
    key = None
    if alibi_slopes is None and config is None:
        key = signature(q, k_cache, v_cache, cache_seqlens, block_table, cache_batch_idx, out,
                        scale, left, right, softcap, num_splits)
    plan = _PLANS.get(key) if key is not None else None
    if plan is None:
        p = check_decode(q, k_cache, v_cache, cache_seqlens=cache_seqlens, block_table=block_table,
                         cache_batch_idx=cache_batch_idx, scale=scale, left=left, right=right, softcap=softcap,
                         alibi_slopes=alibi_slopes, num_splits=num_splits)
        if out is not None:
            check_out(out, q)
    else:
        p = plan.problem

    B, Nq, H, D = q.shape
    device = q.device
    o = out if out is not None else torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((B, H, Nq), dtype=torch.float32, device=device)
    if p.capacity == 0:   # a cache with no room for a key: every row sees nothing
        o.zero_()
        lse.fill_(float("-inf"))
        return o, lse

    work = work_dtype(q.dtype)
    if work != q.dtype:
        q, k_cache, v_cache = (t.to(work) for t in (q, k_cache, v_cache))
    o_work = o if work == o.dtype else torch.empty(o.shape, dtype=work, device=device)
    # the kernel reads these integer tensors as dense rows (index b, or b's row of the table)
    cache_seqlens, cache_batch_idx = (t if t is None else t.contiguous() for t in (cache_seqlens, cache_batch_idx))
    if block_table is not None and block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    if plan is None:
        plan = plan_decode(p, q, k_cache, v_cache, o_work, lse, cache_seqlens=cache_seqlens,
                           block_table=block_table, cache_batch_idx=cache_batch_idx, slopes=p.alibi_slopes,
                           config=config)
        if key is not None:
            if len(_PLANS) >= MAX_PLANS:
                _PLANS.clear()
            _PLANS[key] = plan

    if plan.splits > 1:
        o_part = torch.empty((B, Nq, H, plan.splits, D), dtype=torch.float32, device=device)
        lse_part = torch.empty((B, Nq, H, plan.splits), dtype=torch.float32, device=device)
    else:
        o_part = lse_part = lse   # not read or written: SPLIT is off
    unused = lse   # the pointer passed where a tensor is absent (its constexpr switch is off)
    slopes = p.alibi_slopes
    run(plan.split_kv, (q, k_cache, v_cache, o_work, lse, o_part, lse_part,
                        unused if cache_seqlens is None else cache_seqlens,
                        unused if block_table is None else block_table,
                        unused if cache_batch_idx is None else cache_batch_idx,
                        unused if slopes is None else slopes,
                        order_rows_of(plan, device) if plan.order_rows else unused), plan.split_key)
    if plan.combine is not None:
        run(plan.combine, (o_part, lse_part, o_work, lse.transpose(1, 2)), plan.combine_key)
    if o_work is not o:
        o.copy_(o_work)
    return o, lse
