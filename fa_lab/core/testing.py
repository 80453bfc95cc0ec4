"""Inputs and tolerances shared by the tests, the exercise checker and the benchmarks.

Everything is compared with the float64 reference; how close is close depends on the
dtype the kernel computes in (fp16/bf16 inputs and Tensor Core products are rounded).
"""
from __future__ import annotations

import zlib

import torch

from fa_lab.core.world import DEVICE

#: One call of each mask kind (keyword arguments of ``fa_lab.attention``): none, causal, a
#: sliding window, a two-sided window, causal with a window.  Sizes 2..4 keep tiny problems masked.
MASKS = [
    dict(causal=False, window=(-1, -1)),
    dict(causal=True, window=(-1, -1)),
    dict(causal=False, window=(4, 0)),
    dict(causal=False, window=(2, 3)),
    dict(causal=True, window=(3, -1)),
]

#: (atol, rtol) on O against the float64 reference, per input dtype.
TOLERANCE = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (2e-5, 2e-5),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (2.5e-2, 2e-2),
}


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    return TOLERANCE[dtype]


def stable_seed(*parts) -> int:
    """A seed in ``[0, 2**31)`` made from ``parts``, the same in every process and on every machine.

    Python's ``hash()`` of a string is salted per process (PYTHONHASHSEED), so a seed taken
    from it cannot replay a failure; the CRC-32 of the parts' ``repr`` can.
    """
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


def random_qkv(batch=1, heads=2, n_q=16, n_k=None, head_dim=16, *, kv_heads=None,
               dtype=torch.float32, device=None, seed=0, requires_grad=False):
    """Fresh random q ``(B, H, Nq, D)``, k and v ``(B, Hkv, Nk, D)``, standard normal.

    Drawn in float32 on the CPU with a private generator (the same numbers on any
    device), then cast: a test sees the same values whatever world it runs in.
    """
    n_k = n_q if n_k is None else n_k
    kv_heads = heads if kv_heads is None else kv_heads
    g = torch.Generator().manual_seed(seed)
    device = DEVICE if device is None else device

    def draw(h, n):
        t = torch.randn(batch, h, n, head_dim, generator=g).to(device=device, dtype=dtype)
        return t.requires_grad_(requires_grad)

    return draw(heads, n_q), draw(kv_heads, n_k), draw(kv_heads, n_k)


def max_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest absolute difference, treating equal infinities (lse = -inf) as equal."""
    got, expected = got.detach().double().cpu(), expected.detach().double().cpu()
    same_inf = torch.isinf(got) & torch.isinf(expected) & (torch.sign(got) == torch.sign(expected))
    diff = (got - expected).abs().masked_fill(same_inf, 0.0)
    return float(diff.nan_to_num(nan=float("inf")).max()) if diff.numel() else 0.0


def assert_close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str = "output") -> None:
    """Raise AssertionError with the worst element if ``got`` is not within the dtype's tolerance."""
    atol, rtol = tolerance(dtype)
    got_d, exp_d = got.detach().double().cpu(), expected.detach().double().cpu()
    if got_d.shape != exp_d.shape:
        raise AssertionError(f"{what}: shape {tuple(got_d.shape)}, expected {tuple(exp_d.shape)}")
    if torch.isnan(got_d).any():
        raise AssertionError(f"{what}: contains NaN at {torch.nonzero(torch.isnan(got_d))[0].tolist()}")
    same_inf = torch.isinf(got_d) & torch.isinf(exp_d) & (torch.sign(got_d) == torch.sign(exp_d))
    bad = ((got_d - exp_d).abs() > atol + rtol * exp_d.abs()) & ~same_inf
    if bad.any():
        idx = tuple(torch.nonzero(bad)[0].tolist())
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.numel()} elements off (atol={atol}, rtol={rtol}); "
            f"first at {idx}: got {got_d[idx].item():.6g}, expected {exp_d[idx].item():.6g}; "
            f"max error {max_error(got_d, exp_d):.3g}")
