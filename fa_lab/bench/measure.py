"""One measurement, one record: what every chapter and the benchmark suite time an implementation with.

``benchmark`` times a registered implementation or a peer (``fa_lab.bench.peers``) on one
configuration through ``fa_lab.bench.timer`` and returns one record (a dict): time, FLOPs,
TFLOP/s, peak extra memory (measured by the CUDA allocator on a GPU, the registry's model
elsewhere) and, for small sizes, the error against the float64 reference.  ``sweep`` runs it
over sequence lengths; ``to_frame`` and ``plot`` turn records into a table and a figure.
"""
from __future__ import annotations

import torch

from fa_lab.api import attention
from fa_lab.bench.timer import back_to_back_ms, time_fn
from fa_lab.core import registry
from fa_lab.core.dtypes import as_dtype, long_name
from fa_lab.core.flops import spec_flops
from fa_lab.core.testing import random_qkv
from fa_lab.core.world import DEVICE, ON_GPU, WORLD


def peak_extra_bytes(fn, spec, impl) -> tuple[int | None, str]:
    """Peak memory a call needs beyond its inputs and its returned outputs, and where the number comes from."""
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


def resolve(impl: str):
    """``(implementation, registered)``: a registered one, or a peer (PyTorch SDPA, flash-attn)."""
    from fa_lab.bench.peers import get_peer

    peer = get_peer(impl) if isinstance(impl, str) else None
    if peer is not None:
        return peer, False
    return registry.get(impl), True


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


def _timed_call(implementation, registered, q, k, v, spec, mode, mask):
    """``(call, fn, do)``: ``call()`` gives O; ``fn()`` is what is timed for ``mode``."""
    if registered:
        call = lambda: attention(q, k, v, impl=implementation.name, **mask)  # noqa: E731
    else:
        call = lambda: implementation.fn(q, k, v, spec)[0]  # noqa: E731
    if mode == "fwd":
        return call, call, None
    do = torch.randn_like(q)
    if mode == "bwd":
        out = call()
        return call, (lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)), do
    return call, (lambda: torch.autograd.grad(call(), (q, k, v), do)), do


def benchmark(impl: str, *, batch=1, heads=4, seq_len=128, seq_len_k=None, head_dim=64, kv_heads=None,
              dtype="fp32", causal=False, window=(-1, -1), mode="fwd", warmup=3, rep=10, seed=0,
              gpu_ms=None, check_max=None) -> dict:
    """Time one implementation on one configuration; never raises for OOM/unsupported.

    ``impl`` is a registered name or a peer of ``fa_lab.bench.peers`` (``sdpa-flash``, ...).
    ``mode`` is 'fwd', 'bwd' or 'fwd+bwd' (the last two need an implementation with a backward).
    ``check_max``: when B·H·Nq·Nk is at most this, also record ``max_abs_err`` against the float64
    reference (None: off).  On a GPU, calls shorter than a millisecond also get ``ms_back_to_back``.
    A ``KeyboardInterrupt`` is not caught: the caller decides what to keep.
    """
    dtype = as_dtype(dtype)
    record = dict(impl=impl, world=WORLD, batch=batch, heads=heads, kv_heads=kv_heads or heads,
                  n_q=seq_len, n_k=seq_len_k or seq_len, head_dim=head_dim,
                  dtype=long_name(dtype), causal=causal, window=tuple(window), mode=mode)
    try:
        implementation, registered = resolve(impl)
        grad = mode != "fwd"
        if grad and not implementation.backward:
            raise ValueError(f"implementation {impl!r} has no backward; mode {mode!r} needs one")
        q, k, v = random_qkv(batch, heads, seq_len, seq_len_k, head_dim, kv_heads=kv_heads,
                             dtype=dtype, device=DEVICE, seed=seed, requires_grad=grad)
        spec = registry.check(implementation, q, k, v, causal=causal, window=window)
        call, fn, do = _timed_call(implementation, registered, q, k, v, spec, mode, dict(causal=causal, window=window))
        record.update(time_fn(fn, warmup=warmup, rep=rep, gpu_ms=gpu_ms))
        record["flops"] = spec_flops(spec, mode)
        record["tflops"] = record["flops"] / (record["ms"] * 1e-3) / 1e12
        if ON_GPU and record["ms"] < 1.0:
            record["ms_back_to_back"] = back_to_back_ms(fn)
        record["peak_extra_bytes"], record["memory_source"] = peak_extra_bytes(fn, spec, implementation)
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


def sweep(impls, seq_lens, *, progress: bool = True, skip_after_oom: bool = True, **config) -> list[dict]:
    """``benchmark`` every implementation at every sequence length (same other settings).

    Once an implementation runs out of memory at some N, longer N are recorded as
    'oom (skipped)' rather than tried again: the wall is the point, not the retries.
    """
    from tqdm import tqdm  # plain: tqdm.auto warns (with a path) where ipywidgets is absent

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


def to_frame(records):
    """Records → pandas DataFrame, one row per measurement (columns in the records' own order)."""
    import pandas as pd

    return pd.DataFrame.from_records(list(records))


def plot(records, x="n_q", y="ms", hue="impl", ax=None, logy=True, title=None):
    """A line per ``hue`` value of ``y`` against ``x`` (successful runs; the median where several share an x)."""
    import matplotlib.pyplot as plt

    df = to_frame(records)
    df = df[df["status"] == "ok"] if "status" in df else df
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.5))
    for key, part in df.groupby(hue, sort=False):
        line = part.groupby(x)[y].median()
        ax.plot(line.index, line.values, marker="o", label=str(key))
    ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.set_title(title or f"{y} vs {x} ({WORLD} world)")
    ax.legend(fontsize="small")
    ax.grid(True, alpha=0.3)
    return ax
