"""GPU counterparts of the CPU harness fixtures: the same Differential comparison, with
the kernels run by kvcanary's CUDA backend (cupy) on device copies of the arrays."""

from __future__ import annotations

import pytest

from . import Differential, numpy_runs


class GpuKernels:
    """Backend interface on numpy arrays that runs the CUDA kernels: arrays go to the
    device and changed ones come back, through kvcanary's own ``backend="cupy"`` path."""

    def _launch(self, name, kwargs):
        from kvcanary.api import launches as api

        api._run("cupy", "numpy", name, kwargs)

    def plan(self, **kwargs):
        self._launch("plan", kwargs)

    def write(self, context, plan, **kwargs):
        self._launch("write", dict(context=context, plan=plan, **kwargs))

    def verify(self, context, plan, *, check_expected_token: bool):
        self._launch("verify", dict(context=context, plan=plan,
                                    check_expected_token=check_expected_token))


def require_gpu():
    """cupy with a visible device, or skip with the reason kvcanary gives."""
    from kvcanary.backends.cuda import CudaUnavailable, require_cupy

    try:
        return require_cupy()
    except CudaUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def gpu_kernels():
    require_gpu()
    return GpuKernels()


@pytest.fixture
def gpu_behind_numpy(gpu_kernels):
    differential = Differential(gpu_kernels)
    with numpy_runs(differential):
        yield differential
