"""Chapter 3 exercise on a kernel's resources: how many of its blocks one multiprocessor holds.

6. ``ch3_blocks_per_sm``  from a block's threads, registers per thread and shared memory (static and
                          dynamic): whether the launch must opt in to more than 48 KiB of shared
                          memory, and how many such blocks fit on one SM of an H100.

The rules are chapter 0's (an SM holds 2048 threads, 32 blocks, 65,536 registers and 228 KiB of
shared memory, with 1 KiB reserved per block) plus chapter 3's: a block gets 48 KiB of shared
memory unless its kernel opts in, and at most 227 KiB with the opt-in.
"""
from __future__ import annotations

import numbers

import numpy as np
import torch

import fa_lab.exercises.ch3_kernels  # noqa: F401  (the chapter's kernels register first: names() keeps the book's order)
from fa_lab.exercises.registry import Case, Exercise, Mistake, register_exercise
# the kernel's own limits: what a block gets without opting in, and the most it can opt in to
from fa_lab.kernels.numba.tile_config import GPU_CONFIGS, SMALL_SHARED_CONFIGS
from fa_lab.kernels.numba.tile_config import SHARED_LIMIT as MAX_SHARED
from fa_lab.kernels.numba.tile_config import STATIC_SHARED_LIMIT as DEFAULT_SHARED
from fa_lab.perf.devices import get_device

KIB = 1024
SM_THREADS, SM_BLOCKS, SM_REGISTERS = 2048, 32, 65536
SM_SHARED = get_device("H100").smem_per_sm   # 228 KiB
RESERVED_PER_BLOCK = 1 * KIB          # shared memory CUDA keeps for itself in every block


# --------------------------------------------------------------------------- solution

def blocks_per_sm(threads, registers, static_bytes, dynamic_bytes):
    """``(blocks, opt_in)``: blocks of this kernel one H100 SM holds, and whether its launch must opt in.

    ``threads`` per block, ``registers`` per thread, shared memory per block in bytes: ``static_bytes``
    (sized when compiled) and ``dynamic_bytes`` (sized at launch).  A block that needs more shared
    memory than any block may have cannot launch: 0 blocks.
    """
    shared = static_bytes + dynamic_bytes
    opt_in = shared > DEFAULT_SHARED
    if shared > MAX_SHARED:
        return 0, opt_in
    return min(_limits(threads, registers, shared).values()), opt_in


def _limits(threads, registers, shared):
    """How many blocks each of the SM's resources allows."""
    warps = -(-threads // 32)                      # registers and threads are handed out by whole warps
    return dict(threads=SM_THREADS // (32 * warps), blocks=SM_BLOCKS,
                registers=SM_REGISTERS // (registers * 32 * warps),
                shared=SM_SHARED // (shared + RESERVED_PER_BLOCK))


# --------------------------------------------------------------------------- cases

def _shipped(cfg, all_static=False):
    """threads, registers (255: no cap), static and dynamic bytes of a numba_tiled shape."""
    dynamic = 0 if all_static else cfg.dynamic_bytes()
    return cfg.threads, cfg.max_registers or 255, cfg.shared_bytes() - dynamic, dynamic


def _cases(seed):
    g = torch.Generator().manual_seed(seed)
    specs = [  # threads, registers, static, dynamic, note
        (*_shipped(GPU_CONFIGS[64]), "numba_tiled at D = 64 on an H100: 64-key tiles, K/V dynamic"),
        (*_shipped(SMALL_SHARED_CONFIGS[64], all_static=True), "the same kernel with 32-key tiles, all static"),
        (*_shipped(GPU_CONFIGS[128]), "numba_tiled at D = 128: 64 threads of 255 registers, 47.5 KiB"),
        (128, 64, 40 * KIB, 17 * KIB, "57 KiB: the 1 KiB each block keeps decides the count"),
        (256, 32, 48 * KIB, 0, "exactly 48 KiB: no opt-in needed"),
        (256, 32, 8 * KIB, 40 * KIB + 4, "4 bytes over 48 KiB, most of it dynamic"),
        (256, 128, 16 * KIB, 0, "256 threads of 128 registers: the registers decide"),
        (1024, 32, 0, 0, "1024-thread blocks"),
        (200, 64, 0, 0, "200 threads: 7 warps, the last one partly idle"),
        (32, 16, 0, 0, "one warp, nothing shared: the block count itself is the limit"),
        (128, 64, 40 * KIB, 200 * KIB, "240 KiB: more than any block may have"),
    ]
    cases = [Case(f"threads={t} registers={r} static={s} dynamic={d} — {note}", (t, r, s, d))
             for t, r, s, d, note in specs]
    t = 32 * int(torch.randint(1, 9, (1,), generator=g))
    r = 8 * int(torch.randint(4, 32, (1,), generator=g))
    s, d = (KIB * int(x) for x in torch.randint(0, 60, (2,), generator=g))
    cases.append(Case(f"random: threads={t} registers={r} static={s} dynamic={d}", (t, r, s, d)))
    return cases


def _compare(got, expected, case):
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        forgot = " (None: did you forget the `return`?)" if got is None else ""
        raise AssertionError(f"expected a pair (blocks, opt_in), got {type(got).__name__}{forgot}")
    blocks, opt_in = got
    # NumPy's integers and booleans are as good as Python's; floats (a count with a fraction) are not
    if isinstance(blocks, (bool, np.bool_)) or not isinstance(blocks, numbers.Integral) \
            or not isinstance(opt_in, (bool, np.bool_)):
        raise AssertionError(f"expected (int, bool), got ({type(blocks).__name__}, {type(opt_in).__name__})")
    blocks, opt_in = int(blocks), bool(opt_in)
    if (blocks, opt_in) != tuple(expected):
        raise AssertionError(f"got (blocks={blocks}, opt_in={opt_in}), expected "
                             f"(blocks={expected[0]}, opt_in={expected[1]})")


# --------------------------------------------------------------------------- typical mistakes

def _with_limit(resource, count):
    """A wrong answer: ``blocks_per_sm`` with one resource's count replaced by ``count(threads, registers, shared)``
    (None: that limit left out)."""
    def wrong(threads, registers, static_bytes, dynamic_bytes):
        blocks, opt_in = blocks_per_sm(threads, registers, static_bytes, dynamic_bytes)
        if blocks == 0:
            return blocks, opt_in
        shared = static_bytes + dynamic_bytes
        limits = _limits(threads, registers, shared)
        limits[resource] = count(threads, registers, shared)
        return min(n for n in limits.values() if n is not None), opt_in
    return wrong


_no_reserve = _with_limit("shared", lambda t, r, shared: SM_SHARED // shared if shared else None)
_registers_per_thread = _with_limit("registers", lambda t, registers, s: SM_REGISTERS // registers)
_no_block_cap = _with_limit("blocks", lambda t, r, s: None)


def _opt_in_from_dynamic_only(threads, registers, static_bytes, dynamic_bytes):
    blocks, _ = blocks_per_sm(threads, registers, static_bytes, dynamic_bytes)
    return blocks, dynamic_bytes > DEFAULT_SHARED


register_exercise(Exercise(
    name="ch3_blocks_per_sm", chapter=3, title="How many blocks fit on one SM, and when a launch must opt in",
    signature="blocks_per_sm(threads, registers, static_bytes, dynamic_bytes) -> (blocks: int, opt_in: bool)",
    solution=blocks_per_sm, make_cases=_cases, compare=_compare,
    hints=("Each of an SM's resources allows some number of blocks; the smallest of those numbers is the answer. "
           "Which resources does a block take, and how much of each?",
           "Per block: ceil(threads / 32) warps of 32 threads; registers × 32 × warps registers; static + dynamic "
           "+ 1 KiB of shared memory. An SM has 2048 threads, 32 blocks, 65,536 registers and 228 KiB of "
           "shared memory. opt_in: static + dynamic over 48 KiB.",
           "shared = static_bytes + dynamic_bytes; opt_in = shared > 48 * 1024\n"
           "if shared > 227 * 1024: return 0, opt_in\n"
           "warps = -(-threads // 32)\n"
           "blocks = min(2048 // (32 * warps), 32, 65536 // (registers * 32 * warps), "
           "228 * 1024 // (shared + 1024))"),
    mistakes=(Mistake("the 1 KiB per block forgotten", _no_reserve,
                      "CUDA keeps 1 KiB of shared memory in every block for itself: a block takes "
                      "static + dynamic + 1024 bytes of the SM's 228 KiB."),
              Mistake("the opt-in decided by the dynamic part alone", _opt_in_from_dynamic_only,
                      "the 48 KiB a block gets without opting in covers all its shared memory, static and "
                      "dynamic together."),
              Mistake("registers counted per thread, not per block", _registers_per_thread,
                      "every thread of a block holds its registers: a block takes registers × 32 × warps of "
                      "the SM's 65,536."),
              Mistake("no cap of 32 blocks", _no_block_cap,
                      "an SM holds at most 32 blocks, however small they are.")),
))
