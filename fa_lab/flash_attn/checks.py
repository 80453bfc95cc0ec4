"""Input checks for the flash-attn interface, in flash-attn's layout and words.

flash-attn lays tensors out as ``(batch, seqlen, nheads, headdim)`` (or ``(total, nheads, headdim)``
for variable-length batches); the rest of fa_lab speaks ``(batch, heads, seq, head_dim)``.  Shapes are
checked here, in the caller's layout, so that an error names the argument the caller wrote.  The mask
and the score arguments (scale, window, causal, softcap, ALiBi) are checked by ``make_spec``, the
package's one check of them, on views in its layout.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np
import torch

from fa_lab.core.spec import make_spec
from fa_lab.core.world import DEVICE

#: what the kernels behind the interface compute in
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class ScoreArgs:
    """The arguments every kernel call needs besides the tensors, checked."""

    scale: float
    causal: bool
    window: tuple[int, int]
    left: int                           # the window with causal folded in; -1 is unbounded
    right: int
    softcap: float                      # 0.0: off
    alibi_slopes: torch.Tensor | None   # float32 (batch, nheads), contiguous


def is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def check_tensor(name: str, t, layout: str) -> None:
    """A floating tensor with one dim per name in ``layout`` (``"batch, seqlen, nheads, headdim"``)."""
    dims = len(layout.split(","))
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape ({layout}), got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dims ({layout}), got shape {tuple(t.shape)}")
    if t.dtype not in DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    if t.device.type != DEVICE.type:
        raise ValueError(f"{name} must be on {DEVICE.type} (fa_lab.DEVICE in this world), got {t.device}")


def check_packed(name: str, t, axis: int, count: int, layout: str) -> None:
    """A packed tensor: ``count`` tensors stacked at ``axis`` (qkv: 3, kv: 2)."""
    check_tensor(name, t, layout)
    if t.shape[axis] != count:
        raise ValueError(f"{name} must have shape ({layout}) with {count} at dim {axis}, got {tuple(t.shape)}")


def check_same(q, k, v, names=("q", "k", "v")) -> None:
    """One dtype and device; heads divide; one head dim (q and k, and v: fa_lab's kernels need all three)."""
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{', '.join(names)} must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{', '.join(names)} must be on one device, got {q.device}, {k.device}, {v.device}")
    h, hk, hv = q.shape[-2], k.shape[-2], v.shape[-2]
    if hk != hv:
        raise ValueError(f"{names[1]} and {names[2]} must have the same number of heads, got {hk} and {hv}")
    if hk == 0 or h % hk != 0:
        raise ValueError(f"the number of heads in {names[0]} ({h}) must be a multiple of the number in "
                         f"{names[1]} and {names[2]} ({hk})")
    d, dk, dv = q.shape[-1], k.shape[-1], v.shape[-1]
    if not d == dk == dv:
        raise ValueError(f"{', '.join(names)} must have one head dim, got {d}, {dk}, {dv}")
    if not 1 <= d <= 256:
        raise ValueError(f"head dim must be 1..256, got {d}")


def check_dropout(dropout_p) -> None:
    if not isinstance(dropout_p, numbers.Real) or isinstance(dropout_p, (bool, np.bool_)):
        raise TypeError(f"dropout_p must be a float, got {type(dropout_p).__name__} {dropout_p!r}")
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p must be in [0, 1], got {dropout_p}")
    if dropout_p > 0.0:
        raise NotImplementedError(f"dropout_p={dropout_p}: dropout is not implemented in fa_lab's flash-attn "
                                  "interface; pass dropout_p=0.0")


def check_flag(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def _integral(x) -> bool:
    """An integer scalar or array dtype, torch or numpy (bool is not one)."""
    if isinstance(x, torch.Tensor):
        return not (x.is_floating_point() or x.is_complex() or x.dtype == torch.bool)
    return isinstance(x, (np.ndarray, np.integer)) and np.issubdtype(x.dtype, np.integer)


def window_pair(window_size):
    """``window_size`` as a pair of Python ints: flash-attn also takes a 2-element integer tensor or array."""
    if isinstance(window_size, (torch.Tensor, np.ndarray)):
        if tuple(window_size.shape) != (2,) or not _integral(window_size):
            raise TypeError(f"window_size must be a pair of ints (left, right), -1 for unbounded; got {window_size!r}")
        return tuple(int(w) for w in window_size.tolist())
    if isinstance(window_size, (tuple, list)) and len(window_size) == 2:
        # 0-dim integer tensors and numpy ints read as ints; anything else is make_spec's to refuse
        return tuple(int(w) if _integral(w) and np.ndim(w) == 0 else w for w in window_size)
    return window_size


def score_args(q_bhnd: torch.Tensor, kv_heads: int, *, softmax_scale, causal, window_size, softcap,
               alibi_slopes, batch: int | None = None) -> ScoreArgs:
    """Check the mask and score arguments (``make_spec`` on q's own shape ``(B, H, N, D)``) and the slopes.

    ``batch`` is the number of sequences where q's first dim is not it (variable-length batches).
    softcap <= 0 turns the cap off, as in flash-attn.
    """
    if not isinstance(softcap, numbers.Real) or isinstance(softcap, (bool, np.bool_)):
        raise TypeError(f"softcap must be a float (0.0: off), got {type(softcap).__name__} {softcap!r}")
    B, H = (q_bhnd.shape[0] if batch is None else batch), q_bhnd.shape[1]
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, torch.Tensor):
            raise TypeError(f"alibi_slopes must be a float32 tensor of shape ({H},) or ({B}, {H}), "
                            f"got {type(alibi_slopes).__name__}")
        if alibi_slopes.dtype != torch.float32:
            raise TypeError(f"alibi_slopes must be float32, got {alibi_slopes.dtype}")
        if tuple(alibi_slopes.shape) not in ((H,), (B, H)):
            raise ValueError(f"alibi_slopes must have shape ({H},) or ({B}, {H}), got {tuple(alibi_slopes.shape)}")
        if alibi_slopes.device != q_bhnd.device:
            raise ValueError(f"alibi_slopes must be on the device of q ({q_bhnd.device}), got {alibi_slopes.device}")
        alibi_slopes = alibi_slopes.expand(B, H).contiguous()
    kv = q_bhnd[:, :kv_heads]   # only shapes matter here: q's own view stands in for k and v
    spec = make_spec(q_bhnd, kv, kv, causal=causal, window=window_pair(window_size), scale=softmax_scale,
                     softcap=float(softcap) if softcap > 0 else 0.0)
    return ScoreArgs(spec.scale, spec.causal, spec.window, spec.left, spec.right, spec.softcap, alibi_slopes)


def check_cu_seqlens(name: str, cu, device: torch.device) -> int:
    """``cu_seqlens``: an int32 ``(batch + 1,)`` tensor on q's device; returns batch.

    Its values are the kernel's to check: it reads them where that is free (on the CPU); on a GPU
    reading them would wait for the device, and the caller vouches for them, as with flash-attn.
    """
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be an int32 tensor of shape (batch + 1,), got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must have shape (batch + 1,) with batch >= 1, got {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name} must be on the device of q ({device}), got {cu.device}")
    return cu.numel() - 1


def check_max_seqlen(name: str, max_seqlen) -> int:
    if not is_int(max_seqlen):
        raise TypeError(f"{name} must be an int, got {type(max_seqlen).__name__} {max_seqlen!r}")
    if max_seqlen < 0:
        raise ValueError(f"{name} must be >= 0, got {max_seqlen}")
    return int(max_seqlen)
