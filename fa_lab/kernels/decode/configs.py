"""Launch configurations of the decoding kernels, and how many splits a call gets: every knob in one place.

One-query decoding reads the whole KV cache once and does little arithmetic with it, so it
is bound by memory bandwidth.  What the knobs trade:

* ``BLOCK_N`` keys per tile: a K and a V tile of ``BLOCK_N × BLOCK_D`` per loop step.  Wide
  enough to keep many bytes in flight, small enough that ``num_stages`` of them (Triton's
  software pipeline) fit in shared memory with a second program on the SM.  The table keeps a
  K plus V stage at most 32 KiB for 16-bit caches; fp32 caches take half the keys (same bytes).
* ``MAX_BLOCK_M`` query rows per tile: the rows of one K/V head's query heads times the
  queries (GQA packing).  The accumulator is ``BLOCK_M × BLOCK_D`` fp32 in registers.
* the number of splits (flash-decoding): with few (batch, K/V head) pairs the grid would not
  fill the GPU, so the key range is cut into splits, each a program of its own, merged after.

The CPU world (Triton's interpreter) runs one NumPy operation per tile operation: tiny tiles.
"""
from __future__ import annotations

import functools
import math

import torch

from fa_lab.core.world import ON_GPU

#: BLOCK_D -> (BLOCK_N for 16-bit caches, num_warps, num_stages).  At D = 128 a sweep on an H100 (BLOCK_N 64/128,
#: 4/8 warps, 2-4 stages, 1-4 splits; fp16, (B, Hkv, Nk) = (8, 8, 8192) and (64, 8, 2048)) put 128 keys, 4 warps
#: and 3 stages first on both shapes, at the HBM copy bandwidth; the other head dims keep the same bytes per
#: stage.  ``decode_forward(..., config=...)`` overrides them for a tuning run.
GPU_TABLE = {
    16: (128, 4, 3),
    32: (128, 4, 3),
    64: (128, 4, 3),
    128: (128, 4, 3),
    256: (64, 4, 3),
}
#: BLOCK_D -> the most query rows in one tile (the fp32 accumulator lives in registers)
GPU_MAX_BLOCK_M = {16: 64, 32: 64, 64: 64, 128: 64, 256: 32}
#: the interpreter's configuration: one NumPy call per tile operation, so small tiles
CPU_CONFIG = dict(BLOCK_N=16, MAX_BLOCK_M=16, num_warps=1, num_stages=1)
#: warps of the combine kernel (one program per output row)
COMBINE_WARPS = 4 if ON_GPU else 1
#: its software-pipeline stages: it has no loop to pipeline
COMBINE_STAGES = 1

#: programs resident on one SM at a time, the slots the split heuristic fills: the table's configurations
#: keep two stages of 64 KiB of K and V in shared memory, and an H100 SM has 228 KiB (a second program waits)
PROGRAMS_PER_SM = 1
#: programs per SM from which one split is enough: on the H100 64 programs over 132 SMs, each with three
#: stages of 128-key tiles in flight, already read at the HBM copy bandwidth, and splitting them 2 or 4
#: ways was slower (the partial outputs and the merge cost more than they gain)
SATURATING_PROGRAMS_PER_SM = 0.45
#: the same for a cache whose pages are smaller than a key tile, read in key order: the pages of a sequence
#: lie anywhere in the pool, and with one program per (sequence, K/V head) the H100 read 16-token pages
#: scattered at random fastest with twice the programs (pages that hold whole tiles keep the contiguous
#: cache's rule, and so do pages read in pool order)
GATHER_SATURATING_PROGRAMS_PER_SM = 1.0
#: software-pipeline stages a paged cache adds: a tile's K and V loads wait on a load from the block table,
#: and Triton's pipeliner gives each level of such indirection its share of the stages, so two more stages
#: keep two tiles of K and V in flight, as the contiguous loop does with the table's stages
PAGED_EXTRA_STAGES = 2
#: the most pages one program sorts to read them in pool order (``pool_order.py``): the sort holds them in
#: registers, and on the H100 sorting 512 took about 2 µs (paid again when a table row changes other than by
#: a decoding step filling a page)
MAX_ORDERED_PAGES = 1024
#: element offsets into a cache are int32 when its largest one is below this (int64 otherwise)
OFFS32_LIMIT = 2 ** 31
#: flash-attn's ceiling on splits: beyond it the merge costs more than the parallelism gains
MAX_SPLITS = 128
#: the "SM count" of the CPU world: small, so that the interpreter runs few programs
CPU_SM_COUNT = 2
#: the smallest tile tl.dot takes in each dimension
MIN_TILE = 16


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def head_dim_block(head_dim: int) -> int:
    """BLOCK_D: the head dim padded to a power of two, at least 16 (tl.dot's smallest tile); masked."""
    return max(MIN_TILE, next_power_of_2(head_dim))


def decode_config(head_dim: int, itemsize: int, overrides: dict | None = None, paged: bool = False) -> dict:
    """The split-KV kernel's launch configuration for a head dim and the element size it computes in.

    A dict with ``BLOCK_N``, ``MAX_BLOCK_M``, ``num_warps`` and ``num_stages`` (``PAGED_EXTRA_STAGES``
    more for a ``paged`` cache), and ``POOL_ORDER`` (None: ``pool_order_wanted`` decides; True: read small pages
    in pool order wherever keys may be reordered; False: never); ``overrides`` replaces some of them (a tuning
    run or a test), checked here.
    """
    if not ON_GPU:
        cfg = dict(CPU_CONFIG)
    else:
        block_d = head_dim_block(head_dim)
        block_n, warps, stages = GPU_TABLE[block_d]
        if itemsize > 2:   # fp32: the same bytes per tile
            block_n = max(MIN_TILE, block_n * 2 // itemsize)
        stages += PAGED_EXTRA_STAGES if paged else 0
        cfg = dict(BLOCK_N=block_n, MAX_BLOCK_M=GPU_MAX_BLOCK_M[block_d], num_warps=warps, num_stages=stages)
    cfg["POOL_ORDER"] = None
    for key, value in (overrides or {}).items():
        if key not in cfg:
            raise ValueError(f"config keys are {sorted(cfg)}, got {key!r}")
        if key == "POOL_ORDER":
            if value not in (None, True, False):
                raise ValueError(f"config POOL_ORDER must be None (decide), True or False, got {value!r}")
            cfg[key] = value
            continue
        tile = key in ("BLOCK_N", "MAX_BLOCK_M")
        if not isinstance(value, int) or value < (MIN_TILE if tile else 1) or (
                key != "num_stages" and value & (value - 1)):
            raise ValueError(f"config {key} must be a power of two{' >= 16' if tile else ''}, got {value!r}"
                             if key != "num_stages" else f"config num_stages must be an int >= 1, got {value!r}")
        cfg[key] = value
    return cfg


def query_block(rows: int, max_block_m: int) -> int:
    """BLOCK_M for ``rows`` packed query rows (group · Nq): all of them if they fit, padded to >= 16."""
    return max(MIN_TILE, min(next_power_of_2(rows), max_block_m))


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (``CPU_SM_COUNT`` for anything but a CUDA device)."""
    if device.type != "cuda":
        return CPU_SM_COUNT
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).multi_processor_count


def wave_efficiency(programs: int, slots: int) -> float:
    """The busy share of ``slots`` resident programs over the waves that ``programs`` equal programs take."""
    waves = programs / slots
    return waves / math.ceil(waves)


def num_splits_heuristic(programs: int, max_keys: int, block_n: int, sms: int, gather: bool = False) -> int:
    """How many splits of the key range: enough programs to fill ``sms`` SMs, no more splits than key tiles.

    ``programs`` is the grid without splits (batch · K/V heads · query tiles), ``max_keys`` an
    upper bound on the keys one query tile sees (known on the host without reading the lengths).
    ``PROGRAMS_PER_SM · sms`` programs run at once; equal programs then run in waves, and a last
    wave that is mostly empty leaves SMs idle (160 programs on 132 slots take two waves: 61%
    busy; 128 take one: 97%).  The smallest split count whose waves are within 85% of the best
    is chosen, as flash-attn does.  A paged cache whose keys each ``gather`` their block number
    needs more programs to read at full bandwidth (``GATHER_SATURATING_PROGRAMS_PER_SM``).
    """
    tiles = -(-max_keys // block_n)
    slots = PROGRAMS_PER_SM * sms
    saturating = GATHER_SATURATING_PROGRAMS_PER_SM if gather else SATURATING_PROGRAMS_PER_SM
    if tiles <= 1 or programs >= saturating * sms:
        return 1
    candidates = range(1, min(tiles, MAX_SPLITS) + 1)
    efficiency = {s: wave_efficiency(programs * s, slots) for s in candidates}
    best = max(efficiency.values())
    return next(s for s in candidates if efficiency[s] >= 0.85 * best)


def pool_order_wanted(programs: int, splits: int, pages_per_split: int, sms: int, forced: bool | None) -> bool:
    """Whether a call whose keys may be visited in any order reads its small pages in pool order.

    Each program checks (and when its table row changed, sorts) its pages before its first tile
    (``pool_order.py``), a cost paid once per program.  On the H100 it paid off when one wave of
    programs (``PROGRAMS_PER_SM · sms`` slots) read whole sequences, one split each: at (B, Hkv) = (8, 8)
    and 8192 keys.  With a sequence cut into 15 splits, or 512 programs in four waves, it did not.  Each
    program sorts at most ``MAX_ORDERED_PAGES``.  ``forced`` (the config's ``POOL_ORDER``) True or False
    decides instead, within that page limit.
    """
    if pages_per_split > MAX_ORDERED_PAGES or forced is False:
        return False
    return forced is True or (splits == 1 and programs * splits <= PROGRAMS_PER_SM * sms)
