"""One launch of the shipped row-2 kernel, (1, 16, 16384, 128) fp16, for Nsight Compute:

    ncu --kernel-name regex:_attn_fwd --launch-skip 3 --launch-count 1 --section SpeedOfLight \
        --section WarpStateStats --section Occupancy --section ComputeWorkloadAnalysis python .notes/ncu_row2.py
"""
import fa_lab
import torch
from fa_lab import triton_fwd
from fa_lab.testing import random_qkv

q, k, v = random_qkv(1, 16, 16384, 16384, 128, dtype=torch.float16, device="cuda", seed=1)
spec = fa_lab.make_spec(q, k, v)
for _ in range(5):
    triton_fwd.triton_forward(q, k, v, spec)
torch.cuda.synchronize()
