"""The CUDA backend: kernels from ``kernels/`` compiled at run time by CuPy (NVRTC).

Imported only when a launch gets cupy arrays or ``backend="cupy"``; importing kvcanary
itself never imports cupy."""

from __future__ import annotations


class CudaUnavailable(RuntimeError):
    """cupy is missing or sees no CUDA device; the message says which."""


def require_cupy():
    """Return the cupy module with a usable device, or raise CudaUnavailable."""
    try:
        import cupy
    except ImportError as exc:
        raise CudaUnavailable(
            "kv-canary: the CUDA backend needs cupy: pip install 'kvcanary[cuda13]' "
            "(or [cuda12] for CUDA 12 drivers)"
        ) from exc
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # cupy raises its own CUDARuntimeError without a driver
        raise CudaUnavailable(f"kv-canary: cupy sees no CUDA device ({exc})") from exc
    if count < 1:
        raise CudaUnavailable("kv-canary: cupy sees no CUDA device")
    return cupy


def backend():
    """The module with ``plan``, ``write``, ``verify`` on cupy arrays."""
    require_cupy()
    from . import launch

    return launch
