"""The one by-value parameter of ``kvc_write``: ``struct kvc::WriteArgs`` (kernels/kvc_write.cu),
a ``__grid_constant__`` struct of the launch's pointers and sizes followed by the real-KV
descriptors. :data:`WRITE_ARGS_FIELDS` is its layout in declaration order; the CPU harness
compares it with the compiled struct field by field (tests/kernels/test_kernels_launch.py).

Packed once per launch as a read-only 0-d structured array, the form CuPy passes by value
on every version (as the descriptors alone were before)."""

from __future__ import annotations

import functools
import struct

import numpy as np

# (field, numpy type) in the order of struct kvc::WriteArgs; pointers travel as addresses.
_PTR, _I64, _I32 = "<u8", "<i8", "<i4"
WRITE_ARGS_FIELDS = (
    ("canary_buf", _PTR), ("num_slots", _I64), ("slot_stride_bytes", _I64),
    ("write_offsets", _PTR), ("write_seed_slot_indices", _PTR), ("write_num_valid_reqs", _PTR),
    ("write_req_capacity", _I64),
    ("input_ids", _PTR), ("positions", _PTR), ("out_cache_loc", _PTR), ("num_tokens", _I64),
    ("expected_input_tokens", _PTR), ("expected_input_positions", _PTR),
    ("kernel_kind", _I64),
    ("violation_ring", _PTR), ("ring_capacity", _I64), ("violation_write_index", _PTR),
    ("slot_run_counter", _PTR), ("kernel_run_counter", _PTR),
    ("enable_chain_position_assert", _PTR), ("report_conflicts", _I32),
    ("seed_links", _PTR), ("seed_positions", _PTR),
)
_STRUCT_CODES = {_PTR: "Q", _I64: "q", _I32: "i"}


@functools.lru_cache(maxsize=None)
def write_args_dtype(sources: np.dtype) -> np.dtype:
    """numpy layout of ``struct kvc::WriteArgs`` whose last field ``sources`` has the layout
    ``sources`` (:func:`kvcanary.backends.cuda.launch.sources_dtype` of the launch's bound); C's
    alignment rules, as ``align=True`` applies them."""
    return np.dtype([*WRITE_ARGS_FIELDS, ("sources", sources)], align=True)


@functools.lru_cache(maxsize=None)
def _head(sources: np.dtype) -> struct.Struct:
    """The fields before ``sources`` as one ``struct`` format, padding included."""
    dtype = write_args_dtype(sources)
    code, at = "<", 0
    for name, kind in WRITE_ARGS_FIELDS:
        offset = dtype.fields[name][1]
        code += "x" * (offset - at) + _STRUCT_CODES[kind]
        at = offset + np.dtype(kind).itemsize
    code += "x" * (dtype.fields["sources"][1] - at)
    return struct.Struct(code)


def pack_write_args(values, sources: np.ndarray) -> np.ndarray:
    """The packed struct: ``values`` in :data:`WRITE_ARGS_FIELDS` order (integers;
    pointers as addresses, 0 for null), then the packed descriptors ``sources``."""
    dtype = write_args_dtype(sources.dtype)
    raw = _head(sources.dtype).pack(*values) + sources.tobytes()
    packed = np.frombuffer(raw + bytes(dtype.itemsize - len(raw)), dtype=dtype).reshape(())
    return packed  # frombuffer over bytes: read-only, like the descriptors
