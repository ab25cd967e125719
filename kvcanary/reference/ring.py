"""Violation ring commit (docs/format.md §10) and the record-field view of a canary buffer."""

from __future__ import annotations

import numpy as np

from ..consts import CANARY_FIELDS_PER_SLOT, VIOLATION_FIELDS, VIOLATION_WRITE_INDEX_MAX


def canary_fields(canary_buf: np.ndarray) -> np.ndarray:
    """``uint8[N, stride]`` as ``int64[N, 4]`` (a view: writes land in the buffer)."""
    return canary_buf.view("<i8")[:, :CANARY_FIELDS_PER_SLOT]


def as_i64(values) -> np.ndarray:
    """Any integer array or scalar as int64 (uint64 hash bits reinterpreted, not converted)."""
    array = np.asarray(values)
    return array.view(np.int64) if array.dtype == np.uint64 else array.astype(np.int64, copy=False)


def violation_rows(kernel_kind, slot, position, stored_token, expected_token,
                   stored_chain_hash, expected_aux, bits) -> np.ndarray:
    """Stack per-field arrays (or scalars) into ``int64[n, 8]`` ring rows."""
    columns = np.broadcast_arrays(*(as_i64(c) for c in (
        kernel_kind, slot, position, stored_token, expected_token,
        stored_chain_hash, expected_aux, bits)))
    return np.stack(columns, axis=-1).reshape(-1, VIOLATION_FIELDS)


def commit_rows(log, rows: np.ndarray) -> None:
    """Fill-once append: rows land at ``write_index ..`` while they fit; the index advances
    by the number of rows, so overflow stays countable, and saturates at
    ``VIOLATION_WRITE_INDEX_MAX``: rows past it claim no sequence number."""
    count = int(rows.shape[0])
    if count == 0:
        return
    base = int(log.write_index[0])
    capacity = log.ring.shape[0]
    end = min(base + count, VIOLATION_WRITE_INDEX_MAX)
    # Row i claims sequence number base + i and lands only when that is inside the ring
    # (a negative start index skips the rows whose number is still negative).
    lo, hi = max(base, 0), min(end, capacity)
    if hi > lo:
        log.ring[lo:hi] = rows[lo - base:hi - base]
    log.write_index[0] = max(base, end)
