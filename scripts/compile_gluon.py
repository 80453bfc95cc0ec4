"""Chapter 11's Gluon kernels compiled for sm_90 without a GPU: what their SASS says.

    python scripts/compile_gluon.py

For the forward at D = 64, 128 and 256 and the backward's two passes at D = 64 and 128, with and without the
causal mask, prints the shared memory a program takes, the highest register its SASS names, its local-memory
stores (spills), its Tensor Core instructions (``HGMMA``) and the thread counts of its counted barriers
(``BAR.SYNC`` with a count).
``docs/decisions/gluon-forward.md`` rests on the last: each consumer warpgroup, a partition of its own,
synchronizes its own 128 threads, never both warpgroups' 256 (which kept them in step).
``tests/test_compile_gluon.py`` checks it, so a Triton release that compiles the kernels otherwise is noticed.
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

# This compiles for a GPU: the interpreter (set for the CPU world) would swap the kernels for Python functions.
os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fa_lab.kernels.gluon import bwd, copies, fwd  # noqa: E402
from fa_lab.perf import sass  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
#: (pass, head dim, causal)
KERNELS = [(kind, d, causal) for kind, dims in (("fwd", fwd.TILES), ("dq", (64, 128)), ("dkdv", (64, 128)))
           for d in dims for causal in (False, True)]
_BAR = re.compile(r"BAR\.SYNC(?:\.\w+)*\s+(0x[0-9a-f]+|\d+)\s*,\s*(0x[0-9a-f]+|\d+)")


def _desc(rows: int, width: int) -> str:
    layout = gl.NVMMASharedLayout.get_default_for([rows, width], gl.bfloat16)
    return f"tensordesc<bf16[{rows}, {width}],{layout!r}>"


def compile_kernel(kind: str, head_dim: int, causal: bool):
    """The kernel compiled for sm_90 (``triton.compile``'s CompiledKernel), bf16, as the library launches it."""
    scalars = dict(n="i32", heads="i32", kv_heads="i32")
    if kind == "fwd":
        block_n, stages = fwd.TILES[head_dim]
        signature = dict(desc_q=_desc(fwd.BLOCK_M, head_dim), desc_k=_desc(block_n, head_dim),
                         desc_v=_desc(block_n, head_dim), desc_o=_desc(fwd.BLOCK_M, head_dim), LSE="*fp32",
                         qk_scale="fp32", **scalars, n_tiles="i32")
        constexprs = dict(BLOCK_M=fwd.BLOCK_M, BLOCK_N=block_n, HEAD_DIM=head_dim, STAGES=stages, CAUSAL=causal,
                          O_APART=fwd.o_apart(head_dim), CONSUMER_REGS=copies.CONSUMER_REGS)
        fn = fwd.attn_fwd_ws
    else:
        d = _desc(bwd.BLOCK, head_dim)
        if kind == "dq":   # K and V stream past fixed Q and dO tiles
            keys = _desc(bwd.KEY_TILE[head_dim], head_dim)
            tensors = dict(desc_q=d, desc_do=d, desc_k=keys, desc_v=keys, desc_dq=d, O="*bf16", LSE="*fp32")
        else:              # Q and dO stream past fixed K and V tiles
            tensors = dict(desc_q=d, desc_do=d, desc_k=d, desc_v=d, desc_dk=d, desc_dv=d)
        signature = dict(tensors, LSE2="*fp32", Delta="*fp32", **scalars, sm_scale="fp32", qk_scale="fp32")
        constexprs = dict(BLOCK=bwd.BLOCK, HEAD_DIM=head_dim, STAGES=bwd.STAGES, CAUSAL=causal)
        constexprs["SLICES"] = bwd.QUERY_TILE[head_dim] // bwd.BLOCK if kind == "dkdv" else bwd.KEY_SLICES[head_dim]
        constexprs["CONSUMER_REGS"] = copies.CONSUMER_REGS
        fn = bwd.bwd_dq_ws if kind == "dq" else bwd.bwd_dkdv_ws
    signature.update({name: "constexpr" for name in constexprs})
    return triton.compile(GluonASTSource(fn=fn, signature=signature, constexprs=constexprs), target=HOPPER,
                          options=dict(num_warps=4, maxnreg=copies.LAUNCH_REGS))


def describe(kind: str, head_dim: int, causal: bool) -> dict:
    """What the compiled kernel takes and what its SASS says (see the module's docstring)."""
    row = dict(kernel=kind, head_dim=head_dim, causal=causal)
    try:
        compiled = compile_kernel(kind, head_dim, causal)
    except Exception as exc:   # a release that cannot compile it: say so, as a row
        return dict(row, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
    text = sass.of_cubin(compiled.asm["cubin"])
    registers = [int(r) for r in re.findall(r"\bR(\d+)\b", text)]
    return dict(row, shared_bytes=compiled.metadata.shared, max_register=max(registers, default=0),
                spill_stores=len(re.findall(r"\bSTL\b", text)), products=sass.op_counts(sass.parse(text))["HGMMA"],
                barrier_threads=sorted({int(n, 0) for _, n in _BAR.findall(text)}))


def main() -> int:
    print(f"Triton {triton.__version__}, sm_90, bf16")
    for kernel in KERNELS:
        print(describe(*kernel))
    return 0


if __name__ == "__main__":
    sys.exit(main())
