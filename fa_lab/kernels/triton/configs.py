"""Launch configurations of the forward kernel: the chapter's variants, the search space, the defaults.

A launch configuration is a dict: ``BLOCK_M``, ``BLOCK_N``, ``num_warps``, ``num_stages`` and
optionally ``ws`` (warp specialization), ``paired`` (causal query blocks i and last - i share a
program), ``emu`` (half of the exponentials on the FMA units) and ``edge`` (the width of the masked
edge tiles, default ``min(BLOCK_N, BLOCK_M)``).  Tuned winners are keyed by ``config_key``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from fa_lab.core.world import ON_GPU


@dataclass(frozen=True)
class Variant:
    """Which of the chapter's ideas a launch uses (the final kernel uses all of them)."""

    name: str = "triton"
    exp2: bool = True          # scale folded into exp2
    skip_masked: bool = True   # loop bounds per query block, masks only on boundary blocks
    space: str = "pipelined"   # 'fixed' | 'tuned' (tiles, warps) | 'pipelined' (+ num_stages)


FINAL = Variant()

#: what a launch configuration holds (see the module docstring)
CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "ws", "paired", "emu", "edge")
#: the one configuration of the untuned steps (no software pipelining: one stage)
FIXED_CONFIG = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=1, ws=False)
#: the interpreter runs one numpy op per tile operation: small tiles keep it quick
CPU_CONFIG = dict(BLOCK_M=16, BLOCK_N=16, num_warps=1, num_stages=1, ws=False)


def head_dim_pad(head_dim: int) -> int:
    """The head dim padded to a power of two (at least 16, the smallest Tensor Core tile)."""
    return max(16, triton.next_power_of_2(head_dim))


def smem_limit() -> int:
    """Shared memory a program may use on this GPU (228 KiB, an H100's, in the CPU world)."""
    if not ON_GPU:
        return 228 * 1024
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return int(getattr(props, "shared_memory_per_block_optin", 0) or 99 * 1024)


def candidate_configs(space: str, d_pad: int, itemsize: int, n_q: int | None = None) -> list[dict]:
    """The pruned search space of the tuner (tutorial-style rules, plus a shared-memory budget)."""
    if space == "fixed":
        return [dict(FIXED_CONFIG)]
    # 'pipelined' keeps num_stages=1 in the race: one stage frees shared memory for a second
    # resident program per SM, which overlaps the two programs' loads and math instead
    stages = (1,) if space == "tuned" else (1, 2, 3, 4)
    block_ms = (64, 128, 256) if d_pad <= 64 else (64, 128)
    smem = smem_limit()
    out = []
    for bm in block_ms:
        for bn in (32, 64, 128):
            for w in (4, 8):
                for s in stages:
                    if w == 8 and (bm < 128 or (bm * bn < 128 * 128 and d_pad > 64)):
                        continue                          # too little work per warp(group)
                    if bm * d_pad // (32 * w) > 128:      # acc alone would spill registers
                        continue
                    if (bm * d_pad + max(s, 1) * 2 * bn * d_pad) * itemsize > smem - 8 * 1024:
                        continue
                    if n_q is not None and bm > 64 and bm >= 2 * triton.next_power_of_2(n_q):
                        continue                          # mostly padding rows
                    out.append(dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s, ws=False))
    return out


def default_config(space: str, d_pad: int, n_q: int, mask: str = "none") -> dict:
    """What runs when no tuned key is near (or beside them in a quick choice), and for exact fp32.

    The H100 winners of the recorded tuning (fa_lab/data/gpu_ch4.json), generalised by head dim.
    """
    if space == "fixed":
        return dict(FIXED_CONFIG)
    if d_pad >= 256:
        cfg = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2, ws=False)
    elif d_pad == 128:
        cfg = dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=1, ws=False)
    else:
        cfg = dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=2, ws=False, paired=mask == "causal")
    if space == "tuned":
        cfg.update(num_stages=1, paired=False)
    return cfg


def length_bucket(n: int) -> int:
    """Sequence lengths share a tuned config within a power of two (64 .. 65536)."""
    return min(max(1 << (n - 1).bit_length(), 64), 65536)


def config_key(spec, dtype: torch.dtype, space: str) -> str:
    """(dtype, head dim, sequence-length buckets, mask, variant space): one tuned config each."""
    name = str(dtype).replace("torch.", "")
    return (f"{name}|d{head_dim_pad(spec.head_dim)}|q{length_bucket(spec.n_q)}|k{length_bucket(spec.n_k)}"
            f"|{spec.mask}|{space}")
