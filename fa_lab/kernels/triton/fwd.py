"""Chapter 4's forward as a function: ``triton_forward(q, k, v, spec) -> (o, lse)``, registered as ``triton``.

The stable entry point (the backward pass of chapter 5 calls it for ``lse``).  The kernel is
in ``kernel.py``, its launch in ``launch.py``, the choice of launch configuration in
``tuner.py``.

At small sizes a call's host time (checks, choosing a configuration, building launch
arguments) is larger than the kernel's GPU time.  So the first call of a problem with the
default options keeps what it worked out as a ``Plan``; the registry hands a repeated call the
same spec object, and the plan of that spec runs on the new call's tensors straight away.
"""
from __future__ import annotations

from dataclasses import dataclass

from fa_lab.core.registry import register
from fa_lab.kernels.triton.configs import FINAL, Variant
from fa_lab.kernels.triton.launch import (
    HEAD_DIMS,
    SUPPORTED_DTYPES,
    Problem,
    launch_kernel,
    make_launcher,
    new_outputs,
    prepare_inputs,
    problem,
    triton_limits,
)
from fa_lab.kernels.triton.tuner import choose_config


@dataclass(frozen=True, eq=False)
class Plan:
    """What a call of one spec with the default options launches: its problem and configuration."""

    spec: object    # held, so that no other spec can take its id while the plan lives
    problem: Problem
    config: dict
    launch_meta: tuple   # problem.launch_meta(config, ...): grid, constexprs, config as a tuple


#: id(spec) -> Plan; bounded, cleared when full
_PLANS: dict[int, Plan] = {}
_PLANS_MAX = 1024


def forget_plans() -> None:
    """Drop every kept plan (after the cached configurations changed, or in tests)."""
    _PLANS.clear()


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
    default = (variant is FINAL and config is None and precision == "ieee" and candidates is None
               and not retune and host_desc is None)
    plan = _PLANS.get(id(spec)) if default else None
    if plan is not None and plan.spec is spec:
        q_, k_, v_, _, work = prepare_inputs(q, k, v, spec)
        o, lse = new_outputs(spec, work, q.device)
        launch_kernel(plan.problem, plan.config, (q_, k_, v_), (o, lse), spec, launch_meta=plan.launch_meta)
        return (o if o.dtype == q.dtype else o.to(q.dtype)), lse
    if retune:
        forget_plans()   # the key's cached winner changes for every spec that shares it
    launch, o, lse, work = make_launcher(q, k, v, spec, variant=variant, precision=precision, host_desc=host_desc)
    if config is None:
        config = choose_config(launch, spec, work, variant, precision, candidates=candidates, retune=retune)
    launch(config)
    if default:
        if len(_PLANS) >= _PLANS_MAX:
            _PLANS.clear()
        prob = problem(spec, q.dtype, variant, precision, host_desc)
        meta = prob.launch_meta(config, spec.n_q, spec.n_k, spec.batch * spec.heads)
        _PLANS[id(spec)] = Plan(spec, prob, config, meta)
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
