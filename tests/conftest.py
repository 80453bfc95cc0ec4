import os
import warnings

# Tests check answers, not speed: on a GPU, Triton kernels run a shipped launch configuration (the
# key's own, or its nearest tuned key's) or the default, and time nothing (tuning is the benchmarks' job).
os.environ.setdefault("FA_LAB_TRITON_AUTOTUNE", "0")

# fa_lab must be imported before numba or triton: it chooses the world (GPU or simulator).
import fa_lab  # noqa: E402,F401
import pytest  # noqa: E402

from fa_lab.core.testing import stable_seed  # noqa: E402

try:
    from hypothesis import HealthCheck, Phase, settings
except ImportError:   # only tests/test_properties.py needs it, and it fails loudly at import
    settings = None

if settings is not None:
    # "ci" (the default): the same examples on every run and machine, no example database, no
    # per-example deadline (the simulator and interpreter are slow and uneven) and no shrinking,
    # whose hundreds of kernel launches would outlast the suite.  "dev" explores fresh examples
    # and shrinks a failure to a minimal one: HYPOTHESIS_PROFILE=dev or --hypothesis-profile=dev.
    _common = dict(deadline=None, database=None, print_blob=True,
                   suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile("ci", derandomize=True, phases=[Phase.explicit, Phase.generate], **_common)
    settings.register_profile("dev", derandomize=False, **_common)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

#: Whole files that build the book or drive a browser: `make test-fast` leaves them out.
SLOW_FILES = {
    "test_book_browser.py",
}

#: Single tests (file::name, any parameters) that take seconds each in the CPU world: they execute
#: notebooks in a fresh kernel, start a fresh Python (importing torch is seconds), wait out a time
#: limit, or run gradcheck / many backward launches in the interpreter.
SLOW_TESTS = {
    "test_grade.py::test_grade_as_shipped_then_with_solutions",
    "test_grade.py::test_grade_survives_a_broken_notebook",
    "test_backward.py::test_triton_gradients_are_bit_identical_run_to_run",
    "test_backward.py::test_torch_tiled_gradcheck_float64",
    "test_cli.py::test_python_dash_m_is_the_same_command",
    "test_cli.py::test_info_is_not_cut_at_80_columns",
    "test_reliability.py::test_numba_or_triton_imported_first_gives_a_plain_error",
    "test_bench.py::test_timer_imports_nothing_of_the_benchmark_suite",
    "test_exercises.py::test_hanging_code_is_stopped",
    "test_compile_gluon.py::test_every_gluon_kernel_compiles_with_one_warpgroup_per_barrier",
    "test_compile_gluon.py::test_the_unmasked_kernels_do_not_spill",
    # launch-strategy variants and the long-sequence grid of the Triton forward: its answers on
    # tails, GQA and every mask stay in the fast tier (test_attention.py's STEP_SHAPE, edge tiles)
    "test_triton_fwd.py::test_descriptors_built_on_the_host_or_in_the_kernel",
    "test_triton_fwd.py::test_exponentials_on_the_fma_units",
    "test_triton_fwd.py::test_masks_tails_and_lengths",
}


@pytest.fixture
def seed(request) -> int:
    """A seed for this test's random inputs, from its id: the same on every run, so a failure replays.

    ``FA_LAB_TEST_SEED=n`` mixes ``n`` in, to draw other inputs for the same tests.
    A failing test's report shows the seed it used.
    """
    value = stable_seed(request.node.nodeid, os.environ.get("FA_LAB_TEST_SEED", ""))
    request.node.user_properties.append(("seed", value))
    return value


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        extra = os.environ.get("FA_LAB_TEST_SEED", "")
        for key, value in item.user_properties:
            if key == "seed":
                report.sections.append(("seed", f"random inputs drawn with seed={value} "
                                                f"(from the test id; FA_LAB_TEST_SEED={extra!r})"))
    return report


def pytest_collection_modifyitems(config, items):
    slow = pytest.mark.slow
    files, matched = set(), set()
    for item in items:
        file = item.path.name
        name = f"{file}::{getattr(item, 'originalname', item.name)}"
        files.add(file)
        if file in SLOW_FILES or name in SLOW_TESTS:
            item.add_marker(slow)
            matched.add(name)
    # a renamed test would silently move into the fast tier: say so
    stale = sorted(n for n in SLOW_TESTS - matched if n.split("::")[0] in files)
    if stale and not any("::" in arg for arg in config.args):   # whole files were collected
        warnings.warn(pytest.PytestConfigWarning(f"conftest SLOW_TESTS names no collected test: {stale}"))
    if fa_lab.ON_GPU:
        return
    skip = pytest.mark.skip(reason="needs a real CUDA GPU (CPU world)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
