"""Launch configurations of the varlen kernels, all in one place: tiles, warps, pipeline stages.

A configuration is ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``.  On a GPU it depends on the
padded head dim and the element size: a bigger head dim leaves room (registers for the fp32
accumulators, shared memory for the pipelined K/V tiles) for smaller tiles only, and fp32 runs
its exact (IEEE) products on the CUDA cores, where small tiles are the fast ones.  In the CPU
world the interpreter runs every tile operation as NumPy: tiles of 16 keep it quick.

The backward entries are chapter 5's measured winners for the same kernel shapes
(``fa_lab.kernels.triton.bwd.GPU_CONFIGS``); the dK/dV kernel's ``BLOCK_N`` is its stationary key
block, ``BLOCK_M`` the query tile it streams.  The 16-bit forward entries for D = 64 and 128 and
the backward's dQ tile for D = 64 are the fastest of a small sweep on an H100 (Triton 3.6, 4
sequences of 4096, 16 heads, one timing each); D = 128's backward keeps chapter 5's pair, which
beat the sweep's dK/dV winner under a causal mask, and D = 256's takes chapter 5's H200 winners
(``docs/decisions/d256-backward-tiles.md``).
"""
from __future__ import annotations

import torch
import triton

from fa_lab.core.world import ON_GPU
from fa_lab.kernels.triton import bwd

#: the interpreter's configuration, every kernel
CPU_CONFIG = (16, 16, 1, 1)

#: forward, (BLOCK_D, itemsize) -> (BLOCK_M, BLOCK_N, num_warps, num_stages)
FORWARD = {
    (16, 2): (128, 64, 4, 3),
    (32, 2): (128, 64, 4, 3),
    (64, 2): (128, 64, 8, 3),
    (128, 2): (128, 64, 8, 3),
    (256, 2): (64, 32, 4, 2),
    (16, 4): (64, 32, 4, 2),
    (32, 4): (64, 32, 4, 2),
    (64, 4): (64, 32, 4, 2),
    (128, 4): (32, 32, 4, 2),
    (256, 4): (32, 16, 4, 1),
}

#: backward, (BLOCK_D, itemsize) -> (dK/dV config, dQ config): chapter 5's tiles, whose kernels have the
#: same shapes, except the dQ tile at D = 64, where the smaller tile won the sweep
BACKWARD = {**bwd.GPU_CONFIGS, (64, 2): (bwd.GPU_CONFIGS[(64, 2)][0], (64, 64, 4, 3))}


def block_d(head_dim: int) -> int:
    """The head dim padded to a power of two, at least 16 (the smallest Tensor Core tile)."""
    return max(16, triton.next_power_of_2(head_dim))


def _key(head_dim: int, dtype: torch.dtype) -> tuple[int, int]:
    return block_d(head_dim), 4 if dtype == torch.float32 else 2


def forward_config(head_dim: int, dtype: torch.dtype, max_seqlen_q: int) -> tuple[int, int, int, int]:
    """The forward's ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` for the dtype the kernel computes in."""
    if not ON_GPU:
        return CPU_CONFIG
    bm, bn, warps, stages = FORWARD[_key(head_dim, dtype)]
    if bm > 64 and max_seqlen_q <= 64:   # short sequences: a 128-row tile would be mostly padding
        bm = 64
    return bm, bn, warps, stages


def backward_configs(head_dim: int, dtype: torch.dtype) -> tuple[tuple[int, int, int, int], tuple[int, int, int, int]]:
    """``(dK/dV, dQ)`` configurations, each ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``."""
    if not ON_GPU:
        return CPU_CONFIG, CPU_CONFIG
    return BACKWARD[_key(head_dim, dtype)]
