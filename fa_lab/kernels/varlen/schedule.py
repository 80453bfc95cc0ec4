"""Which block of which sequence a program works on: the varlen kernels' work table.

A packed batch holds sequences of different lengths back to back.  Launching one program per
``(sequence, block)`` of the longest sequence would leave most programs of the short sequences
with nothing to do; here the grid covers the real blocks only.  A small int32 table, built on
the device with a handful of torch ops (no copy to the host, no synchronisation), says for each
program id which sequence and which block of it that program owns:

    blocks per sequence   cdiv(L_b, BLOCK)                    [3, 1, 0, 2]
    prefix sums (ends)    cumsum                              [3, 4, 4, 6]
    sequence of program   first end greater than program id   [0, 0, 0, 1, 3, 3]
    block in sequence     program id - start of its sequence  [0, 1, 2, 0, 0, 1]

The number of programs must be known on the host without reading the lengths, so the grid is
an upper bound: ``sum cdiv(L_b, BLOCK) <= (total + B·(BLOCK - 1)) // BLOCK``.  The few programs
past the real blocks (at most B) find the sequence ``-1`` and return at once.

The table may also be reordered, heaviest block first (``work`` below): the programs that see
the most keys start first, and the light ones fill the gaps at the end of the launch.

``scheduled_block`` is the kernels' side (@triton.jit), ``block_schedule`` builds the table,
``schedule_table`` is the same arithmetic in plain Python for figures, tests and exercises.
``cached_schedule`` builds a table once per ``cu_seqlens`` tensor: every layer of a model (and
the backward) reuses its batch's table, and the twenty-odd small torch ops of a build, each
a launch the host must issue, stay out of the step.
"""
from __future__ import annotations

import weakref
from collections import OrderedDict

import torch
import triton
import triton.language as tl


@triton.jit
def scheduled_block(SCHEDULE, pid, n_programs):
    """``(sequence, block)`` of program ``pid``; sequence ``-1`` means no work.

    ``SCHEDULE`` is the int32 ``(2, n_programs)`` table of ``block_schedule``: row 0 the
    sequence, row 1 the block's index inside it.
    """
    seq = tl.load(SCHEDULE + pid)
    block = tl.load(SCHEDULE + n_programs + pid)
    return seq, block


def n_programs(total: int, batch: int, block: int) -> int:
    """Programs to launch for ``batch`` sequences of ``total`` rows in all: an upper bound of the blocks."""
    return (total + batch * (block - 1)) // block


def sequence_of_block(cu_seqlens: torch.Tensor, block: int, programs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sequence, block)`` of each of ``programs`` program ids, in order: sequence by sequence.

    Program ids past the last real block get the sequence ``-1``.
    """
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    blocks = (lengths + block - 1) // block
    ends = torch.cumsum(blocks, 0)
    pid = torch.arange(programs, device=cu_seqlens.device, dtype=torch.int64)
    seq = torch.searchsorted(ends, pid, right=True)          # the first sequence that ends after pid
    batch = lengths.numel()
    starts = ends - blocks
    local = pid - starts[seq.clamp(max=max(batch - 1, 0))] if batch else pid
    seq = torch.where(seq < batch, seq, -1)
    return seq, local


def work(seq: torch.Tensor, local: torch.Tensor, cu_rows: torch.Tensor, cu_cols: torch.Tensor, block: int,
         left: int = -1, right: int = -1) -> torch.Tensor:
    """Columns (keys) some row of each block sees: the block's share of the work (-1 for no block).

    Rows are the blocked dimension (queries in the forward and dQ, keys in dK/dV with the window's
    sides swapped), bottom-right aligned as everywhere in the book.
    """
    ok = seq >= 0
    s = seq.clamp(min=0)
    n_rows = (cu_rows[1:] - cu_rows[:-1]).to(torch.int64)[s]
    n_cols = (cu_cols[1:] - cu_cols[:-1]).to(torch.int64)[s]
    diag = n_cols - n_rows
    start = local * block
    lo = torch.zeros_like(n_cols) if left < 0 else (start + diag - left).clamp(min=0)
    hi = n_cols if right < 0 else torch.minimum(start + block + diag + right, n_cols)
    return torch.where(ok, (hi - lo).clamp(min=0), -1)


def block_schedule(cu_rows: torch.Tensor, cu_cols: torch.Tensor, block: int, programs: int, *,
                   left: int = -1, right: int = -1, heaviest_first: bool = True) -> torch.Tensor:
    """The int32 ``(2, programs)`` table the kernels read with ``scheduled_block``.

    ``cu_rows`` are the cumulative lengths of the blocked dimension, ``cu_cols`` of the other one
    (they only matter for ``heaviest_first``, which orders the blocks by ``work``, stable).
    """
    seq, local = sequence_of_block(cu_rows, block, programs)
    if heaviest_first and programs > 1:
        order = torch.sort(work(seq, local, cu_rows, cu_cols, block, left, right), descending=True,
                           stable=True).indices
        seq, local = seq[order], local[order]
    return torch.stack((seq, local)).to(torch.int32).contiguous()


def schedule_table(lengths, block: int) -> list[tuple[int, int]]:
    """``(sequence, block)`` of every real block, sequence by sequence, in plain Python."""
    return [(b, i) for b, n in enumerate(lengths) for i in range(-(-n // block))]


#: (id(cu_rows), id(cu_cols), block, programs, left, right) -> (weakrefs, versions, table), most recent last
_CACHE: OrderedDict = OrderedDict()
_CACHE_SIZE = 64


def cached_schedule(cu_rows: torch.Tensor, cu_cols: torch.Tensor, block: int, programs: int, *,
                    left: int = -1, right: int = -1) -> torch.Tensor:
    """``block_schedule`` (heaviest first), built once for the same ``cu_seqlens`` tensors.

    A table is reused only while both tensors are the very objects it was built from (held by
    weak references, so a freed tensor whose id is taken again never matches) and unchanged
    since (their version counters: any in-place write bumps them).
    """
    key = (id(cu_rows), id(cu_cols), block, programs, left, right)
    hit = _CACHE.get(key)
    if hit is not None:
        (ref_rows, ref_cols), versions, table = hit
        if ref_rows() is cu_rows and ref_cols() is cu_cols and versions == (cu_rows._version, cu_cols._version):
            _CACHE.move_to_end(key)
            return table
    table = block_schedule(cu_rows, cu_cols, block, programs, left=left, right=right)
    _CACHE[key] = ((weakref.ref(cu_rows), weakref.ref(cu_cols)), (cu_rows._version, cu_cols._version), table)
    if len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return table
