"""The fault kinds, one registered :class:`FaultKind` each (:data:`KINDS`): what the fault
is, the bits it fires, its footprint, how it is applied and placed, and when the canary can
and cannot see it. Everything else that is per kind (the ``--inject`` grammar, the dump's
kind names, the campaign's cells and its "designed to see" column) reads these objects.
Placing faults is :mod:`.faults`; what a placed fault records is :mod:`.fault_sites`.

A fault is a mutation plus its *footprint*: one slot, or on a paged engine (block tables) a
whole block for the kinds whose footprint is :data:`BLOCK` (the kinds that lose a block).

A new kind is one more :class:`FaultKind` in :data:`KINDS` and its change in
:mod:`.fault_changes`.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable

from ..format.consts import REAL_KV_PARTIAL_READ_BYTES, FailReason
from . import fault_changes as change
from .config import SynthError
from .fault_sites import DEFAULT_TARGET, HIGH, LOW, REQUEST, TARGET_CLASSES, real_kv_byte_note

SLOT, BLOCK = "slot", "block"     # footprints (on a paged engine; per token both are a slot)


@dataclass(frozen=True)
class BlindSpot:
    """Where the canary is not designed to see a kind: ``applies(mode, scope, rules,
    target)`` (mode ``none``/``partial``/``all``, the cell's scope, rules ``kvcanary`` or
    ``compat``), and why, in words."""
    applies: Callable[[str, str, str, str], bool]
    why: str


def _never(entry: str, prev: int, real_kv_visible: bool) -> bool:
    return False


@dataclass(frozen=True)
class FaultKind:
    """One fault kind.

    Parameters
    ----------
    name
        The ``--inject`` name, stored in dumps.
    description
        What the fault is, in words (``paged_description``: its paged form, where it differs).
    bits
        What it fires at an interior target (other entries: :meth:`site_bits`).
    apply
        ``(injector, target, i) -> Fault``: the change at picked entry ``i``
        (:mod:`.fault_changes`).
    footprint
        :data:`SLOT`, or :data:`BLOCK`: on a paged engine it claims the entry's whole block.
    targets
        The target classes it can be placed at.
    prefer, only
        ``injector -> mask`` over the entries: tried first (falling back to any entry), or
        required (with a :data:`BLOCK` footprint on a paged engine).
    pairable
        Whether it takes part in the interacting pairs (``KIND+KIND@SHAPE``).
    paged_only, needs_sources
        Only on paged engines; only with real-KV sources.
    offset_scoped
        Whether partial mode splits its rows at the bytes partial mode hashes
        (:data:`~.fault_sites.LOW`, :data:`~.fault_sites.HIGH`).
    unseen
        ``(entry, prev, real_kv_visible) -> bool``: a site it changed where it fires nothing
        (``prev``: the predecessor slot, -1 a chain head, 0 unreachable).
    site_rule
        ``(entry, position, prev) -> bits``, instead of ``bits``/``unseen``, for a kind whose
        bits depend on the site.
    blind_spots
        Where the canary is not designed to see it, checked in order.
    outcome_note
        ``(fault, mode, compat) -> str``: why a scored fault is or is not visible; by default
        the fault's own note.
    """
    name: str
    description: str
    bits: FailReason
    apply: Callable
    paged_description: str = ""
    footprint: str = SLOT
    targets: tuple = TARGET_CLASSES
    prefer: Callable | None = None
    only: Callable | None = None
    pairable: bool = False
    paged_only: bool = False
    needs_sources: bool = False
    offset_scoped: bool = False
    unseen: Callable[[str, int, bool], bool] = _never
    site_rule: Callable[[str, int, int], int] | None = None
    blind_spots: tuple = ()
    outcome_note: Callable | None = None

    def site_bits(self, entry: str, position: int, prev: int, real_kv_visible: bool) -> int:
        """The bits it must fire at one verify entry it changed: a request entry or a sweep
        entry at ``position`` whose predecessor slot is ``prev``."""
        if self.site_rule is not None:
            return self.site_rule(entry, position, prev)
        return 0 if self.unseen(entry, prev, real_kv_visible) else int(self.bits)

    def designed(self, mode: str, scope: str, rules: str, target: str) -> tuple:
        """``(True, "")`` where the canary is designed to see it, else ``(False, why)``."""
        for spot in self.blind_spots:
            if spot.applies(mode, scope, rules, target):
                return False, spot.why
        return True, ""

    def scopes(self, mode: str) -> tuple:
        """The campaign rows a mode splits into (``""``: one row)."""
        return (LOW, HIGH) if self.offset_scoped and mode == "partial" else ("",)

    def scope_of(self, mode: str, detail: int) -> str:
        """The row of :meth:`scopes` a fault with ``detail`` (its byte offset) lands in."""
        if self.offset_scoped and mode == "partial":
            return LOW if detail < REAL_KV_PARTIAL_READ_BYTES else HIGH
        return ""

    def note(self, fault, mode, compat: bool = False) -> str:
        """Why a scored ``fault`` of this kind is or is not visible under hash ``mode`` and
        the rules (``compat``: upstream's only), in words."""
        return fault.note if self.outcome_note is None else self.outcome_note(fault, mode, compat)


def _lost_write_bits(entry: str, position: int, prev: int) -> int:
    # A zero record holds position 0 and chain link 0.
    return ((int(FailReason.VERIFY_POSITION_MISMATCH) if position != 0 else 0)
            | (int(FailReason.VERIFY_CHAIN_HASH_MISMATCH) if prev != 0 else 0))


def _slot_zero_note(fault, mode, compat):
    if compat:
        return "not visible with --compat (upstream skips slot 0 as unfilled)"
    return "seen by kvcanary's SLOT_ZERO_IN_PREFIX extension"


def _real_kv_byte_note(fault, mode, compat):
    return real_kv_byte_note(mode, fault.detail)


_POSITION = FailReason.VERIFY_POSITION_MISMATCH
# Sweep entries carry no expected token (the prefix cache keeps no token pool); verify skips
# slot 0 as unfilled, and the extension flags it in live requests only.
def _live_only(entry: str, prev: int, real_kv_visible: bool) -> bool:
    return entry != REQUEST


_KINDS = (
    FaultKind(
        "token", "the stored token of a record changed", FailReason.VERIFY_TOKEN_MISMATCH,
        change.change_token, pairable=True, unseen=_live_only,
        blind_spots=(BlindSpot(
            lambda mode, scope, rules, target: target == "cached",
            "sweep entries carry no expected token (the prefix cache keeps no token pool); a "
            "changed token shows only as its successor's broken chain link"),)),
    FaultKind(
        "position", "the stored position of a record changed", _POSITION,
        change.change_position, pairable=True),
    FaultKind(
        "prev-hash", "the stored chain link of a record changed",
        FailReason.VERIFY_CHAIN_HASH_MISMATCH, change.change_prev_hash, pairable=True,
        unseen=lambda entry, prev, real_kv_visible: prev == 0,
        blind_spots=(BlindSpot(
            lambda mode, scope, rules, target: target == "window-head",
            "the predecessor's SWA slot is already freed, so verify cannot read it and the "
            "chain check at a window head is vacuous by design"),)),
    FaultKind(
        "real-kv-byte", "one byte of a slot's real KV changed",
        FailReason.VERIFY_REAL_KV_HASH_MISMATCH, change.change_real_kv_byte,
        needs_sources=True, offset_scoped=True,
        unseen=lambda entry, prev, real_kv_visible: not real_kv_visible,
        outcome_note=_real_kv_byte_note,
        blind_spots=(
            BlindSpot(lambda mode, scope, rules, target: mode == "none",
                      "mode none does not hash real KV: the record's real-KV field is 0 and "
                      "the bytes are never read"),
            BlindSpot(lambda mode, scope, rules, target: scope == HIGH,
                      f"partial mode hashes only the first {REAL_KV_PARTIAL_READ_BYTES} bytes "
                      "of each slot's real KV per source"))),
    FaultKind(
        "alias", "a request's table entry points at another request's slot", _POSITION,
        change.alias_entry, footprint=BLOCK, pairable=True,
        paged_description="a block-table entry points at another request's block"),
    FaultKind(
        "swap", "two table entries of one request exchanged", _POSITION,
        change.swap_entries, footprint=BLOCK,
        paged_description="two block-table entries of one request exchanged",
        outcome_note=lambda fault, mode, compat:
            f"positions {fault.position} and {fault.detail} exchanged"),
    FaultKind(
        "stale-reuse", "a slot reallocated and rewritten while a live request still maps it",
        _POSITION, change.reuse_stale, footprint=BLOCK, pairable=True,
        paged_description="a block freed while still referenced, reallocated and rewritten"),
    FaultKind(
        "slot-zero", "a live table entry mapped to padding slot 0",
        FailReason.SLOT_ZERO_IN_PREFIX, change.zero_entry, footprint=BLOCK,
        paged_description="a live block-table entry set to the null block 0",
        unseen=_live_only,
        outcome_note=_slot_zero_note,
        blind_spots=(
            BlindSpot(lambda mode, scope, rules, target: target == "cached",
                      "verify skips slot 0 as unfilled, and SLOT_ZERO_IN_PREFIX checks live "
                      "requests' tables only, not the prefix cache's blocks"),
            BlindSpot(lambda mode, scope, rules, target: rules == "compat",
                      "upstream's verify skips slot 0 as an unfilled slot; only kvcanary's "
                      "SLOT_ZERO_IN_PREFIX audit extension sees it, and --compat turns it "
                      "off"))),
    FaultKind(
        "lost-write", "a token's canary record and KV never written",
        _POSITION | FailReason.VERIFY_CHAIN_HASH_MISMATCH, change.lose_write,
        prefer=change.first_occupants, pairable=True, site_rule=_lost_write_bits),
    FaultKind(
        "evicted-block", "a cached block evicted while live requests map it, then rewritten",
        _POSITION, change.evict_block, footprint=BLOCK, paged_only=True,
        # the entries of prefix-cache blocks live requests map
        targets=("head", "shared"), only=change.evictable),
)
KINDS = MappingProxyType({kind.name: kind for kind in _KINDS})

# Views of the registry, by layout.
FAULT_KINDS = tuple(name for name, kind in KINDS.items() if not kind.paged_only)
PAGED_FAULT_KINDS = tuple(KINDS)
FAULT_DESCRIPTIONS = MappingProxyType({name: KINDS[name].description for name in FAULT_KINDS})
PAGED_FAULT_DESCRIPTIONS = MappingProxyType(
    {name: kind.paged_description or kind.description for name, kind in KINDS.items()})
EXPECTED_BITS = MappingProxyType({name: kind.bits for name, kind in KINDS.items()})

# Two faults placed next to each other where real bugs interact, ``KIND+KIND`` at a shape:
# two entries of one shared prefix-cache block, or a shared prefix's last entry and the first
# entry the request wrote after it (a chain seam). Each fault is scored at its own sites, so
# a site both reach must fire the union of their bits. slot-zero is not paired: a predecessor
# in slot 0 makes the next entry's chain check vacuous (verify's unfilled-slot rule), so it
# would hide a chain fault beside it; real-kv-byte is not paired either (mode-dependent).
PAIR_SHAPES = ("shared-block", "chain-seam")
PAIR_KINDS = tuple(name for name, kind in KINDS.items() if kind.pairable)
# Pairs whose joint effect is not the union of each alone, and why.
PAIRS_NOT_UNION = {
    ("lost-write", "lost-write"): "the chain link of an all-zero record is 0, so a zeroed "
                                  "record right after another zeroed record holds a "
                                  "consistent link: only the position check sees the second",
}


def kind_targets(kind: str) -> tuple:
    """The target classes a fault kind can be placed at."""
    return KINDS[kind].targets if kind in KINDS else TARGET_CLASSES


def default_target(kind: str) -> str:
    return DEFAULT_TARGET if DEFAULT_TARGET in kind_targets(kind) else kind_targets(kind)[-1]


def site_bits(kind: str, entry: str, position: int, prev: int, real_kv_visible: bool) -> int:
    """The bits a fault of ``kind`` must fire at one verify entry it changed
    (:meth:`FaultKind.site_bits`)."""
    return KINDS[kind].site_bits(entry, position, prev, real_kv_visible)


def fault_kinds(paged: bool) -> tuple:
    """The fault kinds of a layout."""
    return PAGED_FAULT_KINDS if paged else FAULT_KINDS


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
