"""GPU probe (session 2026-11-23, second): Triton 3.5+ warp-specializes FlashAttention loops on
Hopper too (producer warps for the TMA loads, two consumer warpgroups sharing a 128-row tile),
but only with descriptors built in the kernel and a single key loop.  Does it pay for the
non-causal rows, where the masked ranges are empty (``EDGES`` False compiles the hot loop alone)?

    FA_LAB_TRITON_AUTOTUNE=0 python .notes/probe_ws.py

Run c used a temporary kernel switch (config key 'probe', constexpr PROBE; never committed).  The kept
kernel has what it tested: bit 1 (O, and later lse too, stored through descriptors under ws), bit 2
(literal loop bounds when EDGES is false) and, under ws only, bit 4.  With the kept kernel the 'probe'
key is ignored, so this script now times the same kernel for every probe value.
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

rows = [(1, 16, 16384, 128, torch.float16)]
# Run a (probe_ws_2026-11-23a.log): every candidate compiled, but the compiles of the
# warp-specialized ones take ~50 s each, and 128-row tiles with 4 warps (two consumer
# warpgroups splitting the tile) gave wrong results (max error 0.08, or NaN).
# Run b (probe_ws_2026-11-23b.log): the correct warp-specialized ones lose (275-485 against 533).
# Run c (this): which difference from the tutorial's loop breaks the 128-row split?  'probe'
# bits: 1 stores O through a tensor descriptor, 2 loops over [0, n_k) literally, 4 updates
# l_i before the rescale of acc (the tutorial's order).
CANDS = [  # (BLOCK_M, BLOCK_N, warps, stages, ws, host_desc, probe)
    (64, 128, 4, 1, False, True, 0),     # shipped
    (128, 128, 4, 2, True, False, 1), (128, 128, 4, 2, True, False, 2), (128, 128, 4, 2, True, False, 4),
    (128, 128, 4, 2, True, False, 7), (128, 64, 4, 2, True, False, 7), (128, 64, 4, 3, True, False, 7),
    (64, 128, 4, 3, True, False, 7), (128, 64, 4, 3, True, False, 3),
]


def compile_one(row: int, cand: int) -> None:
    """Fill Triton's on-disk cache with one kernel (run in parallel, one process each)."""
    B, H, N, D, dtype = rows[row]
    bm, bn, w, st, ws, hd, pr = CANDS[cand]
    q, k, v = random_qkv(B, H, N, N, D, dtype=dtype, device="cuda", seed=1)  # same shapes: same cache key
    spec = fa_lab.make_spec(q, k, v, causal=False)
    launch = triton_fwd.make_launcher(q, k, v, spec, host_desc=hd)[0]
    launch(dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st, ws=ws, probe=pr), warmup=True)


if len(sys.argv) == 3:
    compile_one(int(sys.argv[1]), int(sys.argv[2]))
    sys.exit()
import subprocess
procs = [subprocess.Popen([sys.executable, __file__, str(r), str(c)]) for r in range(len(rows)) for c in range(len(CANDS))]
print("compiled:", [p.wait() for p in procs], flush=True)

out = []
for B, H, N, D, dtype in rows:
    q, k, v = random_qkv(B, H, N, N, D, dtype=dtype, device="cuda", seed=1)
    spec = fa_lab.make_spec(q, k, v, causal=False)
    launchers = {hd: triton_fwd.make_launcher(q, k, v, spec, host_desc=hd) for hd in (True, False)}
    ref = sdpa(SDPBackend.FLASH_ATTENTION)(q, k, v, False).float()
    fns = {"sdpa_flash": lambda: sdpa(SDPBackend.FLASH_ATTENTION)(q, k, v, False),
           "sdpa_cudnn": lambda: sdpa(SDPBackend.CUDNN_ATTENTION)(q, k, v, False)}
    info = {}
    for bm, bn, w, st, ws, hd, pr in CANDS:
        name = f"{bm}/{bn}/w{w}/s{st}" + ("/ws" if ws else "") + ("/host" if hd else "/dev") + f"/p{pr}"
        cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st, ws=ws, probe=pr)
        launch, o, lse, _ = launchers[hd]
        try:
            kern = launch(cfg, warmup=True)
            launch(cfg)
            torch.cuda.synchronize()
            o.fill_(float("nan"))
            launch(cfg)
            torch.cuda.synchronize()
            diff = (o.float() - ref).abs().nan_to_num(1e9).amax(dim=(0, 1, 3))  # per query row
            bad = (diff > 2e-2).nonzero().flatten().tolist()
            err = float(diff.max())
            if bad:
                print(f"    wrong rows: {len(bad)}, first {bad[:8]}, rows mod 128: {sorted(set(r % 128 for r in bad))[:16]}")
            ttgir = kern.asm.get("ttgir", "")
            info[name] = dict(cfg=cfg, host_desc=hd, err=err, regs=kern.n_regs, spills=kern.n_spills,
                              smem=kern.metadata.shared, warps=kern.metadata.num_warps,
                              warp_specialized="warp_specialize" in ttgir)
            print(f"  {name}: {info[name]}", flush=True)
            fns[name] = (lambda c=cfg, l=launch: l(c))  # wrong ones too: what they would be worth
        except Exception as exc:
            print(f"  {name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    t = time_interleaved(fns, rounds=5, gpu_ms=(5, 30))
    flops = attention_flops(B, H, N, N, D, causal=False)
    for name, r in t.items():
        out.append(dict(dtype=str(dtype), row=[B, H, N, D], cand=name, info=info.get(name),
                        tflops=flops / r["ms"] / 1e9, vs_flash=t["sdpa_flash"]["ms"] / r["ms"]))
        print(f"{(B, H, N, D, str(dtype))} {name:28s} {out[-1]['tflops']:6.1f} {out[-1]['vs_flash']:5.2f}x", flush=True)
    del q, k, v, launchers, ref
    torch.cuda.empty_cache()
json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=__import__("triton").__version__, results=out),
          open(os.path.join(os.environ.get("OUT", "/tmp"), "probe_ws.json"), "w"), indent=1)
