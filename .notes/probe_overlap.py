"""GPU probe for issue 4 (session 2026-11-23): does overlapping the softmax of block j with the
P·V product of block j-1 (config 'overlap', FlashAttention-3's intra-warpgroup pipelining) pay?

    FA_LAB_TRITON_AUTOTUNE=0 python .notes/probe_overlap.py   (prints a table, writes $OUT/probe_overlap.json)
"""
import json, os, re
import fa_lab
import torch
from torch.nn.attention import SDPBackend
from fa_lab import triton_fwd
from fa_lab.bench.calls import sdpa
from fa_lab.flops import attention_flops
from fa_lab.testing import random_qkv
from fa_lab.timing import time_interleaved

rows = [(4, 16, 4096, 128, False), (1, 16, 16384, 128, False), (4, 16, 4096, 128, True), (4, 32, 4096, 64, True)]
out = []
for dtype in (torch.float16, torch.bfloat16):
    for B, H, N, D, causal in rows:
        q, k, v = random_qkv(B, H, N, N, D, dtype=dtype, device="cuda", seed=1)
        spec = fa_lab.make_spec(q, k, v, causal=causal)
        launch, o, lse, work = triton_fwd.make_launcher(q, k, v, spec)
        cfg = triton_fwd.choose_config(launch, spec, work, triton_fwd.FINAL)
        cfg = {k_: v_ for k_, v_ in cfg.items() if k_ != "ms"}
        cands = {"shipped": cfg, "shipped+overlap": dict(cfg, overlap=True)}
        for bm, bn, w, st in ((64, 128, 4, 2), (128, 128, 8, 2), (64, 64, 4, 2)):
            c = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st, overlap=True, paired=causal)
            if any(c == {**x, "paired": x.get("paired", False)} for x in cands.values()):
                continue
            cands[f"{bm}/{bn}/w{w}/s{st}+overlap"] = c
        ref = sdpa(SDPBackend.FLASH_ATTENTION)(q, k, v, causal)
        fns = {"sdpa_flash": lambda: sdpa(SDPBackend.FLASH_ATTENTION)(q, k, v, causal)}
        facts = {}
        for name, c in cands.items():
            try:
                kern = launch(c, warmup=True)
                launch(c)
                err = float((o.float() - ref.float()).abs().max())
                ptx = kern.asm["ptx"]
                facts[name] = dict(err=err, regs=getattr(kern, "n_regs", None), spills=getattr(kern, "n_spills", None),
                                   waits=sorted(set(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx))))
                fns[name] = (lambda c=c: launch(c))
            except Exception as exc:
                facts[name] = dict(error=f"{type(exc).__name__}: {str(exc)[:160]}")
            print(f"  {name}: {facts[name]}", flush=True)
        t = time_interleaved(fns, rounds=3)
        flops = attention_flops(B, H, N, N, D, causal=causal)
        for name, r in t.items():
            rec = dict(dtype=str(dtype), row=[B, H, N, D, causal], cand=name, cfg=cands.get(name), ms=r["ms"],
                       tflops=flops / r["ms"] / 1e9, **facts.get(name, {}))
            out.append(rec)
            print(f"{str(dtype):15s} {(B, H, N, D, causal)} {name:28s} {rec['tflops']:6.1f}", flush=True)
        del q, k, v, o, lse, ref
        torch.cuda.empty_cache()
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "probe_overlap.json"), "w"), indent=1)
