"""Chapter 9 kernel exercise: the split-KV combine kernel of flash-decoding, in Triton.

``ch9_combine_kernel`` — the second kernel of split-KV decoding: one program per query row
merges the row's S partial outputs ``o_parts (rows, S, D)`` (float32) with their log-sum-exps
``lse_parts (rows, S)`` into ``o (rows, D)`` and ``lse (rows,)``.  ``tl.arange`` takes powers of
two, so the program covers ``BLOCK_S >= S`` splits and ``BLOCK_D >= D`` columns: a padding split
must load as an empty split (``lse = -inf``), a padding column must never be stored.

It is judged, like the warm-up of ``ch9``, by the float64 merge on the same cases (S from 1 to
8, D not a power of two, lse far from 0, empty splits, rows whose splits are all empty, NaN in
a partial).  The model answer (a kernel a learner would write, with its launcher) is
``combine_splits_triton`` below; fa_lab's own combine kernel is ``fa_lab.kernels.decode.combine``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fa_lab.exercises.ch9 import MISTAKES, merge, merge_cases
from fa_lab.exercises.registry import Exercise, Mistake, register_exercise


def combine_splits(o_parts, lse_parts):
    """``(o (rows, D), lse (rows,))`` float32 from ``o_parts (rows, S, D)`` and ``lse_parts (rows, S)``, float32.

    The judge (run in float64); the learner writes it as a Triton kernel and its launcher (the
    notebook gives the skeleton).
    """
    return merge(o_parts, lse_parts)


@triton.jit
def combine_kernel(O_PART, LSE_PART, O, LSE, n_splits, head_dim, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """The notebook's skeleton of ``ch9_combine_kernel``, filled in: one program per row."""
    row = tl.program_id(0).to(tl.int64)          # rows · S · D can pass 2**31 at full size
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < n_splits
    d_ok = offs_d < head_dim
    # a padding split loads as an empty one: lse = -inf weighs exactly 0
    lse_s = tl.load(LSE_PART + row * n_splits + offs_s, mask=s_ok, other=float("-inf"))
    o_s = tl.load(O_PART + (row * n_splits + offs_s)[:, None] * head_dim + offs_d[None, :],
                  mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    m = tl.max(lse_s, 0)
    m = tl.where(m == float("-inf"), 0.0, m)     # every split empty: exp(-inf - 0) = 0, not NaN
    w = tl.exp(lse_s - m)                        # each <= 1: nothing overflows
    l = tl.sum(w, 0)
    acc = tl.sum(w[:, None] * o_s, 0)
    seen = l != 0.0                              # NaN counts as seen: NaN in, NaN out
    l_safe = tl.where(seen, l, 1.0)
    tl.store(O + row * head_dim + offs_d, acc / l_safe, mask=d_ok)
    tl.store(LSE + row, tl.where(seen, m + tl.log(l_safe), float("-inf")))


def combine_splits_triton(o_parts, lse_parts):
    """The model answer of ``ch9_combine_kernel``: the notebook's launcher, unchanged."""
    rows, n_splits, head_dim = o_parts.shape
    o = torch.empty((rows, head_dim), dtype=torch.float32, device=o_parts.device)
    lse = torch.empty(rows, dtype=torch.float32, device=o_parts.device)
    combine_kernel[(rows,)](o_parts, lse_parts, o, lse, n_splits, head_dim,
                            BLOCK_S=triton.next_power_of_2(n_splits), BLOCK_D=triton.next_power_of_2(head_dim))
    return o, lse


def _padding_weighed(o_parts, lse_parts):
    return merge(o_parts, lse_parts, pad_to=triton.next_power_of_2(lse_parts.shape[-1]))


#: the warm-up's mistakes, and the kernel's own: padding splits loaded as lse = 0
KERNEL_MISTAKES = MISTAKES + (
    Mistake("padding splits loaded with lse = 0", _padding_weighed,
            "the program covers BLOCK_S (a power of two) splits; when S is smaller the masked loads of the padding "
            "splits return `other`: load lse with other=float('-inf') so that a padding split is an empty one "
            "(weight 0), not a split of lse 0 and output 0."),
)

KERNEL_HINTS = (
    "One program per row: which addresses hold its S lse values and its S × D partial outputs? A program's index "
    "ranges are powers of two, so it covers BLOCK_S ≥ S splits and BLOCK_D ≥ D columns: what must a padding split "
    "load so that it weighs nothing, and what must never happen to a padding column? Then the warm-up's merge, "
    "on a tile.",
    "row = tl.program_id(0); offs_s = tl.arange(0, BLOCK_S), offs_d = tl.arange(0, BLOCK_D). lse_s is at "
    "LSE_PART + row·S + offs_s, loaded with mask offs_s < S and other=-inf (a padding split is an empty split); "
    "o_s at O_PART + (row·S + offs_s)[:, None]·D + offs_d[None, :], masked in both dimensions, other=0. Reduce "
    "over the splits (axis 0) with tl.max and tl.sum, and use tl.where for the row whose splits are all empty.",
    "m = tl.max(lse_s, 0); m = tl.where(m == -inf, 0.0, m); w = tl.exp(lse_s - m); l = tl.sum(w, 0); "
    "acc = tl.sum(w[:, None] * o_s, 0); seen = l != 0.0; l_safe = tl.where(seen, l, 1.0); "
    "tl.store(O + row * D + offs_d, acc / l_safe, mask=offs_d < D); "
    "tl.store(LSE + row, tl.where(seen, m + tl.log(l_safe), -inf)).",
)

register_exercise(Exercise(
    name="ch9_combine_kernel", chapter=9, title="The split-KV combine kernel",
    signature="combine_splits(o_parts, lse_parts) -> (o, lse)   # o_parts (rows, S, D), lse_parts (rows, S), "
              "float32; launches your Triton kernel",
    solution=combine_splits, make_cases=merge_cases, outputs=("o", "lse"), judge_dtype=torch.float64,
    mistakes=KERNEL_MISTAKES, kind="triton", model_answer=combine_splits_triton, hint=KERNEL_HINTS[0],
    hints=KERNEL_HINTS,
))
