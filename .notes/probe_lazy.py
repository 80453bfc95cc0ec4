"""GPU probe (session 2026-11-23; needs a probe-only switch FA_LAB_LAZY in _attn_fwd_inner): rescale
acc and l only when some row's max grew by more than 2**8 (FlashAttention-4's conditional rescaling,
program-wide here), instead of every key block.  Run with FA_LAB_LAZY=0 and =1 in separate processes;
SDPA flash in the same process anchors each run.
"""
import json, os, sys
import fa_lab
import torch
from torch.nn.attention import SDPBackend
from fa_lab import triton_fwd
from fa_lab.bench.calls import sdpa
from fa_lab.flops import attention_flops
from fa_lab.testing import random_qkv
from fa_lab.timing import time_interleaved

rows = [(1, 16, 16384, 128, False), (4, 16, 4096, 128, False), (4, 16, 4096, 128, True), (4, 32, 4096, 64, True)]
tag = "lazy" if os.environ.get("FA_LAB_LAZY") == "1" else "eager"
out = []
for dtype in (torch.float16, torch.bfloat16):
    for B, H, N, D, causal in rows:
        q, k, v = random_qkv(B, H, N, N, D, dtype=dtype, device="cuda", seed=1)
        spec = fa_lab.make_spec(q, k, v, causal=causal)
        launch, o, lse, work = triton_fwd.make_launcher(q, k, v, spec)
        cfg = {k_: v_ for k_, v_ in triton_fwd.choose_config(launch, spec, work, triton_fwd.FINAL).items() if k_ != "ms"}
        cands = {"shipped": cfg, "128/128/w8/s3": dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, paired=causal),
                 "64/128/w4/s2": dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=2, paired=causal)}
        ref = sdpa(SDPBackend.FLASH_ATTENTION)(q, k, v, causal)
        fns = {"sdpa_flash": lambda: sdpa(SDPBackend.FLASH_ATTENTION)(q, k, v, causal)}
        for name, c in cands.items():
            launch(c)
            assert float((o.float() - ref.float()).abs().max()) < 1e-2
            fns[name] = (lambda c=c: launch(c))
        t = time_interleaved(fns, rounds=5)
        flops = attention_flops(B, H, N, N, D, causal=causal)
        for name, r in t.items():
            out.append(dict(tag=tag, dtype=str(dtype), row=[B, H, N, D, causal], cand=name, cfg=cands.get(name),
                            tflops=flops / r["ms"] / 1e9, vs_flash=t["sdpa_flash"]["ms"] / r["ms"]))
            print(f"{tag} {str(dtype):15s} {(B, H, N, D, causal)} {name:14s} {out[-1]['tflops']:6.1f} "
                  f"{out[-1]['vs_flash']:5.2f}x", flush=True)
        del q, k, v, o, lse, ref
        torch.cuda.empty_cache()
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), f"probe_lazy_{tag}.json"), "w"), indent=1)
