"""The one timer: how long a call takes, in either world.

On a GPU: ``triton.testing.do_bench`` (CUDA events; it clears the L2 cache between
repetitions, so large inputs are read from HBM), median with p10/p90.  On the CPU: wall
clock of the simulator/interpreter, labelled as such.  Everything that times anything in
``fa_lab`` (``fa_lab.bench.measure``, ``fa_lab.perf.hardware``, the Triton autotuner, the
recording scripts) goes through ``time_fn`` or ``time_interleaved``.

This module only measures: it knows nothing of implementations, so it imports nothing of
``fa_lab`` beyond the world.
"""
from __future__ import annotations

import statistics
import time

import torch

from fa_lab.core.world import ON_GPU

CPU_TIMER = "wall-clock (CPU simulator/interpreter)"
GPU_TIMER = "cuda-events (do_bench)"


def time_fn(fn, *, warmup: int = 3, rep: int = 10, gpu_ms=None) -> dict:
    """Median, p10 and p90 of ``fn()`` in milliseconds, and how it was measured.

    ``warmup``/``rep`` count calls on the CPU; on a GPU ``gpu_ms=(warmup_ms, rep_ms)`` is the
    time budget given to ``triton.testing.do_bench`` (default (25, 100)).
    """
    if ON_GPU:
        import triton.testing

        # warmup/rep are milliseconds for do_bench; ask for enough to reach a stable median
        warmup_ms, rep_ms = gpu_ms or (25, 100)
        p50, p10, p90 = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5, 0.1, 0.9])
        return dict(ms=p50, ms_p10=p10, ms_p90=p90, timer=GPU_TIMER)
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(rep):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    # inclusive: with few samples the default method extrapolates past them (a negative p10)
    q = statistics.quantiles(samples, n=10, method="inclusive") if len(samples) > 1 else samples * 9
    return dict(ms=statistics.median(samples), ms_p10=q[0], ms_p90=q[-1], timer=CPU_TIMER)


def balanced_orders(n: int) -> list[list[int]]:
    """Orders of ``n`` callables in which each one follows every other equally often.

    A Williams design (a balanced Latin square): ``n`` orders for even ``n``, ``2n`` for odd.
    Under a power limit a kernel runs at the clock its predecessor left behind; a plain
    rotation keeps every callable's predecessor fixed (the one after the hungriest peer would
    always start throttled), this spreads that evenly.
    """
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:  # 0, 1, n-1, 2, n-2, ...
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    orders = [[(i + shift) % n for i in first] for shift in range(n)]
    return orders + [order[::-1] for order in orders] if n % 2 and n > 1 else orders


def time_interleaved(fns: dict, *, rounds: int = 6, gpu_ms=(10, 40), measure=None,
                     errors: dict | None = None) -> dict[str, dict]:
    """``time_fn`` for several callables (peers on the same inputs), in alternating rounds.

    Under sustained load a GPU's clock drifts (an H100 at full power can lose 5-10% over a
    minute), so peers timed one after the other would each see a different clock.  Here every
    round times each callable once, the rounds cycling through ``balanced_orders`` (each
    callable follows every other equally often: pass a multiple of ``len(balanced_orders(n))``
    rounds for an exact balance); each one's result is the median of its rounds' medians, with
    the spread of the rounds as p10/p90.

    ``measure(fn) -> ms`` replaces ``time_fn`` (a CUDA-graph timing, a host-time loop).  With an
    ``errors`` dict, a callable that raises while timed is measured no more, its error is put
    there and it has no result (a peer that refuses an input is a fact, not a crash); without
    one, the exception propagates.
    """
    if measure is None:
        def measure(fn):
            return time_fn(fn, gpu_ms=gpu_ms)["ms"]
    names = list(fns)
    orders = balanced_orders(len(names)) if names else []
    samples = {name: [] for name in names}
    for r in range(rounds if names else 0):
        for i in orders[r % len(orders)]:
            name = names[i]
            if errors is not None and name in errors:
                continue
            try:
                samples[name].append(measure(fns[name]))
            except Exception as exc:
                if errors is None:
                    raise
                errors[name] = f"error: {type(exc).__name__}: {str(exc)[:200]}"
    out = {}
    for name, ms in samples.items():
        if not ms or (errors is not None and name in errors):
            continue
        p10, p90 = (statistics.quantiles(ms, n=10, method="inclusive")[i] for i in (0, -1)) if len(ms) > 1 \
            else (ms[0], ms[0])
        out[name] = dict(ms=statistics.median(ms), ms_p10=p10, ms_p90=p90, rounds=len(ms),
                         timer=("cuda-events (do_bench), " if ON_GPU else "wall-clock, ")
                         + f"median of {len(ms)} interleaved rounds (balanced orders)")
    return out


def back_to_back_ms(fn, n: int = 50) -> float:
    """Wall clock per call of ``n`` calls in a row: what an eager program sees when the host
    (Python, argument checks, launches) and not the GPU is the bottleneck."""
    fn()
    if ON_GPU:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    if ON_GPU:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / n
