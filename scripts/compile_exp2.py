"""How many special-function instructions does 2**x cost on Hopper, unpacked or as packed halves?

    python scripts/compile_exp2.py

PTX has packed exponentials: ``ex2.approx.f16x2`` (two fp16 values in one 32-bit register) and, from sm_90,
``ex2.approx.ftz.bf16x2``.  If one such instruction became one ``MUFU`` instruction for two values, the
softmax's exponentials, one per score on the special function unit (16 per clock per SM), would cost half
as much.  This compiles one small kernel three ways for sm_90 (no GPU needed): ``tl.math.exp2`` in fp32,
and the two packed forms through ``tl.inline_asm_elementwise`` (``pack=2``), and counts, in the SASS, the
``MUFU.EX2`` instructions a thread issues for its values and the conversions around them.  Nothing runs:
``docs/decisions/packed-exp2.md`` says what the count means.
"""
from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

# This compiles for a GPU: the interpreter (set for the CPU world) would swap the kernel for Python functions.
os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # fa_lab.perf.sass, from this checkout

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
#: values per program, and the warps that share them: each thread holds VALUES / (32 * WARPS)
VALUES, WARPS = 2048, 4
#: form -> how the exponential is written
FORMS = {"fp32": 0, "f16x2": 1, "bf16x2": 2}


@triton.jit
def exp2_kernel(X, Y, FORM: tl.constexpr, VALUES: tl.constexpr):
    offs = tl.arange(0, VALUES)
    x = tl.load(X + offs)
    if FORM == 0:
        y = tl.math.exp2(x)
    elif FORM == 1:
        y = tl.inline_asm_elementwise("ex2.approx.f16x2 $0, $1;", "=r,r", [x.to(tl.float16)],
                                      dtype=tl.float16, is_pure=True, pack=2)
    else:
        y = tl.inline_asm_elementwise("ex2.approx.ftz.bf16x2 $0, $1;", "=r,r", [x.to(tl.bfloat16)],
                                      dtype=tl.bfloat16, is_pure=True, pack=2)
    tl.store(Y + offs, y.to(tl.float32))


def describe(form: str) -> dict:
    """The SASS instruction counts of one thread for ``form``: MUFU.EX2 (any width) and conversions."""
    kernel = triton.compile(ASTSource(fn=exp2_kernel, signature={"X": "*fp32", "Y": "*fp32", "FORM": "constexpr",
                                                                 "VALUES": "constexpr"},
                                      constexprs={"FORM": FORMS[form], "VALUES": VALUES}),
                            target=HOPPER, options=dict(num_warps=WARPS))
    with warnings.catch_warnings():
        # fa_lab warns that Triton came first (its own kernels would not run here); only its SASS reader is used
        warnings.simplefilter("ignore", RuntimeWarning)
        from fa_lab.perf import sass
    ops = [r["op"] for r in sass.parse(kernel.asm["sass"])]
    return dict(form=form, values_per_thread=VALUES // (32 * WARPS),
                mufu_ex2=sum(op.startswith("MUFU.EX2") for op in ops),
                mufu_ops=sorted({op for op in ops if op.startswith("MUFU")}),
                conversions=sum(op.startswith("F2FP") for op in ops))


def main() -> None:
    print(f"triton {triton.__version__}, target sm_90, {VALUES} values over {WARPS} warps")
    for form in FORMS:
        print(describe(form), flush=True)


if __name__ == "__main__":
    main()
