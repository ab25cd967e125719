"""Where each request the guard follows wrote each of its own positions, kept as one log.

A finding's explanation asks where the reader itself wrote the position it read (the slot,
and whether the block table named it then): a record that is not the reader's own is either
a write of the reader that went elsewhere or someone else's. Only a finding asks, but every
step writes, so the log is built for the clean path: a step appends its writes as four
arrays (no work per request) and a question scans the log (a finding may be slower).

A request is keyed by a serial number the session gives each of its request records, never
reused: a request the session starts over (preempted and scheduled again) gets a new serial,
so its old writes are never its own again. The log is compacted to the live requests' latest
write of each position whenever it grows past twice its size after the last compaction (and
at least :data:`MIN_LIMIT` entries), so what it keeps is bounded by the live requests'
positions, not by the steps or requests served.
"""

from __future__ import annotations

import numpy as np

MIN_LIMIT = 1 << 16       # entries kept before the first compaction


class OwnWrites:
    """The log: per write ``(serial, position, slot, followed)``, in step order."""

    def __init__(self):
        self.columns = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64),
                        np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool))
        self.pending: list = []   # the steps' writes since the last flush
        self.size = 0             # entries in columns and pending together
        self.limit = MIN_LIMIT

    def add(self, serial: np.ndarray, position: np.ndarray, slot: np.ndarray,
            followed: np.ndarray) -> None:
        """One step's writes (equal-length arrays, one entry per token written)."""
        self.pending.append((serial, position, slot, followed))
        self.size += int(serial.size)

    def full(self) -> bool:
        """Whether the log has grown past its limit (then :meth:`compact` it)."""
        return self.size > self.limit

    def _flush(self) -> tuple:
        if self.pending:
            self.columns = tuple(np.concatenate([old] + [step[i] for step in self.pending])
                                 for i, old in enumerate(self.columns))
            self.pending = []
        return self.columns

    def get(self, serial: int, position: int):
        """``(slot, followed)`` of request ``serial``'s latest write of ``position``; None if
        it wrote none."""
        serials, positions, slots, followed = self._flush()
        hits = np.flatnonzero((serials == serial) & (positions == position))
        if hits.size == 0:
            return None
        last = int(hits[-1])
        return int(slots[last]), bool(followed[last])

    def compact(self, live: np.ndarray) -> None:
        """Keep only the latest write of each position of the ``live`` serials."""
        serials, positions, slots, followed = self._flush()
        keep = np.isin(serials, live)
        serials, positions = serials[keep], positions[keep]
        # The latest write of each (serial, position): the first one in reverse order.
        key = np.stack([serials[::-1], positions[::-1]], axis=1)
        _, first = np.unique(key, axis=0, return_index=True)
        index = np.sort(serials.size - 1 - first)
        self.columns = (serials[index], positions[index], slots[keep][index],
                        followed[keep][index])
        self.size = int(index.size)
        self.limit = max(MIN_LIMIT, 2 * self.size)
