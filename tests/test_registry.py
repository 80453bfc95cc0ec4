"""The registry's table of modules: the names each one registers, and one name loading one module."""
import json
import subprocess
import sys

import pytest

from fa_lab.core import registry

#: a fresh interpreter, so that no module was imported before the one it asks for
WHAT_EACH_REGISTERS = """
import importlib, json
import fa_lab
from fa_lab.core import registry
seen, out = set(), {}
for module in registry.IMPLEMENTATION_MODULES:
    importlib.import_module(module)
    out[module] = sorted(set(registry._REGISTRY) - seen)
    seen = set(registry._REGISTRY)
print(json.dumps(out))
"""

ONE_NAME = """
import json, sys
import fa_lab
from fa_lab.core import registry
registry.get(sys.argv[1])
print(json.dumps(dict(registered=sorted(registry._REGISTRY), numba="numba" in sys.modules)))
"""


def fresh(code: str, *args) -> dict:
    run = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_each_module_registers_the_names_the_table_gives_it():
    registered = fresh(WHAT_EACH_REGISTERS)
    assert registered == {m: sorted(names) for m, names in registry.IMPLEMENTATION_MODULES.items()}


@pytest.mark.parametrize("name, module", [("triton", "fa_lab.kernels.triton.fwd"),
                                          ("reference", "fa_lab.core.reference"),
                                          ("triton_decode", "fa_lab.kernels.decode.adapter")])
def test_asking_for_one_implementation_imports_only_its_module(name, module):
    got = fresh(ONE_NAME, name)
    # its module's names (and those of a module it imports itself), never the whole table
    assert set(registry.IMPLEMENTATION_MODULES[module]) <= set(got["registered"])
    assert "numba_tiled" not in got["registered"]
    assert not got["numba"]     # none of these needs Numba, and importing it costs a first call most of a second


def test_an_unknown_name_is_refused_with_every_known_one():
    with pytest.raises(ValueError, match="unknown impl 'tritn'; known implementations: reference, ") as refused:
        registry.get("tritn")
    assert all(name in str(refused.value) for names in registry.IMPLEMENTATION_MODULES.values() for name in names)


def test_a_name_the_package_registers_cannot_be_taken_first():
    code = """
import fa_lab
from fa_lab.core import registry
registry.register("triton", chapter=4, description="mine")(lambda q, k, v, spec: None)
try:
    registry.get("triton")
except ValueError as exc:
    print("refused:", exc)
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "refused: implementation 'triton' is registered twice" in run.stdout, run.stdout + run.stderr[-2000:]
