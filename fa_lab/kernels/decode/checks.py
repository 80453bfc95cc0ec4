"""Input checking for decoding with a KV cache: one ``DecodeProblem`` describes a valid call.

Bad input raises here, before any launch, with a message that says what was expected.  The
cache is read in place: nothing here copies it.  Values inside the integer tensors (lengths,
block-table entries, batch rows) are checked only where that costs no device synchronisation
(tensors on the CPU); on a GPU the kernel clamps each length to the cache's capacity.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from fa_lab.core.spec import FLOAT32_MAX, check_alibi_slopes

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HEAD_DIMS = (1, 256)
#: window sizes past this are unbounded in practice and keep the kernel's int32 positions exact
WINDOW_MAX = 2 ** 30


@dataclass(frozen=True)
class DecodeProblem:
    batch: int
    n_q: int
    heads: int
    kv_heads: int
    head_dim: int
    page_size: int        # 0: a contiguous cache (one row per sequence)
    capacity: int         # the most keys a sequence can hold
    scale: float
    left: int             # -1 = unbounded
    right: int
    softcap: float
    alibi_slopes: torch.Tensor | None   # float32 (B, H) or None
    num_splits: int       # 0 = the heuristic

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def paged(self) -> bool:
        return self.page_size > 0

    @property
    def max_keys(self) -> int:
        """An upper bound on the keys one query tile sees (from shapes and the window, no lengths read)."""
        if self.left >= 0 and self.right >= 0:
            return min(self.capacity, self.n_q + self.left + self.right)
        return self.capacity


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _tensor(name: str, t, dims: int, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {what}, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dims {what}, got shape {tuple(t.shape)}")


def _index_tensor(name: str, t, shape: tuple, what: str, device) -> None:
    _tensor(name, t, len(shape), what)
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be an int32 tensor {what}, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape} {what}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on the device of q ({device}), got {t.device}")


def _window_side(name: str, x) -> int:
    if not _is_int(x):
        raise TypeError(f"{name} must be an int (-1 for unbounded), got {type(x).__name__} {x!r}")
    if x < -1:
        raise ValueError(f"{name} must be >= 0, or -1 for unbounded; got {x}")
    return int(min(x, WINDOW_MAX))


def _real(name: str, x, lo: float) -> float:
    if not isinstance(x, numbers.Real) or isinstance(x, bool):
        raise TypeError(f"{name} must be a real number, got {type(x).__name__} {x!r}")
    x = float(x)
    if not (math.isfinite(x) and lo <= x and abs(x) <= FLOAT32_MAX):
        raise ValueError(f"{name} must be a finite number{' >= 0' if lo == 0 else ''} that float32 can hold, got {x}")
    return x


def check_cache_tensors(k_cache, v_cache, device, dtype) -> None:
    """k_cache and v_cache: 4-dim tensors of one shape, on ``device``, in ``dtype``."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _tensor(name, t, 4, "(batch or blocks, keys, kv_heads, head_dim)")
        if t.device != device:
            raise ValueError(f"{name} must be on the device of q ({device}), got {t.device}")
        if t.dtype != dtype:
            raise TypeError(f"{name} must have the dtype of q ({dtype}), got {t.dtype}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have one shape, got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")


def check_layout(batch: int, k_cache, cache_seqlens, block_table, cache_batch_idx, device) -> tuple[int, int]:
    """Check the cache's integer tensors; return ``(page_size, capacity)`` (page_size 0: contiguous)."""
    rows, n_keys = k_cache.shape[0], k_cache.shape[1]
    if block_table is not None:
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx selects rows of a contiguous cache; a paged cache (block_table "
                             "given) maps sequences to blocks through block_table alone: pass one, not both")
        _tensor("block_table", block_table, 2, "(batch, max_blocks_per_seq)")
        _index_tensor("block_table", block_table, (batch, block_table.shape[1]), "(batch, max_blocks_per_seq)",
                      device)
        if n_keys < 1:
            raise ValueError(f"a paged cache (num_blocks, page_size, kv_heads, head_dim) needs page_size >= 1, "
                             f"got {tuple(k_cache.shape)}")
        page_size, capacity = n_keys, block_table.shape[1] * n_keys
    else:
        if cache_batch_idx is not None:
            _index_tensor("cache_batch_idx", cache_batch_idx, (batch,), "(batch,)", device)
            if device.type == "cpu" and batch and not bool(((cache_batch_idx >= 0) & (cache_batch_idx < rows)).all()):
                raise ValueError(f"cache_batch_idx values must index the cache's {rows} rows, got "
                                 f"{cache_batch_idx.tolist()}")
        elif rows != batch:
            raise ValueError(f"k_cache has {rows} rows for a batch of {batch}: a contiguous cache needs one row per "
                             "sequence, or cache_batch_idx (batch,) int32 to say which row each sequence uses "
                             "(a paged cache needs block_table)")
        page_size, capacity = 0, n_keys
    if cache_seqlens is not None:
        _index_tensor("cache_seqlens", cache_seqlens, (batch,), "(batch,)", device)
        if device.type == "cpu" and batch and not bool(((cache_seqlens >= 0) & (cache_seqlens <= capacity)).all()):
            raise ValueError(f"cache_seqlens must lie in 0..{capacity} (the keys the cache holds per sequence), "
                             f"got {cache_seqlens.tolist()}")
    if block_table is not None and device.type == "cpu" and batch:
        lengths = cache_seqlens.long() if cache_seqlens is not None else torch.full((batch,), capacity)
        used = torch.arange(block_table.shape[1]) < ((lengths + page_size - 1) // page_size)[:, None]
        bad = used & ((block_table < 0) | (block_table >= rows))
        if bad.any():
            b, p = torch.nonzero(bad)[0].tolist()
            raise ValueError(f"block_table[{b}, {p}] = {int(block_table[b, p])} is not a block of the cache "
                             f"(0..{rows - 1})")
    return page_size, capacity


def check_decode(q, k_cache, v_cache, *, cache_seqlens, block_table, cache_batch_idx, scale, left, right,
                 softcap, alibi_slopes, num_splits) -> DecodeProblem:
    """Validate a decoding call and describe it (raises ValueError/TypeError naming what was expected)."""
    _tensor("q", q, 4, "(batch, n_q, heads, head_dim)")
    if q.dtype not in DTYPES:
        raise TypeError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    device = q.device
    check_cache_tensors(k_cache, v_cache, device, q.dtype)
    B, Nq, H, D = q.shape
    Hkv, Dk = k_cache.shape[2], k_cache.shape[3]
    if Dk != D:
        raise ValueError(f"k_cache and v_cache must have the head dim of q ({D}), got {Dk}")
    if not HEAD_DIMS[0] <= D <= HEAD_DIMS[1]:
        raise ValueError(f"decoding kernels support head dims {HEAD_DIMS[0]}..{HEAD_DIMS[1]}, got {D}")
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"query heads ({H}) must be a multiple of the cache's key/value heads ({Hkv})")
    if min(B, Nq) == 0:
        raise ValueError(f"empty input: q {tuple(q.shape)}")
    page_size, capacity = check_layout(B, k_cache, cache_seqlens, block_table, cache_batch_idx, device)
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    scale = _real("scale", scale, -math.inf)
    softcap = _real("softcap", softcap, 0.0)
    if not _is_int(num_splits) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0 picks by heuristic, 1 means no split), got {num_splits!r}")
    slopes = check_alibi_slopes(alibi_slopes, B, H, device)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_cache, v_cache)):
        raise ValueError("decode_forward is forward only, but q, k_cache or v_cache requires grad: its output would "
                         "carry no gradient. Call it under torch.no_grad() or on detached tensors.")
    return DecodeProblem(B, Nq, H, Hkv, D, page_size, capacity, scale, _window_side("left", left),
                         _window_side("right", right), softcap, slopes, int(num_splits))


def check_out(out, q) -> None:
    """``out`` receives o: q's shape, dtype and device."""
    _tensor("out", out, 4, "(batch, n_q, heads, head_dim)")
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must match q: shape {tuple(q.shape)}, {q.dtype} on {q.device}; got "
                         f"{tuple(out.shape)}, {out.dtype} on {out.device}")
