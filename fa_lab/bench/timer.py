"""The timing and memory harness every chapter uses.

On a GPU: ``triton.testing.do_bench`` (CUDA events; it clears the L2 cache between
repetitions, so large inputs are read from HBM), median with p10/p90, and peak extra
memory measured by the CUDA caching allocator.  On the CPU: wall clock of the
simulator/interpreter, labelled as such, and extra memory from the registry's model.

``benchmark`` returns one record (a dict); a list of records becomes a pandas table
with ``to_frame`` and a plot with ``plot``.
"""
from __future__ import annotations

import statistics
import time

import torch

from fa_lab.core import registry
from fa_lab.api import attention
from fa_lab.core.flops import spec_flops
from fa_lab.core.spec import make_spec
from fa_lab.core.testing import random_qkv
from fa_lab.core.world import DEVICE, ON_GPU, WORLD

_DTYPES = {"fp16": torch.float16, "float16": torch.float16, "bf16": torch.bfloat16,
           "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
           "fp64": torch.float64, "float64": torch.float64}


def as_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).replace("torch.", "")]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPES)}") from None


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
        return dict(ms=p50, ms_p10=p10, ms_p90=p90, timer="cuda-events (do_bench)")
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(rep):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    q = statistics.quantiles(samples, n=10) if len(samples) > 1 else samples * 9
    return dict(ms=statistics.median(samples), ms_p10=q[0], ms_p90=q[-1],
                timer="wall-clock (CPU simulator/interpreter)")


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


def time_interleaved(fns: dict, *, rounds: int = 6, gpu_ms=(10, 40)) -> dict[str, dict]:
    """``time_fn`` for several callables (peers on the same inputs), in alternating rounds.

    Under sustained load a GPU's clock drifts (an H100 at full power can lose 5-10% over a
    minute), so peers timed one after the other would each see a different clock.  Here every
    round times each callable once, the rounds cycling through ``balanced_orders`` (each
    callable follows every other equally often: pass a multiple of ``len(balanced_orders(n))``
    rounds for an exact balance); each one's result is the median of its rounds' medians, with
    the spread of the rounds as p10/p90.
    """
    names = list(fns)
    orders = balanced_orders(len(names))
    samples = {name: [] for name in names}
    for r in range(rounds):
        for i in orders[r % len(orders)]:
            samples[names[i]].append(time_fn(fns[names[i]], gpu_ms=gpu_ms)["ms"])
    out = {}
    for name, ms in samples.items():
        p10, p90 = (statistics.quantiles(ms, n=10, method="inclusive")[i] for i in (0, -1)) if rounds > 1 \
            else (ms[0], ms[0])
        out[name] = dict(ms=statistics.median(ms), ms_p10=p10, ms_p90=p90, rounds=rounds,
                         timer=("cuda-events (do_bench), " if ON_GPU else "wall-clock, ")
                         + f"median of {rounds} interleaved rounds (balanced orders)")
    return out


def _peak_extra_bytes(fn, spec, impl) -> tuple[int | None, str]:
    """Peak memory a call needs beyond its inputs and its returned outputs."""
    if ON_GPU and spec.device.type == "cuda" and not impl.host_only:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out = fn()
        torch.cuda.synchronize()
        outs = out if isinstance(out, tuple) else (out,)
        out_bytes = sum(t.numel() * t.element_size() for t in outs if isinstance(t, torch.Tensor))
        extra = torch.cuda.max_memory_allocated() - before - out_bytes
        del out, outs
        return max(extra, 0), "measured (CUDA allocator peak)"
    if impl.extra_memory is None:
        return None, "unknown"
    # host implementations (NumPy, Numba @njit) and the CPU world: the registry's model
    return int(impl.extra_memory(spec)), "model (registry)"


def _back_to_back_ms(fn, n: int = 50) -> float:
    """Wall clock per call of ``n`` calls in a row: what an eager program sees when the host
    (Python, argument checks, launches) and not the GPU is the bottleneck."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / n


def _resolve(impl: str):
    """A registered implementation, or a peer (PyTorch SDPA, flash-attn) from ``fa_lab.bench.peers``."""
    try:
        return registry.get(impl), True
    except ValueError:
        from fa_lab.bench.peers import get_peer

        peer = get_peer(impl) if isinstance(impl, str) else None
        if peer is None:
            raise
        return peer, False


def _check(call, q, k, v, spec, mode, do) -> dict:
    """Max abs error of O (and of dQ, dK, dV for the backward modes) against the float64 reference."""
    from fa_lab.core.reference import reference_attention
    from fa_lab.core.testing import max_error

    q64, k64, v64 = (t.detach().to(torch.float64).requires_grad_(mode != "fwd") for t in (q, k, v))
    ref_o, _ = reference_attention(q64, k64, v64, spec)
    out = {}
    if mode == "fwd":
        with torch.no_grad():
            out["max_abs_err"] = max_error(call(), ref_o)
        return out
    o = call()
    out["max_abs_err"] = max_error(o, ref_o)
    grads = torch.autograd.grad(o, (q, k, v), do)
    ref_grads = torch.autograd.grad(ref_o, (q64, k64, v64), do.to(torch.float64))
    out["max_abs_err_grad"] = max(max_error(g, r) for g, r in zip(grads, ref_grads))
    return out


def benchmark(impl: str, *, batch=1, heads=4, seq_len=128, seq_len_k=None, head_dim=64, kv_heads=None,
              dtype="fp32", causal=False, window=(-1, -1), mode="fwd", warmup=3, rep=10, seed=0,
              gpu_ms=None, check_max=None) -> dict:
    """Time one implementation on one configuration; never raises for OOM/unsupported.

    ``impl`` is a registered name or a peer of ``fa_lab.bench.peers`` (``sdpa-flash``, ...).
    ``mode`` is 'fwd', 'bwd' or 'fwd+bwd' (the last two need an implementation with a backward).
    ``check_max``: when B·H·Nq·Nk is at most this, also record ``max_abs_err`` against the float64
    reference (None: off).  On a GPU, calls shorter than a millisecond also get ``ms_back_to_back``.
    """
    dtype = as_dtype(dtype)
    record = dict(impl=impl, world=WORLD, batch=batch, heads=heads, kv_heads=kv_heads or heads,
                  n_q=seq_len, n_k=seq_len_k or seq_len, head_dim=head_dim,
                  dtype=str(dtype).replace("torch.", ""), causal=causal, window=tuple(window), mode=mode)
    try:
        implementation, registered = _resolve(impl)
        grad = mode != "fwd"
        if grad and not implementation.backward:
            raise ValueError(f"implementation {impl!r} has no backward; mode {mode!r} needs one")
        q, k, v = random_qkv(batch, heads, seq_len, seq_len_k, head_dim, kv_heads=kv_heads,
                             dtype=dtype, device=DEVICE, seed=seed, requires_grad=grad)
        spec = make_spec(q, k, v, causal=causal, window=window)
        why = implementation.unsupported(spec, WORLD)
        if why:
            raise ValueError(why)
        if registered:
            call = lambda: attention(q, k, v, impl=impl, causal=causal, window=window)  # noqa: E731
        else:
            call = lambda: implementation.fn(q, k, v, spec)[0]  # noqa: E731
        do = None
        if mode == "fwd":
            fn = lambda: call()  # noqa: E731
        else:
            do = torch.randn_like(q)
            out = call()
            if mode == "bwd":
                fn = lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)  # noqa: E731
            else:
                fn = lambda: torch.autograd.grad(call(), (q, k, v), do)  # noqa: E731
        record.update(time_fn(fn, warmup=warmup, rep=rep, gpu_ms=gpu_ms))
        record["flops"] = spec_flops(spec, mode)
        record["tflops"] = record["flops"] / (record["ms"] * 1e-3) / 1e12
        if ON_GPU and record["ms"] < 1.0:
            record["ms_back_to_back"] = _back_to_back_ms(fn)
        record["peak_extra_bytes"], record["memory_source"] = _peak_extra_bytes(fn, spec, implementation)
        if check_max is not None and batch * heads * spec.n_q * spec.n_k <= check_max:
            record.update(_check(call, q, k, v, spec, mode, do))
        record["status"] = "ok"
    except torch.cuda.OutOfMemoryError:
        record["status"] = "oom"
    except (ValueError, TypeError) as exc:
        record["status"] = f"unsupported: {exc}"
    except Exception as exc:  # numba's CUDA OOM and friends: recorded, never a crash of a sweep
        record["status"] = "oom" if "out of memory" in str(exc).lower() else f"error: {type(exc).__name__}: {exc}"
    finally:
        if ON_GPU:
            torch.cuda.empty_cache()
    return record


def to_frame(records):
    """Records → pandas DataFrame, one row per measurement."""
    import pandas as pd

    return pd.DataFrame.from_records(list(records))


def plot(records, x="n_q", y="ms", hue="impl", ax=None, logy=True, title=None):
    """A line per ``hue`` value of ``y`` against ``x`` (only successful runs)."""
    import matplotlib.pyplot as plt

    df = to_frame(records)
    df = df[df["status"] == "ok"] if "status" in df else df
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.5))
    for key, part in df.groupby(hue):
        part = part.sort_values(x)
        ax.plot(part[x], part[y], marker="o", label=str(key))
    ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.set_title(title or f"{y} vs {x} ({WORLD} world)")
    ax.legend(fontsize="small")
    ax.grid(True, alpha=0.3)
    return ax


def sweep(impls, seq_lens, *, progress: bool = True, skip_after_oom: bool = True, **config) -> list[dict]:
    """``benchmark`` every implementation at every sequence length (same other settings).

    Once an implementation runs out of memory at some N, longer N are recorded as
    'oom (skipped)' rather than tried again: the wall is the point, not the retries.
    """
    from tqdm.auto import tqdm

    records = []
    hit_wall: set[str] = set()
    jobs = [(impl, n) for impl in impls for n in seq_lens]
    for impl, n in tqdm(jobs, disable=not progress, desc="benchmark", leave=False):
        if skip_after_oom and impl in hit_wall:
            records.append(dict(impl=impl, n_q=n, n_k=n, world=WORLD, status="oom (skipped)"))
            continue
        rec = benchmark(impl, seq_len=n, **config)
        if rec["status"] == "oom":
            hit_wall.add(impl)
        records.append(rec)
    return records
