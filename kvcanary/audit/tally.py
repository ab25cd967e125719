"""Step 4 of the audit: exact totals over every row and the findings of the first rows kept."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np

from ..dump import Dump
from ..backends.reference.plan import verify_entries
from ..findings.evidence import or_by_slot
from ..format.violations import reason_labels, tag_name
from .launches import Launch
from .result import AuditResult, RequestSummary


def _weighted_counts(values: np.ndarray, weights: np.ndarray) -> tuple:
    """``(distinct values, summed weights)`` of an int64 column."""
    distinct, inverse = np.unique(values, return_inverse=True)
    return distinct, np.bincount(inverse.reshape(-1), weights=weights,
                                 minlength=distinct.size).astype(np.int64)


def _value_counts(values: np.ndarray) -> tuple:
    """``(distinct values, counts)`` of an int64 column."""
    if values.size and 0 <= int(values.min()) and int(values.max()) < 1 << 16:
        counts = np.bincount(values)
        present = np.flatnonzero(counts)
        return present, counts[present]
    return np.unique(values, return_counts=True)


class Tally:
    """Exact totals over every row, and the findings of the first ``keep`` rows."""

    def __init__(self, d: Dump, keep: int):
        self.dump, self.keep = d, keep
        self.total = self.unattributed = self.sweep = 0
        self.reasons, self.tags = Counter(), Counter()
        self.kept = _Kept()
        self.requests: list = []
        # Fail bits ORed per failing canary slot (sorted slots, their bits; sized by the rows,
        # never by the pool), and per launch which entries had a row.
        self._failing_parts: list = []
        self.failing_entries: list = []

    def add(self, rows: np.ndarray, entry_of: np.ndarray, launch: Launch) -> None:
        if rows.shape[0] == 0:
            self.failing_entries.append(None)
            return
        self.total += rows.shape[0]
        for value, count in zip(*(a.tolist() for a in _value_counts(rows[:, 7]))):
            for label in reason_labels(value) or ["none"]:
                self.reasons[label] += count
        for value, count in zip(*(a.tolist() for a in _value_counts(rows[:, 0]))):
            self.tags[tag_name(value)] += count
        # Row of each failing entry. An entry yields at most one row: a second row naming the
        # same entry (only a faulty backend emits one) counts as unattributed.
        claims = np.flatnonzero(entry_of >= 0)[::-1]
        row_of = np.full(launch.size, -1, dtype=np.int64)
        row_of[entry_of[claims]] = claims          # reversed: the first claim wins
        failing = np.flatnonzero(row_of >= 0)
        attributed = np.zeros(rows.shape[0], dtype=bool)
        attributed[row_of[failing]] = True
        entry_of = np.where(attributed, entry_of, -1)
        self.unattributed += int(rows.shape[0] - failing.size)
        inside = (rows[:, 1] >= 0) & (rows[:, 1] < self.dump.num_slots)
        self._failing_parts.append(or_by_slot(rows[inside, 1], rows[inside, 7]))
        mask = np.zeros(launch.size, dtype=bool)
        mask[failing] = True
        self.failing_entries.append(mask)
        if launch.live:
            self._add_requests(failing, launch)
        else:
            self.sweep += int(failing.size)
        room = self.keep - self.kept.count
        if room <= 0:
            return
        order = np.concatenate([row_of[failing[:room]], np.flatnonzero(~attributed)[:room]])[:room]
        entry = entry_of[order]
        known = entry >= 0
        at = np.where(known, entry, 0)
        e = launch.entries
        none = np.full(order.size, -1, dtype=np.int64)
        position, prev = np.where(known, e.positions[at], -1), np.where(known, e.prevs[at], -1)
        if launch.live:
            batch = np.where(known, launch.batch_index[at], -1)
            row = np.where(known, np.asarray(self.dump.req_pool_indices)[np.maximum(batch, 0)], -1)
            kind, sweep = np.where(known, 0, 2), none
        else:
            batch = row = none
            kind, sweep = np.where(known, 1, 2), np.where(known, launch.sweep_begin + at, -1)
        self.kept.add(rows[order], kind, batch, row, position, prev, sweep)

    def add_distinct(self, grouped, found) -> None:
        """The live rows of a grouped audit (:mod:`.distinct`): each row counts once per
        request reading its entry; requests and findings in batch and position order."""
        from .distinct import first_findings, request_counts   # noqa: PLC0415 (a cycle)
        weights = found.readers[found.row_index]
        rows = np.concatenate([found.rows, found.unattributed])
        weights = np.concatenate([weights, np.ones(found.unattributed.shape[0], np.int64)])
        self.total += int(weights.sum())
        self.unattributed += int(found.unattributed.shape[0])
        if rows.shape[0]:
            for value, count in zip(*(a.tolist() for a in _weighted_counts(rows[:, 7], weights))):
                for label in reason_labels(value) or ["none"]:
                    self.reasons[label] += count
            for value, count in zip(*(a.tolist() for a in _weighted_counts(rows[:, 0], weights))):
                self.tags[tag_name(value)] += count
            inside = (rows[:, 1] >= 0) & (rows[:, 1] < self.dump.num_slots)
            self._failing_parts.append(or_by_slot(rows[inside, 1], rows[inside, 7]))
        count, first, last = request_counts(grouped, found)
        readers = grouped.readers
        for i in np.flatnonzero(count).tolist():
            self.requests.append(RequestSummary(
                batch_index=int(readers.batch_index[i]), request_row=int(readers.rows[i]),
                violations=int(count[i]), first_position=int(first[i]),
                last_position=int(last[i])))
        room = self.keep - self.kept.count
        if room <= 0:
            return
        picked = first_findings(grouped, found, count, room)
        if picked:
            batch, row, position, entry = (np.array(c, dtype=np.int64) for c in zip(*picked))
            d = self.dump
            _, _, prevs, _ = verify_entries(d.slot_table, d.block_size,
                                            d.full_to_swa_index_mapping, row, position,
                                            np.ones(row.size, np.int64), row.size, None, None, 0)
            self.kept.add(found.row_of(entry), np.zeros(row.size, np.int64), batch, row,
                          position, prevs, np.full(row.size, -1, np.int64))
        left = found.unattributed[:self.keep - self.kept.count]
        none = np.full(left.shape[0], -1, dtype=np.int64)
        self.kept.add(left, np.full(left.shape[0], 2, np.int64), none, none, none, none, none)

    def failing_bits_at(self, slots: np.ndarray) -> tuple:
        """``(slots, bits)``: those of the sorted ``slots`` that have a row, with their
        fail bits ORed."""
        failing, bits = or_by_slot(*(np.concatenate([p[i] for p in self._failing_parts]
                                                    or [np.zeros(0, np.int64)]) for i in (0, 1)))
        if failing.size == 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        at = np.minimum(np.searchsorted(failing, slots), failing.size - 1)
        found = failing[at] == slots
        return slots[found], bits[at[found]]

    def _add_requests(self, failing: np.ndarray, launch: Launch) -> None:
        """Per affected request: count and first/last position (entries of a request are
        consecutive and in position order)."""
        if failing.size == 0:
            return
        batch = launch.batch_index[failing]
        heads = np.flatnonzero(np.diff(batch, prepend=-1))
        tails = np.append(heads[1:], batch.size) - 1
        positions = launch.entries.positions
        rows_table = self.dump.req_pool_indices
        for head, tail in zip(heads.tolist(), tails.tolist()):
            b = int(batch[head])
            summary = RequestSummary(
                batch_index=b, request_row=int(rows_table[b]), violations=tail - head + 1,
                first_position=int(positions[failing[head]]),
                last_position=int(positions[failing[tail]]))
            if self.requests and self.requests[-1].batch_index == b:   # a long request's piece
                earlier = self.requests.pop()
                summary = replace(summary, violations=earlier.violations + summary.violations,
                                  first_position=earlier.first_position)
            self.requests.append(summary)

    def fill(self, result: AuditResult) -> None:
        result.total_violations = self.total
        result.counts_by_reason = dict(sorted(self.reasons.items()))
        result.counts_by_tag = dict(sorted(self.tags.items()))
        requests = sum(r.violations for r in self.requests)
        result.counts_by_entry = {name: count for name, count in (
            ("request", requests), ("sweep", self.sweep), ("unattributed", self.unattributed))
            if count}
        result.requests = self.requests
        result.unattributed = self.unattributed


def block_of(d: Dump, row: int, position: int) -> dict:
    """Where a paged dump's position goes through its block table (nothing for per-token)."""
    if d.block_table is None:
        return {}
    index = position // d.block_size
    inside = 0 <= row < d.block_table.shape[0] and index < d.block_table.shape[1]
    return {"block_index": index, "block": int(d.block_table[row, index]) if inside else -1}


class _Kept:
    """The rows kept as findings, as columns (see :class:`~.result.FindingList`)."""

    NAMES = ("rows", "kind", "batch_index", "request_row", "position", "prev_slot",
             "sweep_index")

    def __init__(self):
        self.parts, self.count = [], 0

    def add(self, rows, *columns) -> None:
        if rows.shape[0]:
            self.parts.append((np.asarray(rows, dtype=np.int64).reshape(-1, 8),
                               *(np.asarray(c, dtype=np.int64) for c in columns)))
            self.count += int(rows.shape[0])

    def columns(self, d: Dump) -> dict:
        empty = [np.zeros((0, 8), np.int64)] + [np.zeros(0, np.int64)] * (len(self.NAMES) - 1)
        result = {name: np.concatenate([p[i] for p in self.parts] or [empty[i]])
                  for i, name in enumerate(self.NAMES)}
        block_index = np.full(self.count, -1, dtype=np.int64)
        block = np.full(self.count, -1, dtype=np.int64)
        if d.block_table is not None:   # where a paged dump's positions go (request findings)
            request = np.flatnonzero(result["kind"] == 0)
            index = result["position"][request] // d.block_size
            rows = result["request_row"][request]
            table = d.block_table
            inside = (rows >= 0) & (rows < table.shape[0]) & (index >= 0) & (index < table.shape[1])
            block_index[request] = index
            block[request[inside]] = np.asarray(table)[rows[inside], index[inside]]
        result.update(block_index=block_index, block=block)
        return result
