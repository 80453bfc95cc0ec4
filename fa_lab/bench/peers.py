"""Peers: attention we did not write, measured beside ours.  The one wrapper of PyTorch SDPA.

PyTorch's ``scaled_dot_product_attention`` with one backend forced through
``torch.nn.attention.sdpa_kernel`` (``sdpa-flash``, ``sdpa-cudnn``, ``sdpa-efficient``,
``sdpa-math``), PyTorch's own choice (``sdpa``), and the ``flash-attn`` package when it
is installed.  They are *not* in the registry — the registry holds the book's kernels,
and the tests judge every registered kernel — but they answer to the same
``unsupported(spec, world)`` and ``fn(q, k, v, spec)``, so the benchmark runner treats
them like any implementation.  Older spellings (``sdpa_flash``, or ``flash`` as
``fa-lab correlate`` once named it) are accepted through ``canonical_name``.

Two traps, reported as ``unsupported``, never computed wrongly:

* SDPA's ``is_causal`` is *top-left* aligned; ours is bottom-right (DESIGN.md).  The two
  agree only when ``Nq == Nk``.
* SDPA has no sliding window (only an explicit mask tensor, which no fused backend takes).

``bind(..., mask_tensor=True)`` gets past both the way a user would, by handing SDPA a mask
(``causal_lower_right``, or a dense boolean window): the performance model measures that,
and models it as a kernel that cannot skip masked tiles.  ``raw_call`` is the bare
``fn(q, k, v, causal)`` the recording scripts time, without per-call checks.
"""
from __future__ import annotations

import contextlib
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

#: SDPA backends by peer name (``sdpa``: PyTorch chooses)
SDPA_BACKENDS = ("sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "sdpa-math")
#: older spellings of the same peers
ALIASES = {**{n.removeprefix("sdpa-"): n for n in SDPA_BACKENDS}, **{n.replace("-", "_"): n for n in SDPA_BACKENDS},
           "flash_attn": "flash-attn"}


def canonical_name(name):
    """``sdpa_flash`` or ``flash`` → ``sdpa-flash``; any other name is returned unchanged."""
    return ALIASES.get(name, name) if isinstance(name, str) else name


@dataclass(frozen=True)
class Peer(Implementation):
    """An implementation from outside the book; ``kind`` says whose ('sdpa' or 'flash-attn')."""

    kind: str = "sdpa"

    def unsupported(self, spec, world):
        why = super().unsupported(spec, world)
        if why:
            return why
        return _trap(self.name, spec) if self.kind == "sdpa" else None


def _trap(name: str, spec) -> str | None:
    """Why SDPA's own flags cannot say ``spec``'s mask (None when they can)."""
    if spec.mask == "window":
        return f"{name}: PyTorch SDPA has no sliding window (window={spec.window})"
    if spec.causal and spec.n_q != spec.n_k:
        return (f"{name}: SDPA's is_causal is top-left aligned, ours bottom-right; they differ "
                f"when Nq != Nk (Nq={spec.n_q}, Nk={spec.n_k})")
    return None


def _backend(name: str):
    from torch.nn.attention import SDPBackend

    return {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
            "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION, "sdpa-math": SDPBackend.MATH}.get(name)


def sdpa_kwargs(name: str, spec, *, mask_tensor: bool = False) -> dict:
    """Keyword arguments of ``F.scaled_dot_product_attention`` that give ``spec``'s mask.

    Without ``mask_tensor`` only what ``is_causal`` can say exactly; with it, a bottom-right
    causal bias or a dense boolean window where a backend takes one (ValueError otherwise).
    """
    kw = dict(scale=spec.scale, enable_gqa=spec.group > 1)
    why = _trap(name, spec)
    if why is None:
        return dict(kw, is_causal=spec.causal)
    if not mask_tensor:
        raise ValueError(why)
    if spec.mask == "causal":      # DESIGN's causal is bottom-right aligned; SDPA's is_causal is top-left
        from torch.nn.attention.bias import causal_lower_right

        return dict(kw, attn_mask=causal_lower_right(spec.n_q, spec.n_k))
    if name in ("sdpa-flash", "sdpa-cudnn"):
        raise ValueError(f"SDPA's {name.removeprefix('sdpa-')} backend takes no sliding window (only an "
                         "is_causal flag); use sdpa-efficient, sdpa-math, or a fa_lab kernel such as triton")
    from fa_lab.core.masks import visible

    return dict(kw, attn_mask=visible(spec.n_q, spec.n_k, spec.left, spec.right, device=spec.device))


def _declined(name, run, exc) -> ValueError:
    """The reasons PyTorch gives (as warnings) for a forced backend that declined, as one ValueError."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            run()
        except RuntimeError:
            pass
    lines = [str(w.message).split(" (Triggered internally")[0].strip() for w in caught]
    # keep the reasons, not PyTorch's "X not used because:" / "X has been runtime disabled" lines
    reasons = "; ".join(dict.fromkeys(
        ln for ln in lines if ln and "not used because" not in ln and "runtime disabled" not in ln))
    return ValueError(f"{name} declined this input: {reasons or exc}")


def bind(name: str, q, k, v, spec, *, mask_tensor: bool = False):
    """A zero-argument callable running peer ``name`` on ``q, k, v``: the arguments are worked out once."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    name = canonical_name(name)
    if name == "flash-attn":
        return lambda: _flash_attn(q, k, v, spec)[0]
    if name != "sdpa" and name not in SDPA_BACKENDS:
        raise ValueError(f"unknown peer {name!r}; known: {', '.join(PEERS)}")
    kw = sdpa_kwargs(name, spec, mask_tensor=mask_tensor)
    backend = _backend(name)

    def run():
        with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q, k, v, **kw)

    def checked():
        try:
            return run()
        except RuntimeError as exc:
            if "no available kernel" not in str(exc).lower() and "no viable backend" not in str(exc).lower():
                raise
            raise _declined(name, run, exc) from None
    return checked


def _make_sdpa(name: str):
    def sdpa(q, k, v, spec):
        return bind(name, q, k, v, spec)(), None

    sdpa.__name__ = name.replace("-", "_")
    return sdpa


def _flash_attn(q, k, v, spec):
    from flash_attn import flash_attn_func  # (B, N, H, D) layout; bottom-right causal and windows natively

    o = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=spec.scale,
                        causal=spec.causal, window_size=(spec.left, spec.right))
    return o.transpose(1, 2), None


def raw_call(name: str):
    """``fn(q, k, v, causal) -> o`` for a peer or a registered implementation, with no per-call checks
    beyond the kernel's own: what the recording scripts time (SDPA's causal is top-left: use Nq == Nk)."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    name = canonical_name(name)
    if name in PEERS:
        backend = _backend(name)
        if name == "flash-attn":
            from fa_lab.core.spec import make_spec

            return lambda q, k, v, causal: _flash_attn(q, k, v, make_spec(q, k, v, causal=causal))[0]

        def run(q, k, v, causal):
            with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return run
    from fa_lab.api import attention
    from fa_lab.core.registry import get

    get(name)   # a clear ValueError for an unknown name, now rather than at the first call
    return lambda q, k, v, causal: attention(q, k, v, impl=name, causal=causal)


def _lse_only(s):
    return 4 * s.batch * s.heads * s.n_q


def _scores(s):
    return 2 * 4 * s.batch * s.heads * s.n_q * s.n_k


_SDPA_INFO = {
    "sdpa": ("PyTorch SDPA, backend chosen by PyTorch", ("cpu", "gpu"), _lse_only),
    "sdpa-flash": ("PyTorch SDPA forced to its FlashAttention-2 backend (on the CPU: PyTorch's CPU flash kernel)",
                   ("cpu", "gpu"), _lse_only),
    "sdpa-cudnn": ("PyTorch SDPA forced to the cuDNN fused attention backend", ("gpu",), _lse_only),
    "sdpa-efficient": ("PyTorch SDPA forced to the memory-efficient (xFormers) backend", ("gpu",), _lse_only),
    "sdpa-math": ("PyTorch SDPA forced to the math backend: plain ops, materialises S and P", ("cpu", "gpu"), _scores),
}

PEERS: dict[str, Peer] = {}
for _name, (_desc, _worlds, _mem) in _SDPA_INFO.items():
    PEERS[_name] = Peer(name=_name, fn=_make_sdpa(_name), chapter=7, description=_desc, dtypes=_ALL,
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
    """The peer called ``name`` (or one of its older spellings), None if there is none."""
    return PEERS.get(canonical_name(name))
