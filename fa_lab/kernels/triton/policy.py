"""What the forward does differently per GPU architecture (and why): the measured special cases.

Everything that depends on the device's name or compute capability is decided here, so that
the launcher and the tuner ask one place: where tensor descriptors are built, when a
warp-specialized configuration can run, and which extra configurations the tuner tries.
"""
from __future__ import annotations

import functools

import torch

from fa_lab.kernels.triton.configs import head_dim_pad

#: Where the tensor descriptors are built.  On the host (one set, passed as kernel parameters,
#: shared by all programs) the copy engine's descriptor cache always hits, which pays on long
#: loops (+20% measured at one pipeline stage); but encoding them costs ~40 µs of Python per
#: launch.  Built in the kernel (per head) costs no host time: better for small problems.
HOST_DESC_MIN_FLOPS = 2 ** 33


def device_index(spec) -> int:
    """The CUDA device a problem runs on."""
    return spec.device.index if spec.device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def device_facts(index: int) -> tuple[str, tuple[int, int]]:
    """(device name, compute capability (major, minor)) of one CUDA device, asked once."""
    return torch.cuda.get_device_name(index), tuple(torch.cuda.get_device_capability(index))


def host_descriptors_pay(spec) -> bool:
    """Whether a GPU problem is long enough for host-built descriptors (``HOST_DESC_MIN_FLOPS``)."""
    return 4 * spec.batch * spec.heads * spec.n_q * spec.n_k * spec.head_dim >= HOST_DESC_MIN_FLOPS


def ws_fits_problem(spec, work: torch.dtype, major: int) -> bool:
    """Whether a warp-specialized configuration can run this problem: lse goes out through a
    tensor descriptor (n_q % 4 == 0), and on Hopper Triton 3.6 specializes only a single unmasked
    loop over whole key tiles (at D_PAD = 128 in 16 bits: the one case measured correct)."""
    if spec.n_q % 4:
        return False
    if major == 9:
        return (work.itemsize == 2 and head_dim_pad(spec.head_dim) == 128 and spec.mask == "none"
                and spec.n_k % 128 == 0)
    return True


def tuner_extras(spec, work: torch.dtype, major: int) -> tuple[list[dict], tuple[dict, ...]]:
    """For the final kernel's search: ``(extra candidates, refinements)``.

    A refinement is tried on top of the tuner's three fastest candidates.
    """
    extra, refine = [], []
    if major == 9 and ws_fits_problem(spec, work, major):
        # Hopper, one unmasked key loop: Triton's warp specialization (a producer warpgroup
        # issuing the copies, two consumer warpgroups splitting a 128-row tile,
        # FlashAttention-3's layout) is correct in this case and can pay (at (1, 16, 16384, 128)
        # +2% fp16 and +6% bf16 over the best 64-row tiles in the recorded tuning); with 64-key
        # tiles or deeper pipelines it returned wrong rows, so only this configuration is tried.
        extra.append(dict(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=2, ws=True))
    if spec.mask == "causal":
        refine.append({"paired": True})
    if work.itemsize == 2:  # exponentials partly on the FMA units (P is 16-bit anyway)
        refine.append({"emu": 1})
    if major >= 10:
        # Triton's automatic warp specialization pays on Blackwell; on Hopper (Triton 3.6) it
        # leaves this kernel unchanged, so it is not tried there.
        refine.append({"ws": True})
    return extra, tuple(refine)
