"""The masking convention every implementation follows (see DESIGN.md).

Queries and keys are aligned at the *bottom right*, as in FlashAttention 2.1+:
query ``i`` of ``Nq`` sits at key position ``i + Nk - Nq``.  When ``Nq < Nk``
(decoding with a KV cache) the last query sees every key; when ``Nq > Nk`` the
first ``Nq - Nk`` queries see no key at all under a causal mask, and return zeros.

A sliding window ``(left, right)`` lets query ``i`` see keys
``j`` in ``[i + Nk - Nq - left, i + Nk - Nq + right]``; ``-1`` means unbounded on
that side.  ``causal=True`` is the window ``(left, 0)``.
"""
from __future__ import annotations

import torch

UNBOUNDED = -1


def effective_window(causal: bool, window: tuple[int, int]) -> tuple[int, int]:
    """Fold ``causal`` into the window: the only mask a kernel needs to know."""
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    return left, right


def mask_kind(causal: bool, window: tuple[int, int]) -> str:
    """'none', 'causal' or 'window' — what the registry lists as supported masks."""
    if tuple(window) != (UNBOUNDED, UNBOUNDED):
        return "window"
    return "causal" if causal else "none"


def key_range(i: int, n_q: int, n_k: int, left: int, right: int) -> tuple[int, int]:
    """Keys ``[lo, hi)`` that query row ``i`` may see (possibly empty)."""
    diag = i + n_k - n_q
    lo = 0 if left < 0 else max(0, diag - left)
    hi = n_k if right < 0 else min(n_k, diag + right + 1)
    return lo, max(lo, hi)


def block_key_range(m_start: int, m_end: int, n_q: int, n_k: int, left: int, right: int) -> tuple[int, int]:
    """Keys ``[lo, hi)`` that *any* query row in ``[m_start, m_end)`` may see.

    Tiled kernels loop only over key tiles that intersect this range: tiles outside
    it are fully masked and are skipped, not computed and thrown away.
    """
    lo, _ = key_range(m_start, n_q, n_k, left, right)
    _, hi = key_range(m_end - 1, n_q, n_k, left, right)
    return lo, max(lo, hi)


def visible(n_q: int, n_k: int, left: int, right: int, device=None) -> torch.Tensor:
    """Boolean ``(Nq, Nk)``: True where query i may attend to key j."""
    return tile_visible(0, n_q, 0, n_k, n_q, n_k, left, right, device=device)


def tile_visible(m0: int, m1: int, n0: int, n1: int, n_q: int, n_k: int, left: int, right: int,
                 device=None) -> torch.Tensor:
    """Boolean ``(m1 - m0, n1 - n0)``: the part of ``visible`` for query rows ``[m0, m1)`` and keys ``[n0, n1)``."""
    i = torch.arange(m0, m1, device=device).unsqueeze(1)
    j = torch.arange(n0, n1, device=device).unsqueeze(0)
    diag = i + n_k - n_q
    ok = torch.ones(m1 - m0, n1 - n0, dtype=torch.bool, device=device)
    if left >= 0:
        ok &= j >= diag - left
    if right >= 0:
        ok &= j <= diag + right
    return ok
