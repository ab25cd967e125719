"""Step 4 of the audit: exact totals over every row and the findings of the first rows kept."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np

from ..findings.diagnosis import failed_checks
from ..dump import Dump
from ..format.violations import Violation, reason_labels, tag_name
from .launches import _Launch
from .result import AuditResult, Finding, RequestSummary


def _value_counts(values: np.ndarray) -> tuple:
    """``(distinct values, counts)`` of an int64 column."""
    if values.size and 0 <= int(values.min()) and int(values.max()) < 1 << 16:
        counts = np.bincount(values)
        present = np.flatnonzero(counts)
        return present, counts[present]
    return np.unique(values, return_counts=True)


class _Tally:
    """Exact totals over every row, and the findings of the first ``keep`` rows."""

    def __init__(self, d: Dump, keep: int):
        self.dump, self.keep = d, keep
        self.total = self.unattributed = self.sweep = 0
        self.reasons, self.tags = Counter(), Counter()
        self.findings: list = []
        self.requests: list = []
        # Fail bits ORed per canary slot (allocated at the first row), and per launch which
        # entries had a row.
        self.slot_bits = np.zeros(0, dtype=np.int64)
        self.failing_entries: list = []

    def add(self, rows: np.ndarray, entry_of: np.ndarray, launch: _Launch) -> None:
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
        if self.slot_bits.size == 0:
            self.slot_bits = np.zeros(self.dump.num_slots, dtype=np.int64)
        inside = (rows[:, 1] >= 0) & (rows[:, 1] < self.dump.num_slots)
        slots, bits = rows[inside, 1], rows[inside, 7]
        for value in _value_counts(bits)[0].tolist():   # a few distinct reason sets
            self.slot_bits[slots[bits == value]] |= value
        mask = np.zeros(launch.size, dtype=bool)
        mask[failing] = True
        self.failing_entries.append(mask)
        if launch.live:
            self._add_requests(failing, launch)
        else:
            self.sweep += int(failing.size)
        room = self.keep - len(self.findings)
        if room <= 0:
            return
        order = np.concatenate([row_of[failing[:room]], np.flatnonzero(~attributed)[:room]])[:room]
        for index in order.tolist():
            entry = int(entry_of[index])
            self.findings.append(self._finding(Violation(*rows[index].tolist()), entry, launch))

    def _add_requests(self, failing: np.ndarray, launch: _Launch) -> None:
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

    def _finding(self, v: Violation, entry: int, launch: _Launch) -> Finding:
        d, e = self.dump, launch.entries
        if entry < 0:
            return _finding(v, "unattributed")
        where = dict(position=int(e.positions[entry]), prev_slot=int(e.prevs[entry]))
        if not launch.live:
            return _finding(v, "sweep", sweep_index=launch.sweep_begin + entry,
                            **where)
        b = int(launch.batch_index[entry])
        row = int(d.req_pool_indices[b])
        return _finding(v, "request", batch_index=b, request_row=row, **where,
                        **_block_of(d, row, where["position"]))

    def fill(self, result: AuditResult) -> None:
        result.total_violations = self.total
        result.findings = self.findings
        result.counts_by_reason = dict(sorted(self.reasons.items()))
        result.counts_by_tag = dict(sorted(self.tags.items()))
        requests = sum(r.violations for r in self.requests)
        result.counts_by_entry = {name: count for name, count in (
            ("request", requests), ("sweep", self.sweep), ("unattributed", self.unattributed))
            if count}
        result.requests = self.requests
        result.unattributed = self.unattributed


def _block_of(d: Dump, row: int, position: int) -> dict:
    """Where a paged dump's position goes through its block table (nothing for per-token)."""
    if d.block_table is None:
        return {}
    index = position // d.block_size
    inside = 0 <= row < d.block_table.shape[0] and index < d.block_table.shape[1]
    return {"block_index": index, "block": int(d.block_table[row, index]) if inside else -1}


def _finding(v: Violation, kind: str, **where) -> Finding:
    """A finding without its diagnosis yet (:func:`_diagnose` adds it after the loop)."""
    return Finding(violation=v, kind=kind, checks=failed_checks(v.fail_reason_bits), **where)
