"""Step 4 of the audit: exact totals over every row and the findings of the first rows kept."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np

from ..findings.diagnosis import failed_checks
from ..dump import Dump
from ..backends.reference.plan import verify_entries
from ..findings.evidence import or_by_slot
from ..format.violations import Violation, reason_labels, tag_name
from .launches import _Launch
from .result import AuditResult, Finding, RequestSummary


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


class _Tally:
    """Exact totals over every row, and the findings of the first ``keep`` rows."""

    def __init__(self, d: Dump, keep: int):
        self.dump, self.keep = d, keep
        self.total = self.unattributed = self.sweep = 0
        self.reasons, self.tags = Counter(), Counter()
        self.findings: list = []
        self.requests: list = []
        # Fail bits ORed per failing canary slot (sorted slots, their bits; sized by the rows,
        # never by the pool), and per launch which entries had a row.
        self._failing_parts: list = []
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
        inside = (rows[:, 1] >= 0) & (rows[:, 1] < self.dump.num_slots)
        self._failing_parts.append(or_by_slot(rows[inside, 1], rows[inside, 7]))
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

    def add_distinct(self, grouped, found) -> None:
        """The live rows of a grouped audit (:mod:`.distinct`): each row counts once per
        request reading its entry; requests and findings in batch and position order."""
        from .distinct import _first_findings, _request_counts   # noqa: PLC0415 (a cycle)
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
        count, first, last = _request_counts(grouped, found)
        readers = grouped.readers
        for i in np.flatnonzero(count).tolist():
            self.requests.append(RequestSummary(
                batch_index=int(readers.batch_index[i]), request_row=int(readers.rows[i]),
                violations=int(count[i]), first_position=int(first[i]),
                last_position=int(last[i])))
        room = self.keep - len(self.findings)
        if room <= 0:
            return
        picked = _first_findings(grouped, found, count, room)
        if picked:
            batch, row, position, entry = (np.array(c, dtype=np.int64) for c in zip(*picked))
            d = self.dump
            _, _, prevs, _ = verify_entries(d.slot_table, d.block_size,
                                            d.full_to_swa_index_mapping, row, position,
                                            np.ones(row.size, np.int64), row.size, None, None, 0)
            for b, r, q, prev, values in zip(batch.tolist(), row.tolist(), position.tolist(),
                                             prevs.tolist(), found.row_of(entry).tolist()):
                self.findings.append(_finding(Violation(*values), "request", batch_index=b,
                                              request_row=r, position=q, prev_slot=prev,
                                              **_block_of(d, r, q)))
        for values in found.unattributed[:self.keep - len(self.findings)].tolist():
            self.findings.append(_finding(Violation(*values), "unattributed"))

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
