"""Reading a paged cache's small pages in pool order: the sort, and the per-program cache that keeps it.

A block table lists a sequence's pages in key order, and a server's pool hands out pages
wherever it has free ones: after a while, consecutive pages of a sequence lie anywhere in a pool
of gigabytes.  Streaming them in key order then jumps around DRAM.  Attention over a set of keys
does not depend on the order the keys are visited (online softmax, chapter 2), so a program may
visit its pages in any order; visited in ascending block number, every program of a call walks
the pool from its low end to its high end at about the same pace, and the pages that are read at
one moment lie close together.

Each program sorts the block numbers of its split's full pages (the sequence's partly filled last
page stays last, where the length mask expects it) and keeps the sorted row in a small buffer,
with the table row and the page counts it came from.  A later call that finds them unchanged uses
the sorted row as it is; one whose sequence has filled one more page since (a decoding step, the
earlier pages where they were) inserts that page where it belongs; anything else sorts again.

The sort needs key positions not to matter, so the order is used only without ALiBi or a left
window, and with one query (or no right window): then every key of the range is visible to every
row and only the length mask remains.  Each program has its own row of the buffer, and a plan
keeps one buffer per CUDA stream: no two programs running at once share a row.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

#: int32 words in front of a program's row: a tag, the pages it was sorted for, the layout, padding to 64 bytes
HEADER = tl.constexpr(16)
#: the tag of a row this module wrote (whatever else the buffer's memory held never matches all of a row)
TAG = tl.constexpr(0x0FA1AB00)
#: block numbers sort below this (an int32 block table's largest value)
NO_PAGE = tl.constexpr(0x7FFFFFFF)


@triton.jit
def pool_order(seq_blocks, ORDER, row, start, stop, PAGE_SIZE: tl.constexpr, MAX_PAGES: tl.constexpr):
    """The split ``[start, stop)``'s blocks in ascending pool order: a pointer ``p`` such that the page in slot
    ``s`` of the split is block ``p[start // PAGE_SIZE + s]`` (the key loop indexes the table that way).

    ``row`` is this program's row of ``ORDER``: ``[TAG, full pages, pages, PAGE_SIZE, MAX_PAGES, padding,
    the table row it was sorted from (-1 past its pages), the sorted blocks]``.
    """
    # region: pool-order
    order_row = ORDER + row.to(tl.int64) * (HEADER + 2 * MAX_PAGES)
    p0 = start // PAGE_SIZE
    n_keys = tl.maximum(stop - start, 0)
    n_pages = (n_keys + PAGE_SIZE - 1) // PAGE_SIZE
    n_full = n_keys // PAGE_SIZE                     # a partly filled last page stays in the last slot
    offs_p = tl.arange(0, MAX_PAGES)
    blocks = tl.load(seq_blocks + p0 + offs_p, mask=offs_p < n_pages, other=-1)
    seen = order_row + HEADER
    ordered = seen + MAX_PAGES
    # the row as the last call left it, loaded beside the table row (independent loads, one wait): the
    # sorted blocks are then on chip when the key loop starts reading them
    seen_blocks = tl.load(seen + offs_p)
    kept = tl.load(ordered + offs_p)
    kept_before = tl.load(ordered + offs_p - 1, mask=offs_p > 0, other=-1)   # the kept order one slot later
    was_full = tl.load(order_row + 1)
    ours = (tl.load(order_row) == TAG) & (tl.load(order_row + 3) == PAGE_SIZE) & (tl.load(order_row + 4) == MAX_PAGES)
    # the pages that were full are where they were in the table, and the kept order of them is whole
    kept_ok = tl.min(((offs_p >= was_full) | ((seen_blocks == blocks) & (kept >= 0))).to(tl.int32), 0) == 1
    same = tl.min((seen_blocks == blocks).to(tl.int32), 0) == 1
    unchanged = ours & same & (was_full == n_full) & (tl.load(order_row + 2) == n_pages)
    if not unchanged:
        grew = ours & kept_ok & (n_full >= was_full) & (n_full <= was_full + 1)
        if grew:
            # a decoding step: at most one page became full since, so it is inserted where it belongs
            new_page = tl.sum(tl.where(offs_p == was_full, blocks, 0), 0)
            at = tl.sum(((offs_p < was_full) & (kept < new_page)).to(tl.int32), 0)
            inserted = tl.where(offs_p < at, kept, tl.where(offs_p == at, new_page, kept_before))
            by_pool = tl.where(n_full > was_full, inserted, kept)
        else:
            # anything else (a new table row, a shorter sequence, a first call): sort the full pages again
            by_pool = tl.sort(tl.where(offs_p < n_full, blocks, NO_PAGE))
        by_pool = tl.where(offs_p == n_full, blocks, by_pool)   # the partial page (if any) after the full ones
        tl.debug_barrier()   # every thread has read the kept row before any thread rewrites it
        tl.store(ordered + offs_p, by_pool)
        tl.store(seen + offs_p, blocks)
        tl.store(order_row + 1, n_full)
        tl.store(order_row + 2, n_pages)
        tl.store(order_row + 3, PAGE_SIZE)
        tl.store(order_row + 4, MAX_PAGES)
        tl.store(order_row, TAG)
        tl.debug_barrier()   # every thread's stores are visible before the key loop reads the row
    # endregion: pool-order
    return ordered - p0


def row_words(max_pages: int) -> int:
    """int32 words of one program's row."""
    return HEADER.value + 2 * max_pages


def order_buffer(rows: int, max_pages: int, device) -> torch.Tensor:
    """A new buffer for ``rows`` programs: left uninitialised, since a row is used only once its tag, layout, page
    counts and table copy all match (a copy that the kernel wrote together with its sorted blocks)."""
    return torch.empty((rows, row_words(max_pages)), dtype=torch.int32, device=device)
