"""fa_lab — the kernels and tooling behind the FlashAttention Lab book.

Import order matters: ``world`` sets the simulator/interpreter variables before
anything imports numba or triton.
"""
from fa_lab.core.world import DEVICE, ON_GPU, WORLD, banner, describe, pick  # noqa: I001  (must come first)
from fa_lab.api import attention, flash_attention
from fa_lab.core.flops import attention_flops
from fa_lab.core.masks import visible
from fa_lab.core.registry import get as get_implementation, implementations, register
from fa_lab.core.spec import AttentionSpec, make_spec

from importlib.metadata import PackageNotFoundError, version

try:  # one version number, pyproject.toml's
    __version__ = version("fa_lab")
except PackageNotFoundError:  # imported from a clone that was never installed
    __version__ = "0+unknown"

#: chapter 5's course-interface autograd Functions, imported on first use (they load Triton)
_LAZY = {"FlashAttentionPyTorch", "FlashAttentionTriton"}


def __getattr__(name):
    if name in _LAZY:
        implementations()   # load every registered module first: the registry keeps the book's order
        from fa_lab import autograd

        return getattr(autograd, name)
    raise AttributeError(f"module 'fa_lab' has no attribute {name!r}")


__all__ = [
    "DEVICE", "ON_GPU", "WORLD", "banner", "describe", "pick", "attention", "attention_flops",
    "visible", "get_implementation", "implementations", "register", "AttentionSpec", "make_spec",
    "FlashAttentionPyTorch", "FlashAttentionTriton", "flash_attention",
]
