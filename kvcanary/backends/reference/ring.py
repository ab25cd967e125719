"""Violation ring commit (docs/format.md §10)."""

from __future__ import annotations

import numpy as np

from ...format.consts import VIOLATION_WRITE_INDEX_MAX
from ...format.rules import canary_fields  # noqa: F401  (the reference's kernels read records here)


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
