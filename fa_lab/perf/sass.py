"""Reading SASS, the GPU's machine code: instructions, loops, and what the hot loop issues per iteration.

A kernel's SASS comes from ``cuobjdump -sass`` on its cubin (Triton keeps the cubin of every kernel
it compiles, ``compiled.asm["cubin"]``, and ships ``cuobjdump``), or from Triton's own listing
(``compiled.asm["sass"]``), which replaces branch addresses by labels.  Both read the same here::

    from fa_lab.perf import sass
    instrs = sass.parse(text)
    loop = sass.main_loop(instrs)              # the loop with the most Tensor Core instructions
    sass.op_counts(loop["body"])               # {"HGMMA": 16, "MUFU.EX2": 66, "FFMA": ..., ...}

A loop is the span between a backward branch and its target: the instructions one iteration issues
(per thread; a Hopper ``HGMMA`` is issued by each warp of a warpgroup for the warpgroup's tile).
``triton_sass(compiled)`` and ``numba_sass(kernel)`` get the listing of a compiled kernel on a GPU.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

#: cuobjdump's line: ``/*0a40*/   @!P0 HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ ;  /* 0x... */``
_RAW = re.compile(r"^\s*/\*([0-9a-fA-F]{4,})\*/\s+(.*?)\s*;")
#: Triton's listing: ``--:-:-:Y:4\tHGMMA.64x128x16.F32.BF16 R24, ...;`` (control bits, a tab, the instruction)
_TRITON = re.compile(r"^\s*[-\d]{2}:[-\d]:[-\d]:[-Y]:[0-9a-f]+\s+(.*?)\s*;")
#: a label line: ``LBB3:`` (Triton) or ``.L_x_5:`` (nvdisasm)
_LABEL = re.compile(r"^\s*(\.?L[\w.]*):\s*$")
_PREDICATE = re.compile(r"^@!?U?P[0-9T]+\s+")
_BRANCH = re.compile(r"\bBRA(?:\.\S+)?\s+(?:.*,\s*)?`?\(?([\w.]+)\)?\s*$")
#: ``HGMMA.64x128x16.F32.BF16``: the tile shape M x N x K of one warpgroup instruction
_SHAPE = re.compile(r"^[HI]GMMA\.(\d+)x(\d+)x(\d+)")

#: the families worth counting in an attention loop, and what each is
FAMILIES = {
    "HGMMA": "warpgroup Tensor Core matrix multiply-accumulate (wgmma, Hopper)",
    "HMMA": "warp Tensor Core matrix multiply-accumulate (mma.sync)",
    "MUFU.EX2": "2^x on the special function unit",
    "FFMA": "fp32 fused multiply-add",
    "FMUL": "fp32 multiply",
    "FADD": "fp32 add",
    "FMNMX": "fp32 min/max",
    "F2FP": "pack two fp32 into a pair of fp16/bf16",
    "SHFL": "warp shuffle",
    "LDS": "load from shared memory",
    "LDSM": "load a matrix fragment from shared memory",
    "STS": "store to shared memory",
    "LDG": "load from global memory",
    "STG": "store to global memory",
    "UTMALDG": "TMA tile load, global to shared",
    "SYNCS": "mbarrier wait/arrive (TMA completion)",
    "BAR": "barrier across the block",
    "WARPGROUP": "warpgroup fence or wait for outstanding wgmma",
}


def opcode(instruction: str) -> str:
    """The instruction's opcode with its modifiers, predicate dropped: ``@!P0 MUFU.EX2 R3, R4`` -> ``MUFU.EX2``."""
    body = _PREDICATE.sub("", instruction.strip())
    return body.split(None, 1)[0] if body else ""


def family(op: str) -> str:
    """``HGMMA.64x128x16.F32.BF16`` -> ``HGMMA``; ``MUFU.EX2`` stays whole (MUFU does several functions)."""
    return op if op.startswith("MUFU.") else op.split(".", 1)[0]


def parse(text: str) -> list[dict]:
    """Instructions of a SASS listing (the first function in it): ``index``, ``address``, ``op``, ``text``,
    ``target`` (a branch's target address, else None).  Both cuobjdump's and Triton's format."""
    rows, labels, pending, functions = [], {}, [], 0
    for line in text.splitlines():
        if re.match(r"^\s*(Function\s*:|\.text\.)", line):
            functions += 1
            if functions > 1 and rows:
                break
            continue
        m = _LABEL.match(line)
        if m:
            pending.append(m.group(1))
            continue
        m = _RAW.match(line)
        if m:
            address, instruction = int(m.group(1), 16), m.group(2)
        else:
            m = _TRITON.match(line)
            if not m:
                continue
            address, instruction = 16 * len(rows), m.group(1)   # Triton numbers instructions 16 bytes apart
        for name in pending:
            labels[name] = address
        pending = []
        rows.append(dict(index=len(rows), address=address, op=opcode(instruction), text=instruction.strip(),
                         target=None))
    for row in rows:
        if family(row["op"]) == "BRA":
            m = _BRANCH.search(row["text"])
            if m:
                dest = m.group(1)
                row["target"] = int(dest, 16) if dest.lower().startswith("0x") else labels.get(dest)
    return rows


def _leaves(row: dict) -> bool:
    """An ``EXIT`` without a predicate: what follows it is reached only by a jump."""
    return row["op"] == "EXIT" and not row["text"].lstrip().startswith("@")


def loops(instrs: list[dict]) -> list[dict]:
    """Every backward branch's loop: ``start``/``end`` addresses, ``body`` (the instructions of one
    iteration) and its op counts, innermost-first order by size."""
    out = []
    by_address = {r["address"]: r["index"] for r in instrs}
    for r in instrs:
        t = r["target"]
        # t < address: the branch to itself after EXIT, which every kernel ends with, is no loop
        if t is not None and t < r["address"] and t in by_address:
            body = instrs[by_address[t]:r["index"] + 1]
            # a span across an unconditional EXIT is no iteration: it is a slow path placed after the
            # kernel's end (the retry of a TMA barrier wait) jumping back into the loop, and between
            # the two lie the rest of the loop and the epilogue
            if any(_leaves(b) for b in body[:-1]):
                continue
            out.append(dict(start=t, end=r["address"], instructions=len(body), body=body, counts=op_counts(body)))
    return sorted(out, key=lambda lp: lp["instructions"])


def op_counts(instrs: list[dict]) -> Counter:
    """How many instructions of each family (``family``), plus ``total``."""
    c = Counter(family(r["op"]) for r in instrs)
    c["total"] = len(instrs)
    return c


def main_loop(instrs: list[dict]) -> dict | None:
    """The hot loop: the one with the most Tensor Core instructions, then FMAs, then instructions.
    Among loops that tie (an outer loop around the hot one), the innermost."""
    found = loops(instrs)
    if not found:
        return None
    key = lambda lp: (lp["counts"]["HGMMA"] + lp["counts"]["HMMA"], lp["counts"]["FFMA"])  # noqa: E731
    best = max(key(lp) for lp in found)
    return next(lp for lp in found if key(lp) == best)   # sorted innermost first


def mma_flops(instrs: list[dict]) -> float:
    """FLOPs of the ``HGMMA`` instructions as issued by one warpgroup (2·M·N·K each; each of its four
    warps issues the instruction, so a warp's listing counts it once per warpgroup)."""
    total = 0.0
    for r in instrs:
        m = _SHAPE.match(r["op"])
        if m:
            mm, n, k = (int(x) for x in m.groups())
            total += 2 * mm * n * k
    return total


def excerpt(instrs: list[dict], loop: dict | None, max_lines: int = 400) -> str:
    """The loop's instructions as text (address and instruction); past ``max_lines``, its first and
    last instructions (the branch back) with a line saying how many were left out between them."""
    body = loop["body"] if loop else instrs
    tail = min(20, max_lines // 4)
    rows = body if len(body) <= max_lines else [*body[:max_lines - tail], None, *body[-tail:]]
    lines = [f"... {len(body) - max_lines} instructions left out" if r is None
             else f"/*{r['address']:04x}*/  {_addressed(r)} ;" for r in rows]
    return "\n".join(lines) + "\n"


def _addressed(row: dict) -> str:
    """An instruction's text with a branch's label (``BRA `(.L_x_5)``) replaced by its target address:
    an excerpt keeps no label lines, so only the address says where the branch goes."""
    m = _BRANCH.search(row["text"]) if row["target"] is not None else None
    if m is None or m.group(1).lower().startswith("0x"):
        return row["text"]
    return row["text"][:m.start(1)].rstrip("`(") + f"{row['target']:#x}"


def summary(text: str) -> dict:
    """Counts of a whole kernel and of its hot loop: ``instructions`` and ``loop_instructions``,
    ``total_*`` and ``loop_*`` for each family in ``FAMILIES`` (``loop_hgmma``, ``total_mufu_ex2``, ...),
    the loop's addresses, and its Tensor Core FLOPs per iteration (``mma_flops``)."""
    instrs = parse(text)
    whole = op_counts(instrs)
    loop = main_loop(instrs)
    inner = loop["counts"] if loop else Counter()
    out = dict(instructions=len(instrs), loops=len(loops(instrs)), loop_instructions=inner.get("total", 0),
               loop_start=loop["start"] if loop else None, loop_end=loop["end"] if loop else None,
               loop_mma_flops=mma_flops(loop["body"]) if loop else 0.0)
    for name in FAMILIES:
        key = name.replace(".", "_").lower()
        out[f"total_{key}"] = whole.get(name, 0)
        out[f"loop_{key}"] = inner.get(name, 0)
    return out


# --------------------------------------------------------------------------- getting SASS (GPU world)

def compiled_kernels(fn) -> list:
    """The kernels Triton has compiled for a ``@triton.jit`` function in this process, on every device."""
    out = []
    for entry in getattr(fn, "device_caches", {}).values():
        cache = entry[0] if isinstance(entry, tuple) else entry
        out += [k for k in cache.values() if hasattr(k, "asm")]
    return out


def cuobjdump() -> str | None:
    """The ``cuobjdump`` Triton ships (or the CUDA toolkit's on PATH)."""
    try:
        from triton import knobs

        return knobs.nvidia.cuobjdump.path
    except Exception:  # an older Triton
        return shutil.which("cuobjdump")


def of_cubin(cubin: bytes) -> str:
    """``cuobjdump -sass`` of a cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([cuobjdump(), "-sass", f.name], check=True, capture_output=True, text=True,
                              timeout=120).stdout


def triton_sass(compiled) -> str:
    """The SASS of a compiled Triton kernel: cuobjdump's listing (branch addresses kept), else Triton's own."""
    try:
        return of_cubin(compiled.asm["cubin"])
    except Exception:
        return compiled.asm["sass"]


def numba_sass(kernel) -> str:
    """The SASS of a compiled Numba CUDA kernel: through Numba with the ``nvdisasm`` Triton ships, else
    cuobjdump on its cubin."""
    overload = kernel.overloads[kernel.signatures[0]]
    try:
        import triton

        tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
        os.environ["PATH"] = f"{os.environ.get('PATH', '')}{os.pathsep}{tools}"
        return overload.inspect_sass()
    except Exception:
        return of_cubin(overload._codelibrary.get_cubin())


__all__ = ["FAMILIES", "opcode", "family", "parse", "loops", "op_counts", "main_loop", "mma_flops", "excerpt",
           "summary", "compiled_kernels", "cuobjdump", "of_cubin", "triton_sass", "numba_sass"]
