"""Which attention loops does Triton warp-specialize on Hopper?  Compiled for sm_90, no GPU needed.

    python scripts/compile_ws_loops.py

Compiles the backward's loops and the forward's causal loop, each written the way Triton's warp
specialization needs them (tensor descriptors built in the kernel, ``tl.range(..., warp_specialize=True)``),
bf16, D = 128:

* ``dkdv``: the K/V-stationary pass, dV += Pᵀ dO and dK += dSᵀ Q (4 products a query block);
* ``dq``: the Q-stationary pass, dQ += dS K (3 products a key block);
* ``one_pass``: ``dkdv`` that also adds each query block's dQ into an fp32 buffer by a TMA reduce-add;
  ``one_pass_atomic``: the same with pointer atomics (``tl.atomic_add``) instead;
* ``dkdv_causal_one_loop``: ``dkdv`` under a causal mask, one loop over the query blocks that see the key
  block with the mask applied to every tile; ``dkdv_causal_two_loops``: the diagonal blocks masked in a
  loop of their own, the rest in the warp-specialized loop without a mask;
* ``fwd_causal_one_loop``: the forward (S = Q Kᵀ, online softmax, O += P V) of one query block under a
  causal mask, one loop over the key blocks it sees with the mask on every tile; ``fwd_causal_two_loops``:
  the blocks left of the diagonal unmasked in the warp-specialized loop, the diagonal block in a loop of
  its own.

For each tile it prints whether the compiler split the loop into partitions (``ttg.warp_specialize``
in the TTGIR), the warps a program then has, the ``setmaxnreg`` instructions in the PTX and the
shared memory.  Nothing runs: whether a split loop is correct and fast is a GPU measurement
(``docs/decisions/one-pass-backward.md``, ``docs/decisions/warp-specialization.md``).
"""
from __future__ import annotations

import os

# This compiles for a GPU: the interpreter (set for the CPU world) would swap the kernels for Python functions.
os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

HEAD_DIM = 128
HOPPER = GPUTarget("cuda", 90, 32)
#: (loop, BLOCK_M, BLOCK_N, warps, stages)
TILES = [("dkdv", 64, 128, 4, 2), ("dkdv", 32, 128, 4, 2), ("dkdv", 64, 64, 4, 2), ("dkdv", 128, 64, 4, 2),
         ("dkdv", 128, 128, 4, 2), ("dkdv", 64, 128, 8, 2), ("dq", 64, 128, 4, 2), ("dq", 128, 64, 4, 2),
         ("dq", 128, 128, 4, 2), ("one_pass", 64, 128, 4, 2), ("one_pass", 64, 128, 8, 2),
         ("one_pass", 64, 64, 4, 2), ("one_pass_atomic", 64, 128, 4, 2), ("one_pass_atomic", 64, 64, 4, 2),
         ("one_pass_atomic", 128, 64, 4, 2),
         ("dkdv_causal_one_loop", 64, 128, 4, 2), ("dkdv_causal_two_loops", 64, 128, 4, 2),
         ("fwd_causal_one_loop", 128, 128, 4, 2), ("fwd_causal_one_loop", 128, 64, 4, 2),
         ("fwd_causal_one_loop", 128, 64, 4, 3), ("fwd_causal_one_loop", 64, 128, 4, 2),
         ("fwd_causal_one_loop", 128, 128, 8, 2), ("fwd_causal_two_loops", 128, 128, 4, 2),
         ("fwd_causal_two_loops", 128, 64, 4, 2)]
#: how the one-pass loop adds its dQ tile: a TMA reduce-add through a descriptor, or pointer atomics
ONE_PASS_VARIANTS = {"one_pass": 1, "one_pass_atomic": 2}
#: a loop under a causal mask: one loop, the mask on every tile; or the diagonal in a loop of its own
CAUSAL_VARIANTS = {"dkdv_causal_one_loop": 1, "dkdv_causal_two_loops": 2,
                   "fwd_causal_one_loop": 1, "fwd_causal_two_loops": 2}


@triton.jit
def stacked(X, rows, D: tl.constexpr, BLOCK: tl.constexpr):
    """A descriptor over every head's rows stacked, (B·H·N, D), in tiles of BLOCK rows."""
    return tl.make_tensor_descriptor(X, shape=[rows, D], strides=[D, 1], block_shape=[BLOCK, D])


@triton.jit
def dkdv_tile(dk, dv, k, v, q_desc, do_desc, lse_desc, delta_desc, dq_desc, DQ, row0, start_m, offs_n,
              qk_scale, D: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr, ONE_PASS: tl.constexpr):
    q = q_desc.load([row0 + start_m, 0])
    do = do_desc.load([row0 + start_m, 0])
    lse2 = lse_desc.load([row0 + start_m])
    Di = delta_desc.load([row0 + start_m])
    pT = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse2[None, :])
    if MASKED:   # causal: key j is seen by query i >= j
        pT = tl.where(offs_n[:, None] <= start_m + tl.arange(0, BLOCK_M)[None, :], pT, 0.0)
    dv += tl.dot(pT.to(tl.bfloat16), do)
    dsT = pT * (tl.dot(v, tl.trans(do)) - Di[None, :])
    dk += tl.dot(dsT.to(tl.bfloat16), q)
    if ONE_PASS == 1:
        dq_desc.atomic_add([row0 + start_m, 0], tl.dot(tl.trans(dsT.to(tl.bfloat16)), k))
    if ONE_PASS == 2:
        rows = row0 + start_m + tl.arange(0, BLOCK_M)
        tl.atomic_add(DQ + rows[:, None] * D + tl.arange(0, D)[None, :], tl.dot(tl.trans(dsT.to(tl.bfloat16)), k),
                      sem="relaxed")
    return dk, dv


@triton.jit
def dkdv_loop(Q, K, V, DO, LSE2, Delta, DK, DV, DQ, N, qk_scale, sm_scale,
              D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
              ONE_PASS: tl.constexpr, CAUSAL: tl.constexpr):
    # one (batch, head) per program_id(1), rows of every head stacked: (B·H·N, D).  CAUSAL: 0 no mask;
    # 1 one loop over the query blocks that see the key block, the mask on every tile; 2 the diagonal
    # blocks masked in a loop of their own, then the rest unmasked in the warp-specialized loop
    start_n = tl.program_id(0) * BLOCK_N
    rows = tl.num_programs(1) * N
    row0 = tl.program_id(1) * N
    q_desc = stacked(Q, rows, D, BLOCK_M)
    do_desc = stacked(DO, rows, D, BLOCK_M)
    k_desc = stacked(K, rows, D, BLOCK_N)
    v_desc = stacked(V, rows, D, BLOCK_N)
    lse_desc = tl.make_tensor_descriptor(LSE2, shape=[rows], strides=[1], block_shape=[BLOCK_M])
    delta_desc = tl.make_tensor_descriptor(Delta, shape=[rows], strides=[1], block_shape=[BLOCK_M])
    dq_desc = stacked(DQ, rows, D, BLOCK_M)
    k = k_desc.load([row0 + start_n, 0])
    v = v_desc.load([row0 + start_n, 0])
    offs_n = start_n + tl.arange(0, BLOCK_N)
    dk = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    lo = 0
    if CAUSAL == 1:
        lo = start_n
    if CAUSAL == 2:
        for start_m in range(start_n, start_n + BLOCK_N, BLOCK_M):
            dk, dv = dkdv_tile(dk, dv, k, v, q_desc, do_desc, lse_desc, delta_desc, dq_desc, DQ, row0, start_m,
                               offs_n, qk_scale, D=D, BLOCK_M=BLOCK_M, MASKED=True, ONE_PASS=ONE_PASS)
        lo = start_n + BLOCK_N
    for start_m in tl.range(lo, N, BLOCK_M, warp_specialize=True, num_stages=STAGES):
        dk, dv = dkdv_tile(dk, dv, k, v, q_desc, do_desc, lse_desc, delta_desc, dq_desc, DQ, row0, start_m, offs_n,
                           qk_scale, D=D, BLOCK_M=BLOCK_M, MASKED=CAUSAL == 1, ONE_PASS=ONE_PASS)
    dk_desc = stacked(DK, rows, D, BLOCK_N)
    dv_desc = stacked(DV, rows, D, BLOCK_N)
    dk_desc.store([row0 + start_n, 0], (dk * sm_scale).to(tl.bfloat16))
    dv_desc.store([row0 + start_n, 0], dv.to(tl.bfloat16))


@triton.jit
def dq_loop(Q, K, V, DO, LSE2, Delta, DQ, N, qk_scale, sm_scale,
            D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr):
    rows = tl.num_programs(1) * N
    row0 = tl.program_id(1) * N
    m0 = row0 + tl.program_id(0) * BLOCK_M
    q_desc = stacked(Q, rows, D, BLOCK_M)
    do_desc = stacked(DO, rows, D, BLOCK_M)
    k_desc = stacked(K, rows, D, BLOCK_N)
    v_desc = stacked(V, rows, D, BLOCK_N)
    q = q_desc.load([m0, 0])
    do = do_desc.load([m0, 0])
    offs_m = m0 + tl.arange(0, BLOCK_M)
    lse2 = tl.load(LSE2 + offs_m)
    Di = tl.load(Delta + offs_m)
    dq = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    for start_n in tl.range(0, N, BLOCK_N, warp_specialize=True, num_stages=STAGES):
        k = k_desc.load([row0 + start_n, 0])
        v = v_desc.load([row0 + start_n, 0])
        p = tl.math.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse2[:, None])
        ds = p * (tl.dot(do, tl.trans(v)) - Di[:, None])
        dq += tl.dot(ds.to(tl.bfloat16), k)
    dq_desc = stacked(DQ, rows, D, BLOCK_M)
    dq_desc.store([m0, 0], (dq * sm_scale).to(tl.bfloat16))


@triton.jit
def fwd_tile(acc, l_i, m_i, q, k_desc, v_desc, row0, start_n, offs_m, qk_scale,
             BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    k = k_desc.load([row0 + start_n, 0])
    s = tl.dot(q, tl.trans(k)) * qk_scale
    if MASKED:   # causal: query i sees key j <= i
        s = tl.where(start_n + tl.arange(0, BLOCK_N)[None, :] <= offs_m[:, None], s, float("-inf"))
    m_ij = tl.maximum(m_i, tl.max(s, 1))
    p = tl.math.exp2(s - m_ij[:, None])
    alpha = tl.math.exp2(m_i - m_ij)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = v_desc.load([row0 + start_n, 0])
    acc = tl.dot(p.to(tl.bfloat16), v, acc * alpha[:, None])
    return acc, l_i, m_ij


@triton.jit
def fwd_loop(Q, K, V, O, N, qk_scale,
             D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
             CAUSAL: tl.constexpr):
    # one query block of one (batch, head); CAUSAL 1: the key blocks up to the diagonal in one loop, the
    # mask on every tile; 2: the blocks left of the diagonal unmasked (split), the diagonal in a loop of its own
    m0 = tl.program_id(0) * BLOCK_M
    rows = tl.num_programs(1) * N
    row0 = tl.program_id(1) * N
    q_desc = stacked(Q, rows, D, BLOCK_M)
    k_desc = stacked(K, rows, D, BLOCK_N)
    v_desc = stacked(V, rows, D, BLOCK_N)
    q = q_desc.load([row0 + m0, 0])
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    if CAUSAL == 1:
        for start_n in tl.range(0, m0 + BLOCK_M, BLOCK_N, warp_specialize=True, num_stages=STAGES):
            acc, l_i, m_i = fwd_tile(acc, l_i, m_i, q, k_desc, v_desc, row0, start_n, offs_m, qk_scale,
                                     BLOCK_N=BLOCK_N, MASKED=True)
    else:
        for start_n in tl.range(0, m0, BLOCK_N, warp_specialize=True, num_stages=STAGES):
            acc, l_i, m_i = fwd_tile(acc, l_i, m_i, q, k_desc, v_desc, row0, start_n, offs_m, qk_scale,
                                     BLOCK_N=BLOCK_N, MASKED=False)
        for start_n in range(m0, m0 + BLOCK_M, BLOCK_N):
            acc, l_i, m_i = fwd_tile(acc, l_i, m_i, q, k_desc, v_desc, row0, start_n, offs_m, qk_scale,
                                     BLOCK_N=BLOCK_N, MASKED=True)
    o_desc = stacked(O, rows, D, BLOCK_M)
    o_desc.store([row0 + m0, 0], (acc / l_i[:, None]).to(tl.bfloat16))


def compile_loop(loop: str, block_m: int, block_n: int, warps: int, stages: int):
    """The loop compiled for sm_90 (``triton.compile``'s CompiledKernel); raises what the compiler raises."""
    if loop.startswith("fwd"):
        signature = dict(Q="*bf16", K="*bf16", V="*bf16", O="*bf16", N="i32", qk_scale="fp32", D="constexpr",
                         BLOCK_M="constexpr", BLOCK_N="constexpr", STAGES="constexpr", CAUSAL="constexpr")
        constexprs = dict(D=HEAD_DIM, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages, CAUSAL=CAUSAL_VARIANTS[loop])
        return triton.compile(ASTSource(fn=fwd_loop, signature=signature, constexprs=constexprs), target=HOPPER,
                              options={"num_warps": warps, "num_stages": stages})
    fn = dq_loop if loop == "dq" else dkdv_loop
    signature = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "DO": "*bf16", "LSE2": "*fp32", "Delta": "*fp32"}
    signature.update({"DQ": "*bf16"} if loop == "dq" else {"DK": "*bf16", "DV": "*bf16", "DQ": "*fp32"})
    signature.update(N="i32", qk_scale="fp32", sm_scale="fp32", D="constexpr", BLOCK_M="constexpr",
                     BLOCK_N="constexpr", STAGES="constexpr")
    constexprs = dict(D=HEAD_DIM, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages)
    if loop != "dq":
        signature.update(ONE_PASS="constexpr", CAUSAL="constexpr")
        constexprs.update(ONE_PASS=ONE_PASS_VARIANTS.get(loop, 0), CAUSAL=CAUSAL_VARIANTS.get(loop, 0))
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=HOPPER,
                          options={"num_warps": warps, "num_stages": stages})


def describe(loop: str, block_m: int, block_n: int, warps: int, stages: int) -> dict:
    row = dict(loop=loop, tile=f"{block_m}x{block_n}/w{warps}/s{stages}")
    try:
        kernel = compile_loop(loop, block_m, block_n, warps, stages)
    except Exception as exc:   # a pass that fails is a result here, not a crash
        return dict(row, split="compile failed", error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
    ptx = kernel.asm["ptx"]
    split = "ttg.warp_specialize(" in kernel.asm["ttgir"]
    return dict(row, split="yes" if split else "no", warps=kernel.metadata.num_warps,
                setmaxnreg=ptx.count("setmaxnreg."), shared_bytes=kernel.metadata.shared)


def main() -> None:
    print(f"triton {triton.__version__}, target sm_90, D = {HEAD_DIM}, bf16")
    for tile in TILES:
        print(describe(*tile), flush=True)


if __name__ == "__main__":
    main()
