"""The FLOP count every TFLOP/s in the book uses (DESIGN.md).

Forward: two matmuls of 2·Nq·Nk·D FLOPs each per (batch, head) → 4·B·H·Nq·Nk·D;
halved for a causal mask when Nq == Nk (half the score matrix is masked out).
Backward: 2.5× the forward (five matmuls instead of two).  Softmax exps are not
counted, by convention, which is why exp throughput can hide inside a "TFLOP/s".
"""
from __future__ import annotations

MODE_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}


def attention_flops(batch: int, heads: int, n_q: int, n_k: int, head_dim: int, *,
                    causal: bool = False, mode: str = "fwd") -> float:
    if mode not in MODE_FACTOR:
        raise ValueError(f"mode must be one of {list(MODE_FACTOR)}, got {mode!r}")
    f = 4.0 * batch * heads * n_q * n_k * head_dim
    if causal and n_q == n_k:
        f /= 2
    return f * MODE_FACTOR[mode]


def spec_flops(spec, mode: str = "fwd") -> float:
    return attention_flops(spec.batch, spec.heads, spec.n_q, spec.n_k, spec.head_dim,
                           causal=spec.causal, mode=mode)
