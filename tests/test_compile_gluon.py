"""``scripts/compile_gluon.py``: chapter 11's Gluon kernels compiled for sm_90, as their decision records state.

``docs/decisions/gluon-forward.md`` rests on each consumer warpgroup being a partition of its own, whose
barriers (``BAR.SYNC`` with a count) cover its 128 threads and never both warpgroups' 256; the records also
give each kernel's shared memory (under the 232,448 bytes one H100 or H200 block may have) and registers
(consumers get 240 each).  Compiling needs no GPU, so the CPU world checks all of it here, on whatever
Triton it has; the script runs in a process of its own, outside the interpreter the CPU world sets.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]
NEEDS_GLUON = pytest.mark.skipif(tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 5),
                                 reason="Gluon's warp specialization needs Triton 3.5 or later")


@pytest.fixture(scope="module")
def compiled():
    code = ("import json, sys; sys.path.insert(0, 'scripts'); import compile_gluon as c; "
            "print(json.dumps([c.describe(*k) for k in c.KERNELS]))")
    env = dict(os.environ, TRITON_INTERPRET="1")   # what the CPU world sets: the script must undo it
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@NEEDS_GLUON
def test_every_gluon_kernel_compiles_with_one_warpgroup_per_barrier(compiled):
    kinds = {(row["kernel"], row["head_dim"], row["causal"]) for row in compiled}
    assert {("fwd", d, c) for d in (64, 128, 256) for c in (False, True)} <= kinds
    assert {(k, d, c) for k in ("dq", "dkdv") for d in (64, 128) for c in (False, True)} <= kinds
    for row in compiled:
        assert "error" not in row, row
        assert row["barrier_threads"] == [128], row          # one consumer warpgroup, never both
        assert 0 < row["shared_bytes"] <= 232448, row
        assert row["max_register"] < 240, row                # within a consumer's setmaxnreg budget


@NEEDS_GLUON
def test_the_unmasked_kernels_do_not_spill(compiled):
    for row in compiled:
        if not row["causal"]:
            assert row["spill_stores"] == 0, row


@NEEDS_GLUON
def test_the_causal_mask_changes_no_product(compiled):
    # the mask only zeroes scores, so a causal kernel issues as many wgmma instructions as the unmasked one: a count
    # that differs means a branch of its compiled loop lost (or gained) a product
    products = {(row["kernel"], row["head_dim"], row["causal"]): row["products"] for row in compiled}
    for (kind, d, causal), count in products.items():
        if causal:
            assert count == products[(kind, d, False)], (kind, d, products)
