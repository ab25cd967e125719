"""Rules every layer shares, public in the core: the numpy reference, the audit and the tools
read them from here, never from each other.

* :func:`window_start`: the first position a request verifies (a sliding window keeps only
  its last ``swa_window_size`` positions).
* :func:`canary_fields`: a canary buffer's records as their int64 fields (a view).
* :func:`violation_rows`: per-field values stacked into the violation ring's ``int64[n, 8]``
  rows, the one row layout of the ring (docs/format.md §10).
"""

from __future__ import annotations

import numpy as np

from .consts import CANARY_FIELDS_PER_SLOT, VIOLATION_FIELDS


def as_i64(values) -> np.ndarray:
    """Any integer array or scalar as int64 (uint64 hash bits reinterpreted, not converted)."""
    array = np.asarray(values)
    return array.view(np.int64) if array.dtype == np.uint64 else array.astype(np.int64, copy=False)


def canary_fields(canary_buf: np.ndarray) -> np.ndarray:
    """``uint8[N, stride]`` as ``int64[N, 4]`` (a view: writes land in the buffer)."""
    return canary_buf.view("<i8")[:, :CANARY_FIELDS_PER_SLOT]


def window_start(prefix_lens: np.ndarray, swa_window_size: int) -> np.ndarray:
    """``max(0, prefix_len - swa_window_size)`` per request under a sliding window
    (``swa_window_size > 0``), else 0: positions ``[window_start, prefix_len)`` are verified.

    >>> window_start(np.array([3, 40]), 16).tolist()
    [0, 24]
    """
    if swa_window_size > 0:
        return np.maximum(0, prefix_lens - swa_window_size)
    return np.zeros_like(prefix_lens)


def violation_rows(kernel_kind, slot, position, stored_token, expected_token,
                   stored_chain_hash, expected_aux, bits) -> np.ndarray:
    """Stack per-field arrays (or scalars, broadcast) into ``int64[n, 8]`` ring rows, the
    fields in ring order."""
    fields = (kernel_kind, slot, position, stored_token, expected_token, stored_chain_hash,
              expected_aux, bits)
    if any(type(c) is np.ndarray and c.size == 0 for c in fields):
        # No rows: most launches break no rule, and each launch asks once per rule.
        return np.zeros((0, VIOLATION_FIELDS), dtype=np.int64)
    columns = np.broadcast_arrays(*(as_i64(c) for c in fields))
    return np.stack(columns, axis=-1).reshape(-1, VIOLATION_FIELDS)
