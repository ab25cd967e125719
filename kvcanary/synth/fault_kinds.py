"""What a fault is, for per-token and paged engines alike: the kinds, the target classes and
pair shapes, the bits each must fire, and the ground truth a fault carries (:class:`Fault`
with its :class:`Site` list), the one format the dump writer stores and the scorer reads.
Placing faults is :mod:`.faults`.

A fault is a mutation plus its *footprint*: one slot, or on a paged engine (block tables) a
whole block for the kinds that lose a block (:data:`BLOCK_KINDS`). Its *sites* are the verify
entries that read what it changed, each with the bits it must fire there: every live request
that maps a changed record (and the prefix cache's sweep entry of it), or the entries whose
table entry changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..format.consts import REAL_KV_PARTIAL_READ_BYTES, FailReason, RealKvHashMode
from .config import SynthError

FAULT_DESCRIPTIONS = {
    "token": "the stored token of a record changed",
    "position": "the stored position of a record changed",
    "prev-hash": "the stored chain link of a record changed",
    "real-kv-byte": "one byte of a slot's real KV changed",
    "alias": "a request's table entry points at another request's slot",
    "swap": "two table entries of one request exchanged",
    "stale-reuse": "a slot reallocated and rewritten while a live request still maps it",
    "slot-zero": "a live table entry mapped to padding slot 0",
    "lost-write": "a token's canary record and KV never written",
}
FAULT_KINDS = tuple(FAULT_DESCRIPTIONS)
PAGED_FAULT_DESCRIPTIONS = {
    **FAULT_DESCRIPTIONS,
    "alias": "a block-table entry points at another request's block",
    "swap": "two block-table entries of one request exchanged",
    "stale-reuse": "a block freed while still referenced, reallocated and rewritten",
    "slot-zero": "a live block-table entry set to the null block 0",
    "evicted-block": "a cached block evicted while live requests map it, then rewritten",
}
PAGED_FAULT_KINDS = tuple(PAGED_FAULT_DESCRIPTIONS)
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
# Two faults placed next to each other where real bugs interact, ``KIND+KIND`` at a shape:
# two entries of one shared prefix-cache block, or a shared prefix's last entry and the first
# entry the request wrote after it (a chain seam). Each fault is scored at its own sites, so
# a site both reach must fire the union of their bits. slot-zero is not paired: a predecessor
# in slot 0 makes the next entry's chain check vacuous (verify's unfilled-slot rule), so it
# would hide a chain fault beside it; real-kv-byte is not paired either (mode-dependent).
PAIR_SHAPES = ("shared-block", "chain-seam")
PAIR_KINDS = ("token", "position", "prev-hash", "alias", "stale-reuse", "lost-write")
# Pairs whose joint effect is not the union of each alone, and why.
PAIRS_NOT_UNION = {
    ("lost-write", "lost-write"): "the chain link of an all-zero record is 0, so a zeroed "
                                  "record right after another zeroed record holds a "
                                  "consistent link: only the position check sees the second",
}
# Bits a fault fires at an interior target (other targets: :func:`site_bits`).
EXPECTED_BITS = {
    "token": FailReason.VERIFY_TOKEN_MISMATCH,
    "position": FailReason.VERIFY_POSITION_MISMATCH,
    "prev-hash": FailReason.VERIFY_CHAIN_HASH_MISMATCH,
    "real-kv-byte": FailReason.VERIFY_REAL_KV_HASH_MISMATCH,
    "alias": FailReason.VERIFY_POSITION_MISMATCH,
    "swap": FailReason.VERIFY_POSITION_MISMATCH,
    "stale-reuse": FailReason.VERIFY_POSITION_MISMATCH,
    "slot-zero": FailReason.SLOT_ZERO_IN_PREFIX,
    "lost-write": FailReason.VERIFY_POSITION_MISMATCH | FailReason.VERIFY_CHAIN_HASH_MISMATCH,
    "evicted-block": FailReason.VERIFY_POSITION_MISMATCH,
}
REQUEST, SWEEP = "request", "sweep"
# Kinds whose paged form loses a whole block, and the classes evicted-block can reach (the
# entries of prefix-cache blocks live requests map).
BLOCK_KINDS = ("alias", "swap", "stale-reuse", "slot-zero", "evicted-block")
KIND_TARGETS = {"evicted-block": ("head", "shared")}


def kind_targets(kind: str) -> tuple:
    """The target classes a fault kind can be placed at."""
    return KIND_TARGETS.get(kind, TARGET_CLASSES)


def default_target(kind: str) -> str:
    return DEFAULT_TARGET if DEFAULT_TARGET in kind_targets(kind) else kind_targets(kind)[-1]


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


def site_bits(kind: str, entry: str, position: int, prev: int, real_kv_visible: bool) -> int:
    """The bits a fault of ``kind`` must fire at one verify entry it changed: a request entry
    or a sweep entry at ``position`` whose predecessor slot is ``prev`` (-1: chain head, 0:
    unreachable, its chain check vacuous)."""
    if kind == "lost-write":
        # A zero record holds position 0 and chain link 0.
        return ((int(FailReason.VERIFY_POSITION_MISMATCH) if position != 0 else 0)
                | (int(FailReason.VERIFY_CHAIN_HASH_MISMATCH) if prev != 0 else 0))
    # Sweep entries carry no expected token (the prefix cache keeps no token pool); verify
    # skips slot 0 as unfilled, and the extension flags it in live requests only.
    unseen = {"token": entry != REQUEST, "slot-zero": entry != REQUEST,
              "prev-hash": prev == 0, "real-kv-byte": not real_kv_visible}
    return 0 if unseen.get(kind, False) else int(EXPECTED_BITS[kind])


@dataclass(frozen=True)
class Site:
    """A verify entry a fault changed: ``entry`` is ``request`` (``request_row``, ``position``)
    or ``sweep`` (``position``, ``slot``); ``slot`` is what the entry reads after the fault."""
    entry: str
    request_row: int
    position: int
    slot: int
    bits: int


def fault_kinds(paged: bool) -> tuple:
    """The fault kinds of a layout."""
    return PAGED_FAULT_KINDS if paged else FAULT_KINDS


@dataclass
class Fault:
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



def _did_you_mean(word: str, choices) -> str:
    import difflib

    near = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f": did you mean {near[0]!r}?" if near else ""

def check_kind_target(kind: str, target: str, paged: bool = False) -> None:
    """A SynthError naming the ``--inject`` spec unless ``kind`` can be placed at ``target``."""
    if target in PAIR_SHAPES:
        first, plus, second = kind.partition("+")
        if paged:
            raise SynthError(f"--inject {kind}@{target}: pair shapes are per-token only "
                             "(a paged fault's block would cover its partner)")
        if not plus or first not in PAIR_KINDS or second not in PAIR_KINDS:
            raise SynthError(f"--inject {kind}@{target}: a pair shape takes KIND+KIND, each "
                             f"one of {', '.join(PAIR_KINDS)}")
        return
    kinds = fault_kinds(paged)
    if kind not in kinds:
        if kind in PAGED_FAULT_KINDS:   # a known kind, of the paged layout only
            raise SynthError(f"--inject: fault kind {kind!r} is a paged-layout kind: it needs "
                             "--block-size N (a simulated paged engine)")
        raise SynthError(f"--inject: unknown fault kind {kind!r}{_did_you_mean(kind, kinds)} "
                         f"(one of {', '.join(kinds)}, or all)")
    if target not in TARGET_CLASSES:
        choices = TARGET_CLASSES + PAIR_SHAPES
        raise SynthError(f"--inject: unknown target class {target!r}"
                         f"{_did_you_mean(target, choices)} (one of {', '.join(choices)}, "
                         "or all)")
    if target not in kind_targets(kind):
        raise SynthError(f"--inject {kind}@{target}: {kind} reaches only "
                         f"{', '.join(kind_targets(kind))} entries")
