"""What the Gluon passes share: the consumers' register budget, the layouts of one warpgroup's products, and the
TMA descriptors and copies (named as in Triton 3.6 and in later releases)."""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma

LOG2E = 1.4426950408889634
#: registers per thread of a consumer warpgroup; the loader warp lives on the minimum (24)
CONSUMER_REGS = 240
#: the TMA copies between global and shared memory (Triton 3.6 names them async_copy_*)
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global


@gluon.constexpr_function
def mma_layout(n):
    """The layout one warpgroup's ``wgmma`` leaves an accumulator of ``n`` columns in (16 rows per warp a step)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.constexpr_function
def operand_layout(parent):
    """The layout a 16-bit register operand (P, dS) needs for a ``wgmma`` that accumulates in ``parent``."""
    return gl.DotOperandLayout(operand_index=0, parent=parent, k_width=2)


def descriptor(t: torch.Tensor, rows: int):
    """A TMA descriptor over the rows of contiguous ``t`` (its last dim), copying ``rows`` of them at a time."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    width = t.shape[-1]
    element = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}[t.dtype]
    layout = gl.NVMMASharedLayout.get_default_for([rows, width], element)
    return TensorDescriptor.from_tensor(t.reshape(-1, width), [rows, width], layout)


__all__ = ["CONSUMER_REGS", "LOG2E", "descriptor", "mma_layout", "operand_layout", "tma_load", "tma_store"]
