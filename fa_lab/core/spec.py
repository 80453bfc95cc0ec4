"""Input checking, once, for every implementation: one ``AttentionSpec`` describes the call.

Bad input raises here with a message that says what was expected, so that no kernel
ever sees a shape it would silently mis-index.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np
import torch

from fa_lab.core.masks import effective_window, mask_kind

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: kernels compute the scale in float32: a larger one is infinite there
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


@dataclass(frozen=True)
class AttentionSpec:
    """Everything a kernel needs to know about one attention call."""

    batch: int
    heads: int        # query heads H
    kv_heads: int     # key/value heads Hkv; H % Hkv == 0 (grouped-query attention)
    n_q: int
    n_k: int
    head_dim: int     # D of q and k
    head_dim_v: int   # D of v (equal to head_dim everywhere in this book's kernels)
    scale: float
    causal: bool
    window: tuple[int, int]   # as the user gave it
    left: int                 # effective window, causal folded in; -1 = unbounded
    right: int
    dtype: torch.dtype
    device: torch.device
    #: score modifications (Part II): ``softcap > 0`` caps scores at ``softcap·tanh(s·scale/softcap)``;
    #: ``alibi_slopes`` (float32, ``(H,)`` or ``(B, H)``) adds ``-slope·|i + Nk - Nq - j|`` after the cap
    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None

    @property
    def group(self) -> int:
        """Query heads per K/V head."""
        return self.heads // self.kv_heads

    @property
    def mask(self) -> str:
        return mask_kind(self.causal, self.window)

    @property
    def score_mods(self) -> tuple[str, ...]:
        """The score modifications this call asks for: a subset of ``("softcap", "alibi")``."""
        return (("softcap",) if self.softcap > 0 else ()) + (("alibi",) if self.alibi_slopes is not None else ())


def _check_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape (batch, heads, seq, head_dim), got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(f"{name} must have 4 dims (batch, heads, seq, head_dim), got shape {tuple(t.shape)}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating tensor (float16, bfloat16, float32 or float64), got {t.dtype}")


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def _check_causal(causal) -> bool:
    # bool("no") is True: anything but a real bool would be read as some mask the caller did not mean
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal (is_causal) must be a bool, got {type(causal).__name__} {causal!r}")
    return bool(causal)


def _check_window(window) -> tuple[int, int]:
    if not isinstance(window, (tuple, list)) or len(window) != 2 or not all(_is_int(w) for w in window):
        raise TypeError(f"window must be a pair of ints (left, right), -1 for unbounded; got {window!r}")
    left, right = int(window[0]), int(window[1])
    if left < -1 or right < -1:
        raise ValueError(f"window sizes must be >= 0, or -1 for unbounded; got {window!r}")
    return left, right


def _check_scale(scale) -> float:
    if not isinstance(scale, numbers.Real) or isinstance(scale, (bool, np.bool_)):
        raise TypeError(f"scale must be a real number (or None for 1/sqrt(head_dim)), got {type(scale).__name__} "
                        f"{scale!r}")
    scale = float(scale)
    if not math.isfinite(scale) or abs(scale) > FLOAT32_MAX:
        raise ValueError(f"scale must be a finite number that float32 can hold (|scale| <= {FLOAT32_MAX:.3g}), "
                         f"got {scale}")
    return scale


def _check_softcap(softcap) -> float:
    if not isinstance(softcap, numbers.Real) or isinstance(softcap, (bool, np.bool_)):
        raise TypeError(f"softcap must be a real number (0 for none), got {type(softcap).__name__} {softcap!r}")
    softcap = float(softcap)
    if not (math.isfinite(softcap) and 0.0 <= softcap <= FLOAT32_MAX):
        raise ValueError(f"softcap must be a finite number >= 0 (0 turns it off), got {softcap}")
    return softcap


def check_alibi_slopes(alibi_slopes, batch: int, heads: int, device) -> torch.Tensor | None:
    """``alibi_slopes`` as a float32 ``(B, H)`` tensor (None stays None), or a clear error."""
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a torch.Tensor of shape (nheads,) or (batch, nheads), "
                        f"got {type(alibi_slopes).__name__}")
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must be float32, got {alibi_slopes.dtype}")
    if tuple(alibi_slopes.shape) not in ((heads,), (batch, heads)):
        raise ValueError(f"alibi_slopes must have shape ({heads},) or ({batch}, {heads}), "
                         f"got {tuple(alibi_slopes.shape)}")
    if alibi_slopes.device != device:
        raise ValueError(f"alibi_slopes must be on the device of q ({device}), got {alibi_slopes.device}")
    return alibi_slopes.expand(batch, heads)


def make_spec(q, k, v, *, causal: bool = False, window=(-1, -1), scale=None, softcap=0.0,
              alibi_slopes=None) -> AttentionSpec:
    """Validate ``q, k, v``, the mask and the score modifications, and describe the problem."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t)
    # shapes and devices read once: this runs on every call, and small calls are host-bound
    device = q.device
    if not (device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {device}, {k.device}, {v.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    B, H, Nq, D = q.shape
    Bk, Hkv, Nk, Dk = k.shape
    Bv, Hv, Nv, Dv = v.shape
    if Bk != B or Bv != B:
        raise ValueError(f"batch sizes differ: q {B}, k {Bk}, v {Bv}")
    if Hkv != Hv:
        raise ValueError(f"k and v must have the same number of heads, got {Hkv} and {Hv}")
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(f"query heads ({H}) must be a multiple of key/value heads ({Hkv})")
    if Nk != Nv:
        raise ValueError(f"k and v must have the same sequence length, got {Nk} and {Nv}")
    if Dk != D:
        raise ValueError(f"q and k must have the same head dim, got {D} and {Dk}")
    if Dv != D:
        raise ValueError(f"v must have the same head dim as q ({D}), got {Dv}")
    if min(B, H, Nq, Nk, D) == 0:
        raise ValueError(f"empty input: q {tuple(q.shape)}, k {tuple(k.shape)}")
    causal = _check_causal(causal)
    left, right = _check_window(window)
    scale = 1.0 / math.sqrt(D) if scale is None else _check_scale(scale)
    eff_left, eff_right = effective_window(causal, (left, right))
    softcap = _check_softcap(softcap) if softcap else 0.0
    alibi_slopes = check_alibi_slopes(alibi_slopes, B, H, device)
    return AttentionSpec(B, H, Hkv, Nq, Nk, D, Dv, scale, causal, (left, right),
                         eff_left, eff_right, q.dtype, device, softcap, alibi_slopes)
