"""Findings of an engine guard: one per distinct problem, each with its explanation.

Which plan entry (request, position) a verify row belongs to, also when several requests read
one slot, comes from :func:`kvcanary.attribute`, and its diagnosis from
:mod:`kvcanary.findings.diagnosis`; :class:`kvcanary.Merger` folds the sightings of every step into
findings. What this module adds is what only the engine knows (it imports neither torch nor
any engine):

* :class:`Sighting` -- one flagged (request, position, slot) of one launch, the engine's id
  of the request instead of a batch row (batch rows change from step to step);
* :class:`Finding` -- a merged sighting with its first and last step, a count and its
  likely cause;
* :func:`explain` -- the likely cause from the row, the shared diagnosis and the engine's
  evidence (:class:`EngineEvidence`: who wrote the record now in the slot, where the request
  itself wrote the position, which slot the block table names). Every cause is a member of
  the one vocabulary, :class:`~kvcanary.findings.causes.Cause`; the guard supplies only the
  evidence its template renders (:meth:`kvcanary.Diagnosis.of`), never its own sentence.

Besides the canary's fail reasons (``FailReason`` labels such as ``verify_position``) a guard
adds two checks of its own, named like them: ``read_index_mismatch`` (attention gathers a
slot other than the one the block table maps) and ``write_index_mismatch`` (a token's KV is
written to a slot other than the one the block table maps).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np

from .. import Diagnosis, MergedFinding, Violation
from ..findings.causes import Cause
from ..format.bits import (VERIFY_CHAIN_HASH_MISMATCH as _CHAIN,
                           VERIFY_REAL_KV_HASH_MISMATCH as _REAL_KV,
                           WRITE_POSITION_MISMATCH as _WRITE_POSITION)
from ..format.consts import VIOLATION_FIELDS
from ..format.errors import GuardError
from ..format.violations import reason_labels

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
    ``kv_canary violation:`` line; ``diagnosis`` the likely cause (a
    :class:`~kvcanary.Diagnosis`: ``cause``, a :class:`~kvcanary.findings.causes.Cause`, and
    its sentence), stated with :meth:`state`; ``explanation`` that sentence, after the cache
    group's name where a model has several; ``group`` the cache group (its name, or vLLM's
    group index), None where the engine has one."""

    diagnosis: Diagnosis | None = None
    group: object = None
    explanation_prefix: str = ""

    request_id = property(lambda self: self.finding.request_id)
    position = property(lambda self: self.finding.position)
    slot = property(lambda self: self.finding.slot)
    block = property(lambda self: self.finding.block)
    reasons = property(lambda self: self.finding.reasons)
    first_step = property(lambda self: self.first_launch)
    last_step = property(lambda self: self.last_launch)

    def state(self, diagnosis: Diagnosis, prefix: str = "") -> None:
        """Give the finding its likely cause (``prefix``: words before its sentence, e.g.
        ``"sliding_attention group: "``). Raises ``TypeError`` for anything but a
        :class:`~kvcanary.Diagnosis`, whose cause is always a member of ``Cause``."""
        if not isinstance(diagnosis, Diagnosis):
            raise TypeError(f"a finding's cause is a kvcanary.Diagnosis (a Cause and its "
                            f"sentence), got {type(diagnosis).__name__}")
        self.diagnosis, self.explanation_prefix = diagnosis, prefix

    @property
    def cause(self) -> Cause | None:
        """The likely cause (a :class:`~kvcanary.findings.causes.Cause`), None before
        :meth:`state`."""
        return None if self.diagnosis is None else self.diagnosis.cause

    @property
    def explanation(self) -> str:
        """The likely cause in words (after the group's name where there are several)."""
        return "" if self.diagnosis is None else self.explanation_prefix + self.diagnosis.text

    @property
    def log_line(self) -> str:
        if self.violation is None:
            return (f"kv_canary check: {'+'.join(self.reasons)} slot_idx={self.slot} "
                    f"position={self.position}")
        return self.violation.log_line()

    def where(self) -> str:
        """``request R position P (slot S, block B), step N`` (or ``steps F..L (C times)``)."""
        seen = (f"step {self.first_step}" if self.count == 1 else
                f"steps {self.first_step}..{self.last_step} ({self.count} times)")
        return (f"request {self.request_id} position {self.position} (slot {self.slot}, "
                f"block {self.block}), {seen}")

    def describe(self) -> str:
        """The frozen line, then ``  at: ...`` (:meth:`where`) and ``  likely cause: ...``,
        labelled as every finding's :meth:`describe` is."""
        return f"{self.log_line}\n  at: {self.where()}\n  likely cause: {self.explanation}"

    def to_dict(self) -> dict:
        """JSON-ready: the fields above, ``likely_cause`` (and ``explanation``, the same
        words, as the guard's findings have always named them) and ``diagnosis`` (``cause``,
        ``certain``, ...) as an audit's findings carry them."""
        out = {k: getattr(self, k) for k in ("request_id", "position", "slot", "block",
                                             "first_step", "last_step", "count",
                                             "explanation")}
        out["likely_cause"] = self.explanation
        out["diagnosis"] = None if self.diagnosis is None else self.diagnosis.to_dict(text=False)
        out["reasons"] = list(self.reasons)
        out["violation"] = None if self.violation is None else self.violation.to_dict()
        if self.group is not None:
            out["group"] = self.group
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
    ``history``: the :class:`~kvcanary.Diagnosis` the allocator's history states for the
    slot's block (freed while held, handed to another request, remapped, a stale
    prefix-cache entry, a fork's wrong copy), None if none;
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
    history: Diagnosis | None = None
    moved: str | None = None


def explain(sighting: Sighting, ev: EngineEvidence) -> Diagnosis:
    """The likely cause of one finding: a :class:`~kvcanary.Diagnosis` whose cause is a
    :class:`~kvcanary.findings.causes.Cause` and whose text is that cause's template rendered
    from the engine's evidence where it tells more than the canary records (who wrote the
    slot, where the request wrote it, what the block table maps, the allocator's history);
    the sighting's shared diagnosis for an index outside the buffer, padding slot 0, and a
    chain link that alone fails."""
    reasons, violation = sighting.reasons, sighting.violation
    bits = 0 if violation is None else int(violation.fail_reason_bits)
    if READ_INDEX_MISMATCH in reasons:
        return Diagnosis.of(Cause.MISREAD, request=ev.request_id, position=ev.position,
                            slot=ev.slot, table_slot=ev.table_slot)
    if WRITE_INDEX_MISMATCH in reasons:
        shift = _shift(ev.slot, ev.near_slots)
        if shift and bits & _WRITE_POSITION:
            return Diagnosis.of(Cause.OFFSET_SHIFTED, "write", request=ev.request_id,
                                shift=shift, position=ev.position,
                                engine_position=ev.engine_position,
                                shifted=ev.position + shift)
        if ev.trash:
            return Diagnosis.of(Cause.LOST_WRITE, "write", request=ev.request_id,
                                position=ev.position, slot=ev.slot, table_slot=ev.table_slot)
        victim = (f", a slot {ev.writer[0]} holds for its position {ev.writer[1]}"
                  if ev.writer and ev.writer[0] != ev.request_id else "")
        return Diagnosis.of(Cause.MISDIRECTED_WRITE, "write", request=ev.request_id,
                            position=ev.position, slot=ev.slot, victim=victim,
                            table_slot=ev.table_slot)
    if sighting.diagnosis is not None and sighting.diagnosis.cause in SHARED_CAUSES:
        return sighting.diagnosis
    if sighting.diagnosis is not None and sighting.diagnosis.cause is Cause.WRITE_INPUT:
        # No write index check failed with it: the write went where the block table says.
        return replace(sighting.diagnosis, text=f"{ev.request_id}: {sighting.diagnosis.text} "
                       "(written to the slot the block table maps)")
    if bits == _REAL_KV:
        return Diagnosis.of(Cause.KV_BYTES_CHANGED, slot=ev.slot, sources=ev.sources)
    found = _mapping_cause(violation, ev, sighting.diagnosis)
    if bits & _REAL_KV:
        return replace(found, text=found.text + KV_ALSO_CHANGED)
    return found


# Added to the cause of a record that is not the reader's when its KV bytes fail too.
KV_ALSO_CHANGED = " The slot's KV bytes no longer match its record either."


def _mapping_cause(v: Violation | None, ev: EngineEvidence, diagnosis=None) -> Diagnosis:
    """The record at the slot is not this request's position: whose it is and why (the
    shared ``diagnosis`` where the engine's evidence adds nothing)."""
    writer = ev.writer
    holds = ("nothing this session" if writer is None else
             f"{writer[0]}'s record of position {writer[1]} (written at step {writer[2]})")
    if ev.own_slot is not None and ev.own_slot != ev.slot:
        shift = _shift(ev.own_slot, ev.near_slots)
        if shift:
            return Diagnosis.of(Cause.OFFSET_SHIFTED, request=ev.request_id,
                                position=ev.position, shifted=ev.position + shift, shift=shift,
                                slot=ev.slot, holds=holds)
        if ev.trash:
            return Diagnosis.of(Cause.LOST_WRITE, request=ev.request_id, position=ev.position,
                                slot=ev.slot, holds=holds)
        if not ev.own_followed:
            return Diagnosis.of(Cause.MISDIRECTED_WRITE, request=ev.request_id,
                                position=ev.position, own_slot=ev.own_slot, slot=ev.slot,
                                holds=holds)
        if ev.history:
            return ev.history
        if ev.moved:
            return Diagnosis.of(Cause.CHANGED_AFTER_MOVE, slot=ev.slot, holds=holds,
                                request=ev.request_id, position=ev.position,
                                moved=_moved(ev.moved))
        return Diagnosis.of(Cause.REMAPPED, request=ev.request_id, position=ev.position,
                            own_slot=ev.own_slot, slot=ev.slot, holds=holds)
    if writer is not None and writer[0] != ev.request_id and ev.own_slot == ev.slot:
        if not writer[3]:
            return Diagnosis.of(Cause.MISDIRECTED_WRITE, "victim", writer=writer[0],
                                writer_position=writer[1], slot=ev.slot, writer_step=writer[2],
                                request=ev.request_id, position=ev.position)
        if ev.history:
            return ev.history
        return Diagnosis.of(Cause.OVERWRITTEN, slot=ev.slot, request=ev.request_id,
                            position=ev.position, writer=writer[0], writer_position=writer[1],
                            writer_step=writer[2])
    if ev.history:
        return ev.history
    if writer is None:
        return Diagnosis.of(Cause.NEVER_WRITTEN, slot=ev.slot, request=ev.request_id,
                            position=ev.position)
    if v is not None and int(v.fail_reason_bits) == _CHAIN and ev.misread_before:
        return Diagnosis.of(Cause.MISREAD, "successor", request=ev.request_id,
                            position=ev.position, previous=ev.position - 1)
    if v is not None and int(v.fail_reason_bits) == _CHAIN and diagnosis is not None:
        return diagnosis            # which of the two records changed: the shared rule
    if v is not None and writer[:2] == (ev.request_id, ev.position) and v.position != ev.position:
        return Diagnosis.of(Cause.WRITE_INPUT, "position", slot=ev.slot, request=ev.request_id,
                            position=ev.position, step=writer[2], stored_position=v.position,
                            offset=v.position - ev.position)
    if v is not None and writer[:2] == (ev.request_id, ev.position):
        return Diagnosis.of(Cause.WRITE_INPUT, "token", slot=ev.slot,
                            stored_token=v.stored_token, request=ev.request_id,
                            position=ev.position, step=writer[2],
                            expected_token=v.expected_token)
    if ev.moved:
        return Diagnosis.of(Cause.CHANGED_AFTER_MOVE, "held", slot=ev.slot, holds=holds,
                            request=ev.request_id, position=ev.position,
                            moved=_moved(ev.moved))
    return Diagnosis.of(Cause.FOREIGN_RECORD, slot=ev.slot, holds=holds,
                        request=ev.request_id, position=ev.position)


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


def deliver(finding: "Finding", on_violation, stopped: str) -> GuardError | None:
    """Hand a new finding to what the user chose at ``guard()``: ``"log"`` writes a WARNING
    on the ``kvcanary`` logger (SGLang's violation line, the request, the position and the
    likely cause), a callable receives the finding, and ``"raise"`` returns the
    :class:`GuardError` (``stopped``: what it says stopped) that the guard raises where the
    engine's call returns."""
    if on_violation == "log":
        logging.getLogger("kvcanary").warning(
            "%s request=%s position=%d: likely cause: %s", finding.log_line,
            finding.request_id, finding.position, finding.explanation)
    elif on_violation == "raise":
        return GuardError(f"{stopped}: {finding.describe()}", finding)
    else:
        on_violation(finding)
    return None


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
