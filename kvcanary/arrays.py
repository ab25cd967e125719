"""Array plumbing shared by every backend: which library an array belongs to, DLPack
entry for foreign arrays (torch, jax) without importing them, and the argument checks
whose messages name the argument at fault."""

from __future__ import annotations

import numpy as np

# DLPack device types (dlpack.h): what a foreign array's __dlpack_device__ reports.
_DLPACK_CPU = 1
_DLPACK_CUDA = 2
_DLPACK_CUDA_HOST = 3
_DLPACK_CUDA_MANAGED = 13


def is_cupy_array(x) -> bool:
    return type(x).__module__.split(".")[0] == "cupy"


def library_of(x) -> str:
    """``"numpy"`` or ``"cupy"``: the backend an (already converted) array selects."""
    return "cupy" if is_cupy_array(x) else "numpy"


def as_array(x, name: str):
    """Return ``x`` as a numpy or cupy array, sharing memory whenever ``x`` is an array.

    numpy and cupy arrays pass through. Anything with ``__dlpack__`` (torch, jax, ...)
    is imported zero-copy: host memory as numpy, device memory as cupy. Other array-likes
    go through ``numpy.asarray``.
    """
    if x is None:
        return None
    if isinstance(x, np.ndarray) or is_cupy_array(x):
        return x
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        device_type = int(x.__dlpack_device__()[0])
        if device_type in (_DLPACK_CPU, _DLPACK_CUDA_HOST):
            return np.from_dlpack(x)
        if device_type in (_DLPACK_CUDA, _DLPACK_CUDA_MANAGED):
            try:
                import cupy
            except ImportError as exc:  # pragma: no cover - depends on the machine
                raise ValueError(
                    f"kv-canary: {name} lives in GPU memory; install kvcanary[cuda12] or "
                    f"kvcanary[cuda13] (cupy) to use it"
                ) from exc
            return cupy.from_dlpack(x)
        raise ValueError(f"kv-canary: {name} lives on DLPack device type {device_type}, "
                         f"which kvcanary does not support")
    try:
        return np.asarray(x)
    except Exception as exc:
        raise TypeError(f"kv-canary: {name} is not an array: {type(x).__name__}") from exc


def check_dtype(x, name: str, *dtypes) -> None:
    if x.dtype not in tuple(np.dtype(d) for d in dtypes):
        wanted = " or ".join(str(np.dtype(d)) for d in dtypes)
        raise ValueError(f"kv-canary: {name} must have dtype {wanted}, got {x.dtype}")


def check_ndim(x, name: str, ndim: int) -> None:
    if x.ndim != ndim:
        raise ValueError(f"kv-canary: {name} must be {ndim}-D, got shape {tuple(x.shape)}")


def check_length(x, name: str, expected: int) -> None:
    if x.shape[0] != expected:
        raise ValueError(f"kv-canary: {name} length must be {expected}, got {x.shape[0]}")


def check_contiguous(x, name: str) -> None:
    if not x.flags.c_contiguous:
        raise ValueError(f"kv-canary: {name} must be contiguous")


def data_address(x) -> int:
    """Address of the first element (numpy or cupy)."""
    return int(x.data.ptr) if is_cupy_array(x) else int(x.__array_interface__["data"][0])


def check_aligned(x, name: str, alignment: int | None = None) -> None:
    """The kernels load elements (and canary fields) with aligned loads: a misaligned
    array is a fault on the GPU, so it is refused on every backend."""
    alignment = alignment or x.dtype.itemsize
    if x.size and data_address(x) % alignment:
        raise ValueError(f"kv-canary: {name} must be aligned to {alignment} bytes, got data "
                         f"starting {data_address(x) % alignment} byte(s) past a boundary")


def check_writeable(x, name: str) -> None:
    """Launch outputs are written in place: a read-only array is refused, never written."""
    if isinstance(x, np.ndarray) and not x.flags.writeable:
        raise ValueError(f"kv-canary: {name} is read-only but the launch writes it")


def check_int64(value, name: str) -> int:
    """A scalar argument as a Python int inside int64 (the kernels take it as int64_t)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"kv-canary: {name} must be an integer, got {type(value).__name__}")
    value = int(value)
    if not -(1 << 63) <= value < (1 << 63):
        raise ValueError(f"kv-canary: {name} must fit in int64, got {value}")
    return value


def check_array(x, name: str, dtypes, ndim: int, length: int | None = None) -> None:
    """The usual checks of a kernel argument, in upstream's order of messages."""
    check_contiguous(x, name)
    check_dtype(x, name, *dtypes)
    check_aligned(x, name)
    check_ndim(x, name, ndim)
    if length is not None:
        check_length(x, name, length)


def same_library(reference_name: str, reference, **arrays) -> str:
    """All given arrays must belong to the library of ``reference``; returns its name."""
    library = library_of(reference)
    for name, array in arrays.items():
        if array is not None and library_of(array) != library:
            raise ValueError(
                f"kv-canary: {name} is a {library_of(array)} array but {reference_name} is a "
                f"{library} array; pass arrays of one library (or convert them)"
            )
    return library
