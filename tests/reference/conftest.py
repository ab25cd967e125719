"""The scenario files of this folder (plan, write, verify) run on every backend: the numpy
reference alone, the CUDA kernel source compiled for the CPU behind kvcanary's numpy dispatch,
and the CUDA kernels on the GPU (both compared with the reference byte for byte after every
launch, and each run must have compared one launch at least). The scenarios' own assertions
run on every backend's results; test ids end in ``[reference]``, ``[kernels-cpu]`` or
``[kernels-gpu]``."""

import pytest

from kernel_harness.fixtures import assert_compared, cpu_kernels, kernels_behind_numpy  # noqa: F401
from kernel_harness.gpu import gpu_behind_numpy, gpu_kernels  # noqa: F401

SCENARIO_FILES = ("test_reference_plan.py", "test_reference_verify.py",
                  "test_reference_write.py")
BACKENDS = ["reference", "kernels-cpu", pytest.param("kernels-gpu", marks=pytest.mark.gpu)]
# Scenarios that launch nothing (they check a freshly allocated log): the reference only.
NO_LAUNCH = {"test_fresh_log_is_zero"}


def pytest_generate_tests(metafunc):
    if metafunc.definition.path.name in SCENARIO_FILES:
        backends = ["reference"] if metafunc.function.__name__ in NO_LAUNCH else BACKENDS
        metafunc.parametrize("scenario_backend", backends, indirect=True)


@pytest.fixture
def scenario_backend(request):
    name = getattr(request, "param", "reference")
    if name == "reference":
        yield name
        return
    differential = request.getfixturevalue(
        "kernels_behind_numpy" if name == "kernels-cpu" else "gpu_behind_numpy")
    yield name
    assert_compared(differential)


@pytest.fixture(autouse=True)
def _every_backend(scenario_backend):
    """Every test of this folder takes the backend (the reference alone outside the
    scenario files)."""
    yield
