"""The CUDA backend: kernels from ``kernels/`` compiled at run time by CuPy (NVRTC).

Imported only when a launch gets cupy arrays or ``backend="cupy"``; importing kvcanary
itself never imports cupy."""

from __future__ import annotations

from ...format.errors import CanaryRuntimeError


class CudaUnavailable(CanaryRuntimeError):
    """cupy is missing or sees no CUDA device; the message says which."""


_CUPY = None      # cupy, once a device was seen: checked once per process, not per launch
_MISSING = None   # why not, once the check failed: a failed import or driver call is not retried


def require_cupy():
    """Return the cupy module with a usable device, or raise CudaUnavailable. The first
    answer is cached: launches and backend resolutions do not count devices again."""
    global _CUPY, _MISSING
    if _CUPY is not None:
        return _CUPY
    if _MISSING is not None:
        raise CudaUnavailable(_MISSING)
    try:
        _CUPY = _device_cupy()
    except CudaUnavailable as exc:
        _MISSING = exc.detail
        raise
    return _CUPY


def _device_cupy():
    try:
        import cupy
    except ImportError as exc:
        raise CudaUnavailable(
            "the CUDA backend needs cupy: pip install 'kvcanary[cuda13]' "
            "(or [cuda12] for CUDA 12 drivers)"
        ) from exc
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # cupy raises its own CUDARuntimeError without a driver
        raise CudaUnavailable(f"cupy sees no CUDA device ({exc})") from exc
    if count < 1:
        raise CudaUnavailable("cupy sees no CUDA device")
    return cupy


def unavailable_reason() -> str | None:
    """Why the CUDA backend cannot run here (without the message prefix), or None."""
    try:
        require_cupy()
    except CudaUnavailable as exc:
        return exc.detail
    return None


def compile_kernels(max_real_kv_sources: int) -> list:
    """Compile every kernel variant a launch with this source-count bound uses; returns
    ``[(variant name, seconds)]`` (a variant compiled before takes ~0 s)."""
    import time

    require_cupy()
    from . import launch

    timings = []
    for kernel, check in VARIANTS:
        started = time.perf_counter()
        launch.module(kernel, None if kernel == "plan" else max_real_kv_sources, check)
        timings.append((launch.variant_name(kernel, max_real_kv_sources, check),
                        time.perf_counter() - started))
    return timings


# The module variants a launch with one source-count bound uses: (kernel, expected-token check).
VARIANTS = (("verify", False), ("verify", True), ("write", False), ("plan", False))


def variant_names(max_real_kv_sources: int) -> list:
    """Names of the variants :func:`compile_kernels` compiles for a bound."""
    from .launch import variant_name

    return [variant_name(kernel, max_real_kv_sources, check) for kernel, check in VARIANTS]


def compiled_variants() -> list:
    """Names of the kernel variants compiled in this process (``verify_n4_tok1``, ...)."""
    from .launch import COMPILED

    return list(COMPILED)


def kernel_cache_dir() -> str:
    """Where cupy keeps compiled kernels (``CUPY_CACHE_DIR``, default ``~/.cupy/kernel_cache``)."""
    import os

    return os.environ.get("CUPY_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cupy", "kernel_cache")


def backend():
    """The module with ``plan``, ``write``, ``verify`` on cupy arrays."""
    require_cupy()
    from . import launch

    return launch
