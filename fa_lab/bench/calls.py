"""Plain ``fn(q, k, v, causal) -> o`` callables, for the recording scripts that time raw calls.

The benchmark runner goes through ``peers`` and the registry (with their checks); the
chapter scripts (``scripts/bench_ch4.py``, ``bench_ch5.py``) time the bare call instead,
so that per-call checking stays out of the kernel comparison.
"""
from __future__ import annotations

import torch.nn.functional as F


def sdpa(backend):
    """PyTorch SDPA with one ``torch.nn.attention.SDPBackend`` forced (top-left causal: use Nq == Nk)."""
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run


def ours(name):
    """A registered fa_lab implementation, called through ``fa_lab.attention``."""
    from fa_lab.api import attention

    def run(q, k, v, causal):
        return attention(q, k, v, impl=name, causal=causal)
    return run
