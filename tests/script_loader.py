"""Load a script of ``scripts/`` as a module, for the tests that call its functions."""
import importlib.util
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str, monkeypatch=None):
    """``scripts/<name>.py`` as a fresh module; given pytest's ``monkeypatch``, it is also importable by
    name while the test runs (code that looks a function's module up, as FlexAttention's tracing does)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    if monkeypatch is not None:
        monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module
