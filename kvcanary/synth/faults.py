"""Fault injection into a finished run's state (the faults themselves: :mod:`.fault_kinds`),
one injector for per-token and paged engines over one entry table: every verify entry of the
final state with its class masks, and its ``unit`` (the table entry it reads through: its
position, or on a paged engine its block; a block fault's footprint).

Faults of one injector never interact: a target's slots are never another target's slots or
chain neighbours of them (in any request row or sweep chain), because a changed record breaks
its successor's chain link. Candidates are filtered without random draws and a failed pick
gives its draws back, so ``inject(kind, n)`` after ``k`` placed faults of a kind that ran out
leaves the generator exactly where ``inject(kind, k)`` would have.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, fields

import numpy as np

from ..api import launches as api
from ..model.types import WritePlan
from .config import SynthError
from .fault_kinds import (BLOCK_KINDS, DEFAULT_TARGET, PAIR_SHAPES, REQUEST, SWEEP, Fault, Site,
                          check_kind_target, real_kv_byte_note, real_kv_byte_visible,
                          site_bits)
from .prefix_cache import SweepIndex


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
        check_kind_target(kind, target, self.paged)
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
        """Each live request's window, then the sweep entries, as columns; a request's own
        numbers (matched prefix, length, prompt length, window start) go to the class masks."""
        s, bs = self.s, self.bs
        c, canary, table = s.config, s.allocator.canary_slots, s.scheduler.table
        offsets = np.arange(bs, dtype=np.int64)
        parts = []
        for b, request in enumerate(s.running):
            start = max(0, request.seq_len - c.swa_window) if c.swa_window else 0
            positions = np.arange(start, request.seq_len, dtype=np.int64)
            slots = canary(table.slots(request.row, 0, request.seq_len))
            prev = np.where(positions > 0, slots[np.maximum(positions - 1, 0)], -1)
            unit = positions[:, None] // bs * bs + offsets
            parts.append(dict(
                entry=0, batch=b, row=request.row, position=positions, slot=slots[start:],
                prev=prev, unit=b * (c.max_context_len + 1) + positions // bs,
                unit_slots=np.where(unit < request.seq_len,
                                    slots[np.minimum(unit, request.seq_len - 1)], -1),
                matched=request.matched, seq_len=request.seq_len,
                prompt_len=request.prompt_len, start=start, unmapped=0))
        self._sweep = sweep = SweepIndex(s.cache, s.allocator.lut)
        k = np.arange(sweep.slots.shape[0], dtype=np.int64)
        parts.append(dict(
            entry=1, batch=-1, row=-1, position=sweep.positions, slot=sweep.slots,
            prev=sweep.prevs, unit=-1 - k // bs,
            unit_slots=sweep.slots[(k // bs * bs)[:, None] + offsets].reshape(-1, bs),
            matched=-1, seq_len=-1, prompt_len=-1, start=-1, unmapped=sweep.unmapped))
        cols = {name: np.concatenate([np.full(p["position"].shape[0], p[name], dtype=np.int64)
                                      if np.ndim(p[name]) == 0 else p[name] for p in parts])
                for name in parts[0]}
        return _Entries(**{f.name: cols[f.name] for f in fields(_Entries) if f.name != "masks"},
                        masks=self._class_masks(cols))

    def _class_masks(self, e: dict) -> dict:
        """Target class -> mask over the entries; the classes of live entries are disjoint
        except that an interior entry may sit on a chunk boundary."""
        chunk = self.s.config.chunk_size
        live, p, prev = e["entry"] == 0, e["position"], e["prev"]
        owned = p >= e["matched"]
        head = live & (p == 0)
        window_head = live & (p == e["start"]) & (p > 0) & (prev == 0)
        last = live & (p == e["seq_len"] - 1) & ~head & ~window_head
        inside = live & (p > e["start"]) & (p < e["seq_len"] - 1) & (prev != 0)
        reachable = live & (prev != 0) & ~owned
        return {
            "head": head,
            "interior": inside & owned & (p > 0),
            "last": last,
            "chunk-boundary": inside & owned & (p < e["prompt_len"])
                              & ((p - e["matched"]) % chunk == 0) & (p > e["matched"]),
            "window-head": window_head,
            "shared": inside & ~owned,
            "cached": (e["unmapped"] == 1) & (prev != 0),
            # first entries of the pair shapes (the second: ``_place_pair``)
            "shared-block": reachable,
            "chain-seam": reachable & (p == e["matched"] - 1),
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
                gone = self._subtree_slots(block) if s.cache.blocks.get(block.key) is block \
                    else None
                seen[id(block)] = gone is not None and not self.blocked[gone[gone > 0]].any()
            ok[i] = seen[id(block)]
        return ok

    def _mapped_block(self, i: int):
        e = self.entries()
        return self.s.running[int(e.batch[i])].blocks[int(e.position[i]) // self.bs]

    def _subtree_slots(self, block) -> np.ndarray:
        below = [b.slots for b in self.s.cache.subtree(block)]
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
                     for u in np.flatnonzero(e.unit == e.unit[i]).tolist()
                     if reads[e.position[u] % self.bs] >= least)

    def _unit_taken(self, i: int) -> list:
        u = self.entries().unit_slots[i]
        return [int(x) for x in u if x > 0]

    def _fault(self, kind, target, i, sites, *, detail=-1, note="") -> Fault:
        e = self.entries()
        expected = functools.reduce(operator.or_, (site.bits for site in sites), 0)
        return Fault(kind=kind, batch_index=int(e.batch[i]), request_row=int(e.row[i]),
                     position=int(e.position[i]), slot=int(e.slot[i]), expected_bits=expected,
                     visible=expected != 0, detail=detail, note=note, target=target,
                     sites=sites)

    def _set_table(self, i: int, full_slot: int) -> None:
        """Point entry ``i``'s table entry (a request row's, or a cached block's) at
        ``full_slot``: on a paged engine the block holding it."""
        e, bs = self.entries(), self.bs
        if e.entry[i] == 0:
            self.s.scheduler.table.array[e.row[i], e.position[i] // bs] = full_slot // bs
        else:
            block, k = self._owner(i)
            block.slots[k // bs * bs:(k // bs + 1) * bs] = (
                full_slot // bs * bs + np.arange(bs)) if full_slot else 0

    def _table_slot(self, i: int) -> int:
        e = self.entries()
        if e.entry[i] == 0:
            return int(self.s.scheduler.table.slots(e.row[i], e.position[i],
                                                    e.position[i] + 1)[0])
        block, k = self._owner(i)
        return int(block.slots[k])

    def _owner(self, i: int) -> tuple:
        """``(cached block, index in it)`` of sweep entry ``i``."""
        return self._sweep.owner(i - int(np.count_nonzero(self.entries().entry == 0)))

    # ------------------------------------------------------------------ record faults

    def _record_fault(self, kind, target, i, change, *, detail=-1, note="",
                      real_kv_visible=False):
        slot = int(self.entries().slot[i])
        change(slot)
        self._take(slot)
        return self._fault(kind, target, i, self._record_sites(kind, slot, real_kv_visible),
                           detail=detail, note=note)

    def _apply_token(self, target, i):
        return self._record_fault("token", target, i, lambda slot: self._bump(slot, 0, 1))

    def _apply_position(self, target, i):
        return self._record_fault("position", target, i, lambda slot: self._bump(slot, 1, 1))

    def _apply_prev_hash(self, target, i):
        bit = int(self.s.rng.integers(64))
        flip = np.int64(-(1 << 63)) if bit == 63 else np.int64(1 << bit)
        return self._record_fault("prev-hash", target, i,
                                  lambda slot: self._bump(slot, 2, flip, xor=True), detail=bit)

    def _bump(self, slot: int, field: int, by, xor: bool = False) -> None:
        """Change a record's int64 field (token, position, chain link, real-KV hash)."""
        fields = self.s.canary.view("<i8")[:, :4]
        fields[slot, field] = fields[slot, field] ^ by if xor else fields[slot, field] + by

    def _apply_real_kv_byte(self, target, i):
        s, c = self.s, self.s.config
        k = self.real_kv_faults
        self.real_kv_faults += 1
        source = k % len(s.sources)
        offset = (k * 16 + int(s.rng.integers(16))) % c.bytes_per_token
        flip = np.uint8(1 << int(s.rng.integers(8)))
        view = s.pool.slot_bytes(s.sources[source])

        def change(slot):
            view[slot // c.page_size, slot % c.page_size, offset] ^= flip
        return self._record_fault("real-kv-byte", target, i, change, detail=offset,
                                  note=real_kv_byte_note(c.hash_mode, offset)
                                  + f" (source {source})",
                                  real_kv_visible=real_kv_byte_visible(c.hash_mode, offset))

    def _apply_lost_write(self, target, i):
        s = self.s
        slot = int(self.entries().slot[i])
        note = ("slot never written (first occupant)" if s.pool.write_count[slot] == 1 else
                "slot had an earlier occupant; left zeroed")
        return self._record_fault("lost-write", target, i, self._zero, note=note)

    def _zero(self, slot: int) -> None:
        s, ps = self.s, self.s.config.page_size
        s.canary[slot] = 0
        for tensor in s.sources:
            s.pool.slot_bytes(tensor)[slot // ps, slot % ps] = 0

    def _apply_stale_reuse(self, target, i):
        """The slot (paged: every written slot of the block) reallocated and rewritten as
        another sequence's, from a position past the unit's end."""
        s, e = self.s, self.entries()
        high = (int(e.position[i]) // self.bs + 1) * self.bs
        new_position = high + int(s.rng.integers(1, 64))
        sites = self._rewrite("stale-reuse", self._unit_taken(i), new_position)
        return self._fault("stale-reuse", target, i, sites, detail=new_position,
                           note=f"rewritten as position {new_position} of another sequence")

    def _rewrite(self, kind: str, slots: list, first_position: int) -> tuple:
        """Queue ``slots`` to be rewritten as another sequence's from ``first_position``
        (:meth:`_write_rewrites`); the sites of every entry reading them."""
        s = self.s
        tokens = s.workload.tokens(len(slots)).astype(np.int64)
        positions = first_position + np.arange(len(slots), dtype=np.int64)
        index = np.array(slots, dtype=np.int64)
        s.pool.write_kv(index, tokens, positions)
        s.pool.write_count[index] += 1
        self._rewrites += zip(slots, tokens.tolist(), positions.tolist())
        self._take(*slots)
        return tuple(site for x in slots for site in self._record_sites(kind, x))

    def _apply_evicted_block(self, target, i):
        """A cached block that live requests map evicted (as if its reference count had
        dropped to 0) with the cached blocks below it, reallocated and rewritten: every live
        entry that maps it reads another sequence's records; its sweep entries are gone."""
        s = self.s
        block = self._mapped_block(i)
        gone = self._subtree_slots(block)
        s.cache.drop_subtree(block)
        new_position = (block.depth + 1) * self.bs + int(s.rng.integers(1, 64))
        sites = self._rewrite("evicted-block", self._unit_taken(i), new_position)
        self._take(*gone[gone > 0].tolist())
        return self._fault("evicted-block", target, i,
                           tuple(site for site in sites if site.entry == REQUEST),
                           detail=new_position,
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

    def _aligned_units(self, i: int):
        """Entries another unit of which ``i``'s table entry can point at: per token any; on
        a paged engine those at ``i``'s offset in a whole, free block."""
        e = self.entries()
        if self.bs == 1:
            return True
        return (e.position % self.bs == e.position[i] % self.bs) & self._free_units(whole=True)

    def _remap(self, kind: str, pairs: list) -> tuple:
        """Point the table entry of each ``(i, j)``'s ``i`` at what ``j``'s read before any
        changed, taking both units; the sites of every entry of the remapped units."""
        e = self.entries()
        for i, slot in [(i, self._table_slot(j)) for i, j in pairs]:
            self._set_table(i, slot)
        self._take(*(x for pair in pairs for k in pair for x in self._unit_taken(k)))
        return sum((self._unit_sites(kind, i, e.unit_slots[j]) for i, j in pairs), ())

    def _apply_alias(self, target, i):
        e = self.entries()
        other = self._pick("interior", (e.batch != e.batch[i]) & (e.slot != e.slot[i])
                           & (e.position // self.bs != e.position[i] // self.bs)
                           & self._aligned_units(i))
        sites = self._remap("alias", [(i, other)])
        into = int(e.slot[other])
        return self._fault("alias", target, i, sites, detail=into,
                           note=f"now maps slot {into} (request row {int(e.row[other])}, "
                                f"position {int(e.position[other])})")

    def _apply_swap(self, target, i):
        e = self.entries()
        same = ((e.entry == e.entry[i]) & (e.slot != e.slot[i]) & self._aligned_units(i)
                & (np.abs(e.position // self.bs - e.position[i] // self.bs) > 1))
        if e.entry[i] == 0:
            j = self._pick("interior", same & (e.batch == e.batch[i]))
        else:
            j = self._pick("cached", same)
        return self._fault("swap", target, i, self._remap("swap", [(i, j), (j, i)]),
                           detail=int(e.position[j]),
                           note=f"exchanged with position {int(e.position[j])}")

    def _apply_slot_zero(self, target, i):
        self._set_table(i, 0)
        self._take(*self._unit_taken(i))
        return self._fault("slot-zero", target, i, self._unit_sites("slot-zero", i, 0),
                           note="seen only by kvcanary's SLOT_ZERO_IN_PREFIX extension")


class _NoTarget(Exception):
    """No free entry of the class is left (internal: ``inject`` turns it into SynthError)."""
