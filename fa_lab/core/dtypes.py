"""One vocabulary for dtypes: parse what a user writes, name what a tensor holds.

Short names (``fp16``, ``bf16``, ``fp32``, ``fp64``) are what the CLI, the recorded data and
the performance model use; ``torch.float16`` and ``"float16"`` are accepted everywhere too.
"""
from __future__ import annotations

import torch

#: short name -> torch dtype, in the order the book lists them
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}
_ALIASES = {"float16": "fp16", "half": "fp16", "bfloat16": "bf16", "float32": "fp32", "float": "fp32",
            "float64": "fp64", "double": "fp64"}


def short_name(dtype) -> str:
    """``torch.bfloat16``, ``"bfloat16"`` or ``"bf16"`` -> ``"bf16"``; anything else is a ValueError."""
    if isinstance(dtype, torch.dtype):
        for name, d in DTYPES.items():
            if d == dtype:
                return name
        raise ValueError(f"unsupported dtype {dtype}; expected one of {list(DTYPES)}")
    if not isinstance(dtype, str):
        raise TypeError(f"dtype must be a torch.dtype or a name such as 'bf16', got {type(dtype).__name__}")
    name = dtype.strip().lower().removeprefix("torch.")
    name = _ALIASES.get(name, name)
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {list(DTYPES)} "
                         f"(or {', '.join(sorted(_ALIASES))})")
    return name


def as_dtype(dtype) -> torch.dtype:
    """The torch dtype for ``dtype`` (a torch dtype or any accepted name)."""
    return DTYPES[short_name(dtype)]


def long_name(dtype) -> str:
    """``"bf16"`` or ``torch.bfloat16`` -> ``"bfloat16"`` (torch's own name, as tables show it)."""
    return str(as_dtype(dtype)).removeprefix("torch.")
