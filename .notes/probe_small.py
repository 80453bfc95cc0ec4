"""GPU probe (session 2026-11-23, third): the small latency shape (1, 8, 512, 64) alone, after the
recording's do_bench median for fp16 came out host-bound (ours 43 µs, flash 39 µs, p10-p90 15-61 µs).
Same method as scripts/bench_ch4.py (balanced interleaved rounds), three repeats, plus the CUDA-graph
GPU time; informational, the recording stays as measured.

    python .notes/probe_small.py
"""
import functools, json, os
import torch, triton.testing
import fa_lab
from torch.nn.attention import SDPBackend
from fa_lab.bench.calls import sdpa
from fa_lab.testing import random_qkv
from fa_lab.timing import time_interleaved

out = []
for dtype in (torch.float16, torch.bfloat16):
    q, k, v = random_qkv(1, 8, 512, 512, 64, dtype=dtype, device="cuda", seed=1)
    fns = {"sdpa_flash": functools.partial(sdpa(SDPBackend.FLASH_ATTENTION), q, k, v, False),
           "sdpa_cudnn": functools.partial(sdpa(SDPBackend.CUDNN_ATTENTION), q, k, v, False),
           "triton": lambda: fa_lab.attention(q, k, v, impl="triton")}
    for fn in fns.values():
        fn()
    for rep in range(3):
        t = time_interleaved(fns, rounds=12, gpu_ms=(10, 50))
        rec = {name: dict(us=r["ms"] * 1e3, p10=r["ms_p10"] * 1e3, p90=r["ms_p90"] * 1e3) for name, r in t.items()}
        print(dtype, rep, {n: round(r["us"], 1) for n, r in rec.items()}, flush=True)
        out.append(dict(dtype=str(dtype), rep=rep, do_bench=rec))
    graph = {name: triton.testing.do_bench_cudagraph(fn, rep=50) * 1e3 for name, fn in fns.items()}
    print(dtype, "cuda graph us", {n: round(x, 2) for n, x in graph.items()}, flush=True)
    out.append(dict(dtype=str(dtype), cuda_graph_us=graph))
json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, results=out),
          open(os.path.join(os.environ.get("OUT", "/tmp"), "probe_small.json"), "w"), indent=1)
