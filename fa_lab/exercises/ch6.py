"""Chapter 6 exercise: count the HBM bytes of the tiled FlashAttention forward."""
from __future__ import annotations

from fa_lab.exercises.registry import Case, Exercise, Mistake, register_exercise

LSE_BYTES = 4  # lse is float32 whatever the input dtype


def tiled_forward_hbm_bytes(batch, heads, n_q, n_k, head_dim, block_m, block_n, causal=False, itemsize=2):
    """HBM bytes the tiled forward moves when nothing is cached: an int.

    One program per ``block_m`` query rows of one (batch, head): it reads its Q rows once, then
    the K and V tiles of ``block_n`` keys that its rows can see (whole tiles, aligned to
    ``block_n``, clipped at ``n_k``; bottom-right causal skips the tiles past the block's last
    diagonal), and writes its O rows and their float32 lse once.
    """
    kv_rows = 0
    for m_start in range(0, n_q, block_m):
        m_end = min(m_start + block_m, n_q)
        hi = n_k if not causal else min(n_k, m_end + n_k - n_q)   # last row's diagonal + 1
        if hi <= 0:
            continue                                              # no row of this block sees a key
        kv_rows += min(-(-hi // block_n) * block_n, n_k)          # whole tiles, clipped at n_k
    per_head = itemsize * (2 * n_q * head_dim + 2 * kv_rows * head_dim) + LSE_BYTES * n_q
    return batch * heads * per_head


# --------------------------------------------------------------------------- typical mistakes

def _kv_once(batch, heads, n_q, n_k, head_dim, block_m, block_n, causal=False, itemsize=2):
    return batch * heads * (itemsize * 2 * (n_q + n_k) * head_dim + LSE_BYTES * n_q)


def _no_lse(batch, heads, n_q, n_k, head_dim, block_m, block_n, causal=False, itemsize=2):
    return (tiled_forward_hbm_bytes(batch, heads, n_q, n_k, head_dim, block_m, block_n, causal, itemsize)
            - batch * heads * LSE_BYTES * n_q)


def _no_skipping(batch, heads, n_q, n_k, head_dim, block_m, block_n, causal=False, itemsize=2):
    return tiled_forward_hbm_bytes(batch, heads, n_q, n_k, head_dim, block_m, block_n, False, itemsize)


def _exact_keys(batch, heads, n_q, n_k, head_dim, block_m, block_n, causal=False, itemsize=2):
    kv_rows = 0
    for m_start in range(0, n_q, block_m):
        m_end = min(m_start + block_m, n_q)
        kv_rows += max(0, n_k if not causal else min(n_k, m_end + n_k - n_q))
    return batch * heads * (itemsize * 2 * (n_q + kv_rows) * head_dim + LSE_BYTES * n_q)


def _cases(seed):
    import random

    rng = random.Random(seed)
    cases = [
        Case("hand count: Nq=Nk=256, D=64, 128x64 tiles, fp16", (1, 1, 256, 256, 64, 128, 64)),
        Case("causal, Nq=Nk=256, D=64, 128x64 tiles", (1, 1, 256, 256, 64, 128, 64), dict(causal=True)),
        Case("N = 1", (1, 1, 1, 1, 16, 64, 64)),
        Case("Nq=17 < Nk=100 (KV cache), causal, fp32", (2, 3, 17, 100, 32, 16, 32), dict(causal=True, itemsize=4)),
        Case("Nq=100 > Nk=23, causal: early rows see no key", (1, 2, 100, 23, 16, 32, 16), dict(causal=True)),
    ]
    n_q, n_k = rng.randint(33, 3000), rng.randint(33, 3000)
    cases.append(Case(f"random: Nq={n_q}, Nk={n_k}, causal", (rng.randint(1, 4), rng.randint(1, 16), n_q, n_k,
                                                             rng.choice([64, 128]), 128, 64), dict(causal=True)))
    cases.append(Case(f"random: Nq={n_q}, Nk={n_k}, full, bf16", (1, 8, n_q, n_k, 128, 64, 32), dict(itemsize=2)))
    return cases


register_exercise(Exercise(
    name="ch6_tiled_forward_bytes", chapter=6, title="The HBM bytes of the tiled forward",
    signature=("tiled_forward_hbm_bytes(batch, heads, n_q, n_k, head_dim, block_m, block_n, causal=False, "
               "itemsize=2) -> int"),
    solution=tiled_forward_hbm_bytes, make_cases=_cases, outputs=("bytes",),
    hints=("Count per (batch, head), operand by operand: which tensors are read once, and which are read again "
           "by every program?",
           "Q is read once and O written once (itemsize bytes each), lse written once (4 bytes a row); K and V are "
           "read by every program of block_m query rows.",
           "Each program reads K and V for the whole key tiles its rows see — all of them, or under bottom-right "
           "causal only up to its last row's diagonal (query i sits at key i + n_k − n_q)."),
    mistakes=(
        Mistake("K and V counted once per head", _kv_once,
                "without a cache every program re-reads K and V: ceil(n_q / block_m) programs, each loading its "
                "key tiles. That re-reading is what BLOCK_M trades against shared memory."),
        Mistake("the lse left out", _no_lse,
                "the forward also writes the log-sum-exp, one float32 (4 bytes) per query row, for the backward."),
        Mistake("causal tiles not skipped", _no_skipping,
                "under a causal mask a program stops at the tile holding its last row's diagonal: the tiles "
                "past it are never loaded."),
        Mistake("keys counted exactly, not in whole tiles", _exact_keys,
                "a program loads whole block_n-key tiles (clipped at n_k), so it reads up to the end of the "
                "tile that holds its last visible key."),
    ),
))
