"""DLPack import without the producer's library: the exported ``DLTensor`` is read
directly, so a tensor of an element type numpy and cupy lack (bf16, fp8, packed fp4) can
still be seen as its bytes, zero-copy, on the CPU and on a CUDA device.

The capsule is asked for as numpy's and cupy's ``from_dlpack`` ask for it (``max_version``
1.0, the consumer's stream on a CUDA device, a legacy call when the producer predates those
keywords), with ``copy=False``: the bytes seen must be the producer's own. The capsule is kept
unconsumed inside the returned view's owner, so the producer's capsule destructor frees the
tensor only once kvcanary drops the last view of it.
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass

import numpy as np

from ..format.errors import CanaryError

# dlpack.h device types
CPU, CUDA, CUDA_HOST, CUDA_MANAGED = 1, 2, 3, 13
HOST_DEVICES = (CPU, CUDA_HOST)
CUDA_DEVICES = (CUDA, CUDA_MANAGED)

# dlpack.h type codes, for naming an element type in messages.
_TYPE_CODES = {
    0: "int", 1: "uint", 2: "float", 3: "opaque handle", 4: "bfloat", 5: "complex", 6: "bool",
    7: "float8_e3m4", 8: "float8_e4m3", 9: "float8_e4m3b11fnuz", 10: "float8_e4m3fn",
    11: "float8_e4m3fnuz", 12: "float8_e5m2", 13: "float8_e5m2fnuz", 14: "float8_e8m0fnu",
    15: "float6_e2m3fn", 16: "float6_e3m2fn", 17: "float4_e2m1fn",
}
# The element types numpy and cupy hold as numbers: (code, bits) -> dtype.
_NUMPY_TYPES = {
    (0, 8): np.int8, (0, 16): np.int16, (0, 32): np.int32, (0, 64): np.int64,
    (1, 8): np.uint8, (1, 16): np.uint16, (1, 32): np.uint32, (1, 64): np.uint64,
    (2, 16): np.float16, (2, 32): np.float32, (2, 64): np.float64,
    (5, 64): np.complex64, (5, 128): np.complex128, (6, 8): np.bool_,
}
_FLAG_READ_ONLY = 1 << 0
_FLAG_SUBBYTE_PADDED = 1 << 2


# dlpack.h structs as struct formats:
# DLTensor {void* data; DLDevice {int32 type, id}; int32 ndim; DLDataType {uint8 code, bits;
# uint16 lanes}; int64* shape; int64* strides; uint64 byte_offset}; DLManagedTensor starts
# with it; DLManagedTensorVersioned starts with {uint32 major, minor}, manager_ctx, deleter,
# uint64 flags, then the DLTensor.
_DL_TENSOR = struct.Struct("<QiiiBBHQQQ")
_VERSIONED_HEAD = struct.Struct("<IIQQQ")


_capsule_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_is_valid.argtypes = (ctypes.py_object, ctypes.c_char_p)
_capsule_is_valid.restype = ctypes.c_int
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.argtypes = (ctypes.py_object, ctypes.c_char_p)
_capsule_pointer.restype = ctypes.c_void_p


def is_dlpack(x) -> bool:
    return hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__")


def device(x, name: str) -> tuple:
    """``(device_type, device_id)`` of a DLPack producer; a tensor DLPack cannot describe
    (torch's ``meta`` device, which holds no data) is one error naming the argument."""
    try:
        device_type, device_id = (int(v) for v in x.__dlpack_device__())
    except (ValueError, TypeError, RuntimeError, BufferError) as exc:
        where = getattr(x, "device", None)
        where = f" on device {where}" if where is not None else ""
        raise CanaryError(f"{name} is a {type(x).__name__}{where}, which DLPack cannot share "
                          f"({exc}); pass a tensor in CPU or CUDA memory", key=name) from None
    return device_type, device_id


@dataclass(frozen=True)
class Tensor:
    """What an exported ``DLTensor`` says, with strides in elements (``None``: compact)."""

    device_type: int
    device_id: int
    code: int
    bits: int
    lanes: int
    data: int
    shape: tuple
    strides: tuple | None
    read_only: bool
    capsule: object  # kept alive (unconsumed) for as long as a view of the data exists

    @property
    def element_bits(self) -> int:
        return self.bits * self.lanes

    @property
    def type_name(self) -> str:
        name = _TYPE_CODES.get(self.code, f"type code {self.code}")
        name = name if name.startswith("float") and "_" in name else f"{name}{self.bits}"
        return name if self.lanes == 1 else f"{name}x{self.lanes}"

    @property
    def numpy_dtype(self) -> np.dtype | None:
        """The numpy/cupy dtype of the elements, or None for a type they lack."""
        dtype = _NUMPY_TYPES.get((self.code, self.bits)) if self.lanes == 1 else None
        return None if dtype is None else np.dtype(dtype)

    def element_strides(self) -> tuple:
        if self.strides is not None:
            return self.strides
        strides, step = [], 1
        for extent in reversed(self.shape):
            strides.append(step)
            step *= max(1, extent)
        return tuple(reversed(strides))


def export(x, name: str) -> Tensor:
    """Ask ``x`` for its DLPack capsule and read the ``DLTensor`` inside."""
    device_type, device_id = device(x, name)
    if device_type in HOST_DEVICES:
        capsule = _call_dlpack(x, name, stream=None)
    elif device_type in CUDA_DEVICES:
        cupy = import_cupy(name)
        with cupy.cuda.Device(device_id):
            # The producer orders its work before this stream (1: the legacy default stream).
            capsule = _call_dlpack(x, name, stream=cupy.cuda.get_current_stream().ptr or 1)
    else:
        raise CanaryError(f"{name} lives on DLPack device type {device_type}, "
                          "which kvcanary does not support", key=name)
    return _read_capsule(capsule, name)


def import_cupy(name: str):
    try:
        import cupy
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise CanaryError(f"{name} lives in GPU memory; install kvcanary[cuda12] or "
                          "kvcanary[cuda13] (cupy) to use it", key=name) from exc
    return cupy


def _call_dlpack(x, name: str, stream):
    try:
        return x.__dlpack__(stream=stream, max_version=(1, 0), copy=False)
    except TypeError:
        pass  # a producer older than the versioned protocol: no max_version or copy keywords
    except BufferError as exc:
        raise CanaryError(f"{name} cannot be shared without a copy ({exc})", key=name) from None
    return x.__dlpack__() if stream is None else x.__dlpack__(stream=stream)


def _read_capsule(capsule, name: str) -> Tensor:
    if _capsule_is_valid(capsule, b"dltensor_versioned"):
        address = _capsule_pointer(capsule, b"dltensor_versioned")
        major, minor, _, _, flags = _VERSIONED_HEAD.unpack(
            ctypes.string_at(address, _VERSIONED_HEAD.size))
        if major > 1:
            raise CanaryError(f"{name} is a DLPack {major}.{minor} tensor; kvcanary "
                              "reads DLPack 1.x", key=name)
        address += _VERSIONED_HEAD.size
    elif _capsule_is_valid(capsule, b"dltensor"):
        address = _capsule_pointer(capsule, b"dltensor")
        flags = _FLAG_READ_ONLY  # an unversioned export cannot say it is writable (numpy agrees)
    else:
        raise CanaryError(f"{name}.__dlpack__() did not return an unused DLPack capsule", key=name)
    (data, device_type, device_id, ndim, code, bits, lanes, shape_at, strides_at,
     byte_offset) = _DL_TENSOR.unpack(ctypes.string_at(address, _DL_TENSOR.size))
    shape = _int64s(shape_at, ndim)
    strides = _int64s(strides_at, ndim) if strides_at else None
    if flags & _FLAG_SUBBYTE_PADDED and bits < 8:
        bits = 8  # each sub-byte element sits in a byte of its own
    return Tensor(device_type=device_type, device_id=device_id, code=code, bits=bits,
                  lanes=lanes, data=data + byte_offset, shape=shape, strides=strides,
                  read_only=bool(flags & _FLAG_READ_ONLY), capsule=capsule)


def _int64s(address: int, count: int) -> tuple:
    return struct.unpack(f"<{count}q", ctypes.string_at(address, 8 * count)) if count else ()


class _Owner:
    """Holds the capsule and describes the memory to numpy or cupy through their array
    interfaces; the array made from it keeps this object (and so the capsule) alive."""

    def __init__(self, tensor: Tensor, shape: tuple, byte_strides: tuple):
        self.tensor = tensor
        interface = {"shape": shape, "typestr": "|u1", "strides": byte_strides,
                     "data": (tensor.data, tensor.read_only), "version": 3}
        if tensor.device_type in HOST_DEVICES:
            self.__array_interface__ = interface
        else:
            self.__cuda_array_interface__ = dict(interface, stream=None)  # synced at export


def byte_array(tensor: Tensor, shape: tuple, byte_strides: tuple):
    """A ``uint8`` numpy (host) or cupy (CUDA) array over the tensor's memory, owning the
    capsule."""
    owner = _Owner(tensor, tuple(shape), tuple(byte_strides))
    if tensor.device_type in HOST_DEVICES:
        return np.asarray(owner)
    cupy = import_cupy("array")
    with cupy.cuda.Device(tensor.device_id):
        return cupy.asarray(owner)
