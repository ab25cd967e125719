"""What a violation means: one diagnosis, shared by the audit, by engines and by ``explain``.

A ring row says which checks failed at one slot. The diagnosis cross-references it with the
other verify entries of the same batch (who else maps the slot, whose record the stored one
continues) and with the records themselves, and states the cause the evidence supports: one
of :class:`~kvcanary.findings.causes.Cause`, each with what it means and the evidence for it.
The decision tree here only decides: every sentence is a template of the cause it states,
which :meth:`Diagnosis.of` fills with the evidence fields.

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
from .causes import CACHED_RECORD, OWN_RECORD, REAL_KV_TOO, Cause
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
    def of(cls, cause: Cause, view: str = "", *, certain: bool = True, alternatives=(),
           related=(), **evidence) -> "Diagnosis":
        """The diagnosis ``cause`` states in its template ``view``, rendered from
        ``evidence`` (:meth:`~kvcanary.findings.causes.Cause.render`): how the audit's
        diagnosis and the engine guards state a cause, supplying only the evidence
        (request ids, slot, block, step, ...). ``certain``, ``alternatives`` and ``related``
        are the fields of the same names."""
        cause = Cause(cause)
        return cls(cause, cause.render(view, **evidence), certain=certain,
                   alternatives=tuple(alternatives), related=tuple(related))

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


def _out_of_range(v: Violation, entry: Entry, num_slots: int, table: str) -> Diagnosis:
    s, position = v.slot_idx, entry.position if entry.position >= 0 else v.position
    if s == PLAN_SLOT_OUT_OF_TABLE:
        return Diagnosis.of(Cause.OUT_OF_RANGE, "table", position=position, table=table)
    if s < 0 or (num_slots and s >= num_slots):
        if num_slots:
            return Diagnosis.of(Cause.OUT_OF_RANGE, "buffer", slot=s, num_slots=num_slots,
                                table=table)
        return Diagnosis.of(Cause.OUT_OF_RANGE, "buffer-unsized", slot=s, table=table)
    if v.expected_aux == s:   # the write and verify kernels name the slot itself there
        return Diagnosis.of(Cause.OUT_OF_RANGE, "real-kv-source", slot=s)
    return Diagnosis.of(Cause.OUT_OF_RANGE, "predecessor", previous=position - 1,
                        prev_slot=v.expected_aux)


def _kv_bytes_changed(v: Violation) -> Diagnosis:
    """Names the cache and group from the row's launch tag (``KVC_K_FULL``) where it has them."""
    parts = v.launch_tag.split("_")
    if len(parts) != 3 or parts[1] not in ("K", "V"):
        return Diagnosis.of(Cause.KV_BYTES_CHANGED, "intact", slot=v.slot_idx)
    return Diagnosis.of(Cause.KV_BYTES_CHANGED, "intact-group", slot=v.slot_idx,
                        cache=parts[1], group=parts[2], launch_tag=v.launch_tag)


def _write_input(v: Violation, entry: Entry) -> Diagnosis:
    """A write row: ``position`` is the position id the forward used, ``expected_aux`` the
    position expected (from the caller, or one past the chain seed's record). With the
    entry's expected position known (an engine's own write launch) it says which."""
    if entry.kind != "request" or entry.position < 0:
        return Diagnosis.of(Cause.WRITE_INPUT)
    p = entry.position
    if v.fail_reason_bits & int(FailReason.WRITE_POSITION_MISMATCH):
        if v.position == p:
            return Diagnosis.of(Cause.WRITE_INPUT, "seed", position=p,
                                seed_position=v.expected_aux - 1)
        return Diagnosis.of(Cause.WRITE_INPUT, "position-id", position=p, position_id=v.position)
    return Diagnosis.of(Cause.WRITE_INPUT, "input-id", stored_token=v.stored_token, position=p,
                        expected_token=v.expected_token)


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
    real_kv = REAL_KV_TOO if bits & _REAL_KV and bits & ~_REAL_KV else ""
    if bits & _OUT:
        return _out_of_range(v, entry, num_slots, table)
    if bits & _ZERO_SLOT:
        return Diagnosis.of(Cause.SLOT_ZERO, "swa" if swa else "")
    if bits & _WRITE:
        return _write_input(v, entry)
    zero = v.stored_token == 0 and v.position == 0 and v.stored_chain_hash == 0
    if zero and bits & (_CHAIN | _POSITION | _TOKEN):
        if evidence is not None and evidence.zero_share > WRONG_BUFFER_SHARE:
            return Diagnosis.of(Cause.WRONG_BUFFER, slot=s, zero_entries=evidence.zero_entries,
                                checked_entries=evidence.checked_entries)
        return Diagnosis.of(Cause.NEVER_WRITTEN, "zero-record", slot=s)
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
        return Diagnosis.of(Cause.SHARED_SLOT, slot=s, owners=_names(owner_refs),
                            position=v.position, stored_token=v.stored_token,
                            reader=_where(entry), real_kv=real_kv, related=owner_refs)
    if bits & _POSITION:
        return _position(v, entry, evidence, parent_refs, parent_same, swapped_with, real_kv,
                         tables, swa)
    if bits & _TOKEN:
        if bits & _CHAIN:
            return Diagnosis.of(Cause.RECORD_CHANGED, slot=s, stored_token=v.stored_token,
                                expected_token=v.expected_token, real_kv=real_kv,
                                certain=False, alternatives=(Cause.OVERWRITTEN, Cause.WRONG_TOKEN))
        return Diagnosis.of(Cause.WRONG_TOKEN, slot=s, stored_token=v.stored_token,
                            expected_token=v.expected_token, real_kv=real_kv)
    if bits & _CHAIN:
        return _chain_only(v, entry, evidence, real_kv)
    if bits & _REAL_KV:
        return _kv_bytes_changed(v)
    return Diagnosis.of(Cause.UNKNOWN, certain=False)


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
    swap = _partner(swapped_with, entry.batch_index, q)[0] == p
    whose = OWN_RECORD if entry.kind == "request" else CACHED_RECORD
    alternatives, related = () if certain else alternatives, related[:1]
    if q > 0 and swap:
        return Diagnosis.of(Cause.SHIFTED_MAPPING, "swap", reader=_where(entry), slot=s,
                            whose=whose, position=q, previous=q - 1, expected=p,
                            real_kv=real_kv, certain=certain, alternatives=alternatives,
                            related=related)
    if q > 0:
        return Diagnosis.of(Cause.SHIFTED_MAPPING, "shift", reader=_where(entry), slot=s,
                            whose=whose, position=q, previous=q - 1, shift=q - p, expected=p,
                            real_kv=real_kv, certain=certain, alternatives=alternatives,
                            related=related)
    if swap:   # the chain head, position 0
        return Diagnosis.of(Cause.SHIFTED_MAPPING, "head-swap", reader=_where(entry), slot=s,
                            whose=whose, position=q, expected=p, real_kv=real_kv,
                            certain=certain, alternatives=alternatives, related=related)
    return Diagnosis.of(Cause.SHIFTED_MAPPING, "head-shift", reader=_where(entry), slot=s,
                        whose=whose, position=q, shift=q - p, expected=p, real_kv=real_kv,
                        certain=certain, alternatives=alternatives, related=related)


def _position(v, entry: Entry, ev, parents, same, swapped_with, real_kv,
              tables=None, swa: bool = False) -> Diagnosis:
    s, p, q = v.slot_idx, entry.position, v.position
    bits = int(v.fail_reason_bits)
    if entry.kind == "unknown":   # a log row alone: it does not carry the expected position
        if bits & (_CHAIN | _TOKEN) == 0:
            return Diagnosis.of(Cause.POSITION_CHANGED, "row", slot=s, position=q,
                                real_kv=real_kv)
        return Diagnosis.of(Cause.OVERWRITTEN, "row", slot=s, position=q, real_kv=real_kv,
                            certain=False,
                            alternatives=(Cause.SHIFTED_MAPPING, Cause.SHARED_SLOT))
    if parents:
        after = parents[0]["stored_position"] + 1
        if after != q and same:
            return Diagnosis.of(Cause.POSITION_CHANGED, "continues-own", slot=s,
                                previous=after - 1, written=after, position=q, real_kv=real_kv)
        if after != q:
            return Diagnosis.of(Cause.POSITION_CHANGED, "continues", slot=s, previous=after - 1,
                                parents=_names(parents), written=after, position=q,
                                real_kv=real_kv)
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
        return Diagnosis.of(Cause.OVERWRITTEN, "continues-cached" if cached else "continues",
                            slot=s, position=q, parents=_names(parents), reader=_where(entry),
                            real_kv=real_kv, related=parents, certain=not cached,
                            alternatives=(Cause.SHIFTED_MAPPING,) if cached else ())
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
        checked = v.expected_token != EXPECTED_TOKEN_UNKNOWN
        # A passing link ties a non-head record to this entry's predecessor; a chain head
        # with no token check could as well be another sequence's head written here, and a
        # predecessor in slot 0 (a freed SWA slot) makes the link check vacuous.
        certain = checked or entry.prev_slot > 0
        return Diagnosis.of(Cause.POSITION_CHANGED, "" if checked else "unchecked" if certain
                            else "unchecked-ambiguous", slot=s, position=q,
                            reader=_where(entry), expected=p, real_kv=real_kv, certain=certain,
                            alternatives=() if certain else (Cause.OVERWRITTEN,
                                                             Cause.SHIFTED_MAPPING))
    # No verified record continuing into it proves nothing under a sliding window: the
    # predecessor's slot may be freed and unverified, so a record of this very chain fits.
    certain = ev is not None and ev.has_records and not swa
    return Diagnosis.of(Cause.OVERWRITTEN, "stale" if certain else "stale-window" if swa
                        else "stale-unchecked", slot=s, position=q, reader=_where(entry),
                        expected=p, real_kv=real_kv, certain=certain,
                        alternatives=() if certain else (Cause.SHIFTED_MAPPING,
                                                         Cause.SHARED_SLOT))


def _chain_only(v: Violation, entry: Entry, ev, real_kv) -> Diagnosis:
    s = v.slot_idx
    if entry.prev_slot < 0 and entry.kind != "unknown":
        return Diagnosis.of(Cause.LINK_CHANGED, "head", position=entry.position, slot=s,
                            real_kv=real_kv)
    changed = None if ev is None or entry.prev_slot <= 0 else predecessor_changed(
        ev, entry.prev_slot)
    if changed is None:
        return Diagnosis.of(Cause.PREDECESSOR_CHANGED, "unchecked", slot=s,
                            predecessor=_prev_where(entry), real_kv=real_kv, certain=False,
                            alternatives=(Cause.LINK_CHANGED,))
    if not changed and ev.prev_of(entry.prev_slot) == 0 and not ev.bits_at(entry.prev_slot):
        # The predecessor looks intact, but its own chain check was vacuous (its predecessor
        # in slot 0: a freed SWA slot), so a change of its link would not show.
        return Diagnosis.of(Cause.LINK_CHANGED, "unverified-predecessor", slot=s,
                            predecessor=_prev_where(entry), real_kv=real_kv, certain=False,
                            alternatives=(Cause.PREDECESSOR_CHANGED,))
    if changed:
        return Diagnosis.of(Cause.PREDECESSOR_CHANGED, slot=s, predecessor=_prev_where(entry),
                            real_kv=real_kv)
    return Diagnosis.of(Cause.LINK_CHANGED, slot=s, predecessor=_prev_where(entry),
                        real_kv=real_kv)


def likely_cause(v: Violation, *, position: int, prev_slot: int, num_slots: int,
                 swa: bool = False, table: str = "req_to_token") -> str:
    """The row-only diagnosis's text (no cross-reference tables)."""
    entry = Entry(kind="request", position=position, prev_slot=prev_slot)
    return diagnose(v, entry, num_slots=num_slots, swa=swa, table=table).text
