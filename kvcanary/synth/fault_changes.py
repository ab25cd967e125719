"""How each fault kind changes a finished run's state: one function per kind, ``(injector,
target, i) -> Fault``, given the :class:`~kvcanary.synth.faults.FaultInjector` and the index
``i`` of the entry it picked, plus the placement preferences of the kinds that have one. Each
kind's :class:`~kvcanary.synth.fault_kinds.FaultKind` names its function here; the injector's
toolkit (picking, taking slots, recording sites) does the rest.

The random draws of each function are part of the synth pins (tests/synth): keep their order.
"""

from __future__ import annotations

import numpy as np

from .fault_sites import REQUEST, real_kv_byte_note, real_kv_byte_visible

# ---------------------------------------------------------------------- record faults


def change_token(inj, target, i):
    return inj.record_fault("token", target, i, lambda slot: inj.bump(slot, 0, 1))


def change_position(inj, target, i):
    return inj.record_fault("position", target, i, lambda slot: inj.bump(slot, 1, 1))


def change_prev_hash(inj, target, i):
    bit = int(inj.s.rng.integers(64))
    flip = np.int64(-(1 << 63)) if bit == 63 else np.int64(1 << bit)
    return inj.record_fault("prev-hash", target, i,
                            lambda slot: inj.bump(slot, 2, flip, xor=True), detail=bit)


def change_real_kv_byte(inj, target, i):
    """The k-th real-KV fault of an injector flips one bit of a byte in 16-byte window k of
    the slot's bytes (modulo their size), in source k modulo the source count."""
    s, c = inj.s, inj.s.config
    k = inj.real_kv_faults
    inj.real_kv_faults += 1
    source = k % len(s.sources)
    offset = (k * 16 + int(s.rng.integers(16))) % c.bytes_per_token
    flip = np.uint8(1 << int(s.rng.integers(8)))
    view = s.pool.slot_bytes(s.sources[source])

    def change(slot):
        view[slot // c.page_size, slot % c.page_size, offset] ^= flip
    return inj.record_fault("real-kv-byte", target, i, change, detail=offset,
                            note=real_kv_byte_note(c.hash_mode, offset) + f" (source {source})",
                            real_kv_visible=real_kv_byte_visible(c.hash_mode, offset))


def lose_write(inj, target, i):
    slot = int(inj.entries().slot[i])
    note = ("slot never written (first occupant)" if inj.s.pool.write_count[slot] == 1 else
            "slot had an earlier occupant; left zeroed")
    return inj.record_fault("lost-write", target, i, inj.zero, note=note)


def first_occupants(inj) -> np.ndarray:
    """Entries whose slot only its first occupant wrote: a real never-written slot, which a
    lost write prefers."""
    return inj.s.pool.write_count[inj.entries().slot] == 1


# ---------------------------------------------------------------------- rewritten slots


def reuse_stale(inj, target, i):
    """The slot (paged: every written slot of the block) reallocated and rewritten as
    another sequence's, from a position past the unit's end."""
    s, e = inj.s, inj.entries()
    high = (int(e.position[i]) // inj.bs + 1) * inj.bs
    new_position = high + int(s.rng.integers(1, 64))
    sites = inj.rewrite("stale-reuse", inj.unit_taken(i), new_position)
    return inj.make_fault("stale-reuse", target, i, sites, detail=new_position,
                          note=f"rewritten as position {new_position} of another sequence")


def evict_block(inj, target, i):
    """A cached block that live requests map evicted (as if its reference count had
    dropped to 0) with the cached blocks below it, reallocated and rewritten: every live
    entry that maps it reads another sequence's records; its sweep entries are gone."""
    s = inj.s
    block = inj.mapped_block(i)
    gone = inj.subtree_slots(block)
    s.cache.drop_subtree(block)
    new_position = (block.depth + 1) * inj.bs + int(s.rng.integers(1, 64))
    sites = inj.rewrite("evicted-block", inj.unit_taken(i), new_position)
    inj.take(*gone[gone > 0].tolist())
    return inj.make_fault("evicted-block", target, i,
                          tuple(site for site in sites if site.entry == REQUEST),
                          detail=new_position,
                          note=f"cached block at positions {block.depth * inj.bs}.."
                               f"{(block.depth + 1) * inj.bs - 1} evicted while live "
                               f"requests map it; rewritten from position {new_position}")


def evictable(inj) -> np.ndarray:
    """Entries of cached blocks live requests map whose subtree holds no taken slot (an
    earlier fault's sweep sites would vanish with it)."""
    s, e = inj.s, inj.entries()
    ok = np.zeros(e.slot.shape, dtype=bool)
    seen = {}
    for i in np.flatnonzero(e.masks["mapped-cached"]).tolist():
        block = inj.mapped_block(i)
        if id(block) not in seen:
            gone = inj.subtree_slots(block) if s.cache.blocks.get(block.key) is block else None
            seen[id(block)] = gone is not None and not inj.blocked[gone[gone > 0]].any()
        ok[i] = seen[id(block)]
    return ok


# ---------------------------------------------------------------------- table faults


def alias_entry(inj, target, i):
    e = inj.entries()
    other = inj.pick("interior", (e.batch != e.batch[i]) & (e.slot != e.slot[i])
                     & (e.position // inj.bs != e.position[i] // inj.bs)
                     & inj.aligned_units(i))
    sites = inj.remap("alias", [(i, other)])
    into = int(e.slot[other])
    return inj.make_fault("alias", target, i, sites, detail=into,
                          note=f"now maps slot {into} (request row {int(e.row[other])}, "
                               f"position {int(e.position[other])})")


def swap_entries(inj, target, i):
    e = inj.entries()
    same = ((e.entry == e.entry[i]) & (e.slot != e.slot[i]) & inj.aligned_units(i)
            & (np.abs(e.position // inj.bs - e.position[i] // inj.bs) > 1))
    if e.entry[i] == 0:
        j = inj.pick("interior", same & (e.batch == e.batch[i]))
    else:
        j = inj.pick("cached", same)
    return inj.make_fault("swap", target, i, inj.remap("swap", [(i, j), (j, i)]),
                          detail=int(e.position[j]),
                          note=f"exchanged with position {int(e.position[j])}")


def zero_entry(inj, target, i):
    inj.set_table(i, 0)
    inj.take(*inj.unit_taken(i))
    return inj.make_fault("slot-zero", target, i,
                          inj.unit_sites("slot-zero", i, 0, keep_zero=True),
                          note="seen only by kvcanary's SLOT_ZERO_IN_PREFIX extension")
