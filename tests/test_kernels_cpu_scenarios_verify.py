"""Every verify scenario of tests/test_reference_verify.py again, with kvcanary's numpy
dispatch running the CUDA kernel source compiled for the CPU next to the reference and
comparing bytes after every launch (kernel_harness.Differential). The scenarios' own
assertions also run, now on the kernels' results."""

import pytest

from kernel_harness.fixtures import assert_compared, cpu_kernels, kernels_behind_numpy  # noqa: F401
from test_reference_verify import *  # noqa: F401,F403  (re-collect the scenarios here)


# Scenarios that launch nothing (they check a freshly allocated log).
NO_LAUNCH = {"test_fresh_log_is_zero"}


@pytest.fixture(autouse=True)
def _kernels(request, kernels_behind_numpy):  # noqa: F811
    yield
    if request.node.originalname not in NO_LAUNCH:
        assert_compared(kernels_behind_numpy)
