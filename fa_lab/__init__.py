"""fa_lab — the kernels and tooling behind the FlashAttention Lab book.

Import order matters: ``fa_lab.core.world`` sets the simulator/interpreter variables before
anything imports numba or triton.  Importing ``fa_lab`` itself loads nothing heavy (so that
``fa-lab --help`` answers at once): the public names load on first use, and the first import
of numba or triton after ``import fa_lab`` decides the world before it proceeds.
"""
import importlib
import importlib.abc
import sys
from importlib.metadata import PackageNotFoundError, version

try:  # one version number, pyproject.toml's
    __version__ = version("fa_lab")
except PackageNotFoundError:  # imported from a clone that was never installed
    __version__ = "0+unknown"

#: public name -> the module that defines it, loaded on first use
_EXPORTS = {
    "fa_lab.core.world": ("DEVICE", "ON_GPU", "WORLD", "HAS_TRITON", "TRITON_MISSING", "banner", "describe", "pick"),
    "fa_lab.api": ("attention", "flash_attention"),
    "fa_lab.core.flops": ("attention_flops",),
    "fa_lab.core.masks": ("visible",),
    "fa_lab.core.registry": ("get", "implementations", "register"),
    "fa_lab.core.spec": ("AttentionSpec", "make_spec"),
    # chapter 5's course-interface autograd Functions (they load Triton)
    "fa_lab.autograd": ("FlashAttentionPyTorch", "FlashAttentionTriton"),
}
#: public name -> its name in that module, where they differ
_RENAMED = {"get_implementation": "get"}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
_WHERE.update({public: _WHERE.pop(private) for public, private in _RENAMED.items()})
#: the subpackages ``import fa_lab`` has always made attributes (the others are attributes once
#: imported, so that ``from fa_lab import cli`` loads the command alone)
_SUBPACKAGES = ("core", "api")
#: what ``import fa_lab`` loaded before its names became lazy: loaded together on first use, so that
#: ``fa_lab.core.registry`` and the like are there as they always were
_EAGER = ("fa_lab.core.world", "fa_lab.api", "fa_lab.core.flops", "fa_lab.core.masks", "fa_lab.core.registry",
          "fa_lab.core.spec")
#: the libraries that read the world's switches when they are imported
_SWITCHED = ("numba", "numba_cuda", "triton")


class _WorldFirst(importlib.abc.MetaPathFinder):
    """Decides the world (imports ``fa_lab.core.world``) just before numba or triton is first imported.

    It finds nothing itself: it returns None and the ordinary finders import the library, which
    then reads the switches the world has set.  (It stays in ``sys.meta_path``: removing a finder
    while the import system walks that list would skip the finder after it.)
    """

    def find_spec(self, name, path=None, target=None):
        if name in _SWITCHED and "fa_lab.core.world" not in sys.modules:
            importlib.import_module("fa_lab.core.world")
        return None


if any(name in sys.modules for name in _SWITCHED):
    # too late for the switches: the world says so (a warning now, a plain error from the kernels later)
    importlib.import_module("fa_lab.core.world")
elif "fa_lab.core.world" not in sys.modules:
    sys.meta_path.insert(0, _WorldFirst())


def _load() -> None:
    for module in _EAGER:
        importlib.import_module(module)


def __getattr__(name):
    if name in _WHERE:
        _load()
        if _WHERE[name] == "fa_lab.autograd":
            # every registered module first: the registry keeps the book's order
            importlib.import_module("fa_lab.core.registry").implementations()
        value = getattr(importlib.import_module(_WHERE[name]), _RENAMED.get(name, name))
        globals()[name] = value
        return value
    if name in _SUBPACKAGES:
        _load()
        return importlib.import_module(f"fa_lab.{name}")
    raise AttributeError(f"module 'fa_lab' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_WHERE))


__all__ = [
    "DEVICE", "ON_GPU", "WORLD", "HAS_TRITON", "TRITON_MISSING", "banner", "describe", "pick", "attention",
    "attention_flops", "visible", "get_implementation", "implementations", "register", "AttentionSpec", "make_spec",
    "FlashAttentionPyTorch", "FlashAttentionTriton", "flash_attention",
]
