"""Record chapters 1 and 2's sweeps on a GPU: time and extra memory vs N.

    python scripts/bench_ch1_2.py [--out DIR]

Writes gpu_ch1_2.json (fa_lab.bench.records format) into DIR (default fa_lab/data).
"""
import argparse
import sys
import time

import fa_lab  # noqa: F401  (first: picks the world)
from fa_lab.bench import records, sweep, to_frame

CONFIG = dict(batch=1, heads=16, head_dim=64, dtype="fp32", causal=False, rep=10, warmup=2)
SEQ_LENS = [512, 1024, 2048, 4096, 8192, 16384, 32768, 65536]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=None, help="directory for the JSON (default: fa_lab/data)")
    args = parser.parse_args(argv)
    if not fa_lab.ON_GPU:
        sys.exit("bench_ch1_2 records GPU numbers: run it on a machine with a CUDA GPU")
    t_start = time.perf_counter()
    measured = sweep(["naive_torch", "numba_naive"], SEQ_LENS, **CONFIG)
    measured += sweep(["naive_numpy", "online_numba"], SEQ_LENS[:4], **CONFIG)
    path = records.save("gpu_ch1_2", measured, command="python scripts/bench_ch1_2.py", directory=args.out,
                         config=CONFIG, seconds=round(time.perf_counter() - t_start, 1))
    print(to_frame(measured)[["impl", "n_q", "ms", "tflops", "peak_extra_bytes", "status"]].to_string())
    print("wrote", path)


if __name__ == "__main__":
    main()
