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

from . import registry
from .api import attention
from .flops import spec_flops
from .spec import make_spec
from .testing import random_qkv
from .world import DEVICE, ON_GPU, WORLD

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


def time_fn(fn, *, warmup: int = 3, rep: int = 10) -> dict:
    """Median, p10 and p90 of ``fn()`` in milliseconds, and how it was measured."""
    if ON_GPU:
        import triton.testing

        # warmup/rep are milliseconds for do_bench; ask for enough to reach a stable median
        p50, p10, p90 = triton.testing.do_bench(fn, warmup=25, rep=100, quantiles=[0.5, 0.1, 0.9])
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


def _peak_extra_bytes(fn, spec, impl) -> tuple[int | None, str]:
    """Peak memory a call needs beyond its inputs and its returned outputs."""
    if ON_GPU and spec.device.type == "cuda":
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
    return int(impl.extra_memory(spec)), "model (registry)"


def benchmark(impl: str, *, batch=1, heads=4, seq_len=128, seq_len_k=None, head_dim=64, kv_heads=None,
              dtype="fp32", causal=False, window=(-1, -1), mode="fwd", warmup=3, rep=10, seed=0) -> dict:
    """Time one registered implementation on one configuration; never raises for OOM/unsupported.

    ``mode`` is 'fwd', 'bwd' or 'fwd+bwd' (the last two need an implementation with a backward).
    """
    dtype = as_dtype(dtype)
    record = dict(impl=impl, world=WORLD, batch=batch, heads=heads, kv_heads=kv_heads or heads,
                  n_q=seq_len, n_k=seq_len_k or seq_len, head_dim=head_dim,
                  dtype=str(dtype).replace("torch.", ""), causal=causal, window=tuple(window), mode=mode)
    try:
        implementation = registry.get(impl)
        grad = mode != "fwd"
        if grad and not implementation.backward:
            raise ValueError(f"implementation {impl!r} has no backward; mode {mode!r} needs one")
        q, k, v = random_qkv(batch, heads, seq_len, seq_len_k, head_dim, kv_heads=kv_heads,
                             dtype=dtype, device=DEVICE, seed=seed, requires_grad=grad)
        spec = make_spec(q, k, v, causal=causal, window=window)
        why = implementation.unsupported(spec, WORLD)
        if why:
            raise ValueError(why)
        call = lambda: attention(q, k, v, impl=impl, causal=causal, window=window)  # noqa: E731
        if mode == "fwd":
            fn = lambda: call()  # noqa: E731
        else:
            do = torch.randn_like(q)
            out = call()
            if mode == "bwd":
                fn = lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)  # noqa: E731
            else:
                fn = lambda: torch.autograd.grad(call(), (q, k, v), do)  # noqa: E731
        record.update(time_fn(fn, warmup=warmup, rep=rep))
        record["tflops"] = spec_flops(spec, mode) / (record["ms"] * 1e-3) / 1e12
        record["peak_extra_bytes"], record["memory_source"] = _peak_extra_bytes(fn, spec, implementation)
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
