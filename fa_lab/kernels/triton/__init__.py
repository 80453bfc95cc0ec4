"""Chapters 4 and 5 in Triton: the FlashAttention-2 forward on Tensor Cores and the deterministic backward.

Other packages import from here only.  The modules, one idea each:

=================  ===========================================================================
``kernel``         the forward's @triton.jit functions (``attn_fwd`` and its helpers)
``steps``          chapter 4's steps (``minimal_kernel``, the variants), registered
``configs``        variants, launch configurations, the search space, ``config_key``
``config_cache``   the tuned winners per device and key (``CACHE``), a JSON file shared safely
``policy``         what differs per GPU architecture
``launch``         checks, input preparation, ``make_launcher``
``fast_launch``    repeated launches straight through the compiled kernel (guarded)
``tuner``          choosing and tuning launch configurations (forward and backward)
``fwd``            ``triton_forward``, registered as ``triton``
``bwd``            the backward kernels and ``triton_backward``
``key_ranges``     which keys a query block sees: the kernels' ``visible_range`` and its Python twin
=================  ===========================================================================
"""
import sys
import types

import torch

from fa_lab.core.world import HAS_TRITON, TRITON_MISSING

if HAS_TRITON:
    from fa_lab.kernels.triton.bwd import triton_backward
    from fa_lab.kernels.triton.config_cache import CACHE, ConfigCache
    from fa_lab.kernels.triton.configs import (
        CONFIG_KEYS,
        CPU_CONFIG,
        FINAL,
        FIXED_CONFIG,
        Variant,
        candidate_configs,
        config_key,
        default_config,
        head_dim_pad,
    )
    from fa_lab.kernels.triton.fwd import triton_forward
    from fa_lab.kernels.triton.key_ranges import key_block_ranges
    from fa_lab.kernels.triton.launch import HEAD_DIMS, SUPPORTED_DTYPES, check_supported, make_launcher, triton_limits
    from fa_lab.kernels.triton.policy import ws_fits_problem
    from fa_lab.kernels.triton.tuner import TUNING_LOG, choose_config
else:
    # Triton publishes wheels for Linux only.  Without it the rest of the book still runs: the registry
    # loads ``fwd`` and ``steps`` to register chapter 4's kernels, and empty stand-ins register nothing;
    # chapter 5's autograd layer imports the names below, and its Triton engines refuse every call with
    # TRITON_MISSING through the registry's ``limits`` hook.
    for _step in ("fwd", "steps"):
        sys.modules[f"{__name__}.{_step}"] = types.ModuleType(f"{__name__}.{_step}", TRITON_MISSING)
    # what the kernels would support (as launch.py declares it), so that `fa-lab info` still says so
    SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
    HEAD_DIMS = (16, 256)

    def triton_limits(spec) -> str:
        return TRITON_MISSING

    def triton_forward(*args, **kwargs):
        raise RuntimeError(TRITON_MISSING)

    triton_backward = triton_forward

__all__ = [
    "CACHE", "CONFIG_KEYS", "CPU_CONFIG", "ConfigCache", "FINAL", "FIXED_CONFIG", "HEAD_DIMS", "SUPPORTED_DTYPES",
    "TUNING_LOG", "Variant", "candidate_configs", "check_supported", "choose_config", "config_key",
    "default_config", "head_dim_pad", "key_block_ranges", "make_launcher", "triton_backward", "triton_forward",
    "triton_limits",
    "ws_fits_problem",
]
