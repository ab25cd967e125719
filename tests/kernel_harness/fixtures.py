"""pytest fixtures of the CPU kernel harness; test modules import the ones they use. A test
using ``cpu_kernels`` needs a C++ compiler: tests/conftest.py skips it where there is none."""

from __future__ import annotations

import pytest

from . import CpuKernels, Differential, build_variants, harness_flags_from_env, load, numpy_runs


@pytest.fixture(scope="session")
def cpu_kernels() -> CpuKernels:
    """Kernels compiled for the CPU; 2 'multiprocessors', 8-thread blocks and 4-thread
    write blocks so even small launches span several blocks."""
    flags = harness_flags_from_env()
    # The default bound and the property tests' 1 and 8, compiled side by side up front.
    build_variants([(bound, check) for bound in (1, 4, 8) for check in (False, True)], flags)
    for check in (False, True):
        load(4, check, flags)  # compile the default variants once per session
    return CpuKernels(multiprocessor_count=2, threads_per_block=8, write_threads_per_block=4,
                      flags=flags)


@pytest.fixture
def kernels_behind_numpy(cpu_kernels):
    """Within the test, kvcanary's numpy dispatch runs the reference and the CPU kernels
    side by side and fails on any byte difference."""
    differential = Differential(cpu_kernels)
    with numpy_runs(differential):
        yield differential


def assert_compared(differential: Differential) -> None:
    """A scenario rerun on the kernels must have compared at least one launch."""
    assert differential.compared > 0, "no launch reached the kernels: nothing was compared"
