"""Step 5 of the audit: a second pass over the live entries feeding each kept finding's
:func:`~kvcanary.findings.diagnosis.diagnose`."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from ..findings.diagnosis import diagnose
from ..dump import Dump
from ..findings.evidence import Evidence, record_links
from ..format.rules import canary_fields
from .distinct import distinct_launches, entry_readers
from .launches import Launcher, live_launches, LiveRequests, sweep_launches
from .result import FindingList
from .tally import block_of, Tally


class _DumpTables:
    """What a dump's tables say at (request row, position), for the diagnosis."""

    def __init__(self, d: Dump):
        self.dump = d
        self._lengths = None   # live request row -> seq_len, made on first use
        self._live = None      # the live batch indices, found on first use

    def slot(self, row: int, position: int) -> int | None:
        """The table's full slot (before any SWA translation), or None past the table or
        past a live request's length (an entry there is a leftover, not the request's)."""
        d = self.dump
        table = d.slot_table
        column = position // d.block_size
        if not (0 <= row < table.shape[0] and 0 <= column < table.shape[1] and position >= 0):
            return None
        if self._lengths is None:   # the live rows' (never a scan of every padding row)
            live = self.live()
            self._lengths = dict(zip(np.asarray(d.req_pool_indices[live]).tolist(),
                                     np.asarray(d.seq_lens[live]).tolist()))
            padding = _first_padding(live, d.batch_size)
            if padding is not None:   # row 0 is padding: no request of it reads a slot
                self._lengths[0] = 0
        if position >= self._lengths.get(row, position + 1):
            return None
        slot = int(table[row, column])
        if d.block_table is not None:
            slot = slot * d.block_size + position % d.block_size if slot else 0
        return slot

    def live(self) -> np.ndarray:
        """The dump's live batch indices, scanned once for every finding's questions."""
        if self._live is None:
            self._live = self.dump.live_batch()
        return self._live

    def token(self, row: int, position: int) -> int | None:
        """The expected token at ``position`` of a batch's request row, or None."""
        d = self.dump
        pool = d.expected_tokens
        if pool is None or not (0 <= row < pool.shape[0] and 0 <= position < pool.shape[1]):
            return None
        live = self.live()
        if row:
            batch = live[np.asarray(d.req_pool_indices[live]) == row]
            first = int(batch[0]) if batch.size else None
        else:
            first = _first_padding(live, d.batch_size)
        if first is None or position >= int(d.expected_tokens_valid_lens[first]):
            return None
        return int(pool[row, position])


def _first_padding(live: np.ndarray, batch_size: int) -> int | None:
    """The first batch index that is not in ``live`` (ascending), or None."""
    gaps = np.flatnonzero(live != np.arange(live.size))
    first = int(gaps[0]) if gaps.size else int(live.size)
    return first if first < batch_size else None


def diagnose_findings(tally: Tally, d: Dump, launcher: Launcher, live: LiveRequests,
              chunk: int, grouped=None, found=None) -> tuple:
    """Every kept finding with its :func:`~kvcanary.findings.diagnosis.diagnose`; returns
    ``(findings, zero records among the live entries)``.

    The other users of a finding's slot and the records its stored link continues may sit
    in any chunk, so the live entries are planned once more, keeping only those that read a
    finding's slot or whose record a finding's record continues."""
    columns = tally.kept.columns(d)
    if not tally.kept.count:
        return FindingList(columns), 0
    rows = columns["rows"]
    fields = canary_fields(d.canary)
    # Zero records are counted only when a finding reads one (the wrong-buffer question).
    count_zero = bool(np.any((rows[:, 2] == 0) & (rows[:, 3] == 0) & (rows[:, 5] == 0)))
    # Only records some entry reads can be a finding's parent (the evidence holds entries),
    # so links are computed for the entries' records, never for the whole buffer: a large
    # pool of zero records (whose link is 0, like a lost write's stored link) costs nothing.
    # An all-zero record's link is 0 and continues nothing: a zero stored link (a never-
    # written record's) asks for no parent among the pool's other zero records.
    targets = np.unique(rows[:, 5])
    targets = targets[targets != 0]
    interest = np.unique(np.concatenate([rows[:, 1], columns["prev_slot"]]))
    parts, parents, zero_entries, checked = [], [], 0, 0
    for launch, failing, first in _second_pass(d, launcher, live, chunk, tally, grouped, found):
        e = launch.entries
        inside = (e.slots > 0) & (e.slots < d.num_slots)
        at_slot = np.where(inside, e.slots, 0)
        records = np.take(fields, at_slot, axis=0)
        weight = 1 if first is None else found.readers[first:first + launch.size]
        if launch.live and count_zero:
            zero_entries += int(np.sum(weight * (inside & ~records.any(axis=1))))
            checked += int(np.sum(weight * (e.slots > 0)))
        parent = inside & np.isin(record_links(records), targets)
        parents.append(e.slots[parent])
        # Entries outside the buffer (past the table, say) are no evidence: an out-of-range
        # finding's cause is its slot alone, and thousands of them share the marker slot.
        keep = np.flatnonzero(inside & np.isin(e.slots, interest) | parent)
        if first is not None:
            # Shared entries: one evidence entry per request reading it (a few of them).
            which, batch, request_rows = entry_readers(grouped, first + keep, e.positions[keep])
            keep = keep[which]
        elif launch.live:
            batch = launch.batch_index[keep]
            request_rows = np.asarray(d.req_pool_indices)[batch]
        else:   # sweep entries belong to no request: batch index and row -1
            batch = request_rows = np.full(keep.size, -1, np.int64)
        parts.append(Evidence.from_entries(
            slots=e.slots[keep], positions=e.positions[keep], tokens=e.tokens[keep],
            batch_index=batch, request_rows=request_rows, records=fields,
            failing=None if failing is None else failing[keep], prev_slots=e.prevs[keep]))
    interest = np.concatenate([interest] + parents)
    evidence = Evidence.merge(parts)
    asked = np.unique(np.concatenate([interest, evidence.prev_slots]).astype(np.int64))
    asked = asked[(asked >= 0) & (asked < d.num_slots)]
    evidence.failing_slots, evidence.failing_bits = tally.failing_bits_at(asked)
    evidence.zero_entries, evidence.checked_entries = zero_entries, checked
    swa = d.full_to_swa_index_mapping is not None
    table = "req_to_token" if d.block_table is None else "block_table"
    tables = _DumpTables(d)
    swapped_with = _stored_positions(columns)

    def explain(findings: list) -> list:
        result = []
        for f in findings:
            entry = f.entry()
            if f.kind == "request" and f.block_index >= 0 and f.position > 0:
                prev = block_of(d, f.request_row, f.position - 1)
                entry = dataclasses.replace(entry, prev_block_index=prev["block_index"],
                                            prev_block=prev["block"])
            diagnosis = diagnose(f.violation, entry, evidence, num_slots=d.num_slots, swa=swa,
                                 table=table, swapped_with=swapped_with, tables=tables)
            result.append(dataclasses.replace(f, diagnosis=diagnosis, cause=diagnosis.text))
        return result

    return FindingList(columns, explain), zero_entries


def _stored_positions(columns: dict):
    """``swapped_with(batch index, position)``: the stored (position, token) of the request
    finding there, or None (sorted arrays: a million findings cost no dictionary)."""
    request = columns["kind"] == 0
    batch, position = columns["batch_index"][request], columns["position"][request]
    stored, token = columns["rows"][request, 2], columns["rows"][request, 3]
    order = np.lexsort((position, batch))
    batch, position, stored, token = batch[order], position[order], stored[order], token[order]

    def swapped_with(b: int, q: int):
        lo, hi = np.searchsorted(batch, b, "left"), np.searchsorted(batch, b, "right")
        at = lo + int(np.searchsorted(position[lo:hi], q, "right")) - 1   # the last such
        if lo <= at < hi and position[at] == q:
            return int(stored[at]), int(token[at])
        return None

    return swapped_with


def _second_pass(d, launcher, live, chunk, tally, grouped, found):
    """``(launch, failing entries, first global entry or None)`` for the evidence: the live
    launches as the audit ran them (grouped or planned per request), then the sweep."""
    sweeps = sweep_launches(d, launcher, chunk)
    if grouped is None:
        launches = itertools.chain(live_launches(d, launcher, live, chunk), sweeps)
        for launch, failing in zip(launches, tally.failing_entries):
            yield launch, failing, None
        return
    for first, launch in distinct_launches(d, launcher, grouped, chunk):
        yield launch, found.failing[first:first + launch.size], first
    for launch, failing in zip(sweeps, tally.failing_entries):
        yield launch, failing, None

