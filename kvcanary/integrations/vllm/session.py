"""kvcanary's state beside one vLLM scheduler, step by step (scheduler mode).

The block tables are rebuilt from each ``SchedulerOutput`` alone, as the model runner
builds its own: a new request's ``block_ids``, a running request's ``new_block_ids``
appended, a resumed request's table replaced, finished and preempted requests dropped. One
canary buffer covers vLLM's block pool (``num_blocks * block_size`` slots; block 0 is
vLLM's null block, kvcanary's padding): cache groups overlay one pool, a block belonging to
one group at a time, so one buffer also sees a block two groups hold at once. Per step and
per KV cache group, every scheduled request is a batch row of one plan; the step's tokens
are written first, then each row's prefix verified (vLLM's layers write their KV before
attention reads it, and a request may hit a block another request fills in the same step,
so the write chains seeds across requests). A sliding-window group verifies only what its
attention reads (blocks wholly below the window are nulled, as the model runner does).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np

import kvcanary as api  # the public API: plan, write, verify
from ... import (CANARY_SLOT_BYTES, CanaryContext, LaunchTag, RealKvHashMode, VerifyPlan, Violation,
                 ViolationLog, WritePlan, attribute, diagnose)
from ...format.bits import SLOT_ZERO_IN_PREFIX as _SLOT_ZERO
from ..findings import (WRITE_INDEX_MISMATCH, EngineEvidence, Sighting, explain, row_reasons,
                        take_ring_rows)
from .causes import vllm_cause

if TYPE_CHECKING:
    from . import Guard



class _Row(NamedTuple):
    """One (group, request) row of a step."""

    group: int
    request_id: str
    computed: int          # tokens already in the cache (the verified prefix)
    scheduled: int         # tokens this step writes
    window_start: int      # first position the group's attention reads
    blocks: np.ndarray     # the group's block table of the request
    tokens: np.ndarray     # the request's token ids (prompt + output)


class Session:
    """Canary buffer over the block pool, tables per request and group, who wrote each
    slot and how each request got each block."""

    def __init__(self, g: "Guard", scheduler):
        self.guard, self.scheduler = g, scheduler
        config = scheduler.kv_cache_config
        self.groups = []
        for spec in (group.kv_cache_spec for group in config.kv_cache_groups):
            window = int(getattr(spec, "sliding_window", 0) or 0)
            if type(spec).__name__ not in ("FullAttentionSpec", "SlidingWindowSpec"):
                window = -1
            self.groups.append((int(spec.block_size), window, type(spec).__name__))
        self.block_size = self.groups[0][0]
        self.num_blocks = int(config.num_blocks)
        self.num_slots = self.num_blocks * self.block_size
        self.context = self.new_context()
        self.writer_request = np.full(self.num_slots, -1, dtype=np.int64)
        self.writer_position = np.full(self.num_slots, -1, dtype=np.int64)
        self.writer_step = np.full(self.num_slots, -1, dtype=np.int64)
        self.writer_followed = np.ones(self.num_slots, dtype=bool)
        self.names, self.uid_of = [], {}
        self.tables = {}      # request id -> [list of block ids] per group
        self.origin = {}      # request id -> {(group, block index): (how, step)}
        self.own = {}         # request id -> {(group, position): (slot it wrote, followed)}
        self.step = 0
        self.last = None
        self.source_names = "no source"

    # -- the step's tables, from the scheduler's output alone


    def new_context(self, real_kv=(), hash_mode=RealKvHashMode.NONE) -> CanaryContext:
        """One canary over the scheduler's pool, its records chained across the requests of
        a launch (vLLM's requests of one step may extend each other's prefixes)."""
        return CanaryContext(
            np.zeros((self.num_slots, CANARY_SLOT_BYTES), dtype=np.uint8),
            kernel_kind=LaunchTag.TAIL_K_FULL,
            violation_log=ViolationLog.allocate(self.guard.ring_capacity),
            slot_run_counter=np.zeros(1, dtype=np.int64),
            kernel_run_counter=np.zeros(1, dtype=np.int64),
            real_kv_sources=tuple(real_kv),
            real_kv_hash_mode=hash_mode if real_kv else RealKvHashMode.NONE,
            max_real_kv_sources=max(1, len(real_kv)),
            chain_across_requests=True)
    def _update_tables(self, out) -> dict:
        computed = {}
        for rid in set(out.finished_req_ids) | set(out.preempted_req_ids or ()):
            self.tables.pop(rid, None)
            self.own.pop(rid, None)       # a preempted request recomputes what it held
            self.origin.pop(rid, None)
        for new in out.scheduled_new_reqs:
            self.tables[new.req_id] = [list(ids) for ids in new.block_ids]
            computed[new.req_id] = int(new.num_computed_tokens)
            self._mark(new.req_id, int(new.num_computed_tokens), "hit")
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            blocks = cached.new_block_ids[i]
            computed[rid] = int(cached.num_computed_tokens[i])
            if rid in cached.resumed_req_ids:
                self.tables[rid] = [list(ids) for ids in blocks]
                self._mark(rid, computed[rid], "resumed")
            elif blocks is not None:
                for table, ids in zip(self.tables.setdefault(rid, [[] for _ in blocks]), blocks):
                    table.extend(ids)
        return computed

    def _mark(self, rid, computed, how) -> None:
        self.origin[rid] = {(group, index): (how, self.step)
                            for group, (block_size, _, _) in enumerate(self.groups)
                            for index in range(computed // block_size)}

    # -- one step

    def on_schedule(self, out) -> None:
        rows = self.step_rows(out)
        if rows:
            self._launch(rows)
        self.last = rows or self.last

    def step_rows(self, out) -> list:
        """The step's (group, request) rows, the tables updated from ``out``."""
        g = self.guard
        self.step += 1
        g.stats["steps"] += 1
        computed = self._update_tables(out)
        rows = []
        for rid, count in out.num_scheduled_tokens.items():
            count -= len(out.scheduled_spec_decode_tokens.get(rid, ()))
            request = self.scheduler.requests.get(rid)
            if request is None or rid not in self.tables or count <= 0:
                continue
            tokens = np.asarray(request.all_token_ids, dtype=np.int64)
            for group, (block_size, window, _) in enumerate(self.groups):
                if window < 0 or group >= len(self.tables[rid]):
                    continue
                c = computed[rid]
                start = max(0, c - (window - 1)) if window else 0
                rows.append(_Row(group, rid, c, count, start,
                                 np.asarray(self.tables[rid][group], dtype=np.int64), tokens))
        return rows

    def _slots(self, blocks: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Slots of ``positions`` in a block table: the null block gives padding slot 0, a
        position past the table a slot past the buffer."""
        index = positions // self.block_size
        slots = np.full(positions.shape, self.num_slots, dtype=np.int64)
        inside = index < blocks.size
        block = blocks[index[inside]]
        slots[inside] = np.where(block == 0, 0, block * self.block_size
                                 + positions[inside] % self.block_size)
        return slots

    def _launch(self, rows, written=None) -> None:
        """Write the step's tokens, then verify what it reads. ``written``: the slots the
        engine wrote, token by token in row order (model-runner mode: its slot_mapping);
        by default the block tables' slots."""
        g, n = self.guard, len(rows)
        width = max(1, max(max(r.blocks.size, (r.computed + r.scheduled) // self.block_size + 1)
                           for r in rows))
        table = np.zeros((n + 1, width), dtype=np.int64)
        pool_width = max(1, max(r.tokens.size for r in rows))
        pool = np.full((n + 1, pool_width), -1, dtype=np.int64)
        valid = np.zeros(n, dtype=np.int64)
        for i, r in enumerate(rows):
            blocks = r.blocks.copy()
            blocks[:r.window_start // self.block_size] = 0    # below the window: not read
            # a table too short for the step names a block past the pool: out of range
            table[i + 1, :] = self.num_blocks
            table[i + 1, :blocks.size] = blocks
            pool[i + 1, :r.tokens.size] = r.tokens
            valid[i] = r.tokens.size
        prefix = np.array([r.computed for r in rows], dtype=np.int64)
        extend = np.array([r.scheduled for r in rows], dtype=np.int64)
        verify_plan = VerifyPlan.allocate(max(1, int(prefix.sum())))
        write_plan = WritePlan.allocate(n)
        api.plan(req_pool_indices=np.arange(1, n + 1, dtype=np.int64), prefix_lens=prefix,
                 extend_seq_lens=extend, block_table=table, block_size=self.block_size,
                 verify_plan=verify_plan, write_plan=write_plan,
                 **(dict(req_to_verify_expected_tokens=pool,
                         req_to_verify_expected_tokens_valid_lens=valid)
                    if g.check_tokens else {}))
        positions = np.concatenate([np.arange(r.computed, r.computed + r.scheduled)
                                    for r in rows]).astype(np.int64)
        owners = np.repeat(np.arange(n), extend)
        table_slots = np.concatenate([self._slots(r.blocks, np.arange(
            r.computed, r.computed + r.scheduled, dtype=np.int64)) for r in rows])
        written = table_slots if written is None else np.asarray(written, dtype=np.int64)
        followed = written == table_slots
        input_ids = np.concatenate([_padded(r.tokens, r.computed, r.scheduled) for r in rows])
        # Write first, as vLLM's layers do, then verify what the step reads.
        api.write(self.context, write_plan, input_ids=input_ids, positions=positions,
                  out_cache_loc=written)
        g.stats["tokens_written"] += int(extend.sum())
        events, before = {}, {}
        for e in np.flatnonzero(~followed).tolist():
            g.stats["write_index_mismatches"] = g.stats.get("write_index_mismatches", 0) + 1
            key = (int(owners[e]), int(positions[e]), int(written[e]))
            events[key] = [0, None, {WRITE_INDEX_MISMATCH}]
            before[key] = self.writer(int(written[e]))    # whose record it overwrote
        for row in self._take_rows():
            hits = np.flatnonzero((written == row[1]) & (positions == row[2]))
            if hits.size:
                e = int(hits[0])
                event = events.setdefault((int(owners[e]), int(positions[e]), int(row[1])),
                                          [0, None, set()])
                event[0] |= int(row[7])
                if event[1] is None:
                    v = Violation.from_row(row)
                    event[1] = (v, diagnose(v))
        self._store_writers(rows, owners, positions, written, followed)
        if int(prefix.sum()):
            api.verify(self.context, verify_plan, check_expected_token=g.check_tokens)
            g.stats["entries_verified"] += int(prefix.sum())
            found = []
            if self.context.violation_log.total:
                found = attribute(self.context, verify_plan,
                                  req_pool_indices=np.arange(1, n + 1, dtype=np.int64),
                                  prefix_lens=prefix, launch=self.step)
            self._take_rows()
            for f in found:
                if f.entry is not None:
                    key = (f.entry.batch_index, f.entry.position, f.violation.slot_idx)
                    event = events.setdefault(key, [0, None, set()])
                    event[0] |= int(f.violation.fail_reason_bits)
                    event[1] = event[1] or (f.violation, f.diagnosis)
        self._null_reads(rows, events)
        self._record(events, rows, before)

    def _null_reads(self, rows, events) -> None:
        """A prefix position the attention reads from vLLM's null block: verify skips
        padding slot 0, so this is the guard's own row (the audit's slot-zero row)."""
        for i, r in enumerate(rows):
            index = np.arange(r.window_start // self.block_size,
                              min(r.blocks.size, -(-r.computed // self.block_size)))
            for b in index[r.blocks[index] == 0].tolist():
                position = max(b * self.block_size, r.window_start)
                token = int(r.tokens[position]) if position < r.tokens.size else -1
                v = Violation.from_row(np.array([int(LaunchTag.TAIL_K_FULL), 0, position, 0,
                                                 token, 0, 0, _SLOT_ZERO], dtype=np.int64))
                events.setdefault((i, position, 0), [_SLOT_ZERO, (v, diagnose(v)), set()])

    def _take_rows(self) -> np.ndarray:
        return take_ring_rows(self.context.violation_log, self.guard, self.step)

    def _store_writers(self, rows, owners, positions, written, followed) -> None:
        inside = (written > 0) & (written < self.num_slots)
        uids = np.array([self._uid(r.request_id) for r in rows], dtype=np.int64)
        self.writer_request[written[inside]] = uids[owners[inside]]
        self.writer_position[written[inside]] = positions[inside]
        self.writer_step[written[inside]] = self.step
        self.writer_followed[written[inside]] = followed[inside]
        for e in np.flatnonzero(inside).tolist():
            r = rows[owners[e]]
            self.own.setdefault(r.request_id, {})[(r.group, int(positions[e]))] = \
                (int(written[e]), bool(followed[e]))

    def _uid(self, rid: str) -> int:
        if rid not in self.uid_of:
            self.uid_of[rid] = len(self.names)
            self.names.append(rid)
        return self.uid_of[rid]

    def writer(self, slot: int):
        """``(request id, position, step, followed)`` of the last write into ``slot``
        (``followed``: it went where the block table said)."""
        if 0 < slot < self.num_slots and self.writer_request[slot] >= 0:
            return (self.names[self.writer_request[slot]], int(self.writer_position[slot]),
                    int(self.writer_step[slot]), bool(self.writer_followed[slot]))
        return None

    def _record(self, events, rows, before=None) -> None:
        """``before``: the writer each misdirected write's slot had before it."""
        g = self.guard
        sightings, where, before = [], {}, before or {}
        for (i, position, slot), (bits, first, checks) in events.items():
            v, d = first if first is not None else (None, None)
            s = Sighting(rows[i].request_id, position, slot, slot // self.block_size,
                         row_reasons(bits, sorted(checks)), v, self.step, d)
            sightings.append(s)
            where[s.key()] = (i, (i, position, slot))
        for found in g.merger.add(sightings):
            i, key = where[found.finding.key()]
            r = rows[i]
            position, slot = found.position, found.slot
            table = self._slots(r.blocks, np.arange(r.computed + r.scheduled, dtype=np.int64))
            own_slot, own_followed = self.own.get(r.request_id, {}).get(
                (r.group, position), (None, True))
            ev = EngineEvidence(
                request_id=r.request_id, position=position, slot=slot,
                table_slot=int(table[position]) if position < table.size else -1,
                writer=before[key] if key in before else self.writer(slot),
                own_slot=own_slot, own_followed=own_followed,
                near_slots=tuple(int(table[p]) if 0 <= p < table.size else None
                                 for p in (position - 1, position + 1)),
                sources=self.source_names)
            found.state(vllm_cause(self, found.finding, ev, r) or explain(found.finding, ev))
            found.group = r.group
            g.report(found)

    # -- dump

    def dump_arrays(self) -> dict:
        rows = [r for r in self.last if r.group == 0]
        n = len(rows)
        width = max(1, max(r.blocks.size for r in rows))
        block_table = np.zeros((n + 1, width), dtype=np.int64)
        expected = np.full((n + 1, max(1, max(r.tokens.size for r in rows))), -1, np.int32)
        for i, r in enumerate(rows):
            block_table[i + 1, :r.blocks.size] = r.blocks
            expected[i + 1, :r.tokens.size] = r.tokens
        arrays = dict(kvcanary_dump_version=1, canary=self.context.canary_buf.copy(),
                      block_table=block_table, block_size=self.block_size,
                      req_pool_indices=np.arange(1, n + 1, dtype=np.int64),
                      seq_lens=np.array([r.computed + r.scheduled for r in rows], np.int64),
                      launch_tag=LaunchTag.TAIL_K_FULL.name)
        if self.guard.check_tokens:
            arrays["expected_tokens"] = expected
            arrays["expected_tokens_valid_lens"] = np.array([r.tokens.size for r in rows],
                                                            np.int64)
        return arrays


def _padded(tokens: np.ndarray, start: int, count: int) -> np.ndarray:
    out = np.full(count, -1, dtype=np.int64)
    part = tokens[start:start + count]
    out[:part.size] = part
    return out
