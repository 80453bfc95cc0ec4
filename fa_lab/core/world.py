"""Which world are we in: a real CUDA GPU, or the CPU simulator/interpreter?

The choice is made once, when ``fa_lab`` is first imported, because Numba reads
``NUMBA_ENABLE_CUDASIM`` and Triton reads ``TRITON_INTERPRET`` when *they* are
imported: setting the variables later has no effect.  So this module must run
before anything imports numba or triton, and it must not import them itself.

Force a world with ``FA_LAB_WORLD=gpu`` or ``FA_LAB_WORLD=cpu`` (default ``auto``:
GPU if torch sees CUDA).
"""
from __future__ import annotations

import importlib.util
import os
import sys
import warnings

import torch

_requested = os.environ.get("FA_LAB_WORLD", "auto").strip().lower()
if _requested not in ("auto", "gpu", "cpu"):
    raise ValueError(f"FA_LAB_WORLD must be 'auto', 'gpu' or 'cpu', got {_requested!r}")

if _requested == "gpu" and not torch.cuda.is_available():
    raise RuntimeError("FA_LAB_WORLD=gpu but torch sees no CUDA device")

#: "gpu" (real kernels on a CUDA device) or "cpu" (Numba CUDA simulator + Triton interpreter)
WORLD: str = "gpu" if (_requested == "gpu" or (_requested == "auto" and torch.cuda.is_available())) else "cpu"
ON_GPU: bool = WORLD == "gpu"
#: the torch device every notebook and test allocates on
DEVICE: torch.device = torch.device("cuda" if ON_GPU else "cpu")


def _imported_too_early() -> dict[str, str]:
    """Libraries already imported without their CPU-world switch: their kernels would look for a GPU.

    Numba reads ``NUMBA_ENABLE_CUDASIM`` and Triton ``TRITON_INTERPRET`` when they are imported;
    what was imported before ``fa_lab`` set them keeps the setting it found.
    """
    late = {}
    numba = sys.modules.get("numba")
    if numba is not None and str(getattr(getattr(numba, "config", None), "ENABLE_CUDASIM", "0")) != "1":
        late["numba.cuda"] = "numba"
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0").strip().lower() not in ("1", "true", "on"):
        late["triton"] = "triton"
    return late


#: backend ("numba.cuda", "triton") -> the module imported before fa_lab without the CPU world's switch
_LATE: dict[str, str] = {} if ON_GPU else _imported_too_early()
_FIX = ("import fa_lab before numba/triton, or set NUMBA_ENABLE_CUDASIM=1 and TRITON_INTERPRET=1 "
        "before importing them; restart the kernel (or the Python process)")

if not ON_GPU:
    if _LATE:
        warnings.warn(f"{', '.join(sorted(set(_LATE.values())))} was imported before fa_lab, without the CPU "
                      f"world's simulator/interpreter switch: its kernels will refuse to run. To fix: {_FIX}.",
                      RuntimeWarning, stacklevel=2)
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    os.environ["TRITON_INTERPRET"] = "1"


def _triton_installed() -> bool:
    # find_spec looks for the package without importing it: this module must not import triton
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


#: whether Triton is installed: without it chapter 4's kernels are not registered and chapter 5's
#: Triton engines refuse every call with TRITON_MISSING
HAS_TRITON: bool = _triton_installed()
#: what to tell a reader whose machine has no Triton
TRITON_MISSING: str = ("Triton is not installed: Triton publishes wheels for Linux only, so there are none for "
                       "macOS or native Windows. Run the Triton chapters (4 and 5) on Linux, WSL2 on Windows, "
                       "a GPU box or Colab.")


def import_order_problem(backend: str | None) -> str | None:
    """Why kernels of ``backend`` cannot run in this process (None if they can)."""
    module = _LATE.get(backend) if backend else None
    if module is None:
        return None
    return (f"{module} was imported before fa_lab without the CPU world's switch, so its kernels would look "
            f"for a CUDA GPU this machine does not have. To fix: {_FIX}.")


# Numba warns about small grids on every launch; the book launches small grids on purpose
# (the simulator, tiny test shapes), and the warning would drown the notebooks' output.
os.environ.setdefault("NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS", "0")


def _numpy_compat() -> None:
    # numba-cuda 0.30 registers an overload for np.row_stack when it compiles a kernel, and
    # NumPy 2.5 removed that alias of vstack: every launch failed with AttributeError on the
    # GPU machine (numpy 2.5.2).  Restore the alias until numba-cuda guards it as numba does.
    import numpy as np

    if not hasattr(np, "row_stack"):
        np.row_stack = np.vstack


_numpy_compat()


def pick(cpu, gpu):
    """The one size switch: ``N = pick(cpu=64, gpu=4096)``."""
    return gpu if ON_GPU else cpu


def describe() -> dict:
    """Facts about this world, recorded next to every benchmark."""
    info = {"world": WORLD, "torch": torch.__version__}
    if ON_GPU:
        props = torch.cuda.get_device_properties(0)
        info.update(device=props.name, sm_count=props.multi_processor_count,
                    cuda=torch.version.cuda, capability=f"{props.major}.{props.minor}")
    else:
        info.update(device="cpu (Numba CUDA simulator, Triton interpreter)")
    for mod in ("triton", "numba"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:  # not installed: that is a fact worth recording, not an error
            info[mod] = None
    return info


def banner() -> None:
    """Print one line saying which world this is: the first cell of every notebook calls it.

    It returns nothing, so that a notebook cell ending in ``fa_lab.banner()`` shows the line once.
    """
    if ON_GPU:
        name = torch.cuda.get_device_name(0)
        line = (f"fa_lab world: GPU — {name}, torch {torch.__version__}. "
                "Real kernels, full sizes, timings from CUDA events.")
    else:
        line = ("fa_lab world: CPU — Numba CUDA simulator + Triton interpreter. "
                "Same kernels, tiny sizes; timings are wall clock of the simulation, not GPU speed.")
    print(line)
