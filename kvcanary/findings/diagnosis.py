"""What a violation means: one diagnosis, shared by the audit, by engines and by ``explain``.

A ring row says which checks failed at one slot. The diagnosis cross-references it with the
other verify entries of the same batch (who else maps the slot, whose record the stored one
continues) and with the records themselves, and states the cause the evidence supports: one
of :class:`~kvcanary.findings.causes.Cause`, each with what it means and the evidence for it.

The entry point is :func:`diagnose`; :class:`~kvcanary.findings.evidence.Evidence` holds the
cross-reference tables (build it with :meth:`~kvcanary.findings.evidence.Evidence.from_entries`). Without evidence (a log line alone) the
diagnosis uses the row's fields only and says where that leaves it ambiguous.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ..format.consts import EXPECTED_TOKEN_UNKNOWN, PLAN_SLOT_OUT_OF_TABLE, FailReason
from ..format.bits import (VERIFY_CHAIN_HASH_MISMATCH as _CHAIN,
                           VERIFY_POSITION_MISMATCH as _POSITION,
                           VERIFY_REAL_KV_HASH_MISMATCH as _REAL_KV,
                           VERIFY_TOKEN_MISMATCH as _TOKEN, WRITE_MISMATCH as _WRITE,
                           SLOT_OUT_OF_RANGE as _OUT, SLOT_ZERO_IN_PREFIX as _ZERO_SLOT)
from .causes import Cause
from .evidence import CHAIN_HEAD_INT64, Entry, Evidence, predecessor_changed
from ..format.violations import Violation

CHECK_WORDS = {
    FailReason.VERIFY_CHAIN_HASH_MISMATCH: "chain link to the predecessor",
    FailReason.VERIFY_POSITION_MISMATCH: "stored position",
    FailReason.VERIFY_REAL_KV_HASH_MISMATCH: "real-KV hash",
    FailReason.WRITE_TOKEN_MISMATCH: "written token",
    FailReason.WRITE_POSITION_MISMATCH: "written position",
    FailReason.VERIFY_TOKEN_MISMATCH: "expected token",
    FailReason.SLOT_OUT_OF_RANGE: "slot inside the canary buffer",
    FailReason.SLOT_ZERO_IN_PREFIX: "live entry not on padding slot 0",
    FailReason.WRITE_SLOT_CONFLICT: "one write per slot per launch",
}
CAUSES = tuple(cause.value for cause in Cause)
# Share of zero records among the entries a batch reads above which a zero record means the
# wrong buffer (or a dump before the writes) rather than one lost write.
WRONG_BUFFER_SHARE = 0.5
# Other requests named in one explanation.
NAMED_REQUESTS = 3

_CHECK_BITS = tuple((int(bit), text) for bit, text in CHECK_WORDS.items())
_KNOWN_BITS = sum(bit for bit, _ in _CHECK_BITS)


@functools.lru_cache(maxsize=1024)   # once per finding: a flooded dump has few distinct bits
def failed_checks(bits: int) -> tuple:
    """The failed checks of ``fail_reason_bits`` in words, in bit order."""
    words = [text for bit, text in _CHECK_BITS if bits & bit]
    unknown = bits & ~_KNOWN_BITS
    if unknown:
        words.append(f"unknown bits {unknown:#x}")
    return tuple(words)


@dataclass(frozen=True)
class Diagnosis:
    """The cause a row's evidence supports. ``cause`` is a :class:`~kvcanary.findings.causes.Cause`
    (given as one or as its name; any other name raises ``ValueError``); ``text`` says it
    with the evidence; ``certain`` is False where the evidence fits several causes, which
    ``alternatives`` then name; ``related`` lists the other entries involved
    (``{"request_row", "batch_index", "position", "slot"}`` dicts)."""

    cause: Cause
    text: str
    certain: bool = True
    alternatives: tuple = ()
    related: tuple = ()

    def __post_init__(self):
        object.__setattr__(self, "cause", Cause(self.cause))
        object.__setattr__(self, "alternatives", tuple(Cause(c) for c in self.alternatives))

    @classmethod
    def of(cls, cause: Cause, view: str = "", **evidence) -> "Diagnosis":
        """The diagnosis ``cause`` states in its template ``view``, rendered from
        ``evidence`` (:meth:`~kvcanary.findings.causes.Cause.render`): how an engine guard
        states a cause, supplying only the evidence (request ids, slot, block, step, ...)."""
        cause = Cause(cause)
        return cls(cause, cause.render(view, **evidence))

    def to_dict(self, text: bool = True) -> dict:
        """JSON-ready; ``text=False`` leaves the explanation out (a record that carries it
        already as ``likely_cause``)."""
        record = {"cause": self.cause, "certain": self.certain}
        if text:
            record["explanation"] = self.text
        if self.alternatives:
            record["alternatives"] = list(self.alternatives)
        if self.related:
            record["related"] = list(self.related)
        return record




def _names(refs: tuple) -> str:
    shown = [f"request row {r['request_row']} (batch index {r['batch_index']}, position "
             f"{r['position']})" if r["request_row"] >= 0 else
             f"a prefix-cache sweep entry (position {r['position']})"
             for r in refs[:NAMED_REQUESTS]]
    more = len(refs) - len(shown)
    return ", ".join(shown) + (f" and {more} more" if more > 0 else "")


def _where(entry: Entry) -> str:
    return entry.name() if entry.kind in ("request", "sweep") else "this entry"


def _prev_where(entry: Entry) -> str:
    if entry.kind == "unknown" or entry.prev_slot < 0:
        return "the predecessor's slot (position one before)"
    text = f"the predecessor slot {entry.prev_slot} (position {entry.position - 1})"
    if entry.prev_block_index >= 0:
        text += f", block-table entry {entry.prev_block_index} (block {entry.prev_block})"
    return text


def _out_of_range(v: Violation, entry: Entry, num_slots: int, table: str) -> str:
    s, position = v.slot_idx, entry.position if entry.position >= 0 else v.position
    if s == PLAN_SLOT_OUT_OF_TABLE:
        return (f"position {position} lies outside {table}: seq_len is larger than the table, "
                "or the request row is not in the table")
    if s < 0 or (num_slots and s >= num_slots):
        size = f", the buffer has {num_slots} slots" if num_slots else ""
        return (f"the table entry points outside the canary buffer (slot {s}{size}): a corrupt "
                f"or stale {table} entry")
    if v.expected_aux == s:   # the write and verify kernels name the slot itself there
        return (f"slot {s} lies past the rows of a real-KV source, so its KV bytes cannot be "
                "checked: the source is smaller than the canary buffer")
    return (f"the predecessor entry (position {position - 1}) points outside the canary buffer "
            f"(slot {v.expected_aux})")


def _source(v: Violation) -> str:
    """`` in the K cache of the FULL group`` from the row's launch tag (empty if unknown)."""
    parts = v.launch_tag.split("_")
    if len(parts) != 3 or parts[1] not in ("K", "V"):
        return ""
    return f" in the {parts[1]} cache of the {parts[2]} group (launch tag {v.launch_tag})"


def _slot_zero(swa: bool) -> str:
    if swa:
        return ("a live entry inside the sliding window maps to SWA slot 0: its SWA slot was "
                "freed (full_to_swa_index_mapping holds 0) or never assigned, or the table "
                "entry itself is 0")
    return ("a live prefix entry is mapped to padding slot 0: the slot was never assigned, or "
            "its mapping was cleared while the request still uses it (lost write or premature "
            "free)")


def _write_input(v: Violation, entry: Entry) -> str:
    """A write row: ``position`` is the position id the forward used, ``expected_aux`` the
    position expected (from the caller, or one past the chain seed's record). With the
    entry's expected position known (an engine's own write launch) it says which."""
    generic = ("the forward consumed different input tokens or positions than expected "
               "(write-path check)")
    if entry.kind != "request" or entry.position < 0:
        return generic
    p = entry.position
    if v.fail_reason_bits & int(FailReason.WRITE_POSITION_MISMATCH):
        if v.position == p:
            return (f"the position id {p} is right, but the record before it (this write's "
                    f"chain seed) holds position {v.expected_aux - 1}: an earlier write of "
                    "this request was lost, misplaced or mis-positioned")
        return (f"position ids off: the token at position {p} was written with position id "
                f"{v.position}")
    return (f"the forward's input id {v.stored_token} at position {p} is not the request's "
            f"token {v.expected_token}")


def diagnose(v: Violation, entry: Entry | None = None, evidence: Evidence | None = None, *,
             num_slots: int = 0, swa: bool = False, table: str = "req_to_token",
             swapped_with=None, tables=None) -> Diagnosis:
    """The cause of one ring row ``v`` read at ``entry`` (None: only the row is known),
    cross-referenced with ``evidence`` (None: no tables). ``swapped_with(batch_index,
    position)`` may return the stored position a row at that entry reports, or
    ``(position, token)`` (or None): it tells a swap from a shift; ``tables`` (an object with ``slot(request_row, position)``,
    the table's entry before any SWA translation, and ``token(request_row, position)``, the
    expected token; each None when unknown) ties a record to the request's own chain
    outside the verified window.

    >>> from kvcanary import Violation
    >>> diagnose(Violation(2, 5, 0, 0, -1, 0, 1, 1)).cause
    'never-written'
    """
    entry = entry or Entry(kind="unknown", position=v.position)
    bits, s = int(v.fail_reason_bits), v.slot_idx
    real_kv = " The slot's real-KV bytes no longer match its record either." \
        if bits & _REAL_KV and bits & ~_REAL_KV else ""
    if bits & _OUT:
        return Diagnosis("out-of-range", _out_of_range(v, entry, num_slots, table))
    if bits & _ZERO_SLOT:
        return Diagnosis("slot-zero", _slot_zero(swa))
    if bits & _WRITE:
        return Diagnosis("write-input", _write_input(v, entry))
    zero = v.stored_token == 0 and v.position == 0 and v.stored_chain_hash == 0
    if zero and bits & (_CHAIN | _POSITION | _TOKEN):
        if evidence is not None and evidence.zero_share > WRONG_BUFFER_SHARE:
            return Diagnosis("wrong-buffer", (
                f"slot {s} holds an all-zero record, and so do {evidence.zero_entries} of the "
                f"{evidence.checked_entries} live entries: the canary buffer checked is not the "
                "one the engine writes (the wrong buffer, layer or group), or it was captured "
                "before the writes"))
        return Diagnosis("never-written", (
            f"slot {s} holds an all-zero record: it was never written (a lost write: the "
            "token's KV and canary were skipped), or the buffer was captured before this "
            "step's write"))
    owner_refs, parent_refs, parent_same = (), (), ()
    if evidence is not None:
        owner_refs, parent_refs, parent_same = _owners(v, entry, evidence, tables)
    own = bool(parent_same) or _own_head(v, entry, evidence) or _own_token(v, entry, tables)
    if owner_refs and own and bits & _POSITION and entry.kind == "request":
        # The record is on this request's own chain too (a prefix it shares with the
        # owner): a swap, or a shift onto a slot this request itself maps at that position.
        swapped = _swapped(v, entry, swapped_with, tables)
        shares = tables is not None and tables.slot(entry.request_row, v.position) == \
            tables.slot(owner_refs[0]["request_row"], v.position)
        if swapped or shares:
            return _shifted(v, entry, swapped_with, real_kv, owner_refs)
    if owner_refs and bits & (_POSITION | _TOKEN | _CHAIN):
        mine = _where(entry)
        return Diagnosis("shared-slot", (
            f"slot {s} is also mapped by {_names(owner_refs)}, and the stored record (position "
            f"{v.position}, token {v.stored_token}) is that request's: both requests hold the "
            f"slot — a double allocation, or the slot was freed and reused while {mine} still "
            f"references it.{real_kv}"), related=owner_refs)
    if bits & _POSITION:
        return _position(v, entry, evidence, parent_refs, parent_same, swapped_with, real_kv,
                         tables, swa)
    if bits & _TOKEN:
        if bits & _CHAIN:
            return Diagnosis("record-changed", (
                f"slot {s} holds token {v.stored_token} where the request's history has "
                f"{v.expected_token}, and its chain link differs too: the record was rewritten "
                "at the same position by other content (a reuse by another sequence), or a "
                f"wrong token was written after a wrong predecessor.{real_kv}"), certain=False,
                alternatives=("overwritten", "wrong-token"))
        return Diagnosis("wrong-token", (
            f"slot {s} holds token {v.stored_token} where the request's history has "
            f"{v.expected_token} (position and chain link right): the KV of a wrong token was "
            "written for this position — the class of a speculative-decoding (EAGLE) "
            f"draft/accept rotation bug.{real_kv}"))
    if bits & _CHAIN:
        return _chain_only(v, entry, evidence, real_kv)
    if bits & _REAL_KV:
        return Diagnosis("kv-bytes-changed", (
            f"the real KV bytes of slot {s}{_source(v)} changed after its canary record was "
            "written (the record itself is intact): an in-place overwrite, a stray write into "
            "this slot, or a KV transfer/offload that changed the bytes"))
    return Diagnosis("unknown", "no check failed that the diagnosis knows", certain=False)


def _owners(v: Violation, entry: Entry, ev: Evidence, tables=None) -> tuple:
    """``(owners, parents, own parents)``: other requests mapping the slot whose expectation
    the stored record meets; entries whose record the stored one continues; and those of
    them on this request's own chain (same batch index, or the slot this request's table
    maps at the stored position's predecessor)."""
    parents = ev.parents(v.stored_chain_hash)
    own = ev.batch_index[parents] == entry.batch_index
    if tables is not None and entry.kind == "request" and v.position > 0 and parents.size:
        # The predecessor's table entry is shared with the parent's request (a common
        # prefix, e.g. outside this request's sliding window): the chain is this request's.
        mine = tables.slot(entry.request_row, v.position - 1)
        if mine is not None:
            own |= np.array([int(ev.request_rows[i]) >= 0 and tables.slot(
                int(ev.request_rows[i]), int(ev.positions[i])) == mine
                for i in parents.tolist()], dtype=bool)
    users = ev.users(v.slot_idx)
    other = users[(ev.batch_index[users] != entry.batch_index) & (ev.request_rows[users] >= 0)
                  & (ev.positions[users] == v.position) & ~ev.failing[users]] if users.size > 1 \
        or (users.size and ev.batch_index[users[0]] != entry.batch_index) else users[:0]
    if other.size:   # (most slots have one reader, the entry itself: nothing to weigh)
        known = ev.tokens[other] != EXPECTED_TOKEN_UNKNOWN
        other = other[~known | (ev.tokens[other] == v.stored_token)]
        # Evidence of another owner only where its expectation differs from this entry's (a
        # shared prefix slot read at the same position and token is no double allocation),
        # or where the record continues the owner's chain and not this request's.
        differs = ev.positions[other] != entry.position
        if v.expected_token != EXPECTED_TOKEN_UNKNOWN:
            differs |= (ev.tokens[other] != EXPECTED_TOKEN_UNKNOWN) & (
                ev.tokens[other] != v.expected_token)
        if parents.size and not own.any():
            differs |= np.isin(ev.batch_index[other], ev.batch_index[parents])
        other = other[differs]
    if parents.size and other.size:   # the record continues a record of the owner
        owned = np.isin(ev.batch_index[other], ev.batch_index[parents])
        other = other[owned] if owned.any() else other
    return ev.refs(other), ev.refs(parents, stored=True), ev.refs(parents[own], stored=True)


def _own_head(v: Violation, entry: Entry, ev) -> bool | None:
    """Whether a chain-head record of position 0 is this request's own (its expected token
    at position 0 matches; None: the token is unknown)."""
    if ev is None or v.position != 0 or v.stored_chain_hash != CHAIN_HEAD_INT64:
        return False
    at = ev.heads_of(entry.batch_index)
    tokens = ev.tokens[at]
    tokens = tokens[tokens != EXPECTED_TOKEN_UNKNOWN]
    if tokens.size == 0:
        return None
    return bool(tokens[0] == v.stored_token)


def _own_token(v: Violation, entry: Entry, tables) -> bool:
    """Whether the stored token is this request's own expected token at the stored position
    (a record past position 0 that links to the chain's anchor is no record of this chain,
    whatever its token)."""
    return (tables is not None and entry.kind == "request"
            and v.expected_token != EXPECTED_TOKEN_UNKNOWN
            and not (v.position > 0 and v.stored_chain_hash == CHAIN_HEAD_INT64)
            and tables.token(entry.request_row, v.position) == v.stored_token)


def _partner(swapped_with, batch_index: int, q: int) -> tuple:
    """``(stored position, stored token)`` reported at this request's entry ``q`` (either
    None when unknown); ``swapped_with`` may return the position alone."""
    found = swapped_with(batch_index, q) if swapped_with else None
    if isinstance(found, tuple):
        return found
    return found, None


def _swapped(v: Violation, entry: Entry, swapped_with, tables) -> bool:
    """Whether this request's entry at the stored position reads this entry's own record: a
    swap. Its stored position alone is not enough (two faults on one request's table can
    make it so): where the tokens are known, the record it reads must hold this request's
    token of this entry's position."""
    position, token = _partner(swapped_with, entry.batch_index, v.position)
    if position != entry.position:
        return False
    own = tables.token(entry.request_row, entry.position) if tables is not None else None
    return token is None or own is None or token == own


def _shifted(v, entry: Entry, swapped_with, real_kv, related=(), certain=True,
             alternatives=("overwritten",)) -> Diagnosis:
    s, p, q = v.slot_idx, entry.position, v.position
    stored = _partner(swapped_with, entry.batch_index, q)[0]
    how = (f"swapped with position {q} (whose entry reads position {p}'s record)"
           if stored == p else f"shifted by {q - p:+d}")
    whose = "this request's own" if entry.kind == "request" else "the same cached chain's"
    return Diagnosis("shifted-mapping", (
        f"{_where(entry)} reads slot {s}, which holds {whose} record of position {q} (its "
        f"chain continues this request's position {q - 1}" if q > 0 else
        f"{_where(entry)} reads slot {s}, which holds {whose} record of position 0 (its chain "
        "head, with this request's token"
    ) + f"): the mapping is {how} — the table entry for position {p} points at the slot of "
        f"position {q}.{real_kv}", certain=certain,
        alternatives=() if certain else tuple(alternatives), related=tuple(related[:1]))


def _position(v, entry: Entry, ev, parents, same, swapped_with, real_kv,
              tables=None, swa: bool = False) -> Diagnosis:
    s, p, q = v.slot_idx, entry.position, v.position
    bits = int(v.fail_reason_bits)
    if entry.kind == "unknown":   # a log row alone: it does not carry the expected position
        if bits & (_CHAIN | _TOKEN) == 0:
            return Diagnosis("position-changed", (
                f"slot {s} holds position {q} with the token and chain link its reader "
                "expects, but not the expected position: the stored position changed after "
                f"the write.{real_kv}"))
        return Diagnosis("overwritten", (
            f"slot {s} holds a record of position {q} that is not the one its reader "
            "expects (position and chain link differ): the slot was rewritten by another "
            "sequence while still mapped (a stale reuse or an evicted block), or the table "
            "maps a shifted, swapped or doubly allocated slot — a log row alone cannot tell "
            "these apart (ambiguous; `kvcanary audit` of a dump cross-references the "
            f"tables).{real_kv}"), certain=False,
            alternatives=("shifted-mapping", "shared-slot"))
    if parents:
        after = parents[0]["stored_position"] + 1
        whose = "this request's chain" if same else _names(parents)
        if after != q:
            return Diagnosis("position-changed", (
                f"slot {s} holds the record continuing position {after - 1} of {whose} (its "
                f"chain link), so it was written as position {after}, but it now says position "
                f"{q}: the stored position changed after the write.{real_kv}"))
        in_place = [r for r in same if r["stored_position"] == r["position"]]
        own_token = _own_token(v, entry, tables)
        if in_place or own_token:
            # Chains are content hashes: a record continuing this request's chain where it
            # reads it in place, or holding this request's own token at q, is its own.
            return _shifted(v, entry, swapped_with, real_kv, in_place or same or parents)
        if same and v.expected_token == EXPECTED_TOKEN_UNKNOWN:
            # A run of displaced records: a shift of a range, or a block rewritten by
            # another sequence; only a token check tells them apart.
            return _shifted(v, entry, swapped_with, real_kv, same, certain=False)
        # A sweep entry has no token check, and its parent (a cached record, or a live
        # request's that shares the cached prefix) may be this very chain's: a block
        # displaced inside it fits as well as a rewrite.
        cached = entry.kind == "sweep"
        return Diagnosis("overwritten", (
            f"slot {s} holds the record of position {q} continuing {_names(parents)}, not "
            f"{_where(entry)}'s: the slot was rewritten for that sequence while this entry "
            f"still maps it (a reuse while still referenced)"
            + (" — or the cached chain's own record, displaced by a shifted or swapped block "
               "(no token check on a sweep entry tells them apart)" if cached else "")
            + f".{real_kv}"), related=parents, certain=not cached,
            alternatives=("shifted-mapping",) if cached else ())
    own_head = _own_head(v, entry, ev)
    if own_head or (own_head is None and entry.kind == "sweep"):
        return _shifted(v, entry, swapped_with, real_kv, certain=bool(own_head))
    if q != p and _own_token(v, entry, tables):
        # No verified record continues into it (its predecessor left the window), but it
        # holds this request's own token of position q.
        return _shifted(v, entry, swapped_with, real_kv)
    if (bits & (_CHAIN | _TOKEN) == 0 and v.expected_token == EXPECTED_TOKEN_UNKNOWN
            and ev is not None and entry.prev_slot > 0
            and ev.bits_at(entry.prev_slot) & _POSITION):
        # The link passes because the predecessor's record moved along with this one (a
        # displaced range: a remapped block); with no token check nothing ties the range to
        # this chain, and a changed position field alone would not move the predecessor.
        return _shifted(v, entry, swapped_with, real_kv, certain=False,
                        alternatives=("position-changed", "overwritten"))
    if bits & (_CHAIN | _TOKEN) == 0:
        token = "token" if v.expected_token != EXPECTED_TOKEN_UNKNOWN else "token (unchecked)"
        # A passing link ties a non-head record to this entry's predecessor; a chain head
        # with no token check could as well be another sequence's head written here, and a
        # predecessor in slot 0 (a freed SWA slot) makes the link check vacuous.
        certain = v.expected_token != EXPECTED_TOKEN_UNKNOWN or entry.prev_slot > 0
        return Diagnosis("position-changed", (
            f"slot {s} holds position {q} where {_where(entry)} expects {p}, with the {token} "
            f"and chain link of this entry: the stored position changed after the write"
            + ("" if certain else "; without a token check this could also be a record "
               "written at position {q} by another sequence (ambiguous)".format(q=q))
            + f".{real_kv}"), certain=certain,
            alternatives=() if certain else ("overwritten", "shifted-mapping"))
    # No verified record continuing into it proves nothing under a sliding window: the
    # predecessor's slot may be freed and unverified, so a record of this very chain fits.
    certain = ev is not None and ev.has_records and not swa
    return Diagnosis("overwritten", (
        f"slot {s} holds a record of position {q} that no live request's chain continues, "
        f"where {_where(entry)} expects position {p}: the slot was freed and rewritten by "
        "another sequence while this request still maps it (a stale reuse, e.g. an evicted "
        "block), or the table entry points at a stale slot"
        + ("" if certain else (" (a sliding window leaves the record's predecessor "
                               "unverified: a shift or a double allocation fits too)" if swa
                               else " (no records to cross-reference: a shift or a double "
                               "allocation fits too)")) + f".{real_kv}"), certain=certain,
        alternatives=() if certain else ("shifted-mapping", "shared-slot"))


def _chain_only(v: Violation, entry: Entry, ev, real_kv) -> Diagnosis:
    s = v.slot_idx
    if entry.prev_slot < 0 and entry.kind != "unknown":
        return Diagnosis("link-changed", (
            f"the chain head at position {entry.position} (slot {s}) does not start from the "
            "anchor: its chain link changed after the write, or it was written as the "
            f"continuation of another sequence.{real_kv}"))
    changed = None if ev is None or entry.prev_slot <= 0 else predecessor_changed(
        ev, entry.prev_slot)
    if changed is None:
        return Diagnosis("predecessor-changed", (
            f"only the chain link of slot {s} fails (token and position right): the record at "
            f"{_prev_where(entry)} changed or was remapped after this token was written, or "
            f"this record's own chain link was altered.{real_kv}"), certain=False,
            alternatives=("link-changed",))
    if not changed and ev.prev_of(entry.prev_slot) == 0 and not ev.bits_at(entry.prev_slot):
        # The predecessor looks intact, but its own chain check was vacuous (its predecessor
        # in slot 0: a freed SWA slot), so a change of its link would not show.
        return Diagnosis("link-changed", (
            f"only the chain link of slot {s} fails (token and position right) and the record "
            f"at {_prev_where(entry)} shows no finding, but its own chain check could not run "
            "(its predecessor's slot is freed): this record's stored chain link changed after "
            f"the write, or the predecessor's did.{real_kv}"), certain=False,
            alternatives=("predecessor-changed",))
    if changed:
        return Diagnosis("predecessor-changed", (
            f"only the chain link of slot {s} fails (token and position right) and "
            f"{_prev_where(entry)} has a finding of its own: the predecessor's record changed "
            f"after this token was written; this row follows from that one.{real_kv}"))
    return Diagnosis("link-changed", (
        f"only the chain link of slot {s} fails (token and position right) while the record "
        f"at {_prev_where(entry)} is intact: this record's stored chain link changed after "
        f"the write.{real_kv}"))


def likely_cause(v: Violation, *, position: int, prev_slot: int, num_slots: int,
                 swa: bool = False, table: str = "req_to_token") -> str:
    """The row-only diagnosis's text (no cross-reference tables)."""
    entry = Entry(kind="request", position=position, prev_slot=prev_slot)
    return diagnose(v, entry, num_slots=num_slots, swa=swa, table=table).text
