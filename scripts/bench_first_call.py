"""What a user's first call costs: a fresh process, empty caches, one call of the Triton forward.

    python scripts/bench_first_call.py [--out DIR]

Each problem runs in a process of its own with an empty Triton kernel cache (``TRITON_CACHE_DIR``)
and an empty fa_lab tuning cache (``FA_LAB_CACHE_DIR``), the quick choice on a miss left on as a user has it
(``FA_LAB_TRITON_AUTOTUNE`` unset).
Timed apart, wall clock with a synchronisation after each: ``import_s`` (import torch and fa_lab,
start CUDA), ``first_s`` (the first call: finding the launch configuration, shipped or chosen now,
and compiling the kernel) and ``second_ms`` (the same call again).  ``shipped`` says whether the
package's table (``fa_lab/data/triton_fwd_configs.json``) holds the problem's key on this GPU.
``warm_first_s`` is the first call of a second fresh process that finds the first one's caches:
what is left of a first call once nothing is compiled or tuned.

Writes gpu_first_call.json (fa_lab.bench.records format) into DIR (default fa_lab/data).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: (B, H, N, D, dtype, causal): shipped keys of the book's chapters, and keys a model of today meets
PROBLEMS = [
    (4, 16, 4096, 128, "bfloat16", True),
    (1, 8, 512, 64, "float16", False),
    (1, 16, 16384, 128, "bfloat16", False),
    (4, 16, 4096, 256, "bfloat16", True),
    (1, 16, 32768, 64, "float16", True),   # not shipped: chosen quickly among its neighbours' winners
]

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
import fa_lab
from fa_lab.core.spec import make_spec
from fa_lab.kernels.triton import CACHE, config_key
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
t1 = time.perf_counter()
B, H, N, D, dtype, causal = json.loads(sys.argv[1])
q = torch.randn(B, H, N, D, device="cuda", dtype=getattr(torch, dtype))
key = config_key(make_spec(q, q, q, causal=causal), q.dtype, "pipelined")
# this process's user cache is empty: an entry is a shipped one (this GPU's, or its architecture's)
shipped = CACHE.get(torch.cuda.get_device_name(), key, torch.cuda.get_device_capability()) is not None
torch.cuda.synchronize()
t2 = time.perf_counter()
with torch.no_grad():
    fa_lab.attention(q, q, q, impl="triton", causal=causal)
torch.cuda.synchronize()
t3 = time.perf_counter()
with torch.no_grad():
    fa_lab.attention(q, q, q, impl="triton", causal=causal)
torch.cuda.synchronize()
t4 = time.perf_counter()
print(json.dumps(dict(key=key, shipped=shipped, import_s=t1 - t0, first_s=t3 - t2, second_ms=(t4 - t3) * 1e3)))
"""


def first_call(problem) -> dict:
    B, H, N, D, dtype, causal = problem
    rec = dict(batch=B, heads=H, n_q=N, n_k=N, head_dim=D, dtype=dtype, causal=causal)
    with tempfile.TemporaryDirectory() as triton_cache, tempfile.TemporaryDirectory() as fa_cache:
        env = dict(os.environ, TRITON_CACHE_DIR=triton_cache, FA_LAB_CACHE_DIR=fa_cache)
        env.pop("FA_LAB_TRITON_AUTOTUNE", None)   # as a user has it: the quick choice on a miss
        runs = []
        for _ in range(2):    # empty caches, then the caches the first process left
            run = subprocess.run([sys.executable, "-c", CHILD, json.dumps(problem)], capture_output=True,
                                 text=True, env=env, cwd=ROOT, timeout=300)
            if run.returncode != 0:
                why = run.stderr.strip().splitlines()[-1][:300] if run.stderr.strip() else run.returncode
                return dict(rec, status=f"error: {why}")
            runs.append(json.loads(run.stdout.strip().splitlines()[-1]))
    return dict(rec, status="ok", **runs[0], warm_first_s=runs[1]["first_s"])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="directory for gpu_first_call.json (default fa_lab/data)")
    args = parser.parse_args(argv)
    import fa_lab  # noqa: F401  (the world, for the recording's facts)
    from fa_lab.bench import records as recorded

    rows = []
    t_start = time.perf_counter()
    for problem in PROBLEMS:
        rows.append(first_call(problem))
        print(rows[-1], flush=True)
    path = recorded.save("gpu_first_call", rows, command="python scripts/bench_first_call.py", directory=args.out,
                         seconds=round(time.perf_counter() - t_start, 1))
    print("wrote", path)


if __name__ == "__main__":
    main()
