"""Input checks of the varlen entry points: one clear ValueError/TypeError before any launch.

What is checked, and what is not:

* q ``(total_q, H, D)``, k and v ``(total_k, Hkv, D)``: tensors of rank 3, one floating dtype
  (float16, bfloat16 or float32), one device (CUDA in the GPU world, the CPU in the CPU world),
  ``1 <= D <= 256``, ``H % Hkv == 0``, the last dim contiguous (any strides for the first two).
* ``cu_seqlens_q`` and ``cu_seqlens_k``: int32 tensors of shape ``(B + 1,)``, both the same B,
  on q's device.  Their *values* (starting at 0, never decreasing, ending at total_q / total_k)
  are checked only when they live on the CPU: on a GPU reading them would stall the host until
  every queued kernel has run.  A GPU caller vouches for them, as with flash-attn.
* ``max_seqlen_q`` / ``max_seqlen_k``: ints >= 0.  They only pick tile sizes; the results never
  depend on them (the grid is bounded by the totals, see ``schedule``).
* ``scale`` (finite), ``left`` / ``right`` (ints >= -1), ``softcap`` (finite, >= 0; 0 is off) and
  ``alibi_slopes`` (float32 ``(H,)`` or ``(B, H)`` on q's device).
* The backward: dO and O shaped like q, in q's dtype; lse float32 ``(H, total_q)``.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np
import torch

from fa_lab.core.spec import check_alibi_slopes
from fa_lab.core.world import WORLD

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class VarlenProblem:
    """One checked varlen call: sizes, mask and score modifications."""

    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    total_q: int
    total_k: int
    max_seqlen_q: int
    max_seqlen_k: int
    scale: float
    left: int
    right: int
    softcap: float
    alibi_slopes: torch.Tensor | None   # float32 (B, H), or None

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def _real(name: str, x, *, nonnegative: bool = False) -> float:
    if not isinstance(x, numbers.Real) or isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name} must be a real number, got {type(x).__name__} {x!r}")
    x = float(x)
    if not math.isfinite(x) or (nonnegative and x < 0):
        raise ValueError(f"{name} must be a finite number{' >= 0' if nonnegative else ''}, got {x}")
    return x


def _tensor(name: str, t, shape_doc: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {shape_doc}, got {type(t).__name__}")
    if t.dim() != 3:
        raise ValueError(f"{name} must have 3 dims {shape_doc}, got shape {tuple(t.shape)}")
    if t.dtype not in DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"{name}'s last dim (head_dim) must be contiguous (stride 1), got strides {t.stride()}; "
                         "call .contiguous() first")


def _cu_seqlens(name: str, cu, device) -> int:
    """The batch size ``cu`` describes, after checking its type, dtype, shape and device."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be an int32 torch.Tensor of shape (batch + 1,), got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"{name} must have shape (batch + 1,), got {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name} must be on q's device ({device}), got {cu.device}")
    return cu.numel() - 1


def _cu_seqlens_values(name: str, cu, total: int) -> None:
    """Starts at 0, never decreases, ends at ``total``: read only on the CPU (on a GPU it would synchronise)."""
    if cu.device.type != "cpu":
        return
    values = cu.tolist()
    if values[0] != 0 or any(b < a for a, b in zip(values, values[1:])) or values[-1] != total:
        raise ValueError(f"{name} must start at 0, never decrease and end at the packed length {total}, "
                         f"got {values if len(values) <= 12 else values[:6] + ['...'] + values[-6:]}")


def _window_side(name: str, x) -> int:
    if not _is_int(x):
        raise TypeError(f"{name} must be an int (-1 for unbounded), got {type(x).__name__} {x!r}")
    if x < -1:
        raise ValueError(f"{name} must be >= 0, or -1 for unbounded; got {x}")
    return int(x)


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, left, right, softcap,
                 alibi_slopes) -> VarlenProblem:
    """Validate one varlen call (see the module docstring for what is checked)."""
    _tensor("q", q, "(total_q, heads, head_dim)")
    _tensor("k", k, "(total_k, kv_heads, head_dim)")
    _tensor("v", v, "(total_k, kv_heads, head_dim)")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    device = q.device
    if not (device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {device}, {k.device}, {v.device}")
    want = "cuda" if WORLD == "gpu" else "cpu"
    if device.type != want:
        raise ValueError(f"the varlen Triton kernels in the {WORLD} world expect {want} tensors, got {device}")
    total_q, heads, head_dim = q.shape
    total_k, kv_heads, _ = k.shape
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[2] != head_dim:
        raise ValueError(f"q and k must have the same head dim, got {head_dim} and {k.shape[2]}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"the varlen kernels support head dims 1..{MAX_HEAD_DIM}, got {head_dim}")
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of key/value heads ({kv_heads})")
    batch = _cu_seqlens("cu_seqlens_q", cu_seqlens_q, device)
    if _cu_seqlens("cu_seqlens_k", cu_seqlens_k, device) != batch:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, "
                         f"got shapes {tuple(cu_seqlens_q.shape)} and {tuple(cu_seqlens_k.shape)}")
    _cu_seqlens_values("cu_seqlens_q", cu_seqlens_q, total_q)
    _cu_seqlens_values("cu_seqlens_k", cu_seqlens_k, total_k)
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not _is_int(m):
            raise TypeError(f"{name} must be an int, got {type(m).__name__} {m!r}")
        if m < 0:
            raise ValueError(f"{name} must be >= 0, got {m}")
    scale = _real("scale", scale)
    softcap = _real("softcap", softcap, nonnegative=True)
    slopes = check_alibi_slopes(alibi_slopes, batch, heads, device)
    return VarlenProblem(batch, heads, kv_heads, head_dim, total_q, total_k, int(max_seqlen_q), int(max_seqlen_k),
                         scale, _window_side("left", left), _window_side("right", right), softcap, slopes)


def check_backward(p: VarlenProblem, q, do, o, lse) -> None:
    """The backward's extra inputs: dO and O like q, lse float32 ``(H, total_q)``."""
    for name, t in (("do", do), ("o", o)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != tuple(q.shape) or t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name} must match q: shape {tuple(q.shape)}, {q.dtype} on {q.device}; "
                             f"got {tuple(t.shape)}, {t.dtype} on {t.device}")
    if not isinstance(lse, torch.Tensor):
        raise TypeError(f"lse must be a torch.Tensor, got {type(lse).__name__}")
    if tuple(lse.shape) != (p.heads, p.total_q) or lse.dtype != torch.float32 or lse.device != q.device:
        raise ValueError(f"lse must be float32 of shape ({p.heads}, {p.total_q}) on {q.device}, "
                         f"got {tuple(lse.shape)}, {lse.dtype} on {lse.device}")
