"""Decoding with a KV cache in Triton: split-KV attention (flash-decoding), contiguous or paged caches.

Other packages import from here only.  The modules, one idea each:

==============  ===============================================================================
``kernel``      the split-KV kernel: GQA-packed query tiles, key splits, contiguous or paged cache
``combine``     the second kernel: merging the splits' partial outputs by their log-sum-exp
``pool_order``  small pages visited in ascending block number, the sorted order kept between calls
``configs``     every launch knob (tiles, warps, stages by head dim and dtype) and the split heuristic
``checks``      the one input check of a decoding call (``DecodeProblem``)
``forward``     ``decode_forward``: check, choose, launch
``cache``       ``append_kv``: new keys and values into the cache, in place
``adapter``     the fixed-length adapter registered as ``triton_decode``
==============  ===============================================================================
"""
from fa_lab.core.world import HAS_TRITON, TRITON_MISSING
from fa_lab.kernels.decode.cache import append_kv
from fa_lab.kernels.decode.checks import DTYPES, HEAD_DIMS, DecodeProblem, check_decode
from fa_lab.kernels.decode.configs import decode_config, num_splits_heuristic, sm_count

if HAS_TRITON:
    from fa_lab.kernels.decode.combine import combine_splits
    from fa_lab.kernels.decode.forward import decode_forward
else:
    def decode_forward(*args, **kwargs):
        raise RuntimeError(TRITON_MISSING)

    combine_splits = decode_forward

__all__ = ["DTYPES", "DecodeProblem", "HEAD_DIMS", "append_kv", "check_decode", "combine_splits", "decode_config",
           "decode_forward", "num_splits_heuristic", "sm_count"]
