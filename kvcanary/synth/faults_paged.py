"""Fault injection into a paged engine's final state (``block_size > 0``), with ground truth.

Each fault targets a request-owned live entry (not shared with another request or the prefix
cache) and its own slot, never next to another target of the same request, so faults of one
run never interact: a fault that changes a record breaks its successor's chain link, and that
successor is never another fault's target.

A paged engine loses whole blocks: its table faults change a block-table entry (every position
of the block goes wrong, and none of them, nor the entry after the block, is another fault's
target), ``stale-reuse`` rewrites a whole block, and ``evicted-block`` (paged only) takes a
prefix-cache block that live requests still map out of the cache and rewrites it. Target
classes (see :mod:`.faults`) are per-token only here.
"""

from __future__ import annotations

import numpy as np

from .. import api
from ..consts import REAL_KV_PARTIAL_READ_BYTES, RealKvHashMode
from ..types import WritePlan
from .config import SynthError
from .faults import DEFAULT_TARGET, EXPECTED_BITS, Fault, _unknown_kind, fault_kinds


class PagedFaultInjector:
    """Changes a paged :class:`~kvcanary.synth.Synthesis`'s final state, one fault at a time
    (every fault targets an interior entry of a request-owned block)."""

    def __init__(self, synthesis):
        self.s = synthesis
        self.used_entries: set = set()     # (request row, position) of every target
        self.used_slots: set = set()
        self.real_kv_faults = 0

    def inject(self, kind: str, count: int, target: str = DEFAULT_TARGET) -> list:
        """Inject ``count`` faults of ``kind``; all or a SynthError."""
        s = self.s
        self._check(kind, count, target)
        made = []
        layout = "_paged" if s.config.paged and kind in _BLOCK_FORMS else ""
        for _ in range(count):
            fault = getattr(self, "_inject_" + kind.replace("-", "_") + layout)()
            s.faults.append(fault)
            made.append(fault)
        return made

    def _check(self, kind: str, count: int, target: str) -> None:
        s = self.s
        if target != DEFAULT_TARGET:
            raise SynthError(f"--inject {kind}@{target}: a paged run (--block-size) places "
                             f"faults at {DEFAULT_TARGET} entries only")
        if kind not in fault_kinds(s.config.paged):
            raise SynthError(_unknown_kind(kind, fault_kinds(s.config.paged)) + ")")
        if count < 1:
            raise SynthError(f"--inject {kind}: COUNT must be at least 1, got {count}")
        if kind == "real-kv-byte" and not s.sources:
            raise SynthError("--inject real-kv-byte needs at least one real-KV source "
                             "(--sources >= 1)")

    def inject_up_to(self, kind: str, count: int, target: str = DEFAULT_TARGET) -> list:
        """Inject up to ``count`` faults, stopping when no target is left; a failed attempt
        leaves the generator and the claimed entries as they were, so ``inject(kind, n)``
        with the ``n`` placed rebuilds the same faults."""
        self._check(kind, count, target)
        made = []
        for _ in range(count):
            state = self.s.rng.bit_generator.state
            claimed = set(self.used_entries), set(self.used_slots)
            try:
                made += self.inject(kind, 1, target)
            except SynthError:
                self.s.rng.bit_generator.state = state
                self.used_entries, self.used_slots = claimed
                break
        return made

    # ------------------------------------------------------------------ targets

    def _candidates(self):
        """(batch index, position) of every request-owned live entry whose predecessor and
        successor are inside the verified window (a window head's predecessor may have lost
        its SWA slot, which makes its chain link unreachable)."""
        W = self.s.config.swa_window
        batch, positions = [], []
        for b, request in enumerate(self.s.running):
            low = max(request.matched, 1, request.seq_len - W + 1 if W else 0)
            high = request.seq_len - 1
            if high > low:
                batch.append(np.full(high - low, b, dtype=np.int64))
                positions.append(np.arange(low, high, dtype=np.int64))
        if not batch:
            raise SynthError("no live request owns enough entries to inject faults into; "
                             "use more requests or longer prompts")
        return np.concatenate(batch), np.concatenate(positions)

    def _canary_slots(self, row: int, start: int, stop: int) -> np.ndarray:
        s = self.s
        return s.allocator.canary_slots(s.scheduler.table.slots(row, start, stop))

    def _canary_slot(self, row: int, position: int) -> int:
        return int(self._canary_slots(row, position, position + 1)[0])

    def _block_span(self, p: int) -> tuple:
        bs = self.s.config.block_size
        return p // bs * bs, (p // bs + 1) * bs

    def _pick(self, extra_filter=None, block=False):
        """A fresh target ``(batch index, position, canary slot)``; with ``block`` the whole
        block of the position is claimed (a paged table fault)."""
        s, used = self.s, self.used_entries
        batch, positions = self._candidates()
        order = s.rng.permutation(batch.shape[0])
        for i in order.tolist():
            b, p = int(batch[i]), int(positions[i])
            request = s.running[b]
            low, high = self._block_span(p) if block else (p, p + 1)
            if any((request.row, q) in used for q in range(low - 1, high + 1)):
                continue
            slot = self._canary_slot(request.row, p)
            if slot in self.used_slots or slot == 0:
                continue
            if extra_filter and not extra_filter(b, p, slot):
                continue
            used.update((request.row, q) for q in range(low, high))
            if block:
                written = self._canary_slots(request.row, low, min(high, request.seq_len))
                self.used_slots.update(written[written != 0].tolist())
            self.used_slots.add(slot)
            return b, p, slot
        raise SynthError("ran out of distinct live entries to inject faults into; use more "
                         "requests or fewer faults")

    def _fault(self, kind, b, p, slot, *, visible=True, detail=-1, note="") -> Fault:
        return Fault(kind=kind, batch_index=b, request_row=self.s.running[b].row, position=p,
                     slot=slot, expected_bits=int(EXPECTED_BITS[kind]), visible=visible,
                     detail=detail, note=note)

    def _fields(self):
        """The canary records' int64 fields: token, position, chain link, real-KV hash."""
        return self.s.canary.view("<i8")[:, :4]

    # ------------------------------------------------------------------ record faults

    def _inject_token(self):
        b, p, slot = self._pick()
        self._fields()[slot, 0] += 1
        return self._fault("token", b, p, slot)

    def _inject_position(self):
        b, p, slot = self._pick()
        self._fields()[slot, 1] += 1
        return self._fault("position", b, p, slot)

    def _inject_prev_hash(self):
        b, p, slot = self._pick()
        bit = int(self.s.rng.integers(64))
        self._fields()[slot, 2] ^= np.int64(-(1 << 63)) if bit == 63 else np.int64(1 << bit)
        return self._fault("prev-hash", b, p, slot, detail=bit)

    def _inject_real_kv_byte(self):
        s = self.s
        c, rng = s.config, s.rng
        b, p, slot = self._pick()
        k = self.real_kv_faults
        self.real_kv_faults += 1
        source = k % len(s.sources)
        offset = (k * 16 + int(rng.integers(16))) % c.bytes_per_token
        view = s.pool.slot_bytes(s.sources[source])
        view[slot // c.page_size, slot % c.page_size, offset] ^= np.uint8(
            1 << int(rng.integers(8)))
        mode = c.hash_mode
        visible = mode == RealKvHashMode.ALL or (
            mode == RealKvHashMode.PARTIAL and offset < REAL_KV_PARTIAL_READ_BYTES)
        if mode == RealKvHashMode.NONE:
            note = "not visible in none mode (real KV is not hashed)"
        elif not visible:
            note = (f"not visible in partial mode (byte {offset} is outside the "
                    f"{REAL_KV_PARTIAL_READ_BYTES} bytes partial hashes)")
        else:
            note = f"byte {offset} of source {source}"
        return self._fault("real-kv-byte", b, p, slot, visible=visible, detail=offset, note=note)

    def _inject_lost_write(self):
        s = self.s
        fresh = s.pool.write_count == 1
        try:
            b, p, slot = self._pick(lambda bb, pp, ss: bool(fresh[ss]))
            note = "slot never written (first occupant)"
        except SynthError:
            b, p, slot = self._pick()
            note = "slot had an earlier occupant; left zeroed"
        s.canary[slot] = 0
        ps = s.config.page_size
        for tensor in s.sources:
            s.pool.slot_bytes(tensor)[slot // ps, slot % ps] = 0
        return self._fault("lost-write", b, p, slot, note=note)

    # ------------------------------------------------------------------ table faults

    def _inject_alias(self):
        s = self.s
        b, p, slot = self._pick()
        request = s.running[b]
        batch, positions = self._candidates()
        for i in s.rng.permutation(batch.shape[0]).tolist():
            b2, p2 = int(batch[i]), int(positions[i])
            other = s.running[b2]
            if b2 == b or p2 == p:
                continue
            full = int(s.table[other.row, p2])
            target = self._canary_slot(other.row, p2)
            if target == 0 or target in self.used_slots or (other.row, p2) in self.used_entries:
                continue
            self.used_slots.add(target)
            self.used_entries.add((other.row, p2))
            s.table[request.row, p] = full
            return self._fault("alias", b, p, slot, detail=target,
                               note=f"now maps slot {target} (request row {other.row}, "
                                    f"position {p2})")
        raise SynthError("alias needs a second live request with an owned entry")

    def _inject_swap(self):
        s = self.s
        b, p, slot = self._pick()
        b2, p2, slot2 = self._pick(lambda bb, pp, ss: bb == b and abs(pp - p) > 1)
        row = s.running[b].row
        s.table[row, p], s.table[row, p2] = s.table[row, p2], s.table[row, p]
        return self._fault("swap", b, p, slot, detail=p2, note=f"exchanged with position {p2}")

    def _inject_slot_zero(self):
        b, p, slot = self._pick()
        self.s.table[self.s.running[b].row, p] = 0
        return self._fault("slot-zero", b, p, slot,
                           note="seen only by kvcanary's SLOT_ZERO_IN_PREFIX extension")

    # ------------------------------------------------------------------ allocator faults

    def _inject_stale_reuse(self):
        s = self.s
        b, p, slot = self._pick()
        new_position = p + 1 + int(s.rng.integers(1, 64))
        self._rewrite(np.array([slot], dtype=np.int64), new_position)
        return self._fault("stale-reuse", b, p, slot, detail=new_position,
                           note=f"rewritten as position {new_position} of another sequence")

    # ------------------------------------------------------------------ paged forms

    def _inject_alias_paged(self):
        s = self.s
        table, bs = s.scheduler.table.array, s.config.block_size
        b, p, slot = self._pick(block=True)
        request = s.running[b]
        batch, positions = self._candidates()
        for i in s.rng.permutation(batch.shape[0]).tolist():
            b2, p2 = int(batch[i]), int(positions[i])
            other = s.running[b2]
            if b2 == b or p2 // bs == p // bs:
                continue
            q = p2 // bs * bs + p % bs      # the other entry our target now reads
            if q >= other.seq_len:
                # Not written by the other request yet: the slot may still hold a record of
                # its block's previous occupant, possibly at position p itself.
                continue
            target = self._canary_slot(other.row, q)
            if target == 0 or target in self.used_slots or (other.row, q) in self.used_entries:
                continue
            self.used_slots.add(target)
            self.used_entries.add((other.row, q))
            block = int(table[other.row, p2 // bs])
            table[request.row, p // bs] = block
            return self._fault("alias", b, p, slot, detail=target,
                               note=f"block-table entry {p // bs} now holds block {block} of "
                                    f"request row {other.row} (its entry {p2 // bs})")
        raise SynthError("alias needs a second live request with an owned entry")

    def _inject_swap_paged(self):
        s = self.s
        table, bs = s.scheduler.table.array, s.config.block_size
        b, p, slot = self._pick(block=True)
        b2, p2, _ = self._pick(lambda bb, pp, ss: bb == b and pp % bs == p % bs, block=True)
        row, k1, k2 = s.running[b].row, p // bs, p2 // bs
        table[row, k1], table[row, k2] = table[row, k2], table[row, k1]
        return self._fault("swap", b, p, slot, detail=p2,
                           note=f"block-table entries {k1} and {k2} exchanged")

    def _inject_slot_zero_paged(self):
        b, p, slot = self._pick(block=True)
        self.s.scheduler.table.array[self.s.running[b].row, p // self.s.config.block_size] = 0
        return self._fault("slot-zero", b, p, slot,
                           note="block-table entry set to the null block 0; seen only by "
                                "kvcanary's SLOT_ZERO_IN_PREFIX extension")

    def _rewrite(self, slots: np.ndarray, first_position: int) -> None:
        """Another sequence's tokens written into ``slots`` (canary slots) as positions
        ``first_position ..``: what a reallocated block holds."""
        s = self.s
        n = int(slots.shape[0])
        tokens = s.workload.tokens(n).astype(np.int64)
        positions = first_position + np.arange(n, dtype=np.int64)
        s.pool.write_kv(slots, tokens, positions)
        plan = WritePlan(write_offsets=np.array([0, n], dtype=np.int64),
                         write_seed_slot_indices=np.array([-1], dtype=np.int64),
                         write_num_valid_reqs=np.array([1], dtype=np.int32))
        api.write(s.pool.context, plan, input_ids=tokens, positions=positions,
                  out_cache_loc=slots, backend=s.config.backend)
        s.pool.write_count[slots] += 1

    def _inject_stale_reuse_paged(self):
        s = self.s
        b, p, slot = self._pick(block=True)
        request = s.running[b]
        low, high = self._block_span(p)
        slots = self._canary_slots(request.row, low, min(high, request.seq_len))
        new_position = high + int(s.rng.integers(1, 64))
        self._rewrite(slots[slots != 0], new_position)
        return self._fault("stale-reuse", b, p, slot, detail=new_position,
                           note=f"block freed and reallocated: rewritten from position "
                                f"{new_position} of another sequence")

    def _inject_evicted_block(self):
        """A cached block that live requests map is evicted (as if its reference count had
        dropped to 0) with the cached blocks below it, reallocated and rewritten. Every live
        request mapping it is affected: its positions in the block and the entry after it are
        claimed."""
        s, W = self.s, self.s.config.swa_window
        B = s.cache.block_tokens
        blocks = [block for block in s.cache.values() if block.refs > 0]
        for i in s.rng.permutation(len(blocks)).tolist():
            block = blocks[i]
            low, high = block.depth * B, (block.depth + 1) * B
            mapping = [(b, r) for b, r in enumerate(s.running) if block in r.blocks]
            if not mapping or any((r.row, q) in self.used_entries
                                  for _, r in mapping for q in range(low - 1, high + 1)):
                continue
            b, request = mapping[0]
            start = max(low, 1, request.seq_len - W if W else 0)
            if start >= high:
                continue    # the block has left the request's window
            p = start + int(s.rng.integers(high - start))
            slots = s.allocator.canary_slots(block.slots.astype(np.int64))
            slot = int(slots[p - low])
            if slot == 0 or self.used_slots.intersection(slots.tolist()):
                continue
            for _, r in mapping:
                self.used_entries.update((r.row, q) for q in range(low, high))
            self.used_slots.update(slots[slots != 0].tolist())
            s.cache.drop_subtree(block)
            new_position = high + int(s.rng.integers(1, 64))
            self._rewrite(slots[slots != 0], new_position)
            return self._fault("evicted-block", b, p, slot, detail=new_position,
                               note=f"cached block at positions {low}..{high - 1} evicted while "
                                    f"{len(mapping)} live request(s) map it; rewritten from "
                                    f"position {new_position}")
        raise SynthError("evicted-block needs a live request that maps a cached leaf block "
                         "inside its window; use more requests or shared prefixes")


# Table and allocator faults whose paged form loses a whole block.
_BLOCK_FORMS = ("alias", "swap", "stale-reuse", "slot-zero")
