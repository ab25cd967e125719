"""kvcanary's state beside one cache group of a transformers ``PagedAttentionCache``, step
by step.

A :class:`Session` (one per cache group, see :mod:`.groups`) holds the canary buffer (one
32-byte record per slot, slot ``block * page_size + offset``), the launch context whose
real-KV sources are zero-copy views of the engine's cache tensor, who wrote each slot
(request, position, step, whether the block table named it) and each request's own
bookkeeping. Per forward step: ``before_step`` plans and verifies what the step reads,
``after_step`` writes what it wrote; ring rows become
:class:`~kvcanary.integrations.findings.Sighting` objects (verify rows attributed and
diagnosed by :func:`kvcanary.attribute`) that the guard merges into findings. Forks copy
records, offloading carries them, and the last step is kept for the dump.
"""

from __future__ import annotations

import contextlib
from itertools import repeat
from operator import attrgetter, is_
from typing import TYPE_CHECKING

import numpy as np

import kvcanary as api  # the public API: plan, write, verify
from ... import (CANARY_SLOT_BYTES, MAX_REAL_KV_SOURCES, CanaryContext, LaunchFinding, LaunchTag,
                 RealKvHashMode, RealKvSource, VerifyPlan, Violation, ViolationLog, WritePlan,
                 attribute, diagnose)
from ...findings.diagnosis import failed_checks
from ...findings.evidence import Entry
from ...format.rules import window_start
from ..findings import (
    READ_INDEX_MISMATCH,
    WRITE_INDEX_MISMATCH,
    EngineEvidence,
    Sighting,
    explain,
    row_reasons,
    take_ring_rows,
)
from ...format.errors import GuardError
from . import dumps
from .engineindex import HostViews, SlotTable, batching_ios
from .history import AllocatorHistory
from .ownwrites import OwnWrites
from .stepbatch import BlockTables, RequestRecord, StepBatch

if TYPE_CHECKING:    # the guard module imports this one
    from . import Guard


_UID = attrgetter("uid")
_SERIAL = attrgetter("serial")
_LENGTH = attrgetter("length")
_RESTORED = attrgetter("restored")
_STATE = attrgetter("state")              # a request record's, or an engine future's
_REQUEST_ID = attrgetter("request_id")
_QUERY_LENGTH = attrgetter("query_length")
_POSITION_OFFSET = attrgetter("position_offset")


class Session:
    """kvcanary's state beside one cache group (one allocator) of a PagedAttentionCache:
    canary buffer, launch context, who wrote each slot, and each request's own bookkeeping.
    This class is a full-attention group; :mod:`.groups` adds the sliding-window group and
    the per-cache object that runs one session per group."""

    launch_tag = LaunchTag.TAIL_K_FULL
    swa_window_size = 0     # positions verified per request: all (a window: the last ones)
    lut = None              # the full-to-SWA slot table a window's plan needs
    explanation_prefix = ""  # names the group in a model with several

    def __init__(self, g: "Guard", cache, group_name: str, allocator):
        self.guard, self.cache = g, cache
        self.group_name = group_name
        self.allocator = allocator
        self.group_index = int(allocator.index)   # the group's row in the engine's indices
        self.page = int(allocator.tokens_per_page)
        self.stride = int(allocator.block_physical_stride)
        copy_view = allocator._copy_view
        self.num_blocks = int(copy_view.shape[0])
        self.num_slots = self.num_blocks * self.page
        self.trash_blocks = 2 * int(allocator.blocks_per_sector)   # sectors 0 and 1
        self.device = copy_view.device
        self.xp = np
        if self.device.type == "cuda":
            import cupy

            self.xp = cupy
        xp = self.xp
        self.real_kv = self._sources(copy_view)
        self.context = CanaryContext(
            xp.zeros((self.num_slots, CANARY_SLOT_BYTES), dtype=xp.uint8),
            kernel_kind=self.launch_tag,
            violation_log=ViolationLog.allocate(g.ring_capacity, xp=xp),
            slot_run_counter=xp.zeros(1, dtype=xp.int64),
            kernel_run_counter=xp.zeros(1, dtype=xp.int64),
            real_kv_sources=tuple(source for _, source in self.real_kv),
            real_kv_hash_mode=g.hash_mode if self.real_kv else RealKvHashMode.NONE,
            max_real_kv_sources=max(MAX_REAL_KV_SOURCES, len(self.real_kv)))
        self.writer_request = np.full(self.num_slots, -1, dtype=np.int64)
        self.writer_position = np.full(self.num_slots, -1, dtype=np.int64)
        self.writer_step = np.full(self.num_slots, -1, dtype=np.int64)
        self.writer_followed = np.zeros(self.num_slots, dtype=bool)
        self.request_names: list = []
        self.uid_of: dict = {}
        self.requests: dict = {}
        self.serials = 0          # request records made so far (the next one's serial)
        self.own = OwnWrites()    # where each request wrote each of its positions
        self.saved: dict = {}     # offloaded request id -> (records, writer columns) per block
        self.step = None
        self._last = self._last_list = None    # the last checked step (see last)
        self.processor = None     # the batch processor of the last guarded step
        self.host_views = HostViews(on_host=self.xp is np)
        self.slot_table = SlotTable(self.stride, self.page, self.num_blocks)
        self.history = AllocatorHistory(allocator)
        self.batch = self.verify_plan = self.write_plan = None

    def _sources(self, copy_view) -> list:
        """``[(name, RealKvSource)]``: each a zero-copy view of one layer's K or V rows (the
        sources of this group's layers)."""
        a = self.allocator
        token_bytes = int(a.num_key_value_heads) * int(a.head_dim) * a.cache_dtype.itemsize
        if self.guard.sources and token_bytes % 16:
            raise GuardError(f"one token's K row is {token_bytes} bytes; real-KV "
                             "sources need a multiple of 16 (use sources=() to guard without)")
        page_bytes = self.page * token_bytes
        out = []
        for kind, layer in self.guard.sources:
            if layer not in a.layer_indices:
                continue
            local = a.layer_indices.index(layer)
            start = (2 * local + (kind == "v")) * page_bytes
            view = copy_view[:, start:start + page_bytes]
            out.append((f"{kind}{layer}", RealKvSource(
                view, page_size=self.page, num_bytes_per_token=token_bytes,
                read_bytes=token_bytes)))
        return out

    def on_engine_stream(self, processor=None):
        """On a CUDA device, kvcanary's launches queue on the stream the engine computes on
        (``processor``'s, by default the last guarded step's), so a verify or write never races
        the engine's KV writes, and the records a fork copies or offloading saves are those the
        step's write launch left (a copy on another stream could read them before it ran)."""
        if self.xp is np:
            return contextlib.nullcontext()
        import torch

        processor = processor or self.processor
        stream = (None if processor is None else processor.inputs_and_outputs.compute_stream) \
            or torch.cuda.current_stream()
        return self.xp.cuda.ExternalStream(stream.cuda_stream)

    # -- index conversions

    def host_view(self, tensor) -> np.ndarray:
        """One of the engine's index or input tensors as a numpy array (:class:`HostViews`)."""
        return self.host_views.of(tensor)

    def to_slots(self, physical: np.ndarray) -> np.ndarray:
        """Canary slots of the engine's physical row indices (``num_slots``, outside the
        buffer, where an index names no K row of a block)."""
        return self.slot_table.to_slots(physical)

    def step_tables(self, blocks: BlockTables, past: np.ndarray, query: np.ndarray,
                    width: int) -> np.ndarray:
        """The slots this step expects, ``int64[requests, width]``: per request (its block
        table's ``blocks``, ``past`` tokens cached and ``query`` written now) and position,
        the block table's slot (``num_slots`` past its blocks)."""
        positions = np.arange(width, dtype=np.int64)
        return blocks.grid(positions // self.page, positions % self.page, self.page,
                           self.num_slots)

    def read_span(self, engine_past: np.ndarray, query: np.ndarray) -> tuple:
        """``(count, first)`` per request: how many read indices the engine lists for it,
        and the position the first one reads (all cached positions, then the new tokens)."""
        return engine_past + query, np.zeros_like(engine_past)

    # -- one forward step

    def before_step(self, processor) -> None:
        ContinuousBatchingIOs = batching_ios()
        g = self.guard
        self.processor = processor
        io = processor.inputs_and_outputs
        if type(io) is not ContinuousBatchingIOs:
            raise GuardError("asynchronous batching is not supported; run with "
                             "ContinuousBatchingConfig(use_async_batching=False)")
        self.step = g.stats["steps"]     # counted once per step for every group
        active = processor.scheduler.active_requests
        self.history.observe(self.step, lambda rid: None if rid not in active else
                             active[rid].initial_tokens + active[rid].generated_tokens)
        read_all, row = None, self.group_index
        if not io.use_block_table and io.max_kv_read > 0 and io.true_read_sizes[row] > 0:
            read_all = self.to_slots(
                self.host_view(io.read_index_storage)[row, :io.true_read_sizes[row]])
        self.batch = batch = self._gather(io.requests_in_batch)
        if read_all is not None and g.plan_from == "read_indices":
            batch.read_from(read_all, *self.read_span(batch.engine_past, batch.query),
                            self.swa_window_size)
        self._plan_and_verify(batch)

    def _gather(self, futures) -> StepBatch:
        """The step's requests as one :class:`StepBatch`. The engine's request objects are
        read in C-level passes (``map``); only a request the session has no current record
        of (new, started over or restored) takes a Python step of its own."""
        n = len(futures)
        states = list(map(_STATE, futures))
        request_ids = list(map(_REQUEST_ID, states))
        query = np.fromiter(map(_QUERY_LENGTH, futures), dtype=np.int64, count=n)
        engine_past = np.fromiter(map(_POSITION_OFFSET, states), dtype=np.int64,
                                  count=n) - query
        requests = self.requests
        recs = list(map(requests.get, request_ids))
        if None in recs or not all(map(is_, map(_STATE, recs), states)) \
                or any(map(_RESTORED, recs)):
            for i, ep in enumerate(engine_past.tolist()):
                rec, state = recs[i], states[i]
                if rec is None or rec.state is not state or rec.restored:
                    if rec is None or rec.state is not state:
                        rec = recs[i] = requests[state.request_id] = RequestRecord(
                            state.request_id, state, ep, self.serials,
                            self._uid(state.request_id))
                        self.serials += 1
                    rec.length, rec.restored = ep, False
        past = np.fromiter(map(_LENGTH, recs), dtype=np.int64, count=n)
        width = int((np.maximum(past, engine_past) + query).max()) + 1 if n else 1
        blocks = BlockTables(list(map(self.allocator.block_table.get, request_ids,
                                      repeat((), n))))
        table = self.step_tables(blocks, past, query, width)
        return StepBatch(recs, query, engine_past, past, table,
                         [rec.token_cache.tokens(rec.state) for rec in recs], blocks)

    def _plan_and_verify(self, batch: StepBatch) -> None:
        g, xp, n = self.guard, self.xp, len(batch)
        prefix, extend = batch.past, batch.query
        width = max(1, int((prefix + extend).max())) if n else 1
        columns = np.arange(width)[None, :]
        table = np.zeros((n + 1, width), dtype=np.int64)
        table[1:] = np.where(columns < prefix[:, None], batch.read[:, :width],
                             np.where(columns < (prefix + extend)[:, None],
                                      batch.table[:, :width], 0))
        entries = int((prefix - window_start(prefix, self.swa_window_size)).sum())
        self._plans(max(1, entries), max(1, n))
        kwargs = {}
        if g.check_tokens:
            pool, valid = batch.token_pool(width)
            kwargs = dict(req_to_verify_expected_tokens=xp.asarray(pool),
                          req_to_verify_expected_tokens_valid_lens=xp.asarray(valid))
        api.plan(req_pool_indices=xp.arange(1, n + 1, dtype=xp.int64),
                 prefix_lens=xp.asarray(prefix), extend_seq_lens=xp.asarray(extend),
                 req_to_token=xp.asarray(table), verify_plan=self.verify_plan,
                 write_plan=self.write_plan, swa_window_size=self.swa_window_size,
                 full_to_swa_index_mapping=self.lut, check_capacity=False, **kwargs)
        events, self.misread = {}, set()
        if batch.read is not batch.table:
            cached = np.minimum(prefix, batch.engine_past)
            rows, positions = np.nonzero(
                (batch.read != batch.table)
                & (np.arange(batch.table.shape[1])[None, :] < cached[:, None]))
            g.stats["read_index_mismatches"] += int(rows.size)
            for i, pos, slot in zip(rows.tolist(), positions.tolist(),
                                    batch.read[rows, positions].tolist()):
                events[(i, pos, slot)] = [0, None, {READ_INDEX_MISMATCH}]
                self.misread.add((i, pos))
        if entries:
            api.verify(self.context, self.verify_plan, check_expected_token=g.check_tokens)
            g.stats["entries_verified"] += entries
            found = []
            if self.context.violation_log.total:
                found = attribute(self.context, self.verify_plan,
                                  req_pool_indices=np.arange(1, n + 1, dtype=np.int64),
                                  prefix_lens=prefix, swa_window_size=self.swa_window_size,
                                  launch=self.step)
            self._take_rows()
            for f in found:
                if f.entry is None:
                    continue
                key = (f.entry.batch_index, f.entry.position, f.violation.slot_idx)
                event = events.setdefault(key, [0, None, set()])
                event[0] |= int(f.violation.fail_reason_bits)
                event[1] = f if event[1] is None else event[1]
        if events:
            self._record(events, batch)
        if g.error is not None:     # on_violation="raise": stop before the forward
            raise g.error

    def _plans(self, entries: int, requests: int) -> None:
        """This step's verify and write plans: last step's when they are large enough (a
        launch reads only the entries its plan fills), else new ones, twice as large."""
        vp, wp = self.verify_plan, self.write_plan
        if vp is None or vp.verify_capacity < entries:
            self.verify_plan = VerifyPlan.allocate(
                max(entries, 2 * (0 if vp is None else vp.verify_capacity)), xp=self.xp)
        if wp is None or wp.write_req_capacity < requests:
            self.write_plan = WritePlan.allocate(
                max(requests, 2 * (0 if wp is None else wp.write_req_capacity)), xp=self.xp)

    def _take_rows(self) -> np.ndarray:
        return take_ring_rows(self.context.violation_log, self.guard, self.step)

    def after_step(self, processor) -> None:
        g, xp, io, batch = self.guard, self.xp, processor.inputs_and_outputs, self.batch
        owners = batch.owners
        total = int(owners.size)
        expected_positions = batch.past[owners] + batch.entry
        planned = batch.slots_from(batch.past)     # the table's slot of each new token
        written = self.written_slots(io, batch, planned)
        input_ids = self.host_view(io.input_ids)[:total].astype(np.int64)
        positions = self.host_view(io.position_ids)[:total].astype(np.int64)
        # A position past the request's tokens has no known token: nothing to compare there.
        expected_tokens = batch.expected_tokens(expected_positions)
        expected_tokens = np.where(expected_tokens < 0, input_ids, expected_tokens)
        api.write(self.context, self.write_plan, input_ids=xp.asarray(input_ids),
                  positions=xp.asarray(positions), out_cache_loc=xp.asarray(written),
                  expected_input_tokens=xp.asarray(expected_tokens),
                  expected_input_positions=xp.asarray(expected_positions))
        g.stats["tokens_written"] += total
        followed = written == planned
        events = {}
        for e in np.flatnonzero(~followed).tolist():
            g.stats["write_index_mismatches"] += 1
            events[(int(owners[e]), int(expected_positions[e]), int(written[e]))] = [
                0, None, {WRITE_INDEX_MISMATCH}]
        for row in self._take_rows():
            hits = np.flatnonzero((written == row[1]) & (positions == row[2])
                                  & (input_ids == row[3]))
            if hits.size == 0:
                continue
            e = int(hits[0])
            key = (int(owners[e]), int(expected_positions[e]), int(row[1]))
            event = events.setdefault(key, [0, None, set()])
            event[0] |= int(row[7])
            if event[1] is None:     # the write row as the shared core explains it
                v = Violation.from_row(row)
                entry = Entry(batch_index=key[0], request_row=key[0] + 1, position=key[1])
                event[1] = LaunchFinding(v, entry, failed_checks(v.fail_reason_bits),
                                         diagnose(v, entry), self.step)
        if events:
            # Who wrote each slot (findings name the writer) and where each request wrote.
            keys = list(zip(owners.tolist(), expected_positions.tolist()))
            self._record(events, batch,
                         written=dict(zip(keys, zip(written.tolist(), followed.tolist()))),
                         engine_positions=dict(zip(keys, positions.tolist())))
        inside = written < self.num_slots
        recs, n = batch.recs, len(batch)
        uids = np.fromiter(map(_UID, recs), dtype=np.int64, count=n)
        slots = written[inside]
        self.writer_request[slots] = uids[owners[inside]]
        self.writer_position[slots] = expected_positions[inside]
        self.writer_step[slots] = self.step
        self.writer_followed[slots] = followed[inside]
        if total:
            serials = np.fromiter(map(_SERIAL, recs), dtype=np.int64, count=n)
            self.own.add(serials[owners], expected_positions, written, followed)
            if self.own.full():
                self.own.compact(np.fromiter(map(_SERIAL, self.requests.values()),
                                             dtype=np.int64, count=len(self.requests)))
        lengths = batch.engine_past + batch.query
        for rec, length in zip(recs, lengths.tolist()):
            rec.length = length       # follow the engine once its step is checked
        self._last = (batch, lengths)
        self._last_list = None
        if g.error is not None:
            raise g.error

    @property
    def last(self) -> list | None:
        """The last checked step's requests as ``(request id, its blocks, its length, its
        token ids)``, None before the first; built when asked (a dump), not every step."""
        if self._last is None:
            return None
        if self._last_list is None:
            self._last_list = dumps.last_requests(*self._last)
        return self._last_list

    def written_slots(self, io, batch: StepBatch, planned: np.ndarray) -> np.ndarray:
        """The slots the engine's write indices of this step name, token by token
        (``planned``: the block table's slot of each)."""
        if io.use_block_table:
            return batch.slots_from(batch.engine_past)
        return self.to_slots(
            self.host_view(io.write_index_storage)[self.group_index, :planned.size])

    def _uid(self, request_id: str) -> int:
        uid = self.uid_of.get(request_id)
        if uid is None:
            uid = self.uid_of[request_id] = len(self.request_names)
            self.request_names.append(request_id)
        return uid

    def _record(self, events: dict, batch, written=None, engine_positions=None) -> None:
        """Turn one launch's events ``(batch index, position, slot) -> [bits, first row,
        guard checks]`` into sightings and merge them; each new finding is explained (once)
        and reported. The first row is a :class:`~kvcanary.LaunchFinding` (verify or write
        row), None for a guard check alone.
        ``written``/``engine_positions``: the write launch's slot and position id of each
        ``(batch index, position)``."""
        g = self.guard
        sightings, batch_index = [], {}
        for (i, position, slot), (bits, first, checks) in events.items():
            sighting = Sighting(batch.recs[i].request_id, position, slot, slot // self.page,
                                row_reasons(bits, sorted(checks)),
                                None if first is None else first.violation, self.step,
                                None if first is None else first.diagnosis)
            sightings.append(sighting)
            batch_index[sighting.key()] = i
        for found in g.merger.add(sightings):
            i, position, slot = batch_index[found.finding.key()], found.position, found.slot
            key = (i, position)
            own = (written or {}).get(key) or self.own.get(batch.recs[i].serial, position) \
                or (None, True)
            found.state(explain(found.finding, self._evidence(
                batch.recs[i], position, slot, batch.table_of(i), own,
                (engine_positions or {}).get(key), (i, position - 1) in self.misread)),
                self.explanation_prefix)
            g.report(found)
    def _evidence(self, rec, position, slot, table, own_write, engine_position,
                  misread_before) -> EngineEvidence:
        own, followed = own_write
        writer = None
        if 0 <= slot < self.num_slots and self.writer_request[slot] >= 0:
            writer = (self.request_names[self.writer_request[slot]],
                      int(self.writer_position[slot]), int(self.writer_step[slot]),
                      bool(self.writer_followed[slot]))
        near = tuple(int(table[p]) if 0 <= p < table.size else None
                     for p in (position - 1, position + 1))
        trash = own is not None and 0 <= own < self.num_slots and \
            own // self.page < self.trash_blocks
        block = slot // self.page if 0 <= slot < self.num_slots else None
        return EngineEvidence(
            request_id=rec.request_id, position=position, slot=slot,
            table_slot=int(table[position]) if position < table.size else -1,
            writer=writer, own_slot=own, engine_position=engine_position, trash=trash,
            near_slots=near, sources="+".join(name for name, _ in self.real_kv) or "no source",
            own_followed=followed, misread_before=misread_before,
            history=None if block is None else self.history.cause(rec.request_id, block, writer),
            moved=None if block is None else self.history.move(rec.request_id, block))

    # -- forks and offloading

    @property
    def writer_columns(self) -> tuple:
        """Per slot: who wrote its record (request uid, position, step, table followed)."""
        return (self.writer_request, self.writer_position, self.writer_step,
                self.writer_followed)

    def _block_slots(self, blocks) -> np.ndarray:
        blocks = np.asarray(blocks, dtype=np.int64)
        return (blocks[:, None] * self.page + np.arange(self.page)).reshape(-1)

    def copy_records(self, source_blocks, dest_blocks) -> None:
        """A fork copied KV blocks: their records (and who wrote them) go along."""
        if not source_blocks:
            return
        self.history.note_copies(source_blocks, dest_blocks)
        src, dst = self._block_slots(source_blocks), self._block_slots(dest_blocks)
        buf = self.context.canary_buf
        buf[self.xp.asarray(dst)] = buf[self.xp.asarray(src)]
        for column in self.writer_columns:
            column[dst] = column[src]
        self.guard.stats["blocks_copied"] += len(source_blocks)

    def save_records(self, request_id: str, blocks) -> None:
        slots = self._block_slots(blocks)
        self.saved[request_id] = (self.context.canary_buf[self.xp.asarray(slots)].copy(),
                                  [column[slots].copy() for column in self.writer_columns])

    def restore_records(self, state) -> None:
        """KV restored from the CPU lands in new blocks: its records come back with it."""
        saved = self.saved.pop(state.request_id, None)
        if saved is None:
            return
        records, columns = saved
        blocks = self.allocator.block_table.get(state.request_id, [])
        count = min(len(blocks), records.shape[0] // self.page)
        slots = self._block_slots(blocks[:count])
        self.context.canary_buf[self.xp.asarray(slots)] = records[:slots.size]
        for column, values in zip(self.writer_columns, columns):
            column[slots] = values[:slots.size]
        rec = self.requests.get(state.request_id)
        if rec is not None:
            rec.restored = True
        self.guard.stats["blocks_restored"] += count

    # -- dump

    def dump_table(self, last) -> dict:
        """The dump's slot table of the last step's requests: their block tables."""
        width = max(1, max(len(blocks) for _, blocks, _, _ in last))
        block_table = np.zeros((len(last) + 1, width), dtype=np.int64)
        for i, (_, blocks, _, _) in enumerate(last):
            block_table[i + 1, :len(blocks)] = blocks
        return dict(block_table=block_table, block_size=self.page)

    def dump_arrays(self) -> dict:
        """The last guarded step as ``kvcanary.dump.save``'s arguments (:mod:`.dumps`)."""
        return dumps.dump_arrays(self)
