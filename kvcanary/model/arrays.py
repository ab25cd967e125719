"""Array plumbing shared by every backend: which library an array belongs to, DLPack
entry for foreign arrays (torch, jax) without importing them, and the argument checks
whose messages name the argument at fault."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from . import dlpack
from ..format.errors import CanaryError, CanaryTypeError


_LIBRARIES: dict = {}  # type -> "cupy" or "numpy", learnt once: asked of every argument


def _library_of_type(kind) -> str:
    library = _LIBRARIES[kind] = "cupy" if kind.__module__.split(".")[0] == "cupy" else "numpy"
    return library


def is_cupy_array(x) -> bool:
    return (_LIBRARIES.get(type(x)) or _library_of_type(type(x))) == "cupy"


def library_of(x) -> str:
    """``"numpy"`` or ``"cupy"``: the backend an (already converted) array selects."""
    return _LIBRARIES.get(type(x)) or _library_of_type(type(x))


def as_array(x, name: str, *, untyped_as_bytes: bool = False):
    """Return ``x`` as a numpy or cupy array, sharing memory whenever ``x`` is an array.

    numpy and cupy arrays pass through. Anything with ``__dlpack__`` (torch, jax, ...)
    is imported zero-copy: host memory as numpy, device memory as cupy. An element type
    neither library holds (bf16, fp8, fp4) is refused by name, or with ``untyped_as_bytes``
    imported as its bytes (see :func:`byte_view`). Other array-likes go through
    ``numpy.asarray``; Python lists and ints of integers become int64 arrays. No array is
    converted to another dtype (docs/format.md, "Integer inputs").
    """
    if x is None:
        return None
    if isinstance(x, np.ndarray) or is_cupy_array(x):
        return x
    if dlpack.is_dlpack(x):
        try:
            return _library_from_dlpack(x, name)
        except (BufferError, RuntimeError, TypeError) as exc:
            tensor = dlpack.export(x, name)
            if tensor.numpy_dtype is not None:
                raise CanaryError(f"{name} cannot be imported through DLPack "
                                  f"({exc})", key=name) from exc
        if not untyped_as_bytes:
            raise CanaryError(
                f"{name} has element type {tensor.type_name}, which kvcanary cannot "
                "use here; only real-KV source tensors (and dumped real_kv_* keys) are read "
                "as raw bytes, whatever their element type", key=name)
        view = _dlpack_bytes(tensor)
        if view.array is None:
            raise CanaryError(f"{name} cannot be read as bytes: its last dimension "
                              f"is not unit-stride (strides={view.strides})", key=name)
        return view.array
    try:
        array = np.asarray(x)
    except Exception as exc:
        raise CanaryTypeError(f"{name} is not an array: {type(x).__name__}", key=name) from exc
    # A list is copied anyway: its integers are read as int64 on every platform (numpy's
    # default integer is int32 on some), the dtype of every integer input but the tables'.
    if isinstance(x, (list, tuple, int)) and array.dtype.kind in "iu" \
            and array.dtype.itemsize < 8:
        array = array.astype(np.int64)
    return array


def _library_from_dlpack(x, name: str):
    """numpy's or cupy's own DLPack import (the per-launch path: far cheaper than reading
    the capsule here); they refuse the element types they lack."""
    device_type = dlpack.device(x, name)[0]
    if device_type in dlpack.HOST_DEVICES:
        return np.from_dlpack(x)
    if device_type in dlpack.CUDA_DEVICES:
        return dlpack.import_cupy(name).from_dlpack(x)
    raise CanaryError(f"{name} lives on DLPack device type {device_type}, "
                      "which kvcanary does not support", key=name)


@dataclass(frozen=True)
class ByteView:
    """An array seen as bytes: ``array`` is the ``uint8`` view (the last dimension widened
    to its bytes, every other stride kept), or None when the last dimension is not
    unit-stride (its elements are not one run of bytes). ``shape``, ``strides`` (bytes) and
    ``dtype`` describe the array as given, for messages."""

    array: object
    shape: tuple
    strides: tuple
    dtype: str


def byte_view(x, name: str) -> ByteView:
    """``x`` (numpy, cupy or any DLPack tensor of any element type) viewed as ``uint8``
    without a copy, like a ``tensor.view(uint8)``."""
    if not (isinstance(x, np.ndarray) or is_cupy_array(x)) and dlpack.is_dlpack(x):
        return _dlpack_bytes(dlpack.export(x, name))
    array = as_array(x, name)
    given = dict(shape=tuple(array.shape), strides=tuple(array.strides), dtype=str(array.dtype))
    if not _unit_last_stride(array.shape, array.strides, array.dtype.itemsize):
        return ByteView(None, **given)
    if array.ndim == 0:
        array = array.reshape(1)
    return ByteView(array if array.dtype == np.uint8 else array.view(np.uint8), **given)


def _dlpack_bytes(tensor: dlpack.Tensor) -> ByteView:
    bits = tensor.element_bits
    elements = tensor.element_strides()
    strides = tuple(s * bits // 8 for s in elements)
    given = dict(shape=tensor.shape, strides=strides, dtype=tensor.type_name)
    if not _unit_last_stride(tensor.shape, elements, 1):
        return ByteView(None, **given)
    if not tensor.shape:
        return ByteView(dlpack.byte_array(tensor, (bits // 8,), (1,)), **given)
    shape = tensor.shape[:-1] + (tensor.shape[-1] * bits // 8,)
    return ByteView(dlpack.byte_array(tensor, shape, strides[:-1] + (1,)), **given)


def _unit_last_stride(shape, strides, unit) -> bool:
    return not shape or shape[-1] <= 1 or strides[-1] == unit


_DTYPES: dict = {}  # the dtypes a check allows, as numpy dtypes, converted once
# The dtype sets of check_array for the int64 and int32 arrays of a launch.
INT64, INT32 = (np.int64,), (np.int32,)
# The rule for integer inputs (docs/format.md, "Integer inputs"), as the dtype errors say it.
CONVERTS_NO_ARRAY = ("kvcanary converts no array it is given: plan, write and verify run in "
                     "place on it, without a copy; a Python list is read as int64")


def check_dtype(x, name: str, *dtypes) -> None:
    allowed = _DTYPES.get(dtypes)
    if allowed is None:
        allowed = _DTYPES[dtypes] = tuple(np.dtype(d) for d in dtypes)
    if x.dtype not in allowed:
        wanted = " or ".join(str(d) for d in allowed)
        raise CanaryError(f"{name} must have dtype {wanted}, got {x.dtype} "
                          f"({CONVERTS_NO_ARRAY})", key=name)


def check_ndim(x, name: str, ndim: int) -> None:
    if x.ndim != ndim:
        raise CanaryError(f"{name} must be {ndim}-D, got shape {tuple(x.shape)}", key=name)


def check_length(x, name: str, expected: int) -> None:
    if x.shape[0] != expected:
        raise CanaryError(f"{name} length must be {expected}, got {x.shape[0]}", key=name)


def check_contiguous(x, name: str) -> None:
    if not x.flags.c_contiguous:
        raise CanaryError(f"{name} must be contiguous", key=name)


def data_address(x) -> int:
    """Address of the first element (numpy or cupy); 0 for ``None`` (a launch's null
    pointer). The one place an array's address is read: the checks and the launcher."""
    if type(x) is np.ndarray and _struct_data is not None:
        return _numpy_address(x)
    if x is None:
        return 0
    return int(x.data.ptr) if is_cupy_array(x) else int(x.__array_interface__["data"][0])


class _ArrayInterface(ctypes.Structure):
    """The leading fields of numpy's C-level array interface (``PyArrayInterface``, the
    struct in an array's ``__array_struct__`` capsule), up to the data address."""

    _fields_ = [("two", ctypes.c_int), ("nd", ctypes.c_int), ("typekind", ctypes.c_char),
                ("itemsize", ctypes.c_int), ("flags", ctypes.c_int),
                ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("data", ctypes.c_void_p)]


_DATA_OFFSET = _ArrayInterface.data.offset


def _struct_reader():
    """``(capsule pointer, address reader)`` reading a numpy array's data address from its
    ``__array_struct__`` (a third of the cost of ``__array_interface__``, whose dict is built
    on every read; launches read the addresses of ~20 arrays each), or ``(None, None)``
    where that cannot be done (no CPython API) or reads another address than the dict."""
    try:
        pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
            ("PyCapsule_GetPointer", ctypes.pythonapi))
        read = ctypes.c_void_p.from_address
        for probe in (np.zeros(3, np.int64)[1:], np.zeros((2, 4), np.uint8)[:, ::2]):
            capsule = probe.__array_struct__
            if read(pointer(capsule, None) + _DATA_OFFSET).value != \
                    probe.__array_interface__["data"][0]:
                return None, None
    except (AttributeError, TypeError, ValueError, OSError):
        return None, None
    return pointer, read


_capsule_pointer, _struct_data = _struct_reader()


def _numpy_address(x: np.ndarray) -> int:
    """The data address of a numpy array, from its C array interface (``_struct_reader``
    found it readable)."""
    capsule = x.__array_struct__    # held while its struct is read: freed with it
    return _struct_data(_capsule_pointer(capsule, None) + _DATA_OFFSET).value or 0


def check_aligned(x, name: str, alignment: int | None = None) -> None:
    """The kernels load elements (and canary fields) with aligned loads: a misaligned
    array is a fault on the GPU, so it is refused on every backend."""
    alignment = alignment or x.dtype.itemsize
    if x.size and data_address(x) % alignment:
        raise CanaryError(f"{name} must be aligned to {alignment} bytes, got data "
                          f"starting {data_address(x) % alignment} byte(s) past a boundary",
                          key=name)


def byte_span(x) -> tuple:
    """``(first, past_last)`` byte addresses an array's elements can touch."""
    first = last = data_address(x)
    for extent, stride in zip(x.shape, x.strides):
        reach = (int(extent) - 1) * int(stride)
        first, last = (first + reach, last) if reach < 0 else (first, last + reach)
    return first, last + x.dtype.itemsize


def check_disjoint(arrays: dict) -> None:
    """No two of the named arrays share memory: launches write some of them in place, so
    an alias would shift what the others read (one array passed for two arguments)."""
    spans = sorted((byte_span(array), name) for name, array in arrays.items()
                   if array is not None and getattr(array, "size", 0))
    for ((_, end), first), ((begin, _), second) in zip(spans, spans[1:]):
        if begin < end:
            raise CanaryError(f"{first} and {second} share memory; pass separate "
                              "arrays (a launch writes one of them in place)", key=first)


def array_state(x):
    """What the checks above read of an array, as plain values (type, shape, strides, dtype,
    data address, numpy's writeability): two arrays with equal states pass or fail the same
    checks, so a state that passed once needs no re-check. Never the array itself, whose
    ``==`` compares elements. Anything that is not an array gets a state equal to nothing,
    so it is always checked."""
    kind = type(x)
    if kind is np.ndarray:      # the usual case first: a launch reads ~40 states
        return (kind, x.shape, x.strides, x.dtype,
                _numpy_address(x) if _struct_data is not None else data_address(x),
                x.flags.writeable)
    try:
        if (_LIBRARIES.get(kind) or _library_of_type(kind)) == "cupy":
            return (kind, x.shape, x.strides, x.dtype, x.data.ptr)
        if isinstance(x, np.ndarray):
            return (kind, x.shape, x.strides, x.dtype, data_address(x), x.flags.writeable)
    except AttributeError:  # a cupy object that is not an array
        pass
    return object()


def check_writeable(x, name: str) -> None:
    """Launch outputs are written in place: a read-only array is refused, never written."""
    if isinstance(x, np.ndarray) and not x.flags.writeable:
        raise CanaryError(f"{name} is read-only but the launch writes it", key=name)


def all_writeable(arrays) -> bool:
    """Whether :func:`check_writeable` passes every one of ``arrays``."""
    return all(x.flags.writeable for x in arrays if isinstance(x, np.ndarray))


def check_int64(value, name: str) -> int:
    """A scalar argument as a Python int inside int64 (the kernels take it as int64_t)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise CanaryTypeError(f"{name} must be an integer, got {type(value).__name__}", key=name)
    value = int(value)
    if not -(1 << 63) <= value < (1 << 63):
        raise CanaryError(f"{name} must fit in int64, got {value}", key=name)
    return value


def check_array(x, name: str, dtypes, ndim: int, length: int | None = None) -> int:
    """The usual checks of a kernel argument, in upstream's order of messages. Returns the
    array's data address (0 when it is empty), which the alignment check reads: a launch's
    overlap check of the same argument takes it from here instead of reading it again."""
    allowed = _DTYPES.get(dtypes)
    if (allowed is not None and x.flags.c_contiguous and x.dtype in allowed and x.ndim == ndim
            and (length is None or x.shape[0] == length)):
        address = data_address(x) if x.size else 0
        if not address % x.dtype.itemsize:
            return address  # all pass, tested at once (launches run this per argument)
    check_contiguous(x, name)   # else find which fails, in order
    check_dtype(x, name, *dtypes)
    check_aligned(x, name)
    check_ndim(x, name, ndim)
    if length is not None:
        check_length(x, name, length)
    return data_address(x) if x.size else 0


def same_library(reference_name: str, reference, **arrays) -> str:
    """All given arrays must belong to the library of ``reference``; returns its name."""
    library = library_of(reference)
    libraries = _LIBRARIES
    for name, array in arrays.items():
        if array is not None and (libraries.get(type(array)) or library_of(array)) != library:
            raise CanaryError(
                f"{name} is a {library_of(array)} array but {reference_name} is a "
                f"{library} array; pass arrays of one library (or convert them)", key=name
            )
    return library


def common_library(*arrays) -> str | None:
    """The one library of ``arrays`` (None entries aside), or None when they mix."""
    libraries = {library_of(array) for array in arrays if array is not None}
    return libraries.pop() if len(libraries) == 1 else None


def context_arrays(context, *, sources: bool = True) -> dict:
    """Every array of a :class:`~kvcanary.CanaryContext` by the name errors use, the canary
    buffer first, the real-KV source tensors last (``sources=False`` leaves them out): the
    one list the checks, the device placement and the transfers share."""
    log = context.violation_log
    arrays = {
        "canary_buf": context.canary_buf,
        "violation_ring": log.ring,
        "violation_write_index": log.write_index,
        "slot_run_counter": context.slot_run_counter,
        "kernel_run_counter": context.kernel_run_counter,
        "enable_chain_position_assert": context.enable_chain_position_assert,
    }
    for index, source in enumerate(context.real_kv_sources if sources else ()):
        arrays[f"real_kv_sources[{index}].tensor"] = source.tensor
    return arrays
