"""Findings of an engine guard: ring rows attributed to (request, position), merged across
forward steps into one finding per distinct problem, each with its explanation.

This is the one place an integration turns violation rows into findings; it imports neither
torch nor any engine. Three steps, each a small function:

* :func:`attribute` -- which plan entry (request, position) each ring row of a launch
  belongs to, also when several requests read one slot (shared prefix blocks);
* :func:`explain` -- one sentence on the likely cause, from the row and the engine's
  evidence (who wrote the record now in the slot, which slot the block table names);
* :class:`FindingLog` -- merges repeats: a bad record every later step reads again is one
  finding with its first and last step and a count; the raw rows stay available.

Besides the canary's fail reasons (``FailReason`` labels such as ``verify_position``) a guard
adds two checks of its own, named like them: ``read_index_mismatch`` (attention gathers a
slot other than the one the block table maps) and ``write_index_mismatch`` (a token's KV is
written to a slot other than the one the block table maps).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .. import api
from ..consts import FailReason
from ..types import CanaryContext, VerifyPlan, ViolationLog
from ..violations import Violation, reason_labels

READ_INDEX_MISMATCH = "read_index_mismatch"
WRITE_INDEX_MISMATCH = "write_index_mismatch"
_CHAIN = int(FailReason.VERIFY_CHAIN_HASH_MISMATCH)
_REAL_KV = int(FailReason.VERIFY_REAL_KV_HASH_MISMATCH)
_WRITE_POSITION = int(FailReason.WRITE_POSITION_MISMATCH)
_WRITE_TOKEN = int(FailReason.WRITE_TOKEN_MISMATCH)


@dataclass
class Finding:
    """One distinct problem a guard found.

    ``request_id`` is the engine's id; ``position`` the request's position where the problem
    was found (not the position stored in the record); ``slot`` the canary slot (``block *
    block_size + offset``); ``reasons`` fail-reason labels plus the guard's own checks;
    ``count`` how many forward steps saw it, from ``first_step`` to ``last_step``;
    ``violation`` the first ring row (None for a guard check alone), ``log_line`` its frozen
    ``kv_canary violation:`` line."""

    request_id: str
    position: int
    slot: int
    block: int
    reasons: tuple
    first_step: int
    last_step: int
    count: int
    explanation: str
    violation: Violation | None = None

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
class Evidence:
    """What the engine's state says about one (request, position) at one step.

    ``writer``: ``(request_id, position, step, followed_table)`` of the last write into the
    slot, None if nothing was written there this session; ``own_slot``: where this request
    itself wrote this position (None when it came from the prefix cache or a fork);
    ``table_slot``: the slot the block table maps; ``engine_position``: the position id the
    engine used (write rows); ``trash``: whether ``own_slot`` lies in the engine's trash
    blocks; ``near_slots``: the table slots of positions ``position - 1`` and ``position + 1``;
    ``own_followed``: whether that write went where the block table said at the time;
    ``misread_before``: whether this step gathered position ``position - 1`` from a wrong slot."""

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


def explain(reasons: tuple, bits: int, violation: Violation | None, ev: Evidence) -> str:
    """The likely cause of one finding, in one or two sentences."""
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
    if violation is not None and bits & (_WRITE_POSITION | _WRITE_TOKEN):
        if bits & _WRITE_POSITION and violation.position == ev.position:
            return (f"the position id {ev.position} is right, but the record before it (this "
                    f"write's chain seed) holds position {violation.expected_aux - 1}: an "
                    f"earlier write of {ev.request_id} was lost, misplaced or mis-positioned")
        if bits & _WRITE_POSITION:
            return (f"position ids off: the engine wrote {ev.request_id}'s token at position "
                    f"{ev.position} with position id {violation.position} (the slot is "
                    "right, the position id is not)")
        return (f"the engine's input id {violation.stored_token} for {ev.request_id} position "
                f"{ev.position} is not the request's token {violation.expected_token}")
    if bits == _REAL_KV:
        return (f"the KV bytes of {at} ({ev.sources}) changed after they were written; the "
                "record still matches token, position and chain: the KV tensor was "
                "overwritten or corrupted in place")
    kv = (" The slot's KV bytes no longer match its record either." if bits & _REAL_KV else "")
    return _mapping_cause(violation, ev) + kv


def _mapping_cause(v: Violation | None, ev: Evidence) -> str:
    """The record at the slot is not this request's position: say whose it is and why."""
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
        return (f"{ev.request_id} wrote position {ev.position} to slot {ev.own_slot} but now "
                f"reads it from slot {ev.slot}, which holds {holds}: its block-table entry was "
                "changed after the write (remapped onto another block)")
    if writer is not None and writer[0] != ev.request_id and ev.own_slot == ev.slot:
        if not writer[3]:
            return (f"{writer[0]} wrote its position {writer[1]} into slot {ev.slot} at step "
                    f"{writer[2]}, a slot {ev.request_id} still holds for position "
                    f"{ev.position}: a misdirected write by {writer[0]}")
        return (f"slot {ev.slot} of {ev.request_id} position {ev.position} was overwritten by "
                f"{writer[0]} (its position {writer[1]}, step {writer[2]}): the block was freed "
                "or handed to another request while still referenced, then reused")
    if writer is None:
        return (f"slot {ev.slot} was never written this session, yet {ev.request_id} reads "
                f"position {ev.position} from it")
    if v is not None and int(v.fail_reason_bits) == _CHAIN and ev.misread_before:
        return (f"the record of {ev.request_id} position {ev.position} is intact; its chain "
                f"link fails because this step gathered position {ev.position - 1} from a wrong "
                "slot (a misread)")
    if v is not None and int(v.fail_reason_bits) == _CHAIN:
        return (f"the record of {ev.request_id} position {ev.position} is intact but its "
                "predecessor's record changed after it was written")
    if v is not None and writer[:2] == (ev.request_id, ev.position) and v.position != ev.position:
        return (f"slot {ev.slot} holds the record {ev.request_id} wrote for position "
                f"{ev.position} at step {writer[2]}, stored with position id {v.position}: that "
                f"write's position id was off by {v.position - ev.position:+d}")
    if v is not None and writer[:2] == (ev.request_id, ev.position):
        return (f"slot {ev.slot} holds the token {v.stored_token} that {ev.request_id} wrote "
                f"for position {ev.position} at step {writer[2]}, but the request's token there "
                f"is {v.expected_token}: its token ids and positions disagree (an input id or "
                "the position offset is off)")
    return f"slot {ev.slot} holds {holds}, not {ev.request_id}'s position {ev.position}"


def _shift(slot, near_slots) -> int:
    before, after = near_slots
    if slot is not None and slot == after:
        return 1
    if slot is not None and slot == before:
        return -1
    return 0


# ------------------------------------------------------------------ attribution


def attribute(rows: np.ndarray, entry_slots: np.ndarray, recheck) -> np.ndarray:
    """The entry index of each ring row of one verify launch (-1 if none reproduces it).

    ``entry_slots`` int64 ``[n]`` are the launch's slots in entry order. A row on a slot one
    entry uses is that entry's. Rows on a slot several entries share (a prefix block two
    requests read) are matched by content against ``recheck(entries)``, which re-verifies the
    given entries (each slot at most once) and returns ``(rows, entry index of each row)``."""
    result = np.full(rows.shape[0], -1, dtype=np.int64)
    if rows.shape[0] == 0 or entry_slots.size == 0:
        return result
    order = np.argsort(entry_slots, kind="stable")
    sorted_slots = entry_slots[order]
    first = np.searchsorted(sorted_slots, rows[:, 1], "left")
    last = np.searchsorted(sorted_slots, rows[:, 1], "right")
    single = (last - first) == 1
    result[single] = order[first[single]]
    shared = np.flatnonzero(last - first > 1)
    if shared.size:
        candidates = np.flatnonzero(np.isin(entry_slots, np.unique(rows[shared, 1])))
        rank = _occurrence(entry_slots[candidates])
        got_rows, got_entries = [], []
        for k in range(int(rank.max()) + 1):
            r, e = recheck(candidates[rank == k])
            got_rows.append(r)
            got_entries.append(e)
        result[shared] = _match(rows[shared], np.concatenate(got_rows),
                                np.concatenate(got_entries))
    return result


def _occurrence(values: np.ndarray) -> np.ndarray:
    """Rank of each element among the equal values before it."""
    order = np.argsort(values, kind="stable")
    s = values[order]
    rank = np.empty(values.size, dtype=np.int64)
    rank[order] = np.arange(values.size) - np.searchsorted(s, s, "left")
    return rank


def _match(rows: np.ndarray, predicted: np.ndarray, entries: np.ndarray) -> np.ndarray:
    """The k-th copy of a row content takes the k-th entry predicting it."""
    result = np.full(rows.shape[0], -1, dtype=np.int64)
    taken: dict = {}
    for i, row in enumerate(rows):
        key = row.tobytes()
        matches = taken.setdefault(key, [int(e) for p, e in zip(predicted, entries)
                                         if p.tobytes() == key])
        if matches:
            result[i] = matches.pop(0)
    return result


def recheck_on_host(context, plan_arrays: dict, check_tokens: bool):
    """A ``recheck`` for :func:`attribute`: re-verifies entries on the numpy reference with
    a fresh ring, over the host copy ``context`` (its canary and sources as numpy)."""
    def run(entries: np.ndarray):
        plan = VerifyPlan(
            verify_slot_indices=plan_arrays["slots"][entries].copy(),
            verify_expected_tokens=plan_arrays["tokens"][entries].copy(),
            verify_expected_positions=plan_arrays["positions"][entries].copy(),
            verify_prev_slot_indices=plan_arrays["prevs"][entries].copy(),
            verify_num_valid=np.array([entries.size], dtype=np.int32),
            enable=np.ones(1, dtype=np.int32))
        log = ViolationLog.allocate(max(1, entries.size))
        ctx = CanaryContext(context.canary_buf, kernel_kind=context.kernel_kind,
                               violation_log=log, slot_run_counter=np.zeros(1, np.int64),
                               kernel_run_counter=np.zeros(1, np.int64),
                               real_kv_sources=context.real_kv_sources,
                               real_kv_hash_mode=context.real_kv_hash_mode,
                               max_real_kv_sources=context.max_real_kv_sources)
        api.verify(ctx, plan, check_expected_token=check_tokens, backend="numpy")
        got = log.rows()
        slots = plan.verify_slot_indices
        by_slot = np.argsort(slots, kind="stable")
        return got, entries[by_slot][np.searchsorted(slots[by_slot], got[:, 1])]

    return run


# ------------------------------------------------------------------ merging


@dataclass
class FindingLog:
    """Findings merged by (request, position, slot, reasons), in order of first sight."""

    findings: dict = field(default_factory=dict)
    raw_rows: list = field(default_factory=list)   # (step, int64 [8] row) of every ring row

    def add(self, step: int, request_id: str, position: int, slot: int, block: int,
            reasons: tuple, violation: Violation | None, evidence_fn) -> Finding | None:
        """Record one sighting; returns the finding when it is new (else None).
        ``evidence_fn()`` is called only for a new finding (explanations are built once)."""
        key = (request_id, int(position), int(slot), tuple(reasons))
        found = self.findings.get(key)
        if found is not None:
            found.last_step, found.count = step, found.count + 1
            return None
        bits = 0 if violation is None else int(violation.fail_reason_bits)
        text = explain(tuple(reasons), bits, violation, evidence_fn())
        found = Finding(request_id, int(position), int(slot), int(block), tuple(reasons),
                        step, step, 1, text, violation)
        self.findings[key] = found
        return found

    def __len__(self) -> int:
        return len(self.findings)

    def all(self) -> list:
        return list(self.findings.values())


def row_reasons(bits: int, guard_checks=()) -> tuple:
    """Fail-reason labels of a row's bits followed by the guard's own checks."""
    return tuple(reason_labels(bits)) + tuple(guard_checks)
