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
from .launches import _Launcher, _live_launches, _LiveRequests, _sweep_launches
from .result import CHUNK_ENTRIES
from .tally import _block_of, _Tally


class _DumpTables:
    """What a dump's tables say at (request row, position), for the diagnosis."""

    def __init__(self, d: Dump):
        self.dump = d

    def slot(self, row: int, position: int) -> int | None:
        """The table's full slot (before any SWA translation), or None past the table."""
        d = self.dump
        table = d.slot_table
        column = position // d.block_size
        if not (0 <= row < table.shape[0] and 0 <= column < table.shape[1] and position >= 0):
            return None
        slot = int(table[row, column])
        if d.block_table is not None:
            slot = slot * d.block_size + position % d.block_size if slot else 0
        return slot

    def token(self, row: int, position: int) -> int | None:
        """The expected token at ``position`` of a batch's request row, or None."""
        d = self.dump
        pool = d.expected_tokens
        if pool is None or not (0 <= row < pool.shape[0] and 0 <= position < pool.shape[1]):
            return None
        batch = np.flatnonzero(np.asarray(d.req_pool_indices) == row)
        if batch.size == 0 or position >= int(d.expected_tokens_valid_lens[batch[0]]):
            return None
        return int(pool[row, position])


def _diagnose(tally: _Tally, d: Dump, launcher: _Launcher, live: _LiveRequests,
              chunk: int) -> tuple:
    """Every kept finding with its :func:`~kvcanary.findings.diagnosis.diagnose`; returns
    ``(findings, zero records among the live entries)``.

    The other users of a finding's slot and the records its stored link continues may sit
    in any chunk, so the live entries are planned once more, keeping only those that read a
    finding's slot or whose record a finding's record continues."""
    findings = tally.findings
    if not findings:
        return findings, 0
    rows = np.stack([f.violation.to_row() for f in findings])
    fields = canary_fields(d.canary)
    # Zero records are counted only when a finding reads one (the wrong-buffer question).
    zero = None
    if np.any((rows[:, 2] == 0) & (rows[:, 3] == 0) & (rows[:, 5] == 0)):
        zero = ~fields.any(axis=1)
        zero[:1] = False   # slot 0 is padding: never counted
    # Records whose link a finding's stored link equals: their readers are its parents.
    parents = _equal_to_any(_slot_links(fields), rows[:, 5])
    interest = np.concatenate([rows[:, 1], [f.prev_slot for f in findings], parents])
    marked = np.zeros(d.num_slots, dtype=bool)
    marked[interest[(interest >= 0) & (interest < d.num_slots)]] = True
    parts, zero_entries, checked = [], 0, 0
    launches = itertools.chain(_live_launches(d, launcher, live, chunk),
                               _sweep_launches(d, launcher, chunk))
    for launch, failing in zip(launches, tally.failing_entries):
        e = launch.entries
        inside = (e.slots > 0) & (e.slots < d.num_slots)
        at_slot = np.where(inside, e.slots, 0)
        if launch.live and zero is not None:
            zero_entries += int(np.count_nonzero(np.take(zero, at_slot)))
            checked += int(np.count_nonzero(e.slots > 0))
        keep = np.flatnonzero(np.take(marked, at_slot))
        outside = np.flatnonzero(~inside)
        if outside.size:
            keep = np.union1d(keep, outside[np.isin(e.slots[outside], interest)])
        # Sweep entries belong to no request: batch index and row -1 (one cached chain).
        batch = launch.batch_index[keep] if launch.live else np.full(keep.size, -1, np.int64)
        parts.append(Evidence.from_entries(
            slots=e.slots[keep], positions=e.positions[keep], tokens=e.tokens[keep],
            batch_index=batch,
            request_rows=np.asarray(d.req_pool_indices)[batch] if launch.live else batch,
            records=fields, failing=None if failing is None else failing[keep],
            prev_slots=e.prevs[keep]))
    evidence = Evidence.merge(parts)
    asked = np.unique(np.concatenate([interest, evidence.prev_slots]).astype(np.int64))
    asked = asked[(asked >= 0) & (asked < d.num_slots)]
    evidence.failing_slots, evidence.failing_bits = asked[tally.slot_bits[asked] != 0], \
        tally.slot_bits[asked][tally.slot_bits[asked] != 0].astype(np.int64)
    evidence.zero_entries, evidence.checked_entries = zero_entries, checked
    stored = {(f.batch_index, f.position): f.violation.position for f in findings
              if f.kind == "request"}
    swa = d.full_to_swa_index_mapping is not None
    table = "req_to_token" if d.block_table is None else "block_table"
    tables = _DumpTables(d)
    result = []
    for f in findings:
        entry = f.entry()
        if f.kind == "request" and f.block_index >= 0 and f.position > 0:
            prev = _block_of(d, f.request_row, f.position - 1)
            entry = dataclasses.replace(entry, prev_block_index=prev["block_index"],
                                        prev_block=prev["block"])
        diagnosis = diagnose(f.violation, entry, evidence, num_slots=d.num_slots, swa=swa,
                             table=table, swapped_with=lambda b, q: stored.get((b, q)),
                             tables=tables)
        result.append(dataclasses.replace(f, diagnosis=diagnosis, cause=diagnosis.text))
    return result, zero_entries


# Low bits of a hash that index the filter of :func:`_equal_to_any`.
_FILTER_BITS = 20


def _equal_to_any(values: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Indices of ``values`` (uniform hashes) equal to one of a few ``targets``: a bit table
    on the low bits picks the candidates in one pass, an exact test confirms them."""
    mask = (1 << _FILTER_BITS) - 1
    table = np.zeros(1 << _FILTER_BITS, dtype=bool)
    table[targets & mask] = True
    candidates = np.flatnonzero(np.take(table, values & mask))
    return candidates[np.isin(values[candidates], targets)]


def _slot_links(fields: np.ndarray) -> np.ndarray:
    """The chain link of every slot's record, block by block (bounded scratch memory)."""
    links = np.empty(fields.shape[0], dtype=np.int64)
    for begin in range(0, fields.shape[0], CHUNK_ENTRIES):
        links[begin:begin + CHUNK_ENTRIES] = record_links(fields[begin:begin + CHUNK_ENTRIES])
    return links
