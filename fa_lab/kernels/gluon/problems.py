"""Which problems the Gluon kernels take, decided without importing Triton: ``gluon_limits(spec)``."""
from __future__ import annotations

import torch

#: the head dims the Gluon forward is built for
HEAD_DIMS = (64, 128, 256)
#: the head dims the Gluon backward is built for: at D = 256 a consumer's dK and dV alone (64 keys each) would
#: need 2·64·256/128 = 256 fp32 registers a thread
BACKWARD_HEAD_DIMS = (64, 128)
#: query rows per program of either kernel (two consumer warpgroups of 64): sequence lengths are multiples of it
PROGRAM_ROWS = 128
DTYPES = (torch.float16, torch.bfloat16)
MASKS = ("none", "causal")


def gluon_limits(spec) -> str | None:
    """Why the Gluon kernels cannot run ``spec`` (None if they can): what they assume, by name."""
    if spec.head_dim not in HEAD_DIMS or spec.head_dim_v != spec.head_dim:
        return f"the Gluon kernels are built for head dims {', '.join(map(str, HEAD_DIMS))}, got {spec.head_dim}"
    if spec.n_q != spec.n_k:
        return f"the Gluon kernels need Nq = Nk, got Nq={spec.n_q}, Nk={spec.n_k}"
    if spec.n_q % PROGRAM_ROWS:
        return f"the Gluon kernels need N to be a multiple of {PROGRAM_ROWS}, got {spec.n_q}"
    if spec.mask not in MASKS:
        return f"the Gluon kernels support masks {', '.join(map(repr, MASKS))}, got {spec.mask!r}"
    if spec.device.type == "cuda" and torch.cuda.get_device_capability(spec.device) != (9, 0):
        major, minor = torch.cuda.get_device_capability(spec.device)
        return f"the Gluon kernels need a Hopper GPU (compute capability 9.0), got {major}.{minor}"
    return None


__all__ = ["BACKWARD_HEAD_DIMS", "DTYPES", "HEAD_DIMS", "MASKS", "PROGRAM_ROWS", "gluon_limits"]
