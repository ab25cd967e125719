"""The one vocabulary of causes: every cause a finding can name, with what it means and the
evidence that supports it. The diagnosis states one of them for every ring row; the audit
counts them, ``explain`` and the engine guards report them; a cause outside this enum is
refused where a :class:`~kvcanary.findings.diagnosis.Diagnosis` is made.

A ``Cause`` is a ``str`` (its name, e.g. ``"shared-slot"``): it compares, hashes, formats
and serialises as that name.

>>> Cause("shared-slot") is Cause.SHARED_SLOT, Cause.SHARED_SLOT == "shared-slot"
(True, True)
>>> Cause.SHARED_SLOT.name, Cause.SHARED_SLOT.description
('SHARED_SLOT', "two live requests map one slot: the record is the other request's")
>>> f"{Cause.NEVER_WRITTEN}: {Cause.NEVER_WRITTEN.evidence}"
'never-written: the stored record is all zeros'
"""

from __future__ import annotations

import enum


class Cause(str, enum.Enum):
    """A cause: its name (the value), ``description`` (what happened) and ``evidence``
    (what in the row, the batch or the records supports it)."""

    def __new__(cls, name: str, description: str, evidence: str):
        member = str.__new__(cls, name)
        member._value_ = name
        member.description = description
        member.evidence = evidence
        return member

    # Shown as its name everywhere (str, format, repr, JSON), as causes were before the enum.
    __str__ = str.__str__
    __format__ = str.__format__
    __repr__ = str.__repr__

    OUT_OF_RANGE = ("out-of-range", "an index the launch read points outside its buffer or table",
                    "the slot or predecessor index lies outside the buffer or table")
    SLOT_ZERO = ("slot-zero", "a live prefix entry is mapped to padding slot 0 (kvcanary's "
                 "extension)", "a live prefix entry maps padding slot 0")
    NEVER_WRITTEN = ("never-written", "the slot was read before anything was written to it",
                     "the stored record is all zeros")
    WRONG_BUFFER = ("wrong-buffer", "the launch read another buffer than the one written (or a "
                    "fresh one)", "the record is zero and so are most records the batch reads")
    SHARED_SLOT = ("shared-slot", "two live requests map one slot: the record is the other "
                   "request's", "another live request maps the slot, and the record is its own")
    SHIFTED_MAPPING = ("shifted-mapping", "the request's slots are shifted or swapped between "
                       "its positions", "the record is another position of the same request")
    POSITION_CHANGED = ("position-changed", "the record's position was changed after the write",
                        "token and chain link are this entry's, only the position differs")
    OVERWRITTEN = ("overwritten", "another sequence rewrote the slot while this request still "
                   "maps it", "the record belongs to no live request")
    PREDECESSOR_CHANGED = ("predecessor-changed", "the previous position's record changed",
                           "only the chain link fails, and the predecessor's record fails too")
    LINK_CHANGED = ("link-changed", "the record's chain link changed",
                    "only the chain link fails, and the predecessor's record is intact")
    KV_BYTES_CHANGED = ("kv-bytes-changed", "the slot's KV bytes changed after the write",
                        "only the real-KV hash fails")
    WRONG_TOKEN = ("wrong-token", "the slot holds another token than the one expected there",
                   "only the token fails against the expected tokens")
    RECORD_CHANGED = ("record-changed", "several fields of the record changed",
                      "several fields of an otherwise unexplained record differ")
    WRITE_INPUT = ("write-input", "the write path consumed other tokens or positions than "
                   "expected", "a write check failed against the expected inputs")
    UNKNOWN = ("unknown", "no known check failed", "only bits the diagnosis does not know")
