"""GPU probe (session 2026-11-23, third): two more ideas for row 2, (1, 16, 16384, 128), where the
kernel is a few % short of the issue's tutorial-class figure.

* probe bit 1: P·V into a fresh accumulator, then ``acc = acc * alpha + pv`` (one FMA) instead of
  rescaling acc before the dot: the dot no longer waits for the rescale, at the price of 64 more
  fp32 registers per thread (warp specialization hands the consumer warpgroups more registers).
* ``ctas``: Triton's cluster launch (``num_ctas``): a program's tile split over a cluster of 2 CTAs;
  whether the compiler then shares the K/V tiles between the two (TMA multicast, FlashAttention-3's
  way of halving the L2 traffic) is what this finds out.

    FA_LAB_TRITON_AUTOTUNE=0 python .notes/probe_pv_ctas.py

Uses a temporary kernel switch (config keys 'probe' and 'ctas', constexpr PROBE; never committed):
apply .notes/probe_pv_ctas_kernel.diff (run c's version) to fa_lab/triton_fwd.py first.  Findings: the
cluster launch fails in Triton 3.6's PlanCTA pass (an assertion, every variant); separate P·V gains
nothing once the rounds are balanced (run c); the same kernel timed twice in a plain rotation differed by
up to 4% (runs a, b), which is why fa_lab.timing.time_interleaved now uses balanced orders.  Also samples the
SM clock (NVML) while timing, to see the clock drop under sustained load.
"""
import json, os, sys, threading, time
import fa_lab
import torch
from torch.nn.attention import SDPBackend
from fa_lab import triton_fwd
from fa_lab.bench.calls import sdpa
from fa_lab.flops import attention_flops
from fa_lab.testing import random_qkv
from fa_lab.timing import time_interleaved

# Run a (probe_pv_ctas_2026-11-23a): the kernel without the change; probe bit 1 = separate P·V
# (there under ws and without), ctas 2 = cluster launch.  Run b (RUN=b): the kernel with separate P·V
# under ws; probe bit 1 = the old order (rescale, then the dot), bit 2 = l_i updated after the dot.
RUN = os.environ.get("RUN", "c")
if RUN == "a":
    rows = [(1, 16, 16384, 128, torch.float16), (1, 16, 16384, 128, torch.bfloat16)]
    CANDS = [  # (BLOCK_M, BLOCK_N, warps, stages, ws, host_desc, probe, ctas)
        (64, 128, 4, 1, False, True, 0, 1),      # the default config
        (128, 128, 4, 2, True, False, 0, 1),     # shipped ws winner
        (128, 128, 4, 2, True, False, 1, 1),     # ws + separate P·V
        (64, 128, 4, 1, False, True, 1, 1),      # default + separate P·V
        (128, 128, 4, 2, False, False, 0, 2),    # 64 rows per CTA, cluster of 2
        (256, 128, 4, 2, False, False, 0, 2),    # 128 rows per CTA, cluster of 2
        (256, 128, 4, 2, True, False, 0, 2),     # ws, cluster of 2
    ]
elif RUN == "b":
    rows = [(1, 16, 16384, 128, torch.float16), (1, 16, 16384, 128, torch.bfloat16), (4, 16, 4096, 128, torch.float16)]
    CANDS = [
        (128, 128, 4, 2, True, False, 0, 1),     # ws, separate P·V (the change)
        (128, 128, 4, 2, True, False, 1, 1),     # ws, old order
        (128, 128, 4, 2, True, False, 2, 1),     # ws, separate P·V, l_i last
        (128, 64, 4, 3, True, False, 0, 1),      # 64-key tiles, 3 stages: still wrong?
        (64, 128, 4, 1, False, True, 0, 1),      # the default config (no ws)
    ]
else:
    # Run c: runs a and b disagree, and in both the same kernel timed twice differed by up to
    # 4%, the copy right after cuDNN lower: a plain rotation keeps each one's predecessor fixed.
    # Here the rounds follow fa_lab.timing.balanced_orders (each follows each other equally
    # often).  The kernel's default is the shipped order again; probe bit 1 = separate P·V.
    rows = [(1, 16, 16384, 128, torch.float16), (1, 16, 16384, 128, torch.bfloat16)]
    CANDS = [
        (128, 128, 4, 2, True, False, 0, 1),     # ws, shipped
        (128, 128, 4, 2, True, False, 1, 1),     # ws, separate P·V
        (64, 128, 4, 1, False, True, 0, 1),      # the default config (no ws)
    ]

def name_of(c):
    bm, bn, w, st, ws, hd, pr, ct = c
    return f"{bm}/{bn}/w{w}/s{st}" + ("/ws" if ws else "") + ("/host" if hd else "/dev") + f"/p{pr}/c{ct}"


def cfg_of(c):
    bm, bn, w, st, ws, hd, pr, ct = c
    return dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st, ws=ws, probe=pr, ctas=ct)


def compile_one(row: int, cand: int) -> None:
    """Fill Triton's on-disk cache with one kernel (run in parallel, one process each)."""
    B, H, N, D, dtype = rows[row]
    q, k, v = random_qkv(B, H, N, N, D, dtype=dtype, device="cuda", seed=1)
    spec = fa_lab.make_spec(q, k, v, causal=False)
    launch = triton_fwd.make_launcher(q, k, v, spec, host_desc=CANDS[cand][5])[0]
    launch(cfg_of(CANDS[cand]), warmup=True)


if len(sys.argv) == 3:
    try:
        compile_one(int(sys.argv[1]), int(sys.argv[2]))
    except Exception as exc:
        print(f"compile {sys.argv[1:]} {name_of(CANDS[int(sys.argv[2])])}: {type(exc).__name__}: {str(exc)[:400]}")
        sys.exit(1)
    sys.exit()
import subprocess
t0 = time.time()
procs = [subprocess.Popen([sys.executable, __file__, str(r), str(c)]) for r in range(len(rows)) for c in range(len(CANDS))]
print("compiled:", [p.wait() for p in procs], f"{time.time() - t0:.0f} s", flush=True)


class Clock(threading.Thread):
    """SM clock samples (MHz) every 50 ms while timing."""

    def __init__(self):
        super().__init__(daemon=True)
        import pynvml
        pynvml.nvmlInit()
        self.nv, self.h = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
        self.samples, self.stop = [], False

    def run(self):
        while not self.stop:
            self.samples.append((self.nv.nvmlDeviceGetClockInfo(self.h, self.nv.NVML_CLOCK_SM),
                                 self.nv.nvmlDeviceGetPowerUsage(self.h) / 1000,
                                 self.nv.nvmlDeviceGetTemperature(self.h, 0)))
            time.sleep(0.05)


out = []
for B, H, N, D, dtype in rows:
    q, k, v = random_qkv(B, H, N, N, D, dtype=dtype, device="cuda", seed=1)
    spec = fa_lab.make_spec(q, k, v, causal=False)
    launchers = {hd: triton_fwd.make_launcher(q, k, v, spec, host_desc=hd) for hd in (True, False)}
    ref = sdpa(SDPBackend.FLASH_ATTENTION)(q, k, v, False).float()
    fns = {"sdpa_flash": lambda: sdpa(SDPBackend.FLASH_ATTENTION)(q, k, v, False),
           "sdpa_cudnn": lambda: sdpa(SDPBackend.CUDNN_ATTENTION)(q, k, v, False)}
    info = {}
    for c in CANDS:
        name, cfg, hd = name_of(c), cfg_of(c), c[5]
        launch, o, lse, _ = launchers[hd]
        try:
            kern = launch(cfg, warmup=True)
            launch(cfg)
            torch.cuda.synchronize()
            o.fill_(float("nan"))
            launch(cfg)
            torch.cuda.synchronize()
            err = float((o.float() - ref).abs().nan_to_num(1e9).max())
            ttgir = kern.asm.get("ttgir", "")
            ptx = kern.asm.get("ptx", "")
            info[name] = dict(cfg=cfg, err=err, regs=kern.n_regs, spills=kern.n_spills,
                              smem=kern.metadata.shared, warps=kern.metadata.num_warps,
                              warp_specialized="warp_specialize" in ttgir,
                              multicast=ptx.count(".multicast::cluster"), cluster=ptx.count("cluster"))
            print(f"  {name}: {info[name]}", flush=True)
            if err < 2e-2:
                fns[name] = (lambda c=cfg, l=launch: l(c))
                if c == CANDS[0]:  # the same kernel twice: the spread between them is noise
                    fns[name + "/again"] = fns[name]
        except Exception as exc:
            print(f"  {name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    clock = Clock()
    clock.start()
    t = time_interleaved(fns, rounds=5 if RUN in 'ab' else 12, gpu_ms=(5, 30))
    clock.stop = True
    mhz = [s[0] for s in clock.samples]
    watts = [s[1] for s in clock.samples]
    print(f"  SM clock while timing: median {sorted(mhz)[len(mhz)//2]} MHz, min {min(mhz)}, max {max(mhz)};"
          f" power median {sorted(watts)[len(watts)//2]:.0f} W, max {max(watts):.0f} W;"
          f" temperature max {max(s[2] for s in clock.samples)} C", flush=True)
    flops = attention_flops(B, H, N, N, D, causal=False)
    for name, r in t.items():
        out.append(dict(dtype=str(dtype), row=[B, H, N, D], cand=name, info=info.get(name), timing=r,
                        tflops=flops / r["ms"] / 1e9, vs_flash=t["sdpa_flash"]["ms"] / r["ms"],
                        clock_mhz=dict(median=sorted(mhz)[len(mhz)//2], min=min(mhz), max=max(mhz))))
        print(f"{(B, H, N, D, str(dtype))} {name:34s} {out[-1]['tflops']:6.1f} {out[-1]['vs_flash']:5.2f}x", flush=True)
    del q, k, v, launchers, ref
    torch.cuda.empty_cache()
json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=__import__("triton").__version__, results=out),
          open(os.path.join(os.environ.get("OUT", "/tmp"), f"probe_pv_ctas_{RUN}.json"), "w"), indent=1)
