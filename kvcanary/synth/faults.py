"""Fault injection into a finished run's state, with ground truth.

Each fault targets a request-owned live entry (not shared with another request or the prefix
cache) and its own slot, never next to another target of the same request, so faults of one
run never interact: a fault that changes a record breaks its successor's chain link, and that
successor is never another fault's target.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import api
from ..consts import REAL_KV_PARTIAL_READ_BYTES, FailReason, RealKvHashMode
from ..types import WritePlan
from .config import SynthError

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
# Bits that must be present at the fault's target entry for it to count as detected.
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
}


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


def inapplicable_kinds(config) -> dict:
    """Fault kinds that cannot be injected into a workload of ``config``, with the reason."""
    if config.sources == 0:
        return {"real-kv-byte": "no real-KV sources (--sources 0)"}
    return {}


def parse_inject(specs, config=None) -> list:
    """``["token", "alias:3"]`` -> ``[("token", 1), ("alias", 3)]``; ``all`` means every
    kind that applies to ``config`` (see :func:`inapplicable_kinds`)."""
    skipped = inapplicable_kinds(config) if config is not None else {}
    result = []
    for spec in specs:
        kind, _, count = spec.partition(":")
        kind = kind.strip()
        try:
            number = int(count) if count else 1
        except ValueError:
            raise SynthError(f"--inject {spec}: COUNT must be an integer") from None
        kinds = [k for k in FAULT_KINDS if k not in skipped] if kind == "all" else (kind,)
        for name in kinds:
            if name not in FAULT_KINDS:
                raise SynthError(f"--inject: unknown fault kind {name!r} (one of "
                                 f"{', '.join(FAULT_KINDS)}, or all)")
            if number < 1:
                raise SynthError(f"--inject {spec}: COUNT must be at least 1")
            result.append((name, number))
    return result


class FaultInjector:
    """Changes a :class:`~kvcanary.synth.Synthesis`'s final state, one fault at a time."""

    def __init__(self, synthesis):
        self.s = synthesis
        self.used_entries: set = set()     # (request row, position) of every target
        self.used_slots: set = set()

    def inject(self, kind: str, count: int) -> list:
        s = self.s
        if kind not in FAULT_KINDS:
            raise SynthError(f"--inject: unknown fault kind {kind!r} (one of "
                             f"{', '.join(FAULT_KINDS)})")
        if count < 1:
            raise SynthError(f"--inject {kind}: COUNT must be at least 1, got {count}")
        if kind == "real-kv-byte" and not s.sources:
            raise SynthError("--inject real-kv-byte needs at least one real-KV source "
                             "(--sources >= 1)")
        made = []
        for _ in range(count):
            fault = getattr(self, "_inject_" + kind.replace("-", "_"))(len(made))
            s.faults.append(fault)
            made.append(fault)
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

    def _canary_slot(self, row: int, position: int) -> int:
        s = self.s
        return int(s.allocator.canary_slots(np.array([s.table[row, position]], np.int64))[0])

    def _pick(self, extra_filter=None):
        s, used = self.s, self.used_entries
        batch, positions = self._candidates()
        order = s.rng.permutation(batch.shape[0])
        for i in order.tolist():
            b, p = int(batch[i]), int(positions[i])
            request = s.running[b]
            if any((request.row, q) in used for q in (p - 1, p, p + 1)):
                continue
            slot = self._canary_slot(request.row, p)
            if slot in self.used_slots or slot == 0:
                continue
            if extra_filter and not extra_filter(b, p, slot):
                continue
            used.add((request.row, p))
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

    def _inject_token(self, k):
        b, p, slot = self._pick()
        self._fields()[slot, 0] += 1
        return self._fault("token", b, p, slot)

    def _inject_position(self, k):
        b, p, slot = self._pick()
        self._fields()[slot, 1] += 1
        return self._fault("position", b, p, slot)

    def _inject_prev_hash(self, k):
        b, p, slot = self._pick()
        bit = int(self.s.rng.integers(64))
        self._fields()[slot, 2] ^= np.int64(-(1 << 63)) if bit == 63 else np.int64(1 << bit)
        return self._fault("prev-hash", b, p, slot, detail=bit)

    def _inject_real_kv_byte(self, k):
        s = self.s
        c, rng = s.config, s.rng
        b, p, slot = self._pick()
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

    def _inject_lost_write(self, k):
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

    def _inject_alias(self, k):
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

    def _inject_swap(self, k):
        s = self.s
        b, p, slot = self._pick()
        b2, p2, slot2 = self._pick(lambda bb, pp, ss: bb == b and abs(pp - p) > 1)
        row = s.running[b].row
        s.table[row, p], s.table[row, p2] = s.table[row, p2], s.table[row, p]
        return self._fault("swap", b, p, slot, detail=p2, note=f"exchanged with position {p2}")

    def _inject_slot_zero(self, k):
        b, p, slot = self._pick()
        self.s.table[self.s.running[b].row, p] = 0
        return self._fault("slot-zero", b, p, slot,
                           note="seen only by kvcanary's SLOT_ZERO_IN_PREFIX extension")

    # ------------------------------------------------------------------ allocator faults

    def _inject_stale_reuse(self, k):
        s = self.s
        b, p, slot = self._pick()
        new_position = p + 1 + int(s.rng.integers(1, 64))
        token = s.workload.tokens(1).astype(np.int64)
        positions = np.array([new_position], dtype=np.int64)
        slots = np.array([slot], dtype=np.int64)
        s.pool.write_kv(slots, token, positions)
        plan = WritePlan(write_offsets=np.array([0, 1], dtype=np.int64),
                         write_seed_slot_indices=np.array([-1], dtype=np.int64),
                         write_num_valid_reqs=np.array([1], dtype=np.int32))
        api.write(s.pool.context, plan, input_ids=token, positions=positions,
                  out_cache_loc=slots, backend=s.config.backend)
        s.pool.write_count[slot] += 1
        return self._fault("stale-reuse", b, p, slot, detail=new_position,
                           note=f"rewritten as position {new_position} of another sequence")
