# fa_lab must be imported before numba or triton: it chooses the world (GPU or simulator).
import fa_lab  # noqa: F401
import pytest


def pytest_collection_modifyitems(config, items):
    if fa_lab.ON_GPU:
        return
    skip = pytest.mark.skip(reason="needs a real CUDA GPU (CPU world)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
