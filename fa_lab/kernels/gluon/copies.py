"""What the Gluon passes share: the consumers' register budget, the layouts of one warpgroup's products, the
TMA descriptors and copies (named as in Triton 3.6 and in later releases), and the launch."""
from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma

from fa_lab.kernels.triton import fast_launch

LOG2E = 1.4426950408889634
#: registers per thread of a consumer warpgroup; the loader warp lives on the minimum (24)
CONSUMER_REGS = 240
#: registers per thread at launch: 12 warps launch (the loader's warpgroup counts whole) on at most
#: 65,536 / (12 · 32) = 170 a thread, 168 in steps of 8; setmaxnreg then moves them from the loader to the consumers
LAUNCH_REGS = 168
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


@functools.lru_cache(maxsize=None)
def shared_layout(rows: int, width: int, dtype: torch.dtype):
    """The swizzled shared-memory layout of a ``rows × width`` tile (built once: at small sizes a call's host time
    counts)."""
    element = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}[dtype]
    return gl.NVMMASharedLayout.get_default_for([rows, width], element)


def descriptor(t: torch.Tensor, rows: int):
    """A TMA descriptor over the rows of contiguous ``t`` (its last dim), copying ``rows`` of them at a time."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    width = t.shape[-1]
    return TensorDescriptor.from_tensor(t.view(-1, width), [rows, width], shared_layout(rows, width, t.dtype))


def launch(kernel, grid: tuple, args: tuple, meta: dict, key: tuple):
    """``kernel[grid](*args, **meta)`` with the passes' launch options (4 warps a partition, ``LAUNCH_REGS``); the
    repeats of ``key``, which must fix every integer argument and pointer alignment, through the compiled kernel
    (``fast_launch``, as chapter 4's forward: at small sizes the JIT's own path costs more host time than the GPU
    time of a pass).  ``maxnreg`` rides with the constexprs, which the JIT takes as a compile option; three stages
    is the JIT's default, which Gluon, without software pipelining, does not use."""
    return fast_launch.launch(kernel, (kernel, *key), (*grid, 1, 1)[:3], args, dict(meta, maxnreg=LAUNCH_REGS), 4, 3)


__all__ = ["CONSUMER_REGS", "LAUNCH_REGS", "LOG2E", "descriptor", "launch", "mma_layout", "operand_layout",
           "shared_layout", "tma_load", "tma_store"]
