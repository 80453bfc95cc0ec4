"""Measuring on the GPU: the ceilings the roofline needs, and one attention kernel on one problem.

A *hardware kernel* is a peer of ``fa_lab.bench.peers`` (``sdpa-flash``, ``sdpa-efficient``,
``sdpa-cudnn``, ``sdpa-math``; the older ``flash``, ``efficient``, … are accepted) or the name of
any implementation registered in ``fa_lab`` (``triton``, ``numba_tiled``, …).  Every timing goes
through ``fa_lab.bench.timer.time_fn`` (CUDA events, median; L2 flushed between runs).
"""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch

from fa_lab.bench import peers
from fa_lab.bench.timer import time_fn
from fa_lab.core.dtypes import as_dtype
from fa_lab.core.world import DEVICE, ON_GPU, WORLD
from fa_lab.perf.model import Problem

#: the SDPA backends a hardware kernel can be
SDPA_BACKENDS = peers.SDPA_BACKENDS


def kernel_names() -> list[str]:
    """What ``--hardware-kernel`` accepts: the SDPA backends, then every registered implementation."""
    from fa_lab.core.registry import implementations

    return list(SDPA_BACKENDS) + [n for n in implementations() if n != "reference"]


def _inputs(p: Problem, seed: int = 0):
    """Standard-normal q, k, v drawn where they will live (on the GPU: no host-side draw of 100M numbers)."""
    dtype = as_dtype(p.dtype)
    g = torch.Generator(device=DEVICE).manual_seed(seed)

    def draw(h, n, d):
        return torch.randn(p.batch, h, n, d, device=DEVICE, generator=g, dtype=torch.float32).to(dtype)

    return draw(p.heads, p.n_q, p.head_dim), draw(p.kv_heads, p.n_k, p.head_dim), draw(p.kv_heads, p.n_k, p.head_dim_v)


def _mask_args(p: Problem) -> dict:
    """``causal``/``window`` of ``fa_lab.attention`` for the model's mask."""
    return dict(causal=p.mask == "causal", window=p.left_right if p.mask == "window" else (-1, -1))


def problem_spec(p: Problem, device=DEVICE):
    """The ``AttentionSpec`` of a problem, without tensors (the model allows Dv != D, which
    ``make_spec`` refuses: SDPA takes it)."""
    from fa_lab.core.masks import effective_window
    from fa_lab.core.spec import AttentionSpec

    mask = _mask_args(p)
    left, right = effective_window(mask["causal"], mask["window"])
    return AttentionSpec(p.batch, p.heads, p.kv_heads, p.n_q, p.n_k, p.head_dim, p.head_dim_v,
                         p.head_dim ** -0.5, mask["causal"], mask["window"], left, right, as_dtype(p.dtype),
                         torch.device(device))


def make_call(kernel: str, p: Problem, seed: int = 0):
    """``fn`` such that ``fn()`` runs the kernel once on inputs drawn here.

    Raises ValueError (with the reason) when the kernel cannot run this problem.
    """
    if p.dtype not in ("fp16", "bf16", "fp32"):
        raise ValueError(f"kernels are measured in fp16, bf16 or fp32; {p.dtype} is a dtype of the model only")
    q, k, v = _inputs(p, seed)
    name = peers.canonical_name(kernel)
    if name in SDPA_BACKENDS:
        # SDPA given the mask as a tensor where its flags cannot say it (correlate models that)
        return peers.bind(name, q, k, v, problem_spec(p, q.device), mask_tensor=True)

    from fa_lab.core.registry import check, get

    impl = get(kernel)   # ValueError listing the known names
    if p.head_dim_v != p.head_dim:
        raise ValueError(f"fa_lab kernels need Dv == D (got D={p.head_dim}, Dv={p.head_dim_v}); the model does not")
    spec = check(impl, q, k, v, **_mask_args(p))
    # straight to the kernel: the spec is checked once here, not on every timed call
    return lambda: impl.fn(q, k, v, spec)


def kernel_blocks(kernel: str, p: Problem) -> dict:
    """``{'block_m', 'block_n', …}`` a fa_lab kernel uses for ``p`` on a GPU (empty if it does not say).

    ``numba_tiled`` compiles one tile shape per head dim; ``triton`` autotunes and caches its
    launch configuration per (dtype, head dim, length bucket, mask), with a default when a shape
    was never tuned.  In the CPU world this is still the *GPU* choice: the model describes a GPU.
    """
    try:
        if kernel == "numba_tiled":
            from fa_lab.kernels.numba import tiled as numba_tiled

            cfg = numba_tiled.GPU_CONFIGS.get(numba_tiled.head_dim_bucket(p.head_dim)) \
                or numba_tiled.config_for(p.head_dim)
            return dict(block_m=cfg.block_m, block_n=cfg.block_n, threads=cfg.threads)
        if kernel == "triton":
            from fa_lab.kernels.triton import CACHE, FINAL, config_key, default_config, head_dim_pad
            from fa_lab.kernels.triton.policy import device_facts

            spec = SimpleNamespace(head_dim=p.head_dim, n_q=p.n_q, n_k=p.n_k, mask=p.mask)
            cfg = None
            if ON_GPU and p.dtype in ("fp16", "bf16", "fp32"):
                key = config_key(spec, as_dtype(p.dtype), FINAL.space)
                device, capability = device_facts(torch.cuda.current_device())
                # the entry the kernel runs: a GPU without entries of its own takes its architecture's
                cfg = CACHE.get(device, key, capability)
            if cfg is None:
                cfg = default_config(FINAL.space, head_dim_pad(p.head_dim), p.n_q, p.mask)
                cfg["source"] = "default (not tuned)"
            return {("block_m" if k == "BLOCK_M" else "block_n" if k == "BLOCK_N" else k): v for k, v in cfg.items()}
    except Exception as exc:  # a kernel module that changed shape: the model falls back to its defaults
        return dict(blocks_error=f"{type(exc).__name__}: {exc}"[:200])
    return {}


def measure(kernel: str, p: Problem, *, rep: int = 10, seed: int = 0) -> dict:
    """Time ``kernel`` on ``p``.

    Returns ``{'status': 'ok', 'ms': …, 'ms_p10', 'ms_p90', 'timer'}``, or a status saying why not.
    """
    out = dict(kernel=peers.canonical_name(kernel), world=WORLD)
    try:
        fn = make_call(kernel, p, seed)
        fn()                                       # compile / pick a kernel outside the timing
        out.update(time_fn(fn, rep=rep))
        out["status"] = "ok"
        out.update(kernel_blocks(out["kernel"], p))
    except torch.cuda.OutOfMemoryError:
        out["status"] = "oom"
    except (ValueError, TypeError, RuntimeError, NotImplementedError) as exc:
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        out["status"] = f"unsupported: {msg[:300]}"
    finally:
        if ON_GPU:
            torch.cuda.empty_cache()
    return out


# ------------------------------------------------------------------------------------------
# Ceilings
# ------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _tf32(allowed: bool):
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = allowed
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def _matmul_ceiling(dtype, n: int, tf32: bool = False) -> float:
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(n, n, device="cuda", dtype=dtype, generator=g)   # random data: zeros run faster
    b = torch.randn(n, n, device="cuda", dtype=dtype, generator=g)
    with _tf32(tf32):
        ms = time_fn(lambda: torch.mm(a, b))["ms"]
    return 2 * n**3 / (ms * 1e-3)


def _copy_ceiling(nbytes: int) -> float:
    x = torch.empty(nbytes // 4, device="cuda", dtype=torch.float32).uniform_()
    y = torch.empty_like(x)
    ms = time_fn(lambda: y.copy_(x))["ms"]
    return 2 * x.numel() * 4 / (ms * 1e-3)           # bytes read + bytes written


def _exp_ceiling() -> float:
    """Exponentials per second: ``exp_probe.exp_chain`` keeps every SM busy with dependent ``exp2``."""
    from fa_lab.perf.exp_probe import exp_chain

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    block, iters, programs = 1024, 2048, sms * 16
    x = torch.zeros(programs * block, device="cuda")
    ms = time_fn(lambda: exp_chain[(programs,)](x, ITERS=iters, BLOCK=block, num_warps=8))["ms"]
    return programs * block * iters / (ms * 1e-3)


def measure_ceilings(*, n: int = 8192, copy_bytes: int = 2 * 2**30) -> list[dict]:
    """The ceilings :meth:`Device.with_ceilings` takes, as records ``{'name', 'value', 'unit', 'how'}``."""
    if not ON_GPU:
        raise RuntimeError("measuring ceilings needs a CUDA GPU (this is the CPU world)")
    jobs = [
        ("tensor_bf16", "FLOP/s", f"torch.mm {n}³ bfloat16, random data", lambda: _matmul_ceiling(torch.bfloat16, n)),
        ("tensor_fp16", "FLOP/s", f"torch.mm {n}³ float16, random data", lambda: _matmul_ceiling(torch.float16, n)),
        ("tensor_tf32", "FLOP/s", f"torch.mm {n}³ float32 with TF32 allowed",
         lambda: _matmul_ceiling(torch.float32, n, tf32=True)),
        ("cuda_fp32", "FLOP/s", f"torch.mm {n}³ float32 with TF32 off (CUDA-core SGEMM)",
         lambda: _matmul_ceiling(torch.float32, n, tf32=False)),
        ("copy_bytes_per_s", "B/s", f"device-to-device copy of {copy_bytes / 2**30:.0f} GiB, bytes read + written",
         lambda: _copy_ceiling(copy_bytes)),
        ("exp_per_s", "1/s", "Triton kernel of dependent exp2 in registers", _exp_ceiling),
    ]
    out = []
    for name, unit, how, fn in jobs:
        rec = dict(name=name, unit=unit, how=how)
        try:
            rec["value"] = float(fn())
            rec["status"] = "ok"
        except Exception as exc:  # one ceiling that fails must not lose the others
            rec["value"] = None
            rec["status"] = f"error: {type(exc).__name__}: {str(exc)[:200]}"
        out.append(rec)
        torch.cuda.empty_cache()
    return out
