"""Hand torch tensors to Numba CUDA kernels without copies, in both worlds.

On a GPU, ``cuda.as_cuda_array`` wraps the tensor's device memory (the CUDA array
interface) and kernels are launched on torch's current stream, so they are ordered
with the surrounding torch work.  In the simulator, kernels take NumPy arrays; a CPU
tensor's ``.numpy()`` shares its memory, so what the kernel writes lands in the tensor.
"""
from __future__ import annotations

import contextlib
import sys

import numpy as np
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


@contextlib.contextmanager
def simulator_speed():
    """In the simulator, run the Python threads that play CUDA threads quickly, and faithfully.

    Every ``syncthreads`` waits for all threads of the block; with Python's default 5 ms
    switch interval each barrier costs milliseconds.  0.1 ms makes the simulated kernels
    about 8x faster.  On a GPU this does nothing.
    """
    if ON_GPU:
        yield
        return
    from numba.cuda.simulator import kernelapi

    old = sys.getswitchinterval()
    simulator_array = getattr(getattr(kernelapi, "FakeCUDAShared", None), "array", None)

    def shared_array(shared, shape, dtype, alignment=None):
        # The simulator keys a launch's shared arrays on the calling line and makes a missing one by look-up,
        # np.empty, store: a thread switch in between gives two threads of a block two different "shared"
        # arrays, each filled only in its part (numba_tiled: about 1 wrong answer in 1000 launches).  Here
        # look-up and store are one dict.setdefault, atomic under the GIL.  (Kernels pass Numba dtypes.)
        if shape == 0 or alignment is not None:      # dynamic shared memory (one buffer), or refused
            return simulator_array(shared, shape, dtype, alignment)
        line = sys._getframe(1).f_code.co_filename, sys._getframe(1).f_lineno
        return shared._allocations.setdefault(line, np.empty(shape, kernelapi.numpy_support.as_dtype(dtype)))

    # a simulator laid out differently keeps its own (racy) allocation
    patch = simulator_array is not None and hasattr(kernelapi, "numpy_support")
    sys.setswitchinterval(1e-4)
    if patch:
        kernelapi.FakeCUDAShared.array = shared_array
    try:
        yield
    finally:
        sys.setswitchinterval(old)
        if patch:
            kernelapi.FakeCUDAShared.array = simulator_array


_allowed_shared: dict = {}


def shared_bytes_optin() -> int:
    """The most shared memory one block of this GPU can opt in to (227 KiB on an H100, 64 KiB on a T4)."""
    return cuda.get_current_device().MAX_SHARED_MEMORY_PER_BLOCK_OPTIN


def allow_shared_bytes(kernel, args, nbytes: int) -> None:
    """Let ``kernel`` (a ``cuda.jit`` dispatcher, to be launched with ``args``) take ``nbytes`` of dynamic
    shared memory, beside its static shared arrays.

    A block gets 48 KiB of shared memory unless its kernel opts in to more, once, through the function
    attribute ``MAX_DYNAMIC_SHARED_SIZE_BYTES`` (``cudaFuncSetAttribute`` in CUDA C++); a launch asking for
    more without it fails.  Numba has no call for that attribute, so this sets it on the compiled function
    through Numba's driver.  A ``ValueError`` if this GPU cannot give a block that much.  The simulator
    has no limit: there this does nothing.
    """
    if not ON_GPU:
        return
    compiled = kernel.compile(tuple(kernel.typeof_pyval(a) for a in args))
    function = compiled._codelibrary.get_cufunc()     # the CUDA function of this compilation (Numba internal)
    key = (id(function), function.device.id)
    if _allowed_shared.get(key, 0) >= nbytes:
        return
    total, most = compiled.shared_mem_per_block + nbytes, function.device.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
    if total > most:
        raise ValueError(f"this kernel needs {total} bytes of shared memory per block; "
                         f"{torch.cuda.get_device_name()} allows at most {most}")
    from numba.cuda.cudadrv.driver import binding, driver

    attribute = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    driver.cuKernelSetAttribute(attribute, nbytes, function.handle, function.device.id)
    _allowed_shared[key] = nbytes
