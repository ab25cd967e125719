"""Violation ring commit (docs/format.md §10) and the record-field view of a canary buffer."""

from __future__ import annotations

import numpy as np

from ..consts import CANARY_FIELDS_PER_SLOT


def canary_fields(canary_buf: np.ndarray) -> np.ndarray:
    """``uint8[N, stride]`` as ``int64[N, 4]`` (a view: writes land in the buffer)."""
    return canary_buf.view("<i8")[:, :CANARY_FIELDS_PER_SLOT]


def commit_rows(log, rows: np.ndarray) -> None:
    """Fill-once append: rows land at ``write_index ..`` while they fit; the index always
    advances by the number of rows, so overflow stays countable."""
    count = int(rows.shape[0])
    if count == 0:
        return
    base = int(log.write_index[0])
    capacity = log.ring.shape[0]
    # Row i claims sequence number base + i and lands only when that is inside the ring
    # (a negative start index skips the rows whose number is still negative).
    lo, hi = max(base, 0), min(base + count, capacity)
    if hi > lo:
        log.ring[lo:hi] = rows[lo - base:hi - base]
    log.write_index[0] = np.int32(np.int64(base + count).astype(np.int32))
