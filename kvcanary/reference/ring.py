"""Violation ring commit (docs/format.md §10)."""

from __future__ import annotations

import numpy as np

from ..rules import canary_fields  # noqa: F401  (the reference's kernels read records here)


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
