"""Findings of an engine guard: one per distinct problem, each with its explanation.

Which plan entry (request, position) a verify row belongs to, also when several requests read
one slot, comes from :func:`kvcanary.attribute`, and its diagnosis from
:mod:`kvcanary.findings.diagnosis`; :class:`kvcanary.Merger` folds the sightings of every step into
findings. What this module adds is what only the engine knows (it imports neither torch nor
any engine):

* :class:`Sighting` -- one flagged (request, position, slot) of one launch, the engine's id
  of the request instead of a batch row (batch rows change from step to step);
* :class:`Finding` -- a merged sighting with its first and last step, a count and the
  explanation;
* :func:`explain` -- the likely cause from the row, the shared diagnosis and the engine's
  evidence (:class:`EngineEvidence`: who wrote the record now in the slot, where the request
  itself wrote the position, which slot the block table names).

Besides the canary's fail reasons (``FailReason`` labels such as ``verify_position``) a guard
adds two checks of its own, named like them: ``read_index_mismatch`` (attention gathers a
slot other than the one the block table maps) and ``write_index_mismatch`` (a token's KV is
written to a slot other than the one the block table maps).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..findings.attribution import MergedFinding
from ..format.bits import (VERIFY_CHAIN_HASH_MISMATCH as _CHAIN,
                           VERIFY_REAL_KV_HASH_MISMATCH as _REAL_KV,
                           WRITE_POSITION_MISMATCH as _WRITE_POSITION)
from ..findings.causes import Cause
from ..format.consts import VIOLATION_FIELDS
from ..findings.diagnosis import Diagnosis
from ..format.violations import Violation, reason_labels

READ_INDEX_MISMATCH = "read_index_mismatch"
WRITE_INDEX_MISMATCH = "write_index_mismatch"
# Causes of a verify row the shared diagnosis states from the index alone, whatever the
# engine's evidence: an index outside the buffer or table, padding slot 0 in a live prefix.
SHARED_CAUSES = (Cause.OUT_OF_RANGE, Cause.SLOT_ZERO)


class Sighting(NamedTuple):
    """One flagged (request, position, slot) of one launch (``launch``: the step):
    ``reasons`` the fail-reason labels plus the guard's own checks, ``violation`` the first
    ring row (None for a guard check alone), ``diagnosis`` the shared diagnosis of a verify
    row (None elsewhere)."""

    request_id: str
    position: int
    slot: int
    block: int
    reasons: tuple
    violation: Violation | None
    launch: int
    diagnosis: Diagnosis | None = None

    def key(self) -> tuple:
        """Sightings with the same key are one finding."""
        return (self.request_id, self.position, self.slot, self.reasons)


@dataclass
class Finding(MergedFinding):
    """One distinct problem a guard found (a :class:`kvcanary.MergedFinding` of
    :class:`Sighting` objects).

    ``request_id`` is the engine's id; ``position`` the request's position where the problem
    was found (not the position stored in the record); ``slot`` the canary slot (``block *
    block_size + offset``); ``reasons`` fail-reason labels plus the guard's own checks;
    ``count`` how many forward steps saw it, from ``first_step`` to ``last_step``;
    ``violation`` the first ring row (None for a guard check alone), ``log_line`` its frozen
    ``kv_canary violation:`` line; ``explanation`` the likely cause."""

    explanation: str = ""

    request_id = property(lambda self: self.finding.request_id)
    position = property(lambda self: self.finding.position)
    slot = property(lambda self: self.finding.slot)
    block = property(lambda self: self.finding.block)
    reasons = property(lambda self: self.finding.reasons)
    first_step = property(lambda self: self.first_launch)
    last_step = property(lambda self: self.last_launch)

    @property
    def log_line(self) -> str:
        if self.violation is None:
            return (f"kv_canary check: {'+'.join(self.reasons)} slot_idx={self.slot} "
                    f"position={self.position}")
        return self.violation.log_line()

    def describe(self) -> str:
        seen = (f"step {self.first_step}" if self.count == 1 else
                f"steps {self.first_step}..{self.last_step} ({self.count} times)")
        return (f"{self.log_line}\n  request {self.request_id} position {self.position} "
                f"(slot {self.slot}, block {self.block}), {seen}\n  {self.explanation}")

    def to_dict(self) -> dict:
        out = {k: getattr(self, k) for k in ("request_id", "position", "slot", "block",
                                             "first_step", "last_step", "count",
                                             "explanation")}
        out["reasons"] = list(self.reasons)
        out["violation"] = None if self.violation is None else self.violation.to_dict()
        return out


@dataclass
class EngineEvidence:
    """What the engine's state says about one (request, position) at one step.

    ``writer``: ``(request_id, position, step, followed_table)`` of the last write into the
    slot, None if nothing was written there this session; ``own_slot``: where this request
    itself wrote this position (None when it came from the prefix cache or a fork);
    ``table_slot``: the slot the block table maps; ``engine_position``: the position id the
    engine used (write rows); ``trash``: whether ``own_slot`` lies in the engine's trash
    blocks; ``near_slots``: the table slots of positions ``position - 1`` and ``position + 1``;
    ``own_followed``: whether that write went where the block table said at the time;
    ``misread_before``: whether this step gathered position ``position - 1`` from a wrong slot;
    ``history``: the cause the allocator's history names for the slot's block (freed while
    held, handed to another request, remapped, a stale prefix-cache entry), None if none;
    ``moved``: how the reader legitimately came to hold the block (``"de-duplicated at step
    7"``, ``"prefix at step 3"``), never itself a cause."""

    request_id: str
    position: int
    slot: int
    table_slot: int
    writer: tuple | None = None
    own_slot: int | None = None
    engine_position: int | None = None
    trash: bool = False
    near_slots: tuple = (None, None)
    sources: str = ""
    own_followed: bool = True
    misread_before: bool = False
    history: str | None = None
    moved: str | None = None


def explain(sighting: Sighting, ev: EngineEvidence) -> str:
    """The likely cause of one finding, in one or two sentences: the engine's evidence where
    it tells more than the canary records (who wrote the slot, where the request wrote it,
    what the block table maps), the sighting's shared diagnosis for an index outside the
    buffer, padding slot 0, and a chain link that alone fails."""
    reasons, violation = sighting.reasons, sighting.violation
    bits = 0 if violation is None else int(violation.fail_reason_bits)
    at = f"slot {ev.slot}"
    if READ_INDEX_MISMATCH in reasons:
        return (f"misread: attention gathered position {ev.position} of {ev.request_id} from "
                f"{at}, but the block table maps that position to slot {ev.table_slot}; the "
                "read indices are wrong (the write path is not involved)")
    if WRITE_INDEX_MISMATCH in reasons:
        shift = _shift(ev.slot, ev.near_slots)
        if shift and bits & _WRITE_POSITION:
            return (f"the position offset of {ev.request_id} is shifted by {shift:+d}: the "
                    f"token at position {ev.position} was written with position id "
                    f"{ev.engine_position} into the slot of position {ev.position + shift}")
        if ev.trash:
            return (f"lost write: the KV of {ev.request_id} position {ev.position} went to the "
                    f"engine's trash block ({at}) instead of slot {ev.table_slot}")
        victim = (f", a slot {ev.writer[0]} holds for its position {ev.writer[1]}"
                  if ev.writer and ev.writer[0] != ev.request_id else "")
        return (f"misdirected write: {ev.request_id} wrote position {ev.position} into {at}"
                f"{victim} instead of its own slot {ev.table_slot}")
    if sighting.diagnosis is not None and sighting.diagnosis.cause in SHARED_CAUSES:
        return sighting.diagnosis.text
    if sighting.diagnosis is not None and sighting.diagnosis.cause is Cause.WRITE_INPUT:
        # No write index check failed with it: the write went where the block table says.
        return (f"{ev.request_id}: {sighting.diagnosis.text} (written to the slot the block "
                "table maps)")
    if bits == _REAL_KV:
        return (f"the KV bytes of {at} ({ev.sources}) changed after they were written; the "
                "record still matches token, position and chain: the KV tensor was "
                "overwritten or corrupted in place")
    kv = (" The slot's KV bytes no longer match its record either." if bits & _REAL_KV else "")
    return _mapping_cause(violation, ev, sighting.diagnosis) + kv


def _mapping_cause(v: Violation | None, ev: EngineEvidence, diagnosis=None) -> str:
    """The record at the slot is not this request's position: say whose it is and why
    (the shared ``diagnosis`` where the engine's evidence adds nothing)."""
    writer = ev.writer
    holds = ("nothing this session" if writer is None else
             f"{writer[0]}'s record of position {writer[1]} (written at step {writer[2]})")
    if ev.own_slot is not None and ev.own_slot != ev.slot:
        shift = _shift(ev.own_slot, ev.near_slots)
        if shift:
            return (f"{ev.request_id} wrote position {ev.position} into the slot of position "
                    f"{ev.position + shift}: its position offset was shifted by {shift:+d}, so "
                    f"slot {ev.slot} holds {holds}")
        if ev.trash:
            return (f"lost write: {ev.request_id} position {ev.position} was written to the "
                    f"trash block, so slot {ev.slot} holds {holds}")
        if not ev.own_followed:
            return (f"{ev.request_id}'s write of position {ev.position} was misdirected to slot "
                    f"{ev.own_slot}, so its own slot {ev.slot} holds {holds}")
        if ev.history:
            return ev.history
        if ev.moved:
            return (f"slot {ev.slot} holds {holds}, not {ev.request_id}'s position "
                    f"{ev.position}; {ev.request_id} reads it there since the engine moved its "
                    f"entry ({_moved(ev.moved)}), a legitimate move: what changed the block "
                    "after that is the fault")
        return (f"{ev.request_id} wrote position {ev.position} to slot {ev.own_slot} but now "
                f"reads it from slot {ev.slot}, which holds {holds}: its block-table entry was "
                "changed after the write (remapped onto another block)")
    if writer is not None and writer[0] != ev.request_id and ev.own_slot == ev.slot:
        if not writer[3]:
            return (f"{writer[0]} wrote its position {writer[1]} into slot {ev.slot} at step "
                    f"{writer[2]}, a slot {ev.request_id} still holds for position "
                    f"{ev.position}: a misdirected write by {writer[0]}")
        if ev.history:
            return ev.history
        return (f"slot {ev.slot} of {ev.request_id} position {ev.position} was overwritten by "
                f"{writer[0]} (its position {writer[1]}, step {writer[2]}): the block was freed "
                "or handed to another request while still referenced, then reused")
    if ev.history:
        return ev.history
    if writer is None:
        return (f"slot {ev.slot} was never written this session, yet {ev.request_id} reads "
                f"position {ev.position} from it")
    if v is not None and int(v.fail_reason_bits) == _CHAIN and ev.misread_before:
        return (f"the record of {ev.request_id} position {ev.position} is intact; its chain "
                f"link fails because this step gathered position {ev.position - 1} from a wrong "
                "slot (a misread)")
    if v is not None and int(v.fail_reason_bits) == _CHAIN and diagnosis is not None:
        return diagnosis.text       # which of the two records changed: the shared rule
    if v is not None and writer[:2] == (ev.request_id, ev.position) and v.position != ev.position:
        return (f"slot {ev.slot} holds the record {ev.request_id} wrote for position "
                f"{ev.position} at step {writer[2]}, stored with position id {v.position}: that "
                f"write's position id was off by {v.position - ev.position:+d}")
    if v is not None and writer[:2] == (ev.request_id, ev.position):
        return (f"slot {ev.slot} holds the token {v.stored_token} that {ev.request_id} wrote "
                f"for position {ev.position} at step {writer[2]}, but the request's token there "
                f"is {v.expected_token}: its token ids and positions disagree (an input id or "
                "the position offset is off)")
    if ev.moved:
        return (f"slot {ev.slot} holds {holds}, not {ev.request_id}'s position {ev.position} "
                f"({ev.request_id} holds the block by a legitimate move: {_moved(ev.moved)})")
    return f"slot {ev.slot} holds {holds}, not {ev.request_id}'s position {ev.position}"


def _moved(moved: str) -> str:
    return moved.replace("prefix", "a prefix-cache hit", 1)


def _shift(slot, near_slots) -> int:
    before, after = near_slots
    if slot is not None and slot == after:
        return 1
    if slot is not None and slot == before:
        return -1
    return 0


def row_reasons(bits: int, guard_checks=()) -> tuple:
    """Fail-reason labels of a row's bits followed by the guard's own checks."""
    return tuple(reason_labels(bits)) + tuple(guard_checks)


def take_ring_rows(log, guard, step: int):
    """A guarded launch's ring rows, taken out of ``log`` (a ``kvcanary.ViolationLog``, cleared
    after): counted in ``guard.stats`` (``ring_rows``, ``rows_dropped``) and kept, with
    ``step``, in ``guard.raw_rows``. Returns the rows, int64 ``(n, 8)``."""
    total = log.total          # one read of the ring's index (a device copy on a GPU)
    if not total:
        return np.zeros((0, VIOLATION_FIELDS), dtype=np.int64)
    rows = log.rows()
    guard.stats["ring_rows"] += total
    guard.stats["rows_dropped"] += log.dropped
    guard.raw_rows.extend((step, row) for row in rows)
    log.clear()
    return rows
