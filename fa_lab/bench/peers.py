"""Peers: attention we did not write, measured beside ours.

PyTorch's ``scaled_dot_product_attention`` with one backend forced through
``torch.nn.attention.sdpa_kernel`` (``sdpa-flash``, ``sdpa-cudnn``, ``sdpa-efficient``,
``sdpa-math``), PyTorch's own choice (``sdpa``), and the ``flash-attn`` package when it
is installed.  They are *not* in the registry — the registry holds the book's kernels,
and the tests judge every registered kernel — but they answer to the same
``unsupported(spec, world)`` and ``fn(q, k, v, spec)``, so the benchmark runner treats
them like any implementation.

Two traps, reported as ``unsupported``, never computed wrongly:

* SDPA's ``is_causal`` is *top-left* aligned; ours is bottom-right (DESIGN.md).  The two
  agree only when ``Nq == Nk``.
* SDPA has no sliding window (only an explicit mask tensor, which no fused backend takes).
"""
from __future__ import annotations

import importlib.util
import warnings
from dataclasses import dataclass

import torch

from fa_lab.core.registry import Implementation

_ALL = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# A forced backend that declines an input makes PyTorch warn, once per reason, before it raises;
# the benchmark turns the refusal into an 'unsupported: why' row, so the warnings are noise here.
for _pattern in (r".*kernel not used because.*", r".*has been runtime disabled.*", r".*Expected query, key and value.*",
                 r".*[Ff]lash attention.*", r".*[Mm]emory.[Ee]fficient.*", r".*cuDNN.*"):
    warnings.filterwarnings("ignore", message=_pattern, category=UserWarning)


@dataclass(frozen=True)
class Peer(Implementation):
    """An implementation from outside the book; ``kind`` says whose ('sdpa' or 'flash-attn')."""

    kind: str = "sdpa"

    def unsupported(self, spec, world):
        why = super().unsupported(spec, world)
        if why:
            return why
        if self.kind == "sdpa":
            if spec.mask == "window":
                return f"{self.name}: PyTorch SDPA has no sliding window (window={spec.window})"
            if spec.causal and spec.n_q != spec.n_k:
                return (f"{self.name}: SDPA's is_causal is top-left aligned, ours bottom-right; they differ "
                        f"when Nq != Nk (Nq={spec.n_q}, Nk={spec.n_k})")
        return None


def _sdpa_backends():
    from torch.nn.attention import SDPBackend

    return {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
            "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION, "sdpa-math": SDPBackend.MATH}


def _make_sdpa(name: str):
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    backend = _sdpa_backends().get(name)

    def call(q, k, v, spec):
        return F.scaled_dot_product_attention(q, k, v, is_causal=spec.causal, scale=spec.scale,
                                              enable_gqa=spec.group > 1)

    def sdpa(q, k, v, spec):
        if backend is None:
            return call(q, k, v, spec), None
        try:
            with sdpa_kernel(backend):
                return call(q, k, v, spec), None
        except RuntimeError as exc:
            if "no available kernel" not in str(exc).lower() and "no viable backend" not in str(exc).lower():
                raise
            # Ask again, this time keeping the warnings in which PyTorch says why the backend declined.
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    with sdpa_kernel(backend):
                        call(q, k, v, spec)
                except RuntimeError:
                    pass
            lines = [str(w.message).split(" (Triggered internally")[0].strip() for w in caught]
            # keep the reasons, not PyTorch's "X not used because:" / "X has been runtime disabled" lines
            reasons = "; ".join(dict.fromkeys(
                ln for ln in lines if ln and "not used because" not in ln and "runtime disabled" not in ln))
            raise ValueError(f"{name} declined this input: {reasons or exc}") from None

    sdpa.__name__ = name.replace("-", "_")
    return sdpa


def _flash_attn(q, k, v, spec):
    from flash_attn import flash_attn_func  # (B, N, H, D) layout; bottom-right causal and windows natively

    o = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=spec.scale,
                        causal=spec.causal, window_size=(spec.left, spec.right))
    return o.transpose(1, 2), None


def _lse_only(s):
    return 4 * s.batch * s.heads * s.n_q


def _scores(s):
    return 2 * 4 * s.batch * s.heads * s.n_q * s.n_k


_SDPA_INFO = {
    "sdpa": ("PyTorch SDPA, backend chosen by PyTorch", _ALL, ("cpu", "gpu"), _lse_only),
    "sdpa-flash": ("PyTorch SDPA forced to its FlashAttention-2 backend (on the CPU: PyTorch's CPU flash kernel)",
                   _ALL, ("cpu", "gpu"), _lse_only),
    "sdpa-cudnn": ("PyTorch SDPA forced to the cuDNN fused attention backend", _ALL, ("gpu",), _lse_only),
    "sdpa-efficient": ("PyTorch SDPA forced to the memory-efficient (xFormers) backend", _ALL, ("gpu",), _lse_only),
    "sdpa-math": ("PyTorch SDPA forced to the math backend: plain ops, materialises S and P", _ALL,
                  ("cpu", "gpu"), _scores),
}

PEERS: dict[str, Peer] = {}
for _name, (_desc, _dtypes, _worlds, _mem) in _SDPA_INFO.items():
    PEERS[_name] = Peer(name=_name, fn=_make_sdpa(_name), chapter=7, description=_desc, dtypes=_dtypes,
                        masks=("none", "causal"), worlds=_worlds, gqa=True, backward=True,
                        extra_memory=_mem, kind="sdpa", tags=("peer",))

#: the flash-attn package (Tri Dao's kernels), only where it is installed
HAVE_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None
if HAVE_FLASH_ATTN:
    PEERS["flash-attn"] = Peer(name="flash-attn", fn=_flash_attn, chapter=7,
                               description="the flash-attn package (FlashAttention-2, Tri Dao)",
                               dtypes=(torch.float16, torch.bfloat16), head_dims=(1, 256), worlds=("gpu",),
                               backward=True, extra_memory=_lse_only, kind="flash-attn", tags=("peer",))


def peer_names() -> list[str]:
    return list(PEERS)


def get_peer(name: str) -> Peer | None:
    return PEERS.get(name)
