"""Chapter 8 exercises, the warm-up: from a padded batch's mask to a packed batch, in PyTorch.

``ch8_pack_from_mask`` — the core of ``unpad_input``: given the ``(B, N)`` mask of a padded
batch (True, or 1, where a token is real), return

* ``indices`` int64 ``(total,)``: the real tokens' positions in the flattened ``(B·N)`` batch, in
  order (gathering those rows packs the batch);
* ``cu_seqlens`` int32 ``(B + 1,)``: 0, then the running total of the rows' real tokens;
* ``max_seqlen``, a Python int: the longest row's real tokens;
* ``padding_ratio``, a Python float: the positions the padded batch holds per real token,
  ``B·N / total`` (1.0: no padding at all).

Cases include left padding (a real token need not start its row), a row with no real token, a
mask wider than the longest row, masks of bool and of int.  The packed float64 judge of the
kernel exercises (``packed_reference``) lives here too, beside the warm-up: both are plain PyTorch.
"""
from __future__ import annotations

import math

import torch

from fa_lab.core.reference import reference_attention
from fa_lab.core.spec import make_spec
from fa_lab.core.world import DEVICE, pick
from fa_lab.exercises.registry import Case, Exercise, Mistake, register_exercise


def pack_from_mask(attention_mask):
    """``(indices, cu_seqlens, max_seqlen, padding_ratio)`` of a padded batch's ``(B, N)`` mask (see the module)."""
    return pack(attention_mask)


def pack(mask, *, leading_zero=True, prefix_sum=True, from_lengths=False, count_padding=False, inverse=False,
         width_as_max=False):
    """``pack_from_mask``'s computation.  Each keyword set away from its default makes one classic mistake
    (``MISTAKES``), so the solution and its wrong twins share every other line."""
    keep = mask.bool()
    B, N = keep.shape
    lengths = keep.sum(dim=1)
    if from_lengths:   # assumes right padding: row b's tokens are its first L_b positions
        cols = torch.arange(N, device=mask.device)
        indices = torch.nonzero((cols[None, :] < lengths[:, None]).flatten()).flatten()
    else:
        indices = torch.nonzero(keep.flatten()).flatten()
    running = torch.cumsum(lengths, 0) if prefix_sum else lengths
    cu_seqlens = torch.cat([running.new_zeros(1), running]) if leading_zero else running
    total = int(lengths.sum())
    max_seqlen = N if width_as_max else int(lengths.max()) if B else 0
    ratio = B * N / total
    if count_padding:
        ratio = (B * N - total) / total
    if inverse:
        ratio = total / (B * N)
    return indices, cu_seqlens.to(torch.int32), max_seqlen, float(ratio)


# --------------------------------------------------------------------------- cases

def _mask(lengths, width, *, left=False, dtype=torch.bool):
    cols = torch.arange(width)[None, :]
    lengths = torch.tensor(lengths)[:, None]
    keep = cols >= width - lengths if left else cols < lengths
    return keep.to(dtype).to(DEVICE)


def mask_cases(seed):
    import random

    rng = random.Random(seed)
    specs = [  # label, lengths, width, left-padded, dtype
        ("right padding", [5, 3, 8, 1], 8, False, torch.bool),
        ("left padding (a serving batch)", [2, 7, 4], 7, True, torch.bool),
        ("a row with no real token", [6, 0, 3], 6, False, torch.bool),
        ("mask wider than the longest row", [3, 5], 9, False, torch.bool),
        ("no padding at all", [4, 4, 4], 4, False, torch.bool),
        ("one sequence", [11], 16, False, torch.int64),
        ("int mask (0/1), an empty first row", [0, 2, 9, 9], 9, False, torch.int32),
    ]
    b = rng.randint(2, 7)
    lengths = [rng.choice([0, rng.randint(1, 40)]) for _ in range(b)]
    lengths[rng.randrange(b)] = rng.randint(1, 40)           # at least one real token
    specs.append(("random", lengths, max(lengths) + rng.randint(0, 5), rng.random() < 0.5, torch.bool))
    for n in pick(cpu=[], gpu=[(64, 4096)]):
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(0, n[1] + 1, (n[0],), generator=g).tolist()
        specs.append(("full size", lengths, n[1], False, torch.bool))
    cases = []
    for label, lengths, width, left, dtype in specs:
        words = f"B={len(lengths)} N={width} lengths={lengths if len(lengths) <= 8 else '...'}"
        words += " (left-padded)" if left else ""
        cases.append(Case(f"{label}: {words}", (_mask(lengths, width, left=left, dtype=dtype),),
                          meta=dict(lengths=lengths, width=width)))
    return cases


# --------------------------------------------------------------------------- typical wrong answers

def _mistaken(**mistake):
    def fn(attention_mask):
        return pack(attention_mask, **mistake)
    fn.__name__ = "pack_" + "_".join(mistake)
    return fn


MISTAKES = (
    Mistake("cu_seqlens without its leading 0", _mistaken(leading_zero=False),
            "cu_seqlens has B + 1 entries: sequence b is rows cu_seqlens[b]:cu_seqlens[b + 1], so the first "
            "sequence needs a start too. Prepend 0 to the running total (an off-by-one in the prefix sum)."),
    Mistake("the lengths, not their running total", _mistaken(prefix_sum=False),
            "cu_seqlens holds where each sequence starts in the packed tensor: the running total (torch.cumsum) "
            "of the lengths, after a 0, not the lengths themselves."),
    Mistake("indices that assume right padding", _mistaken(from_lengths=True),
            "a real token need not sit at the start of its row (left padding, or holes): take the positions where "
            "the flattened mask is true (torch.nonzero), not the first L_b positions of each row."),
    Mistake("the padding counted, not the padded batch", _mistaken(count_padding=True),
            "the padding ratio is the positions the padded batch holds per real token, B·N / total (1.0 without "
            "padding); (B·N − total) / total is that ratio minus 1."),
    Mistake("real tokens over positions (the ratio upside down)", _mistaken(inverse=True),
            "the padding ratio is B·N / total, at least 1: how many positions are computed per real token."),
    Mistake("max_seqlen as the mask's width", _mistaken(width_as_max=True),
            "max_seqlen is the longest sequence's real tokens (it sizes the kernels' tiles), not the padded width."),
)

HINTS = (
    "Everything follows from one number per row: how many real tokens it holds. Where does sequence b start in "
    "the packed tensor, and which positions of the flattened (B·N) batch end up there, in which order? Try it "
    "on a left-padded row, and on a row with no real token.",
    "lengths = mask.sum(1); cu_seqlens is 0 followed by the running total of lengths (B + 1 entries, int32); "
    "indices are the positions of the true entries of mask.flatten() in order (torch.nonzero); max_seqlen and "
    "the ratio B·N / total are Python numbers (int(...), float(...)).",
    "keep = attention_mask.bool(); lengths = keep.sum(1); indices = torch.nonzero(keep.flatten()).flatten(); "
    "cu_seqlens = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32); "
    "max_seqlen = int(lengths.max()); padding_ratio = keep.numel() / int(lengths.sum()).",
)

register_exercise(Exercise(
    name="ch8_pack_from_mask", chapter=8, title="From a padding mask to cu_seqlens and the padding ratio",
    signature="pack_from_mask(attention_mask) -> (indices, cu_seqlens, max_seqlen, padding_ratio)   "
              "# mask (B, N), True where a token is real",
    solution=pack_from_mask, make_cases=mask_cases, outputs=("indices", "cu_seqlens", "max_seqlen", "padding_ratio"),
    mistakes=MISTAKES, hint=HINTS[0], hints=HINTS,
))


# --------------------------------------------------------------------------- the packed float64 judge

def packed_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=False):
    """``(o (total_q, H, D), lse (H, total_q))`` in float64: each sequence through ``reference_attention``.

    Sequence ``b`` is q rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` against k, v rows
    ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``, bottom-right causal on its own; a sequence without keys
    gives zeros and ``lse = -inf``, one without queries gives nothing.
    """
    total_q, H, D = q.shape
    o = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    lse = torch.full((H, total_q), -math.inf, dtype=torch.float64, device=q.device)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        if rq.stop == rq.start or rk.stop == rk.start:
            continue
        qs, ks, vs = (t[r].transpose(0, 1)[None].double() for t, r in ((q, rq), (k, rk), (v, rk)))
        o_b, lse_b = reference_attention(qs, ks, vs, make_spec(qs, ks, vs, causal=causal))
        o[rq] = o_b[0].transpose(0, 1)
        lse[:, rq] = lse_b[0]
    return o, lse
