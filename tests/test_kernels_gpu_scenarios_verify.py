"""Every verify scenario of tests/test_reference_verify.py on the GPU: kvcanary's numpy
dispatch runs the CUDA kernels (through cupy) next to the reference and compares bytes
after every launch. Skipped, with the reason, when cupy sees no device."""

import pytest

from kernel_harness.gpu import gpu_behind_numpy, gpu_kernels  # noqa: F401
from test_reference_verify import *  # noqa: F401,F403  (re-collect the scenarios here)

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _kernels(gpu_behind_numpy):  # noqa: F811
    yield
