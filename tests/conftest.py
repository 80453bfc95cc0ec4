import os

# Tests check answers, not speed: on a GPU, Triton kernels run their shipped or default launch
# configuration instead of tuning every new shape (tuning is the benchmarks' job).
os.environ.setdefault("FA_LAB_TRITON_AUTOTUNE", "0")

# fa_lab must be imported before numba or triton: it chooses the world (GPU or simulator).
import fa_lab  # noqa: E402,F401
import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if fa_lab.ON_GPU:
        return
    skip = pytest.mark.skip(reason="needs a real CUDA GPU (CPU world)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
