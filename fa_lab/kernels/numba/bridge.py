"""Hand torch tensors to Numba CUDA kernels without copies, in both worlds.

On a GPU, ``cuda.as_cuda_array`` wraps the tensor's device memory (the CUDA array
interface) and kernels are launched on torch's current stream, so they are ordered
with the surrounding torch work.  In the simulator, kernels take NumPy arrays; a CPU
tensor's ``.numpy()`` shares its memory, so what the kernel writes lands in the tensor.
"""
from __future__ import annotations

import torch
from numba import cuda

from fa_lab.core.world import ON_GPU


def as_array(t: torch.Tensor):
    """A Numba view of a contiguous tensor (the caller keeps ``t`` alive)."""
    if not t.is_contiguous():
        raise ValueError("as_array needs a contiguous tensor (call .contiguous() first)")
    return cuda.as_cuda_array(t.detach()) if ON_GPU else t.detach().numpy()


def stream():
    """The stream to launch on: torch's current stream on a GPU, the default in the simulator."""
    return cuda.external_stream(torch.cuda.current_stream().cuda_stream) if ON_GPU else 0


def require_float32(spec, name: str) -> None:
    # The registry already refuses other dtypes; this guards direct calls of the kernel wrappers.
    if spec.dtype != torch.float32:
        raise ValueError(f"{name} is an fp32 CUDA-core kernel; got {spec.dtype} (convert with .float())")
