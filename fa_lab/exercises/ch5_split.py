"""Chapter 5's Step 4 as an exercise: the dK/dV kernel written the way Triton can warp-specialize it.

7. ``attention_dkdv_split`` (``dkdv_split_kernel``): exercise 5.5's K/V-stationary kernel with every tile
   loaded and stored through tensor descriptors built in the kernel, and one loop over (query head of the
   group, query block), ``tl.range(..., warp_specialize=WARP_SPECIALIZE)``, the mask applied to every tile.

The descriptors see each tensor as one matrix of rows, every head's sequence after the last, so a tile past
the end of a sequence would read the next head's rows: the cases have whole tiles (sequence lengths multiples
of the tile) and power-of-two head dims.  The grader checks that no pointer load or store is left
(``structure.DescriptorsOnly``): the ones the interpreter runs in the CPU world, the ones in the compiled code
on a GPU.  ``split_report`` compiles a kernel for sm_90, no GPU needed, and says whether Triton split it into a
producer and consumer warpgroups.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

import fa_lab
import fa_lab.exercises.ch5_kernels  # noqa: F401  (the chapter's earlier exercises register first)
from fa_lab.exercises.ch5_kernels import DKDV_MISTAKES, F16, F32, dkdv_reference, kernel_cases
from fa_lab.exercises.registry import Exercise, register_exercise
from fa_lab.exercises.structure import DescriptorsOnly, NoQuadraticBuffer
from fa_lab.kernels.triton.launch import descriptor_scratch

# --------------------------------------------------------------------------- model answer

@triton.jit
def dkdv_split_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, sm_scale, H, HKV, N_Q, N_K,
                      HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    pid_n = tl.program_id(0)                 # which block of keys
    bhk = tl.program_id(1)                   # which (batch, K/V head)
    group = H // HKV
    # every tensor as a 2-D matrix of rows: (B·H·N_Q, D) for the query side, (B·HKV·N_K, D) for keys
    q_rows = tl.num_programs(1) * group * N_Q
    kv_rows = tl.num_programs(1) * N_K
    desc_q = tl.make_tensor_descriptor(Q, [q_rows, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_M, HEAD_DIM])
    desc_do = tl.make_tensor_descriptor(DO, [q_rows, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_M, HEAD_DIM])
    desc_lse = tl.make_tensor_descriptor(LSE, [q_rows], [1], [BLOCK_M])
    desc_delta = tl.make_tensor_descriptor(DELTA, [q_rows], [1], [BLOCK_M])
    desc_k = tl.make_tensor_descriptor(K, [kv_rows, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_N, HEAD_DIM])
    desc_v = tl.make_tensor_descriptor(V, [kv_rows, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_N, HEAD_DIM])
    kv_row = bhk * N_K + pid_n * BLOCK_N
    k = desc_k.load([kv_row, 0])
    v = desc_v.load([kv_row, 0])
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    diag = N_K - N_Q                         # bottom-right: query i sits at key i + diag
    lo = 0
    if CAUSAL:   # earlier query blocks see none of these keys
        lo = tl.maximum(pid_n * BLOCK_N - diag, 0) // BLOCK_M * BLOCK_M
    n_blocks = tl.maximum(tl.cdiv(N_Q - lo, BLOCK_M), 0)
    first = bhk * group * N_Q                # the group's query heads are consecutive rows
    # one loop over (query head of the group, query block): the only form Triton splits
    for it in tl.range(0, group * n_blocks, warp_specialize=WARP_SPECIALIZE):
        g = it // tl.maximum(n_blocks, 1)
        start_m = lo + (it - g * n_blocks) * BLOCK_M
        row = first + g * N_Q + start_m
        q = desc_q.load([row, 0])
        do = desc_do.load([row, 0])
        lse = desc_lse.load([row])
        lse = tl.where(lse == float("-inf"), float("inf"), lse)    # a row that sees no key: P = 0, not NaN
        Di = desc_delta.load([row])
        pT = tl.exp(tl.dot(k, tl.trans(q)) * sm_scale - lse[None, :])
        if CAUSAL:   # the mask on every tile: a second loop for the unmasked ones would stop the split
            offs_m = start_m + tl.arange(0, BLOCK_M)
            pT = tl.where(offs_n[:, None] <= offs_m[None, :] + diag, pT, 0.0)
        dv += tl.dot(pT.to(do.dtype), do)
        dsT = pT * (tl.dot(v, tl.trans(do)) - Di[None, :])
        dk += tl.dot(dsT.to(q.dtype), q)
    desc_dk = tl.make_tensor_descriptor(DK, [kv_rows, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_N, HEAD_DIM])
    desc_dv = tl.make_tensor_descriptor(DV, [kv_rows, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_N, HEAD_DIM])
    desc_dk.store([kv_row, 0], (dk * sm_scale).to(DK.dtype.element_ty))
    desc_dv.store([kv_row, 0], dv.to(DV.dtype.element_ty))


def attention_dkdv_split(q, k, v, o, do, lse, delta, causal=False):
    """(dk, dv) from one K/V-stationary kernel whose loop Triton can warp-specialize."""
    B, H, n_q, d = q.shape
    h_kv, n_k = k.shape[1], k.shape[2]
    q, k, v, do, lse, delta = (t.contiguous() for t in (q, k, v, do, lse, delta))
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    block_m, block_n = fa_lab.pick(cpu=(16, 16), gpu=(64, 128))   # queries per tile, keys per program
    if fa_lab.ON_GPU:
        triton.set_allocator(descriptor_scratch)   # descriptors built in a kernel need scratch memory
    grid = (n_k // block_n, B * h_kv)
    dkdv_split_kernel[grid](q, k, v, do, lse, delta, dk, dv, 1.0 / math.sqrt(d), H, h_kv, n_q, n_k,
                            HEAD_DIM=d, CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n,
                            WARP_SPECIALIZE=False, num_warps=8, num_stages=3)
    # graded unsplit, as the library runs it: Triton 3.6's split of this loop now and then returned a NaN
    # tile (docs/decisions/split-backward-race.md); split_report shows what the split makes of it
    return dk, dv


# --------------------------------------------------------------------------- does Triton split it?

#: compiles the kernel in the file argv[1] for sm_90 and prints what it became, as JSON.  It runs in a
#: fresh Python without TRITON_INTERPRET (the CPU world's interpreter replaces what the compiler needs) and
#: without fa_lab (which would turn the interpreter back on).
_COMPILE = """
import importlib.util, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
spec = importlib.util.spec_from_file_location("kernel_under_test", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
name, head_dim, causal, block_m, block_n = json.loads(sys.argv[2])
signature = {p: "*bf16" for p in ("Q", "K", "V", "DO", "DK", "DV")}
signature.update(LSE="*fp32", DELTA="*fp32", sm_scale="fp32", H="i32", HKV="i32", N_Q="i32", N_K="i32",
                 HEAD_DIM="constexpr", CAUSAL="constexpr", BLOCK_M="constexpr", BLOCK_N="constexpr",
                 WARP_SPECIALIZE="constexpr")
constexprs = dict(HEAD_DIM=head_dim, CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n, WARP_SPECIALIZE=True)
try:
    k = triton.compile(ASTSource(fn=getattr(module, name), signature=signature, constexprs=constexprs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 2})
except Exception as exc:
    print(json.dumps(dict(error=f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}")))
else:
    print(json.dumps(dict(split="ttg.warp_specialize(" in k.asm["ttgir"], warps=k.metadata.num_warps,
                          setmaxnreg=k.asm["ptx"].count("setmaxnreg."))))
"""


def split_report(kernel, *, head_dim: int = 128, causal: bool = True, tile=(64, 128), timeout: float = 300) -> str:
    """Compile ``kernel`` (``dkdv_split_kernel``'s signature) for an sm_90 GPU, no GPU needed, and say
    whether Triton split its loop into a producer and consumer warpgroups."""
    import inspect
    import json
    import os
    import subprocess
    import sys
    import tempfile
    import textwrap
    from pathlib import Path

    fn = getattr(kernel, "fn", kernel)          # the @triton.jit function's Python source, in any world
    source = textwrap.dedent(inspect.getsource(fn))
    where = f"{tile[0]}x{tile[1]} tile, D = {head_dim}, {'causal' if causal else 'no mask'}, 4 warps, sm_90"
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel_under_test.py"
        path.write_text("import math\n\nimport triton\nimport triton.language as tl\n\n\n" + source, encoding="utf-8")
        args = json.dumps([fn.__name__, head_dim, causal, *tile])
        try:
            run = subprocess.run([sys.executable, "-c", _COMPILE, str(path), args], env=env, capture_output=True,
                                 text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return f"{where}: the compiler took longer than {timeout:g} s"
    lines = run.stdout.strip().splitlines()
    if run.returncode != 0 or not lines:
        return f"{where}: the compile did not finish ({(run.stderr.strip().splitlines() or ['no output'])[-1][:300]})"
    result = json.loads(lines[-1])
    if "error" in result:
        return f"{where}: the compiler stopped ({result['error']})"
    if not result["split"]:
        return (f"{where}: not split; the loop compiles as one warpgroup. Check that every tile comes through "
                "a descriptor and that the kernel has one loop, tl.range(..., warp_specialize=WARP_SPECIALIZE).")
    return (f"{where}: split into {result['warps']} warps (a producer and consumer warpgroups), "
            f"{result['setmaxnreg']} setmaxnreg instructions")


# --------------------------------------------------------------------------- cases

SPLIT_SHAPES = fa_lab.pick(  # B, H, Hkv, Nq, Nk, D, causal, dtype, what the case is for: whole tiles only
    cpu=[(1, 1, 1, 16, 16, 16, False, F32, "one tile"),
         (1, 2, 1, 32, 32, 16, True, F16, "causal, 2 query heads per K/V head"),
         (1, 1, 1, 48, 16, 16, True, F32, "Nq > Nk: rows 0-31 see no key, lse = -inf"),
         (2, 4, 2, 16, 48, 32, False, F16, "Nq < Nk, D = 32, GQA 4 -> 2"),
         (1, 2, 1, 64, 64, 16, True, F32, "4 x 4 blocks")],
    gpu=[(2, 8, 2, 1024, 1024, 64, True, F16, "causal, GQA 8 -> 2"),
         (1, 4, 2, 1536, 768, 128, True, F16, "Nq > Nk: rows 0-767 see no key, lse = -inf"),
         # causal with Nq < Nk: a top-left mask hides keys here (P stays <= 1, so that mistake is recognised
         # in fp16); with Nq > Nk it exposes keys whose P overflows fp16
         (2, 8, 2, 256, 1024, 32, True, F16, "Nq < Nk, causal, D = 32"),
         (2, 8, 2, 2048, 2048, 64, False, F16, "full size")],
)

register_exercise(Exercise(
    name="ch5_dkdv_split", chapter=5, title="dK and dV, the loop Triton can warp-specialize",
    signature="attention_dkdv_split(q, k, v, o, do, lse, delta, causal=False) -> (dk, dv)   # as 5.5; lengths "
              "multiples of the tile, head dims powers of two; every load and store through a tensor descriptor",
    solution=dkdv_reference, model_answer=attention_dkdv_split, kind="triton",
    make_cases=lambda seed: kernel_cases(seed, shapes=SPLIT_SHAPES),
    outputs=("dk", "dv"), judge_dtype=torch.float64, mistakes=DKDV_MISTAKES,
    structure=(NoQuadraticBuffer(), DescriptorsOnly()),
    hint="Exercise 5.5's kernel, with tensor descriptors instead of pointers and one loop over (query head, "
         "query block) written tl.range(..., warp_specialize=WARP_SPECIALIZE). hint('ch5_dkdv_split', 1) and on.",
    hints=(
        "A descriptor describes a whole matrix and the tile it copies. View every tensor as rows of length D: "
        "q, do as (B·H·Nq, D), k, v, dk, dv as (B·Hkv·Nk, D), lse and delta as (B·H·Nq,). Where do the rows of "
        "this program's keys start, and where do the rows of its group's query heads start? Then the two nested "
        "loops of 5.5 (heads, query blocks) must become one: which counter gives both?",
        "desc = tl.make_tensor_descriptor(Q, [q_rows, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_M, HEAD_DIM]) with "
        "q_rows = tl.num_programs(1) * (H // HKV) * N_Q; desc.load([row, 0]) gives a [BLOCK_M, HEAD_DIM] tile. "
        "The group's query heads are rows first = bhk · group · N_Q onward, one head every N_Q rows. One loop "
        "`for it in tl.range(0, group * n_blocks, warp_specialize=WARP_SPECIALIZE)` with g = it // n_blocks and "
        "start_m = lo + (it − g · n_blocks) · BLOCK_M. Under the causal mask apply tl.where on every tile.",
        "Inside the loop, row = first + g * N_Q + start_m:\n"
        "  q = desc_q.load([row, 0]); do = desc_do.load([row, 0])\n"
        "  lse = desc_lse.load([row]); lse = tl.where(lse == float('-inf'), float('inf'), lse)\n"
        "  pT = tl.exp(tl.dot(k, tl.trans(q)) * sm_scale - lse[None, :])   # then the causal tl.where\n"
        "  dv += tl.dot(pT.to(do.dtype), do)\n"
        "  dk += tl.dot((pT * (tl.dot(v, tl.trans(do)) - Di[None, :])).to(q.dtype), q)\n"
        "and after the loop: desc_dk.store([kv_row, 0], (dk * sm_scale).to(DK.dtype.element_ty)), the same for dv.",
    ),
))
