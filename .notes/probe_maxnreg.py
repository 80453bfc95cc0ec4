"""GPU probe (session 2026-11-23; needs a config key "maxnreg" passed to the launch as Triton's maxnreg option, not kept): Nsight Compute on row 2 (.notes/ncu_row2_2026-11-23.txt) shows the
L2 at 72% of its throughput and 3 programs per SM, capped by registers (156 per thread).  Does
capping the registers (config 'maxnreg') buy resident programs, and do 128-row tiles (half the K/V
traffic from L2) pay once two of them fit on an SM?
"""
import json, os
import fa_lab
import torch
from torch.nn.attention import SDPBackend
from fa_lab import triton_fwd
from fa_lab.bench.calls import sdpa
from fa_lab.flops import attention_flops
from fa_lab.testing import random_qkv
from fa_lab.timing import time_interleaved

rows = [(1, 16, 16384, 128, False), (4, 16, 4096, 128, False), (4, 16, 4096, 128, True), (4, 32, 4096, 64, True)]
out = []
for dtype in (torch.float16,):
    for B, H, N, D, causal in rows:
        q, k, v = random_qkv(B, H, N, N, D, dtype=dtype, device="cuda", seed=1)
        spec = fa_lab.make_spec(q, k, v, causal=causal)
        launch, o, lse, work = triton_fwd.make_launcher(q, k, v, spec)
        cfg = {k_: v_ for k_, v_ in triton_fwd.choose_config(launch, spec, work, triton_fwd.FINAL).items() if k_ != "ms"}
        cands = {"shipped": cfg}
        for (bm, bn, w, st, cap) in ((64, 128, 4, 1, 128), (128, 64, 8, 2, 128), (128, 64, 8, 2, None),
                                     (128, 128, 8, 1, 128), (64, 64, 4, 2, 128), (64, 128, 4, 2, 168)):
            cands[f"{bm}/{bn}/w{w}/s{st}/r{cap}"] = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st,
                                                         paired=causal and bm == 64, maxnreg=cap)
        ref = sdpa(SDPBackend.FLASH_ATTENTION)(q, k, v, causal)
        fns = {"sdpa_flash": lambda: sdpa(SDPBackend.FLASH_ATTENTION)(q, k, v, causal)}
        for name, c in cands.items():
            try:
                kern = launch(c, warmup=True)
                launch(c)
                err = float((o.float() - ref.float()).abs().max())
                assert err < 1e-2, err
                fns[name] = (lambda c=c: launch(c))
                print(f"  {name}: regs {getattr(kern, 'n_regs', None)} spills {getattr(kern, 'n_spills', None)} "
                      f"smem {kern.metadata.shared}", flush=True)
            except Exception as exc:
                print(f"  {name}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
        t = time_interleaved(fns, rounds=3)
        flops = attention_flops(B, H, N, N, D, causal=causal)
        for name, r in t.items():
            out.append(dict(dtype=str(dtype), row=[B, H, N, D, causal], cand=name, cfg=cands.get(name),
                            tflops=flops / r["ms"] / 1e9, vs_flash=t["sdpa_flash"]["ms"] / r["ms"]))
            print(f"{(B, H, N, D, causal)} {name:24s} {out[-1]['tflops']:6.1f} {out[-1]['vs_flash']:5.2f}x", flush=True)
        del q, k, v, o, lse, ref
        torch.cuda.empty_cache()
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "probe_maxnreg.json"), "w"), indent=1)
