"""Findings in an engine: tie the ring rows of a verify launch back to (request, position)
from the launch's own plan and batch, explain them with :mod:`kvcanary.findings.diagnosis`, and merge
the rows that repeat from launch to launch.

A corrupted record is caught again by every later launch that verifies it, so an engine that
checks every step sees the same row hundreds of times. :func:`attribute` turns one launch's
rows into :class:`LaunchFinding` objects; :class:`Merger` (or :func:`merge_findings`) folds
repeats (same slot, fail reasons and stored record) into one :class:`MergedFinding` with its
first and last launch and a count.

Example, after a ``kvcanary.verify`` of ``verify_plan`` built for the batch
``req_pool_indices`` / ``prefix_lens``::

    merger = kvcanary.Merger()
    before = 0
    for step in steps:
        ...  # plan, verify
        found = kvcanary.attribute(context, verify_plan, req_pool_indices=rows,
                                   prefix_lens=prefix, since=before, launch=step)
        before = context.violation_log.total
        for merged in merger.add(found):         # each distinct corruption once
            logger.warning(merged.finding.describe())   # the frozen line, "  at: ...", ...
    report = merger.findings   # one MergedFinding per distinct corruption
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np

from ..format.consts import EXPECTED_TOKEN_UNKNOWN
from ..format.bits import SLOT_OUT_OF_RANGE as _OUT, VERIFY_POSITION_MISMATCH as _POSITION
from ..format.errors import CanaryError
from .diagnosis import Diagnosis, diagnose, failed_checks
from .evidence import CHAIN_HEAD_INT64, Entry, Evidence, record_links
from ..format.rules import canary_fields, window_start
from ..backends.reference.verify import active_entries
from ..model.types import to_host
from ..format.violations import Violation


@dataclass(frozen=True)
class LaunchFinding:
    """One ring row of one launch: the :class:`~kvcanary.Violation`, the plan entry that
    produced it (``entry``, None when no entry of the plan reproduces the row), the failed
    checks in words and the :class:`~kvcanary.findings.diagnosis.Diagnosis`. ``launch`` is the
    caller's label of the launch (a step number, a tag)."""

    violation: Violation
    entry: Entry | None
    checks: tuple
    diagnosis: Diagnosis
    launch: object = None

    def where(self) -> str:
        """``request row R (batch index B), position P, slot S`` (or why it is unknown)."""
        s = self.violation.slot_idx
        if self.entry is None:
            return f"slot {s} (no plan entry of this launch reproduces this row)"
        e = self.entry
        block = (f", block {e.block} (block-table entry {e.block_index})"
                 if e.block_index >= 0 else "")
        return (f"request row {e.request_row} (batch index {e.batch_index}), position "
                f"{e.position}{block}, slot {s}")

    def describe(self) -> str:
        """The frozen structured line, then ``  at: ...``, ``  failed checks: ...`` and
        ``  likely cause: ...``, labelled as every finding's :meth:`describe` is."""
        return "\n".join((self.violation.log_line(at=self.where()),
                          f"  failed checks: {', '.join(self.checks) or 'none'}",
                          f"  likely cause: {self.diagnosis.text}"))

    def log_line(self) -> str:
        """Deprecated alias of :meth:`describe` (a ``log_line`` is the one frozen line
        elsewhere: :meth:`kvcanary.Violation.log_line`)."""
        warnings.warn("LaunchFinding.log_line() is deprecated: use describe()",
                      DeprecationWarning, stacklevel=2)
        return self.describe()

    def to_dict(self) -> dict:
        record = self.violation.to_dict()
        e = self.entry
        record.update(launch=self.launch, failed_checks=list(self.checks),
                      likely_cause=self.diagnosis.text, diagnosis=self.diagnosis.to_dict(text=False))
        if e is not None:
            record.update(batch_index=e.batch_index, request_row=e.request_row,
                          expected_position=e.position, prev_slot=e.prev_slot)
        return record


def _entry_batch(rows: np.ndarray, lens: np.ndarray, swa_window_size: int) -> np.ndarray:
    """Batch index of each plan entry: the plan lists the live rows' windows in batch order."""
    start = window_start(lens, swa_window_size)
    counts = np.where(rows != 0, np.maximum(0, lens - start), 0)
    return np.repeat(np.arange(rows.shape[0], dtype=np.int64), counts)


def attribute(context, plan, *, req_pool_indices, prefix_lens, swa_window_size: int = 0,
              since: int = 0, launch=None, block_size: int = 0, block_table=None) -> list:
    """:class:`LaunchFinding` objects for the ring rows ``[since, valid rows)`` of
    ``context.violation_log``, each tied to the entry of ``plan`` (a filled
    :class:`~kvcanary.VerifyPlan`) that produced it and explained.

    ``req_pool_indices`` / ``prefix_lens`` (``[bs]``) and ``swa_window_size`` are what the
    plan was built from; ``block_table`` / ``block_size`` (a paged table) add the block of
    each position. Device arrays are copied to the host. A row on a slot that several
    entries read is matched by its expected token and chain link; rows no entry can have
    produced come back with ``entry=None``. Rows of earlier launches still in the ring
    belong to other plans: pass ``since`` = the log's ``total`` before this launch.
    """
    log = context.violation_log
    rows = log.rows()[int(since):]
    if rows.shape[0] == 0:
        return []
    n = active_entries(_HostPlan(plan))
    slots = to_host(plan.verify_slot_indices)[:n].astype(np.int64)
    prevs = to_host(plan.verify_prev_slot_indices)[:n].astype(np.int64)
    positions = to_host(plan.verify_expected_positions)[:n].astype(np.int64)
    tokens = to_host(plan.verify_expected_tokens)[:n].astype(np.int64)
    batch_rows = to_host(req_pool_indices).astype(np.int64)
    batch = _entry_batch(batch_rows, to_host(prefix_lens).astype(np.int64), swa_window_size)
    if batch.shape[0] != n:
        raise CanaryError(f"the plan holds {n} entries but req_pool_indices / "
                          f"prefix_lens describe {batch.shape[0]}: pass the batch the plan "
                          "was built from")
    records = canary_fields(to_host(context.canary_buf))
    entry_of = _match(rows, slots, prevs, positions, tokens, records)
    evidence = Evidence.from_entries(
        slots=slots, positions=positions, tokens=tokens, batch_index=batch,
        request_rows=batch_rows[batch], records=records,
        failing=entry_of[entry_of >= 0], prev_slots=prevs, failing_slots=rows[:, 1],
        failing_bits=rows[:, 7])
    table = None if block_table is None else to_host(block_table)
    stored = {}
    entries = []
    for row, index in zip(rows.tolist(), entry_of.tolist()):
        entry = None
        if index >= 0:
            b, p = int(batch[index]), int(positions[index])
            entry = Entry(kind="request", batch_index=b, request_row=int(batch_rows[b]),
                          position=p, prev_slot=int(prevs[index]),
                          **_blocks(table, block_size, int(batch_rows[b]), p))
            stored[(b, p)] = (row[2], row[3])   # the stored position and token
        entries.append((Violation(*row), entry))
    found = []
    for v, entry in entries:
        diagnosis = diagnose(v, entry, evidence, num_slots=records.shape[0],
                             swa=swa_window_size > 0,
                             table="req_to_token" if table is None else "block_table",
                             swapped_with=lambda b, q: stored.get((b, q)))
        found.append(LaunchFinding(v, entry, failed_checks(v.fail_reason_bits), diagnosis,
                                   launch))
    return found


class _HostPlan:
    """The two scalars :func:`active_entries` reads, on the host."""

    def __init__(self, plan):
        self.enable = to_host(plan.enable)
        self.verify_num_valid = to_host(plan.verify_num_valid)
        self.verify_capacity = plan.verify_capacity


def _blocks(table, block_size: int, row: int, position: int) -> dict:
    if table is None or block_size < 1:
        return {}
    def block(p):
        index = p // block_size
        inside = 0 <= row < table.shape[0] and 0 <= index < table.shape[1]
        return index, int(table[row, index]) if inside else -1
    index, value = block(position)
    out = {"block_index": index, "block": value}
    if position > 0:
        out["prev_block_index"], out["prev_block"] = block(position - 1)
    return out


def _match(rows, slots, prevs, positions, tokens, records) -> np.ndarray:
    """Entry index of each row (-1: none). Candidates read the row's slot; a row's expected
    token, its expected chain link and whether its position check failed (verify rows) or
    its offending index and position (out-of-range rows) single one out; equal candidates
    are taken in entry order."""
    order = np.argsort(slots, kind="stable")
    sorted_slots = slots[order]
    claimed = np.zeros(slots.shape[0], dtype=bool)
    result = np.full(rows.shape[0], -1, dtype=np.int64)
    num_slots = records.shape[0]
    for i, row in enumerate(rows.tolist()):
        lo, hi = np.searchsorted(sorted_slots, row[1]), np.searchsorted(sorted_slots, row[1], "right")
        candidates = order[lo:hi]
        if candidates.size == 0:
            continue
        if row[4] != EXPECTED_TOKEN_UNKNOWN:
            candidates = candidates[tokens[candidates] == row[4]]
        if row[7] & _OUT:
            outside = row[1] < 0 or row[1] >= num_slots
            keep = (positions[candidates] == row[2]) if outside else (prevs[candidates] == row[6])
            candidates = candidates[keep]
        elif candidates.size > 1:
            candidates = candidates[_expected_links(prevs[candidates], records, row[5]) == row[6]]
            # A row holds the stored position, not the expected one: an entry expecting the
            # stored position passed that check, so it cannot have failed it (and vice versa).
            failed_position = bool(row[7] & _POSITION)
            candidates = candidates[(positions[candidates] != row[2]) == failed_position]
        free = candidates[~claimed[candidates]]
        pick = free if free.size else candidates
        if pick.size:
            result[i] = pick[0]
            claimed[pick[0]] = True
    return result


def _expected_links(prevs: np.ndarray, records: np.ndarray, stored_hash: int) -> np.ndarray:
    """The chain link verify expects for entries with predecessor ``prevs``."""
    inside = (prevs > 0) & (prevs < records.shape[0])
    links = record_links(np.take(records, np.where(inside, prevs, 0), axis=0))
    links = np.where(inside, links, stored_hash)
    return np.where(prevs < 0, CHAIN_HEAD_INT64, links)


@dataclass
class MergedFinding:
    """One distinct corruption seen in several launches: the first occurrence
    (``finding``: a :class:`LaunchFinding`, or a bare :class:`~kvcanary.Violation`), how
    many rows repeated it (``count``), the first and last launch labels and every launch tag
    that reported it, in first-seen order."""

    finding: object
    count: int = 0
    first_launch: object = None
    last_launch: object = None
    launch_tags: list = field(default_factory=list)

    @property
    def violation(self) -> Violation | None:
        return _violation(self.finding)

    def to_dict(self) -> dict:
        base = (self.finding.to_dict() if not isinstance(self.finding, Violation)
                else self.violation.to_dict())
        base.update(count=self.count, first_launch=self.first_launch,
                    last_launch=self.last_launch, launch_tags=list(self.launch_tags))
        return base


def merge_key(v: Violation) -> tuple:
    """What makes two rows the same corruption: the slot, the fail reasons and the stored
    record (position, token, chain link). The launch tag is left out: the K and V halves,
    head and tail launches of one corruption merge into one finding."""
    return (v.slot_idx, v.fail_reason_bits, v.position, v.stored_token, v.stored_chain_hash)


class Merger:
    """Folds repeated rows across launches into :class:`MergedFinding` objects, in order of
    first appearance. Memory grows with the distinct corruptions, not with the rows.

    ``key(finding)`` says which added findings are one: by default :func:`merge_key` of the
    finding's violation; an engine that tells requests apart passes its own (e.g. request
    id, position, slot and reasons, so that two requests reading one bad slot stay two
    findings). ``kind`` is the type made for a new finding (a :class:`MergedFinding`
    subclass, constructed as ``kind(finding, first_launch=label)``)."""

    def __init__(self, key=None, kind=None):
        self._key = key or (lambda finding: merge_key(_violation(finding)))
        self._kind = kind or MergedFinding
        self._by_key: dict = {}

    def add(self, findings, launch=None) -> list:
        """Add one launch's findings (:class:`LaunchFinding`, :class:`Violation`, or
        anything with ``violation`` (a Violation or None) and ``launch`` attributes);
        ``launch`` labels them when they carry no label of their own. Returns the merged
        findings this call created, so that a caller can report each problem once."""
        new = []
        for finding in findings:
            v = _violation(finding)
            own = None if isinstance(finding, Violation) else getattr(finding, "launch", None)
            label = launch if own is None else own
            key = self._key(finding)
            merged = self._by_key.get(key)
            if merged is None:
                merged = self._by_key[key] = self._kind(finding, first_launch=label)
                new.append(merged)
            merged.count += 1
            merged.last_launch = label
            if v is not None and v.launch_tag not in merged.launch_tags:
                merged.launch_tags.append(v.launch_tag)
        return new

    def __len__(self) -> int:
        return len(self._by_key)

    @property
    def findings(self) -> list:
        return list(self._by_key.values())


def _violation(finding) -> Violation | None:
    return finding if isinstance(finding, Violation) else finding.violation


def merge_findings(findings) -> list:
    """:class:`MergedFinding` objects of ``findings`` (one :class:`Merger` pass)."""
    merger = Merger()
    merger.add(findings)
    return merger.findings
