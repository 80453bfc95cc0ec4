"""Checking a forward problem, preparing its inputs, and launching the kernel with one configuration.

``make_launcher(q, k, v, spec)`` does the per-call work once and returns ``launch(cfg)``,
which the tuner calls once per candidate and ``triton_forward`` once with the chosen config.
A repeated call skips the checks and the choice: ``triton_forward`` keeps them as a plan and
runs ``prepare_inputs``, ``new_outputs`` and ``launch_kernel`` alone.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from fa_lab.core.world import ON_GPU
from fa_lab.kernels.triton import fast_launch
from fa_lab.kernels.triton.configs import CONFIG_KEYS, FINAL, Variant, head_dim_pad
from fa_lab.kernels.triton.kernel import LOG2E, attn_fwd
from fa_lab.kernels.triton.policy import device_facts, device_index, host_descriptors_pay, ws_fits_problem

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HEAD_DIMS = (16, 256)


def check_supported(spec, dtype: torch.dtype) -> None:
    """ValueError for what the Triton kernels cannot do (the registry checks dtype and D range)."""
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"triton kernels support float16, bfloat16 and float32, got {dtype}")
    if spec.head_dim_v != spec.head_dim:
        raise ValueError(f"triton kernels need v's head dim equal to q's ({spec.head_dim}), got {spec.head_dim_v}")
    lo, hi = HEAD_DIMS
    if not lo <= spec.head_dim <= hi:
        raise ValueError(f"triton kernels support head dims {lo}..{hi}, got {spec.head_dim}")
    align = 16 // dtype.itemsize
    if spec.head_dim % align:
        raise ValueError(f"triton kernels need head_dim to be a multiple of {align} for {dtype} "
                         f"(rows of 16 bytes for the tensor-descriptor copies), got {spec.head_dim}")


def triton_limits(spec) -> str | None:
    """Why the Triton kernels cannot run ``spec`` (None if they can): the registry's ``limits`` hook."""
    try:
        check_supported(spec, spec.dtype)
    except ValueError as e:
        return str(e)
    return None


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernel computes in: bfloat16 is fp32 in the CPU world (the interpreter has no bf16 math)."""
    return torch.float32 if (not ON_GPU and dtype == torch.bfloat16) else dtype


@dataclass(frozen=True, eq=False)  # eq=False: hashed by identity, one object per problem (lru_cache)
class Problem:
    """What a launch depends on apart from the tensors, worked out once per distinct problem."""

    qk_scale: float
    host_desc: bool
    constexprs: tuple   # (name, value) of the problem's tl.constexpr arguments
    ws_ok: bool         # whether a warp-specialized configuration can run it (ws_fits_problem)
    #: (config as a tuple) -> (grid, constexpr values by name, config as a tuple): a repeated launch looks them up
    launches: dict = field(default_factory=dict)

    def launch_meta(self, cfg: dict, n_q: int, n_k: int, batch_heads: int):
        """Grid and constexpr arguments of one launch configuration (cached per config)."""
        cfg_key = tuple(cfg.get(name) for name in CONFIG_KEYS)
        found = self.launches.get(cfg_key)
        if found is None:
            found = self.launches[cfg_key] = (*self._work_out(cfg, n_q, n_k, batch_heads), cfg_key)
        return found

    def _work_out(self, cfg: dict, n_q: int, n_k: int, batch_heads: int):
        statics = dict(self.constexprs)
        bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
        paired = bool(cfg.get("paired", False))
        n_blocks = triton.cdiv(n_q, bm)
        grid = ((n_blocks + 1) // 2 if paired else n_blocks, batch_heads)
        edge = cfg.get("edge") or min(bn, bm)
        if bn % edge:
            raise ValueError(f"config 'edge' ({edge}) must divide BLOCK_N ({bn})")
        # no mask and whole key tiles: the masked ranges are empty, and compiling the hot
        # loop alone leaves the compiler free to warp-specialize it
        edges = statics["HAS_LEFT"] or statics["HAS_RIGHT"] or n_k % bn != 0
        ws = bool(cfg.get("ws", False))
        if ws:
            if not self.ws_ok:
                raise ValueError("config ws=True cannot run this problem: warp specialization needs n_q % 4 "
                                 f"== 0 (lse goes out through a 16-byte aligned tensor descriptor; n_q={n_q}) "
                                 "and, on Hopper, an unmasked 16-bit problem with D_PAD = 128 whose keys fill "
                                 "whole 128-key tiles")
            # warp specialization needs the descriptors built in the kernel (with host
            # descriptors Triton 3.6 hung on an H100), and stores O and lse through them
            statics["HOST_DESC"] = False
        meta = dict(statics, BLOCK_M=bm, BLOCK_N=bn, BLOCK_N_EDGE=edge, EDGES=edges, PAIRED=paired,
                    WARP_SPECIALIZE=ws, EMU=bool(cfg.get("emu", False)) and statics["EXP2"])
        return grid, meta


@functools.lru_cache(maxsize=1024)
def problem(spec, dtype: torch.dtype, variant: Variant, precision: str, host_desc: bool | None) -> Problem:
    """Checks and launch constants of one problem: a repeated call (a decode loop, a benchmark)
    costs a dictionary lookup here instead of the whole check (per-call host time is what
    small problems are made of)."""
    check_supported(spec, dtype)
    if precision not in ("ieee", "tf32"):
        raise ValueError(f"precision must be 'ieee' or 'tf32', got {precision!r}")
    work = work_dtype(dtype)
    scale = abs(spec.scale)
    if host_desc is None:
        host_desc = ON_GPU and host_descriptors_pay(spec)
    constexprs = (("HEAD_DIM", spec.head_dim), ("D_PAD", head_dim_pad(spec.head_dim)),
                  ("HAS_LEFT", spec.left >= 0), ("HAS_RIGHT", spec.right >= 0), ("EXP2", variant.exp2),
                  ("SKIP_MASKED", variant.skip_masked), ("HOST_DESC", host_desc),
                  ("PRECISION", precision if work == torch.float32 else None))
    major = device_facts(device_index(spec))[1][0] if ON_GPU else 0
    return Problem(scale * LOG2E if variant.exp2 else scale, host_desc, constexprs,
                   ws_fits_problem(spec, work, major))


def prepare_inputs(q, k, v, spec):
    """Contiguous, 16-byte aligned inputs in the dtype the kernel computes in, and the scale.

    The Triton interpreter (CPU world) cannot do bfloat16 arithmetic (``tl.dot`` on bf16
    returns garbage there), so on the CPU, and only there, bf16 inputs are upcast to fp32.
    A negative scale is moved onto q: the kernel's max trick assumes ``scale >= 0``.
    """
    work = work_dtype(q.dtype)
    scale = spec.scale
    if scale < 0:
        q, scale = -q, -scale

    def prep(t):
        if t.dtype != work or not t.is_contiguous():
            t = t.to(work).contiguous()
        return t if t.data_ptr() % 16 == 0 else t.clone()  # TMA needs a 16-byte aligned base

    return prep(q), prep(k), prep(v), scale, work


def descriptor_scratch(size: int, alignment: int, stream):
    """Global memory for the tensor descriptors the kernel builds (128 bytes each, per program)."""
    return torch.empty(size, device="cuda", dtype=torch.int8)


def new_outputs(spec, work: torch.dtype, device):
    """Fresh ``o`` (in the dtype the kernel computes in) and ``lse`` (float32) of one call."""
    o = torch.empty((spec.batch, spec.heads, spec.n_q, spec.head_dim), dtype=work, device=device)
    lse = torch.empty((spec.batch, spec.heads, spec.n_q), dtype=torch.float32, device=device)
    return o, lse


def launch_kernel(prob: Problem, cfg: dict, inputs: tuple, outputs: tuple, spec, *, launch_meta: tuple | None = None,
                  warmup: bool = False):
    """Launch the forward once with configuration ``cfg`` on prepared ``inputs`` (q, k, v) into ``outputs``
    (o, lse); ``warmup=True`` only compiles and returns the compiled kernel.  ``launch_meta`` is
    ``prob.launch_meta`` of ``cfg`` when the caller kept it."""
    q_, k_, v_ = inputs
    B, H, Hkv, Nq, Nk, D = spec.batch, spec.heads, spec.kv_heads, spec.n_q, spec.n_k, spec.head_dim
    grid, meta, cfg_key = launch_meta or prob.launch_meta(cfg, Nq, Nk, B * H)
    rest = (*outputs, prob.qk_scale, Nq, Nk, H, Hkv, spec.left, spec.right)
    if meta["HOST_DESC"]:  # over the rows of all heads, (B·H·N, D)
        bm, bn, bn_edge, d_pad = meta["BLOCK_M"], meta["BLOCK_N"], meta["BLOCK_N_EDGE"], meta["D_PAD"]

        def rows(t, n, block):
            return TensorDescriptor(t.view(n, D), [n, D], [D, 1], [block, d_pad])
        desc_k, desc_v = rows(k_, B * Hkv * Nk, bn), rows(v_, B * Hkv * Nk, bn)
        tensors = (rows(q_, B * H * Nq, bm), desc_k, desc_v,
                   *((desc_k, desc_v) if bn_edge == bn else
                     (rows(k_, B * Hkv * Nk, bn_edge), rows(v_, B * Hkv * Nk, bn_edge))))
    else:
        tensors = (q_, k_, v_, k_, v_)  # the kernel builds its descriptors (edge tiles too)
        if ON_GPU:
            triton.set_allocator(descriptor_scratch)  # a context variable: set it where the launch happens
    warps, stages = cfg["num_warps"], cfg["num_stages"]
    if warmup:
        return attn_fwd.warmup(*tensors, *rest, **meta, num_warps=warps, num_stages=stages, grid=grid)
    if not ON_GPU:
        return attn_fwd[grid](*tensors, *rest, **meta, num_warps=warps, num_stages=stages)
    key = (prob, cfg_key, q_.device.index)  # the problem fixes shapes, masks and dtype
    return fast_launch.launch(attn_fwd, key, grid, (*tensors, *rest), meta, warps, stages)


def make_launcher(q, k, v, spec, *, variant: Variant = FINAL, precision: str = "ieee", host_desc: bool | None = None):
    """Check and prepare the inputs once; return ``(launch, o, lse, work_dtype)``.

    ``launch(cfg)`` runs the kernel with one launch configuration (a dict with BLOCK_M,
    BLOCK_N, num_warps, num_stages and optionally ``paired``), writing into ``o`` and ``lse``;
    the tuner calls it once per candidate.  ``launch(cfg, warmup=True)`` only compiles, and
    returns the compiled kernel.  ``host_desc`` picks where the tensor descriptors are built
    (default: on the host for problems of at least ``policy.HOST_DESC_MIN_FLOPS``).
    """
    prob = problem(spec, q.dtype, variant, precision, host_desc)
    q_, k_, v_, _, work = prepare_inputs(q, k, v, spec)
    o, lse = new_outputs(spec, work, q.device)

    def launch(cfg, warmup=False):
        return launch_kernel(prob, cfg, (q_, k_, v_), (o, lse), spec, warmup=warmup)

    return launch, o, lse, work
