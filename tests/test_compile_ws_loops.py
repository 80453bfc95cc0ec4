"""``scripts/compile_ws_loops.py``: attention loops compiled for sm_90, as their decision records state.

The records (``docs/decisions/one-pass-backward.md``, ``docs/decisions/warp-specialization.md``) say Triton
splits the dK/dV loop into a producer and two consumers at 4 warps and leaves it whole at 8, and that under a
causal mask it splits one masked loop, in the backward and in the forward, but fails on a split loop beside
a second loop for the diagonal; and that the one-pass loop splits only with pointer atomics for dQ and
64-key tiles.  A Triton release that compiles it otherwise fails here, and
the record needs its measurement again.  Compiling needs no GPU; the script runs in a process of its own,
outside the interpreter the CPU world sets.

``scripts/compile_exp2.py`` is checked the same way: ``docs/decisions/packed-exp2.md`` says that a packed
exponential (``ex2.approx.f16x2``, ``ex2.approx.ftz.bf16x2``) still costs one ``MUFU`` instruction per value.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]


def _describe(*tiles, script="compile_ws_loops"):
    """``describe(*t)`` of ``scripts/<script>.py`` for each tuple ``t``, in a fresh process."""
    code = (f"import json, sys; sys.path.insert(0, 'scripts'); import {script} as c; "
            f"print(json.dumps([c.describe(*t) for t in {list(tiles)!r}]))")
    env = dict(os.environ, TRITON_INTERPRET="1")   # what the CPU world sets: the script must undo it
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 5),
                    reason="warp specialization of a tl.range loop needs Triton 3.5 or later")
def test_the_dkdv_loop_is_split_at_four_warps_and_whole_at_eight():
    split, whole = _describe(("dkdv", 64, 128, 4, 2), ("dkdv", 64, 128, 8, 2))
    assert split["split"] == "yes" and split["warps"] == 12 and split["setmaxnreg"] > 0, split
    assert whole["split"] == "no" and whole["warps"] == 8 and whole["setmaxnreg"] == 0, whole
    assert 0 < whole["shared_bytes"] < split["shared_bytes"] <= 232448    # what one H100 block may have


@pytest.mark.skipif(tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 5),
                    reason="warp specialization of a tl.range loop needs Triton 3.5 or later")
@pytest.mark.parametrize("loop,tile", [("dkdv", (64, 128)), ("fwd", (128, 128))])
def test_under_a_causal_mask_only_one_loop_is_split(loop, tile):
    one, two = _describe((f"{loop}_causal_one_loop", *tile, 4, 2), (f"{loop}_causal_two_loops", *tile, 4, 2))
    assert one["split"] == "yes" and one["warps"] == 12 and one["setmaxnreg"] > 0, one
    assert one["shared_bytes"] <= 232448, one
    assert two["split"] == "compile failed", two


@pytest.mark.skipif(tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 5),
                    reason="warp specialization of a tl.range loop needs Triton 3.5 or later")
def test_the_one_pass_loop_is_split_only_with_pointer_atomics_and_64_key_tiles():
    atomic_64, atomic_128, tma_64 = _describe(("one_pass_atomic", 64, 64, 4, 2), ("one_pass_atomic", 64, 128, 4, 2),
                                              ("one_pass", 64, 64, 4, 2))
    assert atomic_64["split"] == "yes" and atomic_64["warps"] == 12 and atomic_64["setmaxnreg"] > 0, atomic_64
    assert atomic_128["split"] == "compile failed", atomic_128
    assert tma_64["split"] == "compile failed", tma_64


def test_a_packed_exponential_still_costs_one_mufu_per_value():
    plain, f16x2, bf16x2 = _describe(("fp32",), ("f16x2",), ("bf16x2",), script="compile_exp2")
    assert plain["mufu_ex2"] == plain["values_per_thread"] and plain["mufu_ops"] == ["MUFU.EX2"], plain
    for packed, op in ((f16x2, "MUFU.EX2.F16"), (bf16x2, "MUFU.EX2.BF16")):
        assert packed["mufu_ops"] == [op], packed
        assert packed["mufu_ex2"] == packed["values_per_thread"], packed       # one per value, not per pair
        assert packed["conversions"] == packed["values_per_thread"] // 2, packed   # a pack per pair on top
