"""Chapter 4's forward as a function: ``triton_forward(q, k, v, spec) -> (o, lse)``, registered as ``triton``.

The stable entry point (the backward pass of chapter 5 calls it for ``lse``).  The kernel is
in ``kernel.py``, its launch in ``launch.py``, the choice of launch configuration in
``tuner.py``.
"""
from __future__ import annotations

from fa_lab.core.registry import register
from fa_lab.kernels.triton.configs import FINAL, Variant
from fa_lab.kernels.triton.launch import HEAD_DIMS, SUPPORTED_DTYPES, make_launcher, triton_limits
from fa_lab.kernels.triton.tuner import choose_config


def triton_forward(q, k, v, spec, *, variant: Variant = FINAL, config: dict | None = None,
                   precision: str = "ieee", candidates: list[dict] | None = None, retune: bool = False,
                   host_desc: bool | None = None):
    """FlashAttention-2 forward: ``(o, lse)``, o in q's dtype, lse float32 ``(B, H, Nq)`` (natural log).

    ``precision`` matters for float32 inputs only: ``'ieee'`` (exact fp32 products, the
    default) or ``'tf32'`` (Tensor Cores with a 10-bit mantissa: faster, ~1e-3 relative error).
    ``config`` forces a launch configuration (dict with BLOCK_M, BLOCK_N, num_warps, num_stages);
    ``retune=True`` tunes this key again (over ``candidates`` if given) and caches the winner.
    ``host_desc`` forces where the tensor descriptors are built (default: by problem size).
    """
    launch, o, lse, work = make_launcher(q, k, v, spec, variant=variant, precision=precision, host_desc=host_desc)
    if config is None:
        config = choose_config(launch, spec, work, variant, precision, candidates=candidates, retune=retune)
    launch(config)
    return (o if o.dtype == q.dtype else o.to(q.dtype)), lse


register(
    "triton", chapter=4,
    description="FlashAttention-2 forward on Tensor Cores (Triton): TMA descriptors, exp2, masked blocks "
                "skipped, autotuned tiles and pipelining; fp32 runs exact (IEEE) products",
    dtypes=SUPPORTED_DTYPES, head_dims=HEAD_DIMS, limits=triton_limits,
    extra_memory=lambda s: 4 * s.batch * s.heads * s.n_q,  # lse
    notes="fp32 uses IEEE products; fa_lab.kernels.triton.triton_forward(q, k, v, spec, precision='tf32') "
          "for TF32. head_dim must be a multiple of 8 (fp16/bf16) or 4 (fp32).",
    tags=("triton", "tensor-cores"),
)(triton_forward)
