"""Where a fault lands and what it must fire there: the target classes of verify entries, the
ground truth a placed fault carries (:class:`Fault` with its :class:`Site` list, the one
format the dump writer stores and the scorer reads), and the real-KV byte rule of the hash
modes. The kinds themselves are :mod:`.fault_kinds`.

A fault's *sites* are the verify entries that read what it changed, each with the bits it
must fire there: every live request that maps a changed record (and the prefix cache's sweep
entry of it), or the entries whose table entry changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..format.consts import REAL_KV_PARTIAL_READ_BYTES, RealKvHashMode

TARGET_DESCRIPTIONS = {
    "head": "position 0 of a live request (owned, or the first slot of a shared prefix)",
    "interior": "a request-owned entry whose predecessor and successor are verified",
    "last": "a live request's last written token (it has no successor)",
    "chunk-boundary": "the first token of a later chunk of a chunked prefill",
    "window-head": "the first entry of a sliding window, its predecessor's SWA slot freed",
    "shared": "a slot of a prefix-cache block that live requests map",
    "cached": "a slot of a prefix-cache block no live request maps (a sweep entry only)",
}
TARGET_CLASSES = tuple(TARGET_DESCRIPTIONS)
DEFAULT_TARGET = "interior"
REQUEST, SWEEP = "request", "sweep"
# The two halves of a real-KV byte fault's rows in partial mode: the bytes it hashes, the rest.
LOW, HIGH = f"byte < {REAL_KV_PARTIAL_READ_BYTES}", f"byte >= {REAL_KV_PARTIAL_READ_BYTES}"


def real_kv_byte_visible(mode: RealKvHashMode, offset: int) -> bool:
    """Whether a changed byte at ``offset`` of a slot's real KV changes its record's hash."""
    return mode == RealKvHashMode.ALL or (
        mode == RealKvHashMode.PARTIAL and offset < REAL_KV_PARTIAL_READ_BYTES)


def real_kv_byte_note(mode: RealKvHashMode, offset: int) -> str:
    """:func:`real_kv_byte_visible`, in words."""
    if mode == RealKvHashMode.NONE:
        return "not visible in none mode (real KV bytes are not hashed)"
    if not real_kv_byte_visible(mode, offset):
        return (f"not visible in partial mode (byte {offset} is outside the "
                f"{REAL_KV_PARTIAL_READ_BYTES} bytes partial mode hashes)")
    return f"byte {offset} of the slot's real KV"


@dataclass(frozen=True)
class Site:
    """A verify entry a fault changed: ``entry`` is ``request`` (``request_row``, ``position``)
    or ``sweep`` (``position``, ``slot``); ``slot`` is what the entry reads after the fault."""
    entry: str
    request_row: int
    position: int
    slot: int
    bits: int


@dataclass
class Fault:
    """One placed fault: its kind and target entry, the union of its sites' bits, whether any
    site must fire, a kind-specific ``detail`` (a flipped bit, a byte offset, a position) and
    a note in words."""
    kind: str
    batch_index: int
    request_row: int
    position: int
    slot: int
    expected_bits: int
    visible: bool
    detail: int = -1
    note: str = ""
    target: str = DEFAULT_TARGET
    sites: tuple = field(default_factory=tuple)
