"""What the Gluon passes share: the consumers' register budget and the TMA descriptors and copies (named as
in Triton 3.6 and in later releases)."""
from __future__ import annotations

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma

LOG2E = 1.4426950408889634
#: registers per thread of a consumer warpgroup; the loader warp lives on the minimum (24)
CONSUMER_REGS = 240
#: the TMA copies between global and shared memory (Triton 3.6 names them async_copy_*)
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global


def descriptor(t: torch.Tensor, rows: int):
    """A TMA descriptor over the rows of contiguous ``t`` (its last dim), copying ``rows`` of them at a time."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    width = t.shape[-1]
    element = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}[t.dtype]
    layout = gl.NVMMASharedLayout.get_default_for([rows, width], element)
    return TensorDescriptor.from_tensor(t.reshape(-1, width), [rows, width], layout)


__all__ = ["CONSUMER_REGS", "LOG2E", "descriptor", "tma_load", "tma_store"]
