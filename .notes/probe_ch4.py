"""GPU probe for issue 4 (session 2026-11-23): does the edge tile (BLOCK_N_EDGE = BLOCK_M on the
diagonal) pay on the causal rows, and where does a small call's host time go?

    python .notes/probe_ch4.py   (on the GPU; prints a table, writes $OUT/probe_ch4.json)
"""
import json, os, time
import fa_lab
import torch
from torch.nn.attention import SDPBackend
from fa_lab import triton_fwd
from fa_lab.bench.calls import sdpa
from fa_lab.flops import attention_flops
from fa_lab.testing import random_qkv
from fa_lab.timing import time_interleaved

rows = [(4, 32, 4096, 64, True), (4, 16, 4096, 128, True), (1, 16, 16384, 128, False)]
out = []
for dtype in (torch.float16, torch.bfloat16):
    for B, H, N, D, causal in rows:
        q, k, v = random_qkv(B, H, N, N, D, dtype=dtype, device="cuda", seed=1)
        spec = fa_lab.make_spec(q, k, v, causal=causal)
        launch, o, lse, work = triton_fwd.make_launcher(q, k, v, spec)
        cfg = triton_fwd.choose_config(launch, spec, work, triton_fwd.FINAL)
        cands = {"shipped": cfg}
        if causal:
            cands["shipped edge=BN (old)"] = dict(cfg, edge=cfg["BLOCK_N"])
            for bm, bn, w, st in ((64, 128, 4, 2), (64, 128, 4, 3), (128, 128, 8, 2)):
                cands[f"{bm}/{bn}/w{w}/s{st}/paired"] = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st,
                                                            paired=True)
        else:
            cands["64/128/w4/s1"] = dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=1)
            cands["128/64/w4/s2"] = dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=2)
        ref = sdpa(SDPBackend.FLASH_ATTENTION)(q, k, v, causal)
        fns = {"sdpa_flash": lambda: sdpa(SDPBackend.FLASH_ATTENTION)(q, k, v, causal)}
        for name, c in cands.items():
            try:
                launch(c)
                err = float((o.float() - ref.float()).abs().max())
                fns[name] = (lambda c=c: launch(c))
                print(name, "max err vs flash", err, flush=True)
            except Exception as exc:
                print(name, "failed", type(exc).__name__, str(exc)[:200], flush=True)
        t = time_interleaved(fns, rounds=3)
        flops = attention_flops(B, H, N, N, D, causal=causal)
        for name, r in t.items():
            rec = dict(dtype=str(dtype), row=[B, H, N, D, causal], cand=name, cfg=cands.get(name), ms=r["ms"],
                       tflops=flops / r["ms"] / 1e9)
            out.append(rec)
            print(f"{str(dtype):15s} {(B, H, N, D, causal)} {name:28s} {rec['tflops']:6.1f}", flush=True)
        del q, k, v, o, lse, ref
        torch.cuda.empty_cache()
os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "probe_ch4.json"), "w"), indent=1)
