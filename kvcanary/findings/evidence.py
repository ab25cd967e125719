"""The evidence a diagnosis cross-references: where a row's verify entry sits (:class:`Entry`)
and tables over the live verify entries of one batch or dump (:class:`Evidence`): who else
reads a slot, whose record the stored one continues, which slots have rows and how many
records are zero.

Build the tables with :meth:`Evidence.from_entries` (one batch) or :meth:`Evidence.merge`
(several); :func:`kvcanary.findings.diagnosis.diagnose` reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..format.consts import FailReason
from ..format.hashing import CHAIN_HEAD, link_inplace

# The chain head as the int64 a ring row holds.
CHAIN_HEAD_INT64 = int(np.uint64(CHAIN_HEAD).view(np.int64))


@dataclass(frozen=True)
class Entry:
    """Where a row's verify entry sits: ``kind`` ``request`` (batch index, request row,
    position) or ``sweep`` (sweep index, position); ``prev_slot`` is its predecessor slot
    (-1: chain head); on a paged table ``block_index``/``block`` locate the position and
    ``prev_block_index``/``prev_block`` its predecessor."""

    kind: str = "request"
    batch_index: int = -1
    request_row: int = -1
    position: int = -1
    prev_slot: int = -1
    sweep_index: int = -1
    block_index: int = -1
    block: int = -1
    prev_block_index: int = -1
    prev_block: int = -1

    def name(self) -> str:
        if self.kind == "sweep":
            return f"sweep entry {self.sweep_index} (position {self.position})"
        return (f"request row {self.request_row} (batch index {self.batch_index}, "
                f"position {self.position})")


@dataclass
class Evidence:
    """Cross-reference tables over the live verify entries of one batch (or dump).

    Arrays are int64 ``[n]``, one element per entry: ``slots`` read, expected
    ``positions`` and ``tokens`` (-1 unknown), ``batch_index`` and ``request_rows``, and
    ``links``: the chain link of the record stored at the slot (what that record's successor
    must hold) and ``record_positions``, its stored position (0 where no records were
    given); ``failing``: whether the entry produced a row itself; ``prev_slots``: the
    entry's predecessor slot. ``failing_slots`` (sorted) are the slots that have a row, and
    ``failing_bits`` the fail reasons of their rows ORed; ``zero_entries`` of ``checked_entries`` read all-zero
    records. It may hold only the entries relevant to some rows (the audit keeps those that
    read a finding's slot, its predecessor or a record its record continues)."""

    slots: np.ndarray
    positions: np.ndarray
    tokens: np.ndarray
    batch_index: np.ndarray
    request_rows: np.ndarray
    links: np.ndarray
    record_positions: np.ndarray
    failing: np.ndarray
    prev_slots: np.ndarray
    failing_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    failing_bits: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    zero_entries: int = 0
    checked_entries: int = 0
    has_records: bool = True
    # Sorted views of columns, built on the first lookup: a diagnosis asks once per finding,
    # and a scan of every entry per finding made a flooded dump's diagnosis quadratic.
    _sorted: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def from_entries(cls, *, slots, positions, tokens, batch_index, request_rows,
                     records=None, failing=None, prev_slots=None,
                     failing_slots=(), failing_bits=None) -> "Evidence":
        """Tables of one batch's entries. ``records`` is the canary buffer's ``int64
        [num_slots, 4]`` field view (token, position, chain link, real-KV hash) or None;
        ``failing`` a bool ``[n]`` (or entry indices) of the entries that produced a row;
        ``failing_slots`` / ``failing_bits`` the slot and fail bits of every row (or just
        the slots)."""
        slots = np.asarray(slots, dtype=np.int64)
        n = slots.shape[0]
        links = np.zeros(n, dtype=np.int64)
        stored_positions = np.zeros(n, dtype=np.int64)
        zero = 0
        if records is not None and n and records.shape[0]:
            inside = (slots > 0) & (slots < records.shape[0])
            rec = np.take(records, np.where(inside, slots, 0), axis=0)
            links = record_links(rec)
            stored_positions = rec[:, 1].copy()
            zero = int(np.count_nonzero(inside & ~rec.any(axis=1)))
        failed = np.zeros(n, dtype=bool)
        if failing is not None:
            failing = np.asarray(failing)
            if failing.dtype == bool:
                failed[:] = failing
            else:
                failed[failing.astype(np.int64)] = True
        return cls(slots=slots, positions=np.asarray(positions, dtype=np.int64),
                   tokens=np.asarray(tokens, dtype=np.int64),
                   batch_index=np.asarray(batch_index, dtype=np.int64),
                   request_rows=np.asarray(request_rows, dtype=np.int64), links=links,
                   record_positions=stored_positions, failing=failed,
                   prev_slots=(np.full(n, -1, np.int64) if prev_slots is None
                               else np.asarray(prev_slots, dtype=np.int64)),
                   **dict(zip(("failing_slots", "failing_bits"),
                              or_by_slot(failing_slots, failing_bits))),
                   zero_entries=zero, checked_entries=int(np.count_nonzero(slots > 0)),
                   has_records=records is not None)

    @classmethod
    def merge(cls, parts: list, failing_slots=(), failing_bits=None) -> "Evidence":
        """One table from several (e.g. the chunks of a dump)."""
        columns = [np.concatenate([getattr(p, name) for p in parts] or
                                  [np.zeros(0, dtype=bool if name == "failing" else np.int64)])
                   for name in _COLUMNS]
        slots, bits = or_by_slot(failing_slots, failing_bits)
        return cls(*columns, failing_slots=slots, failing_bits=bits,
                   zero_entries=sum(p.zero_entries for p in parts),
                   checked_entries=sum(p.checked_entries for p in parts),
                   has_records=all(p.has_records for p in parts))

    @property
    def zero_share(self) -> float:
        return self.zero_entries / self.checked_entries if self.checked_entries else 0.0

    def refs(self, index: np.ndarray, stored: bool = False) -> tuple:
        """Entry dicts; ``stored`` adds the stored position of the record each reads."""
        return tuple({"request_row": int(self.request_rows[i]),
                      "batch_index": int(self.batch_index[i]),
                      "position": int(self.positions[i]), "slot": int(self.slots[i]),
                      **({"stored_position": int(self.record_positions[i])} if stored else {})}
                     for i in index.tolist())

    def _equal(self, name: str, value: int, columns: tuple = (), keys=None) -> np.ndarray:
        """Indices (ascending) of the entries whose column ``name`` (or ``keys()``, made of
        ``columns``) equals ``value``: a binary search in a sorted copy made once, and made
        anew when one of the columns is replaced by another array."""
        columns = columns or (getattr(self, name),)
        cached = self._sorted.get(name)
        if cached is None or cached[0] != tuple(map(id, columns)):
            values = keys() if keys else columns[0]
            order = np.argsort(values, kind="stable")
            # The columns themselves are kept too, so that their ids name them while cached.
            cached = self._sorted[name] = (tuple(map(id, columns)), order, values[order],
                                           columns)
        _, order, ordered, _ = cached
        return order[ordered.searchsorted(value, "left"):ordered.searchsorted(value, "right")]

    def users(self, slot: int) -> np.ndarray:
        """Indices of the entries reading ``slot``."""
        return self._equal("slots", slot)

    def parents(self, chain_hash: int) -> np.ndarray:
        """Indices of the entries whose record's link is ``chain_hash`` (none for the
        chain head's anchor, or without records)."""
        if not self.has_records or chain_hash == CHAIN_HEAD_INT64:
            return np.zeros(0, dtype=np.int64)
        return self._equal("links", chain_hash)

    def heads_of(self, batch_index: int) -> np.ndarray:
        """Indices of the entries of ``batch_index`` at position 0."""
        def keys():
            return np.where(self.positions == 0, self.batch_index, np.iinfo(np.int64).min)

        return self._equal("heads", batch_index, (self.positions, self.batch_index), keys)

    def bits_at(self, slot: int) -> int:
        """The fail reasons of the rows on ``slot``, ORed (0: no row)."""
        s = self.failing_slots
        at = int(np.searchsorted(s, slot))
        return int(self.failing_bits[at]) if at < s.size and int(s[at]) == slot else 0

    def prev_of(self, slot: int) -> int:
        """The predecessor slot of an entry reading ``slot`` (-1 when none is known)."""
        at = self.users(slot)
        return int(self.prev_slots[at[0]]) if at.size else -1


_COLUMNS = ("slots", "positions", "tokens", "batch_index", "request_rows", "links",
            "record_positions", "failing", "prev_slots")


def or_by_slot(slots, bits=None) -> tuple:
    """``(sorted distinct slots, their bits ORed)``; bits all-ones when not given."""
    slots = np.asarray(slots, dtype=np.int64).reshape(-1)
    bits = (np.full(slots.shape, -1, np.int64) if bits is None
            else np.asarray(bits, dtype=np.int64).reshape(-1))
    order = np.argsort(slots, kind="stable")
    slots, bits = slots[order], bits[order]
    unique, starts = np.unique(slots, return_index=True)
    merged = np.bitwise_or.reduceat(bits, starts) if slots.size else bits
    return unique, merged


def record_links(records: np.ndarray) -> np.ndarray:
    """int64 chain link of each ``[n, 4]`` record: what its successor's prev-hash holds."""
    rec = np.ascontiguousarray(records[:, :3])
    chain = rec[:, 2].copy().view(np.uint64)
    link_inplace(chain, rec[:, 0].copy().view(np.uint64), rec[:, 1].copy().view(np.uint64))
    return chain.view(np.int64)


# Chain-only findings followed back from one row at most.
CHAIN_WALK = 64


def predecessor_changed(ev: Evidence, prev: int) -> bool | None:
    """Whether the record at ``prev`` changed (so a chain-only row after it follows from it).

    A content finding (token or position) there changed it. A chain-only finding there is
    either its own link field changed (which changes ours) or the victim of its own
    predecessor: along a run of chain-only findings, owners and victims alternate from the
    first record before the run (a content change starts with a victim, an intact record
    with an owner). None when the run's first record is not in the evidence."""
    chain = int(FailReason.VERIFY_CHAIN_HASH_MISMATCH)
    content = int(FailReason.VERIFY_TOKEN_MISMATCH | FailReason.VERIFY_POSITION_MISMATCH)
    run, slot, last = 0, prev, prev
    while run < CHAIN_WALK and slot > 0:
        bits = ev.bits_at(slot)
        if bits & content or not bits & chain:
            break
        run += 1
        last, slot = slot, ev.prev_of(slot)
    if run == 0:
        return bool(slot > 0 and ev.bits_at(slot) & content)
    head = slot < 0 and bool(ev.users(last).size)   # the run reached a chain head
    if (slot <= 0 and not head) or run >= CHAIN_WALK or (slot > 0 and ev.prev_of(slot) == 0
                                                         and not ev.bits_at(slot) & content):
        # The run starts at a record the evidence cannot vouch for (one it does not hold, or
        # one whose own chain check was vacuous), or beyond the walk: its parity, and so
        # who owns the change, is unknown.
        return None
    base_changed = slot > 0 and bool(ev.bits_at(slot) & content)
    # The run's records from the base: with a changed base the first is a victim, so the
    # predecessor (the run's last) changed iff the run's length is even; else iff odd.
    return run % 2 == (0 if base_changed else 1)
