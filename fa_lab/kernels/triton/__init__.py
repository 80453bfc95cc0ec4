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

__all__ = [
    "CACHE", "CONFIG_KEYS", "CPU_CONFIG", "ConfigCache", "FINAL", "FIXED_CONFIG", "HEAD_DIMS", "SUPPORTED_DTYPES",
    "TUNING_LOG", "Variant", "candidate_configs", "check_supported", "choose_config", "config_key",
    "default_config", "head_dim_pad", "key_block_ranges", "make_launcher", "triton_backward", "triton_forward",
    "triton_limits",
    "ws_fits_problem",
]
