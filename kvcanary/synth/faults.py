"""Fault injection into a finished run's state, with ground truth, for per-token and paged
engines alike.

A fault has a kind (what goes wrong) and a target class (where: a request's head, a shared
prefix-cache block, a window edge, ...). It is a mutation plus its *footprint*: one slot, or
on a paged engine (block tables) a whole block for the faults that lose a block (table
entries, reallocation, eviction: :data:`BLOCK_KINDS`). Its ground truth is the list of
*sites*, the verify entries that read what the fault changed, each with the bits it must fire
there: every live request that maps a changed record (and the prefix cache's sweep entry of
it), or the entries whose table entry changed.

Faults of one injector never interact: a target's slots are never another target's slots or
chain neighbours of them (in any request row or sweep chain), because a changed record breaks
its successor's chain link. Candidates are filtered without random draws and a failed pick
gives its draws back, so ``inject(kind, n)`` after ``k`` placed faults of a kind that ran out
leaves the generator exactly where ``inject(kind, k)`` would have.

A target class is a mask over the verify entries of the final state (``_class_masks``), one
entry table for both layouts; its ``unit`` column names the table entry an entry reads
through (a position, or a block of positions).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .. import api
from ..consts import REAL_KV_PARTIAL_READ_BYTES, FailReason, RealKvHashMode
from ..types import WritePlan
from .config import SynthError
from .prefix_cache import SweepIndex

FAULT_KINDS = ("token", "position", "prev-hash", "real-kv-byte", "alias", "swap",
               "stale-reuse", "slot-zero", "lost-write")
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
PAGED_FAULT_KINDS = FAULT_KINDS + ("evicted-block",)
PAGED_FAULT_DESCRIPTIONS = {
    **FAULT_DESCRIPTIONS,
    "alias": "a block-table entry points at another request's block",
    "swap": "two block-table entries of one request exchanged",
    "stale-reuse": "a block freed while still referenced, reallocated and rewritten",
    "slot-zero": "a live block-table entry set to the null block 0",
    "evicted-block": "a cached block evicted while live requests map it, then rewritten",
}
TARGET_CLASSES = ("head", "interior", "last", "chunk-boundary", "window-head", "shared",
                  "cached")
DEFAULT_TARGET = "interior"
TARGET_DESCRIPTIONS = {
    "head": "position 0 of a live request (owned, or the first slot of a shared prefix)",
    "interior": "a request-owned entry whose predecessor and successor are verified",
    "last": "a live request's last written token (it has no successor)",
    "chunk-boundary": "the first token of a later chunk of a chunked prefill",
    "window-head": "the first entry of a sliding window, its predecessor's SWA slot freed",
    "shared": "a slot of a prefix-cache block that live requests map",
    "cached": "a slot of a prefix-cache block no live request maps (a sweep entry only)",
}
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
PAIR_DESCRIPTIONS = {
    "shared-block": "two faults in one prefix-cache block that live requests map",
    "chain-seam": "a fault on a shared prefix's last entry and one on the request's next entry",
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
    if kind == "token":
        # Sweep entries carry no expected token: the prefix cache keeps no token pool.
        return int(FailReason.VERIFY_TOKEN_MISMATCH) if entry == REQUEST else 0
    if kind == "prev-hash":
        return int(FailReason.VERIFY_CHAIN_HASH_MISMATCH) if prev != 0 else 0
    if kind == "real-kv-byte":
        return int(FailReason.VERIFY_REAL_KV_HASH_MISMATCH) if real_kv_visible else 0
    if kind == "slot-zero":
        # Verify skips slot 0 as unfilled; the extension flags it in live requests only.
        return int(FailReason.SLOT_ZERO_IN_PREFIX) if entry == REQUEST else 0
    if kind == "lost-write":
        # A zero record holds position 0 and chain link 0.
        return ((int(FailReason.VERIFY_POSITION_MISMATCH) if position != 0 else 0)
                | (int(FailReason.VERIFY_CHAIN_HASH_MISMATCH) if prev != 0 else 0))
    return int(EXPECTED_BITS[kind])


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


def inapplicable_kinds(config) -> dict:
    """Fault kinds that cannot be injected into a workload of ``config``, with the reason."""
    if config.sources == 0:
        return {"real-kv-byte": "no real-KV sources (--sources 0)"}
    return {}


def parse_inject(specs, config=None) -> list:
    """``["token", "alias:3@head"]`` -> ``[("token", 1, "interior"), ("alias", 3, "head")]``;
    kind ``all`` means every kind that applies to ``config`` (see :func:`inapplicable_kinds`),
    class ``all`` every target class the kind reaches; ``token+position:2@chain-seam`` places
    two interacting pairs (per-token runs). A paged ``config`` takes the paged kinds
    (:func:`fault_kinds`)."""
    skipped = inapplicable_kinds(config) if config is not None else {}
    paged = config is not None and config.paged
    result = []
    for spec in specs:
        body, _, target = spec.partition("@")
        kind, _, count = body.partition(":")
        kind, target = kind.strip(), target.strip()
        try:
            number = int(count) if count else 1
        except ValueError:
            raise SynthError(f"--inject {spec}: COUNT must be an integer") from None
        if number < 1:
            raise SynthError(f"--inject {spec}: COUNT must be at least 1")
        kinds = ([k for k in fault_kinds(paged) if k not in skipped] if kind == "all"
                 else (kind,))
        for name in kinds:
            targets = (kind_targets(name) if target == "all" and name in fault_kinds(True)
                       else (target or default_target(name),))
            for where in targets:
                _check(name, where, paged)
                result.append((name, number, where))
    return result


def _check(kind: str, target: str, paged: bool = False) -> None:
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
        needs = " (needs --block-size)" if kind in PAGED_FAULT_KINDS else ""
        raise SynthError(f"--inject: unknown fault kind {kind!r}{needs} (one of "
                         f"{', '.join(kinds)}, or all)")
    if target not in TARGET_CLASSES:
        raise SynthError(f"--inject: unknown target class {target!r} (one of "
                         f"{', '.join(TARGET_CLASSES + PAIR_SHAPES)}, or all)")
    if target not in kind_targets(kind):
        raise SynthError(f"--inject {kind}@{target}: {kind} reaches only "
                         f"{', '.join(kind_targets(kind))} entries")


@dataclass
class _Entries:
    """Every verify entry of the final state: live requests' windows, then sweep entries."""
    entry: np.ndarray      # 0 request, 1 sweep
    batch: np.ndarray      # batch index (-1 for sweep entries)
    row: np.ndarray        # request row (-1)
    position: np.ndarray
    slot: np.ndarray       # canary slot read
    prev: np.ndarray       # canary slot of the predecessor (-1 head, 0 unreachable)
    unit: np.ndarray       # the table entry read through: same value, same position or block
    unit_slots: np.ndarray  # [entries, block size] canary slots of the unit (-1: unwritten)
    masks: dict            # target class -> bool mask over the entries


class FaultInjector:
    """Changes a :class:`~kvcanary.synth.Synthesis`'s final state, one fault at a time."""

    def __init__(self, synthesis):
        self.s = synthesis
        self.paged = synthesis.config.paged
        self.bs = synthesis.scheduler.table.block_size   # positions per table entry
        self._entries = None
        self._sweep = None
        self.blocked = None                # canary slot -> taken or next to a target
        self.real_kv_faults = 0
        self._rewrites = []                # stale-reuse (slot, token, position) to write

    def inject(self, kind: str, count: int, target: str = DEFAULT_TARGET) -> list:
        """Inject ``count`` faults of ``kind`` at ``target`` entries; all or an error."""
        made = self.inject_up_to(kind, count, target)
        if len(made) < count * (2 if target in PAIR_SHAPES else 1):
            raise SynthError(f"--inject {kind}:{count}@{target}: only {len(made)} distinct "
                             f"{target} entries to inject into; use more requests or fewer "
                             "faults")
        return made

    def inject_up_to(self, kind: str, count: int, target: str = DEFAULT_TARGET) -> list:
        """Inject up to ``count`` faults, stopping (with the generator untouched by the failed
        attempt) when no target entry is left."""
        s = self.s
        _check(kind, target, self.paged)
        if count < 1:
            raise SynthError(f"--inject {kind}: COUNT must be at least 1, got {count}")
        if kind == "real-kv-byte" and not s.sources:
            raise SynthError("--inject real-kv-byte needs at least one real-KV source "
                             "(--sources >= 1)")
        made = []
        try:
            for _ in range(count):
                state = s.rng.bit_generator.state
                try:
                    faults = (self._place_pair(kind, target) if target in PAIR_SHAPES
                              else [self._apply(kind, target, self._pick_for(kind, target))])
                except _NoTarget:
                    s.rng.bit_generator.state = state
                    break
                s.faults.extend(faults)
                made.extend(faults)
        finally:
            self._write_rewrites()
        return made

    # ------------------------------------------------------------------ entries

    def entries(self) -> _Entries:
        if self._entries is None:
            self._entries = self._build_entries()
            self.blocked = np.zeros(self.s.num_canary_slots + 1, dtype=bool)
            self.blocked[0] = True          # padding slot 0 is never a target
        return self._entries

    def _build_entries(self) -> _Entries:
        s, bs = self.s, self.bs
        c, canary, table = s.config, s.allocator.canary_slots, s.scheduler.table
        W = c.swa_window
        names = ("entry", "batch", "row", "position", "slot", "prev", "unit", "unit_slots")
        cols = {name: [] for name in names}
        meta = {name: [] for name in ("matched", "seq_len", "prompt_len", "start")}
        offsets = np.arange(bs, dtype=np.int64)
        for b, request in enumerate(s.running):
            start = max(0, request.seq_len - W) if W else 0
            positions = np.arange(start, request.seq_len, dtype=np.int64)
            slots = canary(table.slots(request.row, 0, request.seq_len))
            prev = np.full(positions.shape, -1, dtype=np.int64)
            prev[positions > 0] = slots[positions[positions > 0] - 1]
            n = positions.shape[0]
            for name, value in (("entry", 0), ("batch", b), ("row", request.row)):
                cols[name].append(np.full(n, value, dtype=np.int64))
            cols["position"].append(positions)
            cols["slot"].append(slots[start:])
            cols["prev"].append(prev)
            cols["unit"].append(b * (c.max_context_len + 1) + positions // bs)
            unit = positions[:, None] // bs * bs + offsets
            cols["unit_slots"].append(np.where(unit < request.seq_len,
                                               slots[np.minimum(unit, request.seq_len - 1)], -1))
            for name, value in (("matched", request.matched), ("seq_len", request.seq_len),
                                ("prompt_len", request.prompt_len), ("start", start)):
                meta[name].append(np.full(n, value, dtype=np.int64))
        self._sweep = SweepIndex(s.cache, s.allocator.lut)
        sweep = self._sweep
        m = sweep.slots.shape[0]
        for name, value in (("entry", 1), ("batch", -1), ("row", -1)):
            cols[name].append(np.full(m, value, dtype=np.int64))
        cols["position"].append(sweep.positions)
        cols["slot"].append(sweep.slots)
        cols["prev"].append(sweep.prevs)
        k = np.arange(m, dtype=np.int64)
        cols["unit"].append(-1 - k // bs)
        cols["unit_slots"].append(sweep.slots[(k // bs * bs)[:, None] + offsets].reshape(m, bs)
                                  if m else np.zeros((0, bs), dtype=np.int64))
        for name in meta:
            meta[name].append(np.full(m, -1, dtype=np.int64))
        e = {name: np.concatenate(v) for name, v in cols.items()}
        mt = {name: np.concatenate(v) for name, v in meta.items()}
        return _Entries(**e, masks=self._class_masks(e, mt, sweep.unmapped))

    def _class_masks(self, e: dict, mt: dict, unmapped: np.ndarray) -> dict:
        """Target class -> mask over the entries; the classes of live entries are disjoint
        except that an interior entry may sit on a chunk boundary."""
        chunk = self.s.config.chunk_size
        live, p, prev = e["entry"] == 0, e["position"], e["prev"]
        owned = p >= mt["matched"]
        head = live & (p == 0)
        window_head = live & (p == mt["start"]) & (p > 0) & (prev == 0)
        last = live & (p == mt["seq_len"] - 1) & ~head & ~window_head
        inside = live & (p > mt["start"]) & (p < mt["seq_len"] - 1) & (prev != 0)
        sweep_mask = np.zeros(live.shape, dtype=bool)
        sweep_mask[~live] = unmapped
        reachable = live & (prev != 0) & ~owned
        return {
            "head": head,
            "interior": inside & owned & (p > 0),
            "last": last,
            "chunk-boundary": inside & owned & (p < mt["prompt_len"])
                              & ((p - mt["matched"]) % chunk == 0) & (p > mt["matched"]),
            "window-head": window_head,
            "shared": inside & ~owned,
            "cached": sweep_mask & (prev != 0),
            # first entries of the pair shapes (the second: ``_place_pair``)
            "shared-block": reachable,
            "chain-seam": reachable & (p == mt["matched"] - 1),
            "mapped-cached": live & ~owned,     # in a prefix-cache block the request holds
        }

    # ------------------------------------------------------------------ picking

    def _pick_for(self, kind: str, target: str) -> int:
        """A lost write prefers a slot its first occupant wrote (a real never-written slot); a
        paged block fault a unit none of whose slots is taken (and, evicted-block, one of a
        cached block live requests map)."""
        e = self.entries()
        if kind == "lost-write":
            try:
                return self._pick(target, self.s.pool.write_count[e.slot] == 1)
            except _NoTarget:
                pass
        if self.paged and kind in BLOCK_KINDS:
            where = self._free_units()
            if kind == "evicted-block":
                where &= self._evictable()
            return self._pick(target, where)
        return self._pick(target)

    def _free_units(self, whole: bool = False) -> np.ndarray:
        """Entries whose unit has no taken slot; ``whole``: and every slot of it written and
        readable (a unit another entry is pointed at). A no-op per token (the unit is the
        entry's own slot, which ``_pick`` checks)."""
        u = self.entries().unit_slots
        written = u > 0
        free = ~(self.blocked[np.maximum(u, 0)] & written).any(axis=1)
        return free & written.all(axis=1) if whole else free

    def _evictable(self) -> np.ndarray:
        """Entries of cached blocks live requests map whose subtree holds no taken slot (an
        earlier fault's sweep sites would vanish with it)."""
        s, e = self.s, self.entries()
        ok = np.zeros(e.slot.shape, dtype=bool)
        seen = {}
        for i in np.flatnonzero(e.masks["mapped-cached"]).tolist():
            block = self._mapped_block(i)
            if id(block) not in seen:
                cached = s.cache.blocks.get(block.key) is block
                gone = self._subtree_slots(block) if cached else None
                seen[id(block)] = cached and not self.blocked[gone[gone > 0]].any()
            ok[i] = seen[id(block)]
        return ok

    def _mapped_block(self, i: int):
        e = self.entries()
        return self.s.running[int(e.batch[i])].blocks[int(e.position[i]) // self.bs]

    def _subtree_slots(self, block) -> np.ndarray:
        below = [b.slots for b in self.s.cache.values() if _descends(b, block)]
        return self.s.allocator.canary_slots(np.concatenate(below).astype(np.int64))

    def _apply(self, kind: str, target: str, i: int) -> Fault:
        return getattr(self, "_apply_" + kind.replace("-", "_"))(target, i)

    def _place_pair(self, kinds: str, shape: str) -> list:
        """Two interacting faults (see ``PAIR_SHAPES``): both entries are picked before
        either fault is placed, so the second may neighbour the first."""
        e = self.entries()
        i = self._pick(shape)
        row_mates = (e.batch == e.batch[i]) & (e.slot != e.slot[i]) & (e.prev != 0)
        if shape == "shared-block":
            block = self.s.config.block_tokens
            j = self._pick("shared-block", row_mates
                           & (e.position // block == e.position[i] // block))
        else:
            j = self._pick(None, row_mates & (e.position == e.position[i] + 1))
        first, _, second = kinds.partition("+")
        return [self._apply(first, shape, i), self._apply(second, shape, j)]

    def _pick(self, target, where=None) -> int:
        """Index of a random free entry of class ``target`` (any when None) and ``where``;
        raises _NoTarget."""
        e = self.entries()
        mask = ~self.blocked[e.slot] if target is None else \
            e.masks[target] & ~self.blocked[e.slot]
        if where is not None:
            mask &= where
        candidates = np.flatnonzero(mask)
        if candidates.size == 0:
            raise _NoTarget
        return int(candidates[int(self.s.rng.integers(candidates.size))])

    def _take(self, *slots) -> None:
        """Block slots and their chain neighbours for later targets."""
        e = self.entries()
        for slot in slots:
            self.blocked[slot] = True
            self.blocked[e.prev[(e.slot == slot) & (e.prev > 0)]] = True
            self.blocked[e.slot[e.prev == slot]] = True

    def _record_sites(self, kind: str, slot: int, real_kv_visible: bool = False) -> tuple:
        """Every entry that reads canary slot ``slot`` (every mapper, and the sweep)."""
        e = self.entries()
        return tuple(self._site(kind, i, slot, real_kv_visible)
                     for i in np.flatnonzero(e.slot == slot).tolist())

    def _site(self, kind: str, i: int, reads: int, real_kv_visible: bool = False) -> Site:
        e = self.entries()
        entry = REQUEST if e.entry[i] == 0 else SWEEP
        return Site(entry=entry, request_row=int(e.row[i]), position=int(e.position[i]),
                    slot=int(reads), bits=site_bits(kind, entry, int(e.position[i]),
                                                   int(e.prev[i]), real_kv_visible))

    def _unit_sites(self, kind: str, i: int, reads) -> tuple:
        """The entries of ``i``'s unit, each now reading ``reads`` (a slot, or the canary
        slots of a unit by offset; no site where that is unwritten or a freed SWA slot)."""
        e = self.entries()
        reads = np.broadcast_to(reads, (self.bs,))
        least = 0 if kind == "slot-zero" else 1
        return tuple(self._site(kind, u, int(reads[e.position[u] % self.bs]))
                     for u in self._unit(i) if reads[e.position[u] % self.bs] >= least)

    def _unit(self, i: int) -> list:
        e = self.entries()
        return [i] if self.bs == 1 else np.flatnonzero(e.unit == e.unit[i]).tolist()

    def _unit_taken(self, i: int) -> list:
        u = self.entries().unit_slots[i]
        return [int(x) for x in u if x > 0]

    def _fault(self, kind, target, i, sites, *, detail=-1, note="") -> Fault:
        e = self.entries()
        expected = 0
        for site in sites:
            expected |= site.bits
        return Fault(kind=kind, batch_index=int(e.batch[i]), request_row=int(e.row[i]),
                     position=int(e.position[i]), slot=int(e.slot[i]), expected_bits=expected,
                     visible=expected != 0, detail=detail, note=note, target=target,
                     sites=sites)

    def _fields(self):
        """The canary records' int64 fields: token, position, chain link, real-KV hash."""
        return self.s.canary.view("<i8")[:, :4]

    def _set_table(self, i: int, full_slot: int) -> None:
        """Point entry ``i``'s table entry (a request row's, or a cached block's) at
        ``full_slot``: on a paged engine the block holding it."""
        e = self.entries()
        if e.entry[i] == 0:
            table = self.s.scheduler.table
            table.array[e.row[i], e.position[i] // self.bs] = full_slot // self.bs
        else:
            block, k = self._sweep.owner(i - int(np.count_nonzero(e.entry == 0)))
            k0 = k // self.bs * self.bs
            block.slots[k0:k0 + self.bs] = (full_slot // self.bs * self.bs
                                            + np.arange(self.bs)) if full_slot else 0

    def _table_slot(self, i: int) -> int:
        e = self.entries()
        if e.entry[i] == 0:
            return int(self.s.scheduler.table.slots(e.row[i], e.position[i],
                                                    e.position[i] + 1)[0])
        block, k = self._sweep.owner(i - int(np.count_nonzero(e.entry == 0)))
        return int(block.slots[k])

    # ------------------------------------------------------------------ record faults

    def _record_fault(self, kind, target, i, change, *, detail=-1, note="",
                      real_kv_visible=False):
        slot = int(self.entries().slot[i])
        change(slot)
        self._take(slot)
        return self._fault(kind, target, i, self._record_sites(kind, slot, real_kv_visible),
                           detail=detail, note=note)

    def _apply_token(self, target, i):
        return self._record_fault("token", target, i,
                                  lambda slot: self._fields().__setitem__(
                                      (slot, 0), self._fields()[slot, 0] + 1))

    def _apply_position(self, target, i):
        return self._record_fault("position", target, i,
                                  lambda slot: self._fields().__setitem__(
                                      (slot, 1), self._fields()[slot, 1] + 1))

    def _apply_prev_hash(self, target, i):
        bit = int(self.s.rng.integers(64))
        slot = int(self.entries().slot[i])
        self._fields()[slot, 2] ^= np.int64(-(1 << 63)) if bit == 63 else np.int64(1 << bit)
        self._take(slot)
        return self._fault("prev-hash", target, i, self._record_sites("prev-hash", slot),
                           detail=bit)

    def _apply_real_kv_byte(self, target, i):
        s = self.s
        c, rng = s.config, s.rng
        slot = int(self.entries().slot[i])
        k = self.real_kv_faults
        source = k % len(s.sources)
        offset = (k * 16 + int(rng.integers(16))) % c.bytes_per_token
        view = s.pool.slot_bytes(s.sources[source])
        view[slot // c.page_size, slot % c.page_size, offset] ^= np.uint8(
            1 << int(rng.integers(8)))
        self.real_kv_faults += 1
        visible = real_kv_byte_visible(c.hash_mode, offset)
        note = real_kv_byte_note(c.hash_mode, offset) + f" (source {source})"
        self._take(slot)
        return self._fault("real-kv-byte", target, i,
                           self._record_sites("real-kv-byte", slot, visible),
                           detail=offset, note=note)

    def _apply_lost_write(self, target, i):
        s = self.s
        slot = int(self.entries().slot[i])
        note = ("slot never written (first occupant)" if s.pool.write_count[slot] == 1 else
                "slot had an earlier occupant; left zeroed")
        s.canary[slot] = 0
        ps = s.config.page_size
        for tensor in s.sources:
            s.pool.slot_bytes(tensor)[slot // ps, slot % ps] = 0
        self._take(slot)
        return self._fault("lost-write", target, i, self._record_sites("lost-write", slot),
                           note=note)

    def _apply_stale_reuse(self, target, i):
        """The slot (paged: every written slot of the block) reallocated and rewritten as
        another sequence's, from a position past the unit's end."""
        s, e = self.s, self.entries()
        high = (int(e.position[i]) // self.bs + 1) * self.bs
        new_position = high + int(s.rng.integers(1, 64))
        slots = self._unit_taken(i)
        self._rewrite(slots, new_position)
        return self._fault("stale-reuse", target, i,
                           sum((self._record_sites("stale-reuse", x) for x in slots), ()),
                           detail=new_position,
                           note=f"rewritten as position {new_position} of another sequence")

    def _rewrite(self, slots: list, first_position: int) -> None:
        s = self.s
        tokens = s.workload.tokens(len(slots)).astype(np.int64)
        positions = first_position + np.arange(len(slots), dtype=np.int64)
        index = np.array(slots, dtype=np.int64)
        s.pool.write_kv(index, tokens, positions)
        s.pool.write_count[index] += 1
        self._rewrites += zip(slots, tokens.tolist(), positions.tolist())
        self._take(*slots)

    def _apply_evicted_block(self, target, i):
        """A cached block that live requests map evicted (as if its reference count had
        dropped to 0) with the cached blocks below it, reallocated and rewritten: every live
        entry that maps it reads another sequence's records; its sweep entries are gone."""
        s = self.s
        block = self._mapped_block(i)
        gone = self._subtree_slots(block)
        slots = self._unit_taken(i)
        s.cache.drop_subtree(block)
        new_position = (block.depth + 1) * self.bs + int(s.rng.integers(1, 64))
        self._rewrite(slots, new_position)
        self._take(*gone[gone > 0].tolist())
        sites = tuple(site for x in slots for site in self._record_sites("evicted-block", x)
                      if site.entry == REQUEST)
        return self._fault("evicted-block", target, i, sites, detail=new_position,
                           note=f"cached block at positions {block.depth * self.bs}.."
                                f"{(block.depth + 1) * self.bs - 1} evicted while live "
                                f"requests map it; rewritten from position {new_position}")

    def _write_rewrites(self) -> None:
        """Write the pending rewritten records in one launch: each its own one-token
        sequence (a chain head), as if written one by one. No other fault touches their
        slots, so writing them at the end of an ``inject`` call changes nothing else."""
        if not self._rewrites:
            return
        slots, tokens, positions = (np.array(v, dtype=np.int64) for v in zip(*self._rewrites))
        n = slots.shape[0]
        self._rewrites = []
        plan = WritePlan(write_offsets=np.arange(n + 1, dtype=np.int64),
                         write_seed_slot_indices=np.full(n, -1, dtype=np.int64),
                         write_num_valid_reqs=np.array([n], dtype=np.int32))
        api.write(self.s.pool.context, plan, input_ids=tokens, positions=positions,
                  out_cache_loc=slots, backend=self.s.config.backend)

    # ------------------------------------------------------------------ table faults

    def _apply_alias(self, target, i):
        e = self.entries()
        where = (e.batch != e.batch[i]) & (e.position != e.position[i]) & (e.slot != e.slot[i])
        if self.bs > 1:     # another request's whole block, at other positions
            where &= (e.position // self.bs != e.position[i] // self.bs) & \
                (e.position % self.bs == e.position[i] % self.bs) & self._free_units(whole=True)
        other = self._pick("interior", where)
        self._set_table(i, self._table_slot(other))
        into = int(e.slot[other])
        self._take(*self._unit_taken(i), *self._unit_taken(other))
        return self._fault("alias", target, i,
                           self._unit_sites("alias", i, e.unit_slots[other]), detail=into,
                           note=f"now maps slot {into} (request row {int(e.row[other])}, "
                                f"position {int(e.position[other])})")

    def _apply_swap(self, target, i):
        e = self.entries()
        same = (e.entry == e.entry[i]) & (np.abs(e.position // self.bs
                                                 - e.position[i] // self.bs) > 1) \
            & (e.slot != e.slot[i])
        if self.bs > 1:
            same &= (e.position % self.bs == e.position[i] % self.bs) & \
                self._free_units(whole=True)
        if e.entry[i] == 0:
            j = self._pick("interior", same & (e.batch == e.batch[i]))
        else:
            j = self._pick("cached", same)
        a, b = self._table_slot(i), self._table_slot(j)
        self._set_table(i, b)
        self._set_table(j, a)
        self._take(*self._unit_taken(i), *self._unit_taken(j))
        sites = (self._unit_sites("swap", i, e.unit_slots[j])
                 + self._unit_sites("swap", j, e.unit_slots[i]))
        return self._fault("swap", target, i, sites, detail=int(e.position[j]),
                           note=f"exchanged with position {int(e.position[j])}")

    def _apply_slot_zero(self, target, i):
        self._set_table(i, 0)
        self._take(*self._unit_taken(i))
        return self._fault("slot-zero", target, i, self._unit_sites("slot-zero", i, 0),
                           note="seen only by kvcanary's SLOT_ZERO_IN_PREFIX extension")


def _descends(block, ancestor) -> bool:
    while block is not None:
        if block is ancestor:
            return True
        block = block.parent
    return False


class _NoTarget(Exception):
    """No free entry of the class is left (internal: ``inject`` turns it into SynthError)."""
