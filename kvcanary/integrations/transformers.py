"""Guard Hugging Face transformers' continuous batching (``model.generate_batch``) with kvcanary.

::

    from kvcanary.integrations import transformers as kvt

    guard = kvt.guard(model, sources="k0", hash_mode="all", check_tokens=True,
                      plan_from="read_indices", on_violation="log")
    with guard:
        outputs = model.generate_batch(inputs=prompts, generation_config=config)
    guard.findings()        # one Finding per distinct problem
    guard.summary()         # steps, entries verified, tokens written, findings, ...
    guard.dump("last.npz")  # the last step as a dump `kvcanary audit` reads

Where kvcanary hooks in (only while the ``with`` block runs, only for the given model):

* ``ContinuousBatchProcessor._generation_step``: before the forward, the plan (from the
  step's read indices or the allocator's block table) and the verify of every prefix slot the
  step reads; after it, the write of the step's new tokens, at the slots the engine's write
  indices really name.
* ``CacheAllocator.copy_blocks`` (forks): records are copied with the KV blocks.
* ``OffloadingManager`` offload and restore: records leave and come back with the KV.
* the model's ``generate_batch`` (an instance attribute, removed on exit), so that
  ``on_violation="raise"`` reaches the caller as :class:`GuardError`.

Canary slot of (block, offset) is ``block * page_size + offset``; the engine's physical row
index ``block * block_physical_stride + offset`` maps to it. Block 0 (the engine's read trash)
is kvcanary's null block. Real-KV sources are views of the engine's cache tensor (zero-copy):
layer ``i``'s K (or V) rows of every block. torch and transformers are imported here only.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import NamedTuple

import numpy as np

from .. import api
from ..consts import CANARY_SLOT_BYTES, MAX_REAL_KV_SOURCES, LaunchTag, RealKvHashMode
from ..types import CanaryContext, RealKvSource, VerifyPlan, ViolationLog, WritePlan

from ..dump import save as save_dump
from ..types import to_host
from ..violations import Violation
from .findings import (
    READ_INDEX_MISMATCH,
    WRITE_INDEX_MISMATCH,
    Evidence,
    FindingLog,
    attribute,
    recheck_on_host,
    row_reasons,
)

logger = logging.getLogger("kvcanary")

# Versions whose continuous batching has the hook points and layout used here.
SUPPORTED_VERSIONS = ((5, 20), (5, 24))   # first and last supported minor, inclusive
SUPPORTED_RANGE = ">=5.20,<5.25"
SOURCE_PRESETS = ("k0", "kv-all")
PLAN_FROM = ("read_indices", "block_table")
ON_VIOLATION = ("log", "raise")
HASH_MODES = {"none": RealKvHashMode.NONE, "partial": RealKvHashMode.PARTIAL,
              "all": RealKvHashMode.ALL}


class GuardError(RuntimeError):
    """A guard that cannot run (unsupported version or engine setup, bad argument), or, with
    ``on_violation="raise"``, the first finding (``.finding``) that stopped the generation."""

    def __init__(self, message: str, finding=None):
        super().__init__(message)
        self.finding = finding


def supported_version(version: str) -> bool:
    parts = version.split(".")
    try:
        major_minor = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        return False
    return SUPPORTED_VERSIONS[0] <= major_minor <= SUPPORTED_VERSIONS[1]


def guard(model, *, sources="k0", hash_mode="all", check_tokens: bool = True,
          plan_from: str = "read_indices", on_violation="log",
          ring_capacity: int = 4096) -> "Guard":
    """A guard for ``model``'s continuous batching; use it as a context manager.

    ``sources``: ``"k0"`` (layer 0's K rows), ``"kv-all"`` (K and V of every layer), a list
    of ``("k" | "v", layer_index)``, or ``()`` for none. ``hash_mode``: ``"none"``,
    ``"partial"`` or ``"all"`` (how much of each slot's KV bytes the record fingerprints).
    ``check_tokens``: verify stored token ids against each request's tokens. ``plan_from``:
    ``"read_indices"`` (verify exactly the slots attention gathers, and check that they agree
    with the block table) or ``"block_table"``. ``on_violation``: ``"log"`` (a WARNING on
    the ``kvcanary`` logger per new finding), ``"raise"`` (stop the generation;
    ``generate_batch`` raises :class:`GuardError`) or a callable receiving each new
    :class:`~kvcanary.integrations.findings.Finding`.

    Raises :class:`GuardError` for a transformers version outside ``SUPPORTED_RANGE`` or a
    bad argument."""
    import transformers

    if not supported_version(transformers.__version__):
        raise GuardError(
            f"kvcanary: transformers {transformers.__version__} is not supported by "
            f"kvcanary.integrations.transformers (supported: transformers{SUPPORTED_RANGE})")
    if hash_mode not in HASH_MODES:
        raise GuardError(f"kvcanary: hash_mode must be one of {', '.join(HASH_MODES)}, "
                         f"got {hash_mode!r}")
    if plan_from not in PLAN_FROM:
        raise GuardError(f"kvcanary: plan_from must be one of {', '.join(PLAN_FROM)}, "
                         f"got {plan_from!r}")
    if not callable(on_violation) and on_violation not in ON_VIOLATION:
        raise GuardError("kvcanary: on_violation must be 'log', 'raise' or a callable, got "
                         f"{on_violation!r}")
    if not hasattr(model, "generate_batch") or not hasattr(model, "config"):
        raise GuardError(f"kvcanary: guard() needs a transformers model with generate_batch, "
                         f"got {type(model).__name__}")
    layers = int(model.config.get_text_config().num_hidden_layers)
    return Guard(model, _source_list(sources, layers), HASH_MODES[hash_mode],
                 bool(check_tokens), plan_from, on_violation, int(ring_capacity))


def _source_list(sources, layers: int) -> tuple:
    if isinstance(sources, str):
        if sources == "k0":
            return (("k", 0),)
        if sources == "kv-all":
            return tuple((kind, layer) for layer in range(layers) for kind in ("k", "v"))
        raise GuardError(f"kvcanary: sources must be 'k0', 'kv-all' or a list of "
                         f"('k' | 'v', layer), got {sources!r}")
    out = []
    for index, item in enumerate(sources or ()):
        try:
            kind, layer = item
            layer = int(layer)
        except (TypeError, ValueError):
            raise GuardError(f"kvcanary: sources[{index}] must be ('k' | 'v', layer), "
                             f"got {item!r}") from None
        if kind not in ("k", "v") or not 0 <= layer < layers:
            raise GuardError(f"kvcanary: sources[{index}] = {item!r}: kind must be 'k' or 'v' "
                             f"and layer in [0, {layers})")
        out.append((kind, layer))
    return tuple(out)


# ------------------------------------------------------------------ hook installation


class _Hooks:
    """The class attributes kvcanary replaces while at least one guard is active, restored
    exactly (an attribute a class did not define itself is deleted again)."""

    lock = threading.Lock()
    active: dict = {}      # id(model) -> Guard
    saved: list = []       # (owner, name, had_own, original)

    @classmethod
    def targets(cls):
        from transformers.generation.continuous_batching import cache_allocators as ca
        from transformers.generation.continuous_batching import continuous_api as api
        from transformers.generation.continuous_batching import offloading_manager as om

        return (
            (api.ContinuousBatchProcessor, "_generation_step", _generation_step_hook),
            (ca.CacheAllocator, "copy_blocks", _copy_blocks_hook),
            (om.OffloadingManager, "_offload_to_cpu", _offload_hook),
            (om.OffloadingManager, "restore_scheduled_requests", _restore_hook),
        )

    @classmethod
    def add(cls, g: "Guard") -> None:
        with cls.lock:
            if id(g.model) in cls.active:
                raise GuardError("kvcanary: this model is already guarded (one guard per model "
                                 "at a time)")
            if not cls.active:
                targets = cls.targets()
                for owner, name, _ in targets:
                    if not callable(getattr(owner, name, None)):
                        raise GuardError(f"kvcanary: transformers lacks {owner.__name__}.{name}; "
                                         f"supported: transformers{SUPPORTED_RANGE}")
                for owner, name, hook in targets:
                    original = getattr(owner, name)
                    cls.saved.append((owner, name, name in owner.__dict__,
                                      owner.__dict__.get(name)))
                    setattr(owner, name, hook(original))
            cls.active[id(g.model)] = g

    @classmethod
    def remove(cls, g: "Guard") -> None:
        with cls.lock:
            cls.active.pop(id(g.model), None)
            if cls.active:
                return
            while cls.saved:
                owner, name, had_own, original = cls.saved.pop()
                if had_own:
                    setattr(owner, name, original)
                else:
                    delattr(owner, name)

    @classmethod
    def session_of(cls, match):
        for g in list(cls.active.values()):
            s = g._session
            if s is not None and match(s):
                return s
        return None


def _generation_step_hook(original):
    def _generation_step(self, model):
        g = _Hooks.active.get(id(model))
        if g is None or g._error is not None:
            return original(self, model)
        start = time.perf_counter()
        session = g._session_for(self)
        with session.on_engine_stream(self):
            session.before_step(self)
        forward = time.perf_counter()
        result = original(self, model)
        back = time.perf_counter()
        with session.on_engine_stream(self):
            session.after_step(self)
        g._time_step(forward - start + time.perf_counter() - back, back - forward)
        return result

    _generation_step.__wrapped__ = original
    return _generation_step


def _copy_blocks_hook(original):
    def copy_blocks(self, source_block_ids, dest_block_ids):
        original(self, source_block_ids, dest_block_ids)
        session = _Hooks.session_of(lambda s: s.allocator is self)
        if session is not None:
            session.copy_records(list(source_block_ids), list(dest_block_ids))

    copy_blocks.__wrapped__ = original
    return copy_blocks


def _offload_hook(original):
    def _offload_to_cpu(self, victims, victim_block_tables):
        offloaded = original(self, victims, victim_block_tables)
        session = _Hooks.session_of(lambda s: s.cache is self.cache)
        if session is not None:
            for request_id in offloaded:
                blocks = victim_block_tables[request_id].get(session.group_name, [])
                session.save_records(request_id, blocks)
        return offloaded

    _offload_to_cpu.__wrapped__ = original
    return _offload_to_cpu


def _restore_hook(original):
    def restore_scheduled_requests(self, requests_in_batch):
        session = _Hooks.session_of(lambda s: s.cache is self.cache)
        if session is not None:
            for future in requests_in_batch:
                if future.state.is_cpu_offloaded:
                    session.restore_records(future.state)
        return original(self, requests_in_batch)

    restore_scheduled_requests.__wrapped__ = original
    return restore_scheduled_requests


# ------------------------------------------------------------------ the guard


class Guard:
    """Guards one model's continuous batching while its ``with`` block runs (see
    :func:`guard`). Outside the block, transformers is exactly as it was."""

    def __init__(self, model, sources, hash_mode, check_tokens, plan_from, on_violation,
                 ring_capacity):
        self.model = model
        self.sources = sources
        self.hash_mode = hash_mode if sources else RealKvHashMode.NONE
        self.check_tokens = check_tokens
        self.plan_from = plan_from
        self.on_violation = on_violation
        self.ring_capacity = ring_capacity
        self.log = FindingLog()
        self.stats = dict(steps=0, entries_verified=0, tokens_written=0, ring_rows=0,
                          rows_dropped=0, blocks_copied=0, blocks_restored=0, sessions=0,
                          read_index_mismatches=0, write_index_mismatches=0)
        self._session = None
        self._error = None
        self._inside = False
        self.step_times = []     # (guard seconds, engine step seconds) per guarded step

    # -- context manager

    def __enter__(self) -> "Guard":
        if self._inside:
            raise GuardError("kvcanary: this guard is already active")
        _Hooks.add(self)
        self._inside = True
        model = self.model
        self._own_generate = model.__dict__.get("generate_batch")
        had_own = "generate_batch" in model.__dict__
        original = model.generate_batch

        def generate_batch(*args, **kwargs):
            self._error = None
            outputs = original(*args, **kwargs)
            if self._error is not None:
                raise self._error
            return outputs

        self._had_own_generate = had_own
        model.generate_batch = generate_batch
        return self

    def __exit__(self, *exc) -> bool:
        model = self.model
        if self._had_own_generate:
            model.generate_batch = self._own_generate
        else:
            model.__dict__.pop("generate_batch", None)
        _Hooks.remove(self)
        self._inside = False
        return False

    # -- results

    def findings(self) -> list:
        """One :class:`~kvcanary.integrations.findings.Finding` per distinct problem, in
        order of first sight."""
        return self.log.all()

    def violations(self) -> list:
        """Every raw ring row as ``(step, Violation)``, in the order the launches gave them."""
        return [(step, Violation.from_row(row)) for step, row in self.log.raw_rows]

    def summary(self) -> dict:
        """``steps`` (forward steps guarded), ``entries_verified``, ``tokens_written``,
        ``findings``, the ring rows, dropped rows, copied and restored blocks, and the median
        per step of the guard's time and of the engine's own step (``guard_ms_median``,
        ``engine_ms_median``; ``guard.step_times`` holds every step's pair in seconds)."""
        times = np.array(self.step_times or [(0.0, 0.0)])
        return dict(self.stats, findings=len(self.log),
                    guard_ms_median=float(np.median(times[:, 0]) * 1e3),
                    engine_ms_median=float(np.median(times[:, 1]) * 1e3))

    def dump(self, path) -> str:
        """Write the engine's last guarded step as a kvcanary dump (the container chosen by
        the suffix, as ``kvcanary.dump.save`` does): canary buffer, block table, live requests
        and their lengths, the real-KV sources and, with ``check_tokens``, the expected tokens.
        ``kvcanary audit`` of a clean run's dump is clean."""
        if self._session is None or self._session.last is None:
            raise GuardError("kvcanary: guard.dump needs at least one guarded step")
        return save_dump(path, **self._session.dump_arrays())

    # -- internals

    def _time_step(self, guard_s: float, engine_s: float) -> None:
        self.step_times.append((guard_s, engine_s))

    def _session_for(self, processor) -> "_Session":
        if self._session is None or self._session.cache is not processor.cache:
            self._session = _Session(self, processor.cache)
            self.stats["sessions"] += 1
        return self._session

    def _report(self, finding) -> None:
        if self.on_violation == "log":
            logger.warning("%s request=%s position=%d: %s", finding.log_line, finding.request_id,
                           finding.position, finding.explanation)
        elif self.on_violation == "raise":
            if self._error is None:
                self._error = GuardError(f"kvcanary: KV-cache violation, generation stopped: "
                                         f"{finding.describe()}", finding)
        else:
            self.on_violation(finding)


class _InBatch(NamedTuple):
    """One request of the step being guarded."""

    rec: "_Request"
    query: int          # tokens this step writes
    engine_past: int    # the engine's position offset before the step
    past: int           # kvcanary's own count of the request's tokens before the step
    table: np.ndarray   # the block table's slots of positions [0, past + query + 1)
    read: np.ndarray    # the slots verified for positions [0, past)
    tokens: np.ndarray  # the request's token ids (prompt + generated)


class _Request:
    __slots__ = ("request_id", "state", "length", "own", "restored")

    def __init__(self, request_id, state, length):
        self.request_id, self.state, self.length = request_id, state, length
        self.own = {}   # position -> (slot it was written to, whether the table named it)
        self.restored = False


class _Session:
    """kvcanary's state beside one PagedAttentionCache: canary buffer, launch context, who
    wrote each slot, and each request's own bookkeeping."""

    def __init__(self, g: Guard, cache):
        from transformers.generation.continuous_batching.cache_allocators import (
            FullAttentionCacheAllocator,
        )

        self.guard, self.cache = g, cache
        groups = cache.cache_allocators
        allocator = next(iter(groups.values()))
        if len(groups) != 1 or type(allocator) is not FullAttentionCacheAllocator:
            raise GuardError("kvcanary: only models whose layers are all full attention are "
                             f"supported, this one has cache groups {sorted(groups)}")
        self.group_name = next(iter(groups))
        self.allocator = allocator
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
            kernel_kind=LaunchTag.TAIL_K_FULL,
            violation_log=ViolationLog.allocate(g.ring_capacity, xp=xp),
            slot_run_counter=xp.zeros(1, dtype=xp.int64),
            kernel_run_counter=xp.zeros(1, dtype=xp.int64),
            real_kv_sources=tuple(source for _, source in self.real_kv),
            real_kv_hash_mode=g.hash_mode,
            max_real_kv_sources=max(MAX_REAL_KV_SOURCES, len(self.real_kv)))
        self.writer_request = np.full(self.num_slots, -1, dtype=np.int64)
        self.writer_position = np.full(self.num_slots, -1, dtype=np.int64)
        self.writer_step = np.full(self.num_slots, -1, dtype=np.int64)
        self.writer_followed = np.zeros(self.num_slots, dtype=bool)
        self.request_names: list = []
        self.uid_of: dict = {}
        self.requests: dict = {}
        self.saved: dict = {}     # offloaded request id -> (records, writer columns) per block
        self.step = None
        self.last = None

    def _sources(self, copy_view) -> list:
        """``[(name, RealKvSource)]``: each a zero-copy view of one layer's K or V rows."""
        a = self.allocator
        token_bytes = int(a.num_key_value_heads) * int(a.head_dim) * a.cache_dtype.itemsize
        if self.guard.sources and token_bytes % 16:
            raise GuardError(f"kvcanary: one token's K row is {token_bytes} bytes; real-KV "
                             "sources need a multiple of 16 (use sources=() to guard without)")
        page_bytes = self.page * token_bytes
        out = []
        for kind, layer in self.guard.sources:
            local = a.layer_indices.index(layer)
            start = (2 * local + (kind == "v")) * page_bytes
            view = copy_view[:, start:start + page_bytes]
            out.append((f"{kind}{layer}", RealKvSource(
                view, page_size=self.page, num_bytes_per_token=token_bytes,
                read_bytes=token_bytes)))
        return out

    def on_engine_stream(self, processor):
        """On a CUDA device, kvcanary's launches queue on the stream the engine computes on,
        so a verify or write never races the engine's KV writes."""
        if self.xp is np:
            return contextlib.nullcontext()
        import torch

        stream = processor.inputs_and_outputs.compute_stream or torch.cuda.current_stream()
        return self.xp.cuda.ExternalStream(stream.cuda_stream)

    # -- index conversions

    def to_slots(self, physical: np.ndarray) -> np.ndarray:
        """Canary slots of the engine's physical row indices (``num_slots``, outside the
        buffer, where an index names no K row of a block)."""
        physical = np.asarray(physical, dtype=np.int64)
        block, offset = np.divmod(physical, self.stride)
        slots = block * self.page + offset
        bad = (physical < 0) | (offset >= self.page) | (block >= self.num_blocks)
        slots[bad] = self.num_slots
        return slots

    def table_slots(self, request_id: str, length: int) -> np.ndarray:
        """The block table's slots of positions ``[0, length)`` (``num_slots`` past it)."""
        blocks = np.asarray(self.allocator.block_table.get(request_id, ()), dtype=np.int64)
        positions = np.arange(length, dtype=np.int64)
        index = positions // self.page
        inside = index < blocks.size
        slots = np.full(length, self.num_slots, dtype=np.int64)
        slots[inside] = blocks[index[inside]] * self.page + positions[inside] % self.page
        return slots

    # -- one forward step

    def before_step(self, processor) -> None:
        from transformers.generation.continuous_batching.input_outputs import (
            ContinuousBatchingIOs,
        )

        g = self.guard
        io = processor.inputs_and_outputs
        if type(io) is not ContinuousBatchingIOs:
            raise GuardError("kvcanary: asynchronous batching is not supported; run with "
                             "ContinuousBatchingConfig(use_async_batching=False)")
        g.stats["steps"] += 1
        self.step = g.stats["steps"]
        batch = []
        read_all = None
        if not io.use_block_table and io.max_kv_read > 0 and io.true_read_sizes[0] > 0:
            read_all = self.to_slots(_host(io.read_index_storage[0, :io.true_read_sizes[0]]))
        read_at = 0
        for future in io.requests_in_batch:
            state = future.state
            q = int(future.query_length)
            engine_past = int(state.position_offset) - q
            rec = self.requests.get(state.request_id)
            if rec is None or rec.state is not state or rec.restored:
                if rec is None or rec.state is not state:
                    rec = _Request(state.request_id, state, engine_past)
                    self.requests[state.request_id] = rec
                rec.length, rec.restored = engine_past, False
            past = rec.length
            reach = max(past, engine_past) + q + 1
            table = self.table_slots(state.request_id, reach)
            read = table[:past].copy()
            if read_all is not None:
                got = read_all[read_at:read_at + engine_past + q]
                read_at += engine_past + q
                if g.plan_from == "read_indices":
                    n = min(past, engine_past, got.size)
                    read[:n] = got[:n]
            tokens = np.asarray(state.initial_tokens + state.generated_tokens, dtype=np.int64)
            batch.append(_InBatch(rec, q, engine_past, past, table, read, tokens))
        self.batch = batch
        self._plan_and_verify(batch)

    def _plan_and_verify(self, batch) -> None:
        g, xp, n = self.guard, self.xp, len(batch)
        lengths = [past + q for _, q, _, past, _, _, _ in batch]
        width = max(1, max(lengths))
        table = np.zeros((n + 1, width), dtype=np.int64)
        pool = np.full((n + 1, width), -1, dtype=np.int64)
        valid = np.zeros(n, dtype=np.int64)
        for i, (rec, q, _, past, slots, read, tokens) in enumerate(batch):
            table[i + 1, :past + q] = slots[:past + q]
            table[i + 1, :past] = read
            valid[i] = min(tokens.size, width)
            pool[i + 1, :valid[i]] = tokens[:valid[i]]
        prefix = np.array([b.past for b in batch], dtype=np.int64)
        extend = np.array([b.query for b in batch], dtype=np.int64)
        capacity = max(1, int(prefix.sum()))
        self.verify_plan = VerifyPlan.allocate(capacity, xp=xp)
        self.write_plan = WritePlan.allocate(max(1, n), xp=xp)
        kwargs = {}
        if g.check_tokens:
            kwargs = dict(req_to_verify_expected_tokens=xp.asarray(pool),
                          req_to_verify_expected_tokens_valid_lens=xp.asarray(valid))
        api.plan(req_pool_indices=xp.arange(1, n + 1, dtype=xp.int64),
                prefix_lens=xp.asarray(prefix), extend_seq_lens=xp.asarray(extend),
                req_to_token=xp.asarray(table), verify_plan=self.verify_plan,
                write_plan=self.write_plan, **kwargs)
        entries = int(prefix.sum())
        events, self.misread = {}, set()
        for i, (rec, _, engine_past, past, slots, read, _) in enumerate(batch):
            n_read = min(past, engine_past)
            bad = np.flatnonzero(read[:n_read] != slots[:n_read])
            g.stats["read_index_mismatches"] += int(bad.size)
            for pos in bad:
                events[(i, int(pos), int(read[pos]))] = [0, None, {READ_INDEX_MISMATCH}]
                self.misread.add((i, int(pos)))
        if entries:
            api.verify(self.context, self.verify_plan, check_expected_token=g.check_tokens)
            g.stats["entries_verified"] += entries
            rows = self._take_rows()
            if rows.shape[0]:
                owners = np.repeat(np.arange(n), prefix)
                positions = np.concatenate([np.arange(p) for p in prefix])
                entry_of = attribute(rows, to_host(self.verify_plan.verify_slot_indices)
                                     [:entries].copy(), self._recheck(entries))
                for row, e in zip(rows, entry_of):
                    if e < 0:
                        continue
                    key = (int(owners[e]), int(positions[e]), int(row[1]))
                    event = events.setdefault(key, [0, None, set()])
                    event[0] |= int(row[7])
                    event[1] = event[1] if event[1] is not None else Violation.from_row(row)
        self._record(events, batch)
        if g._error is not None:     # on_violation="raise": stop before the forward
            raise g._error

    def _recheck(self, entries: int):
        plan = self.verify_plan
        arrays = {"slots": plan.verify_slot_indices, "tokens": plan.verify_expected_tokens,
                  "positions": plan.verify_expected_positions,
                  "prevs": plan.verify_prev_slot_indices}
        arrays = {k: np.array(to_host(v)[:entries]) for k, v in arrays.items()}
        return recheck_on_host(self._host_context(), arrays, self.guard.check_tokens)

    def _host_context(self):
        if self.xp is np:
            return self.context
        sources = tuple(RealKvSource(np.ascontiguousarray(to_host(s.tensor)),
                                        page_size=s.page_size,
                                        num_bytes_per_token=s.num_bytes_per_token,
                                        read_bytes=s.read_bytes)
                        for _, s in self.real_kv)
        c = self.context
        return CanaryContext(to_host(c.canary_buf), kernel_kind=c.kernel_kind,
                                violation_log=ViolationLog.allocate(1),
                                slot_run_counter=np.zeros(1, np.int64),
                                kernel_run_counter=np.zeros(1, np.int64),
                                real_kv_sources=sources, real_kv_hash_mode=c.real_kv_hash_mode,
                                max_real_kv_sources=c.max_real_kv_sources)

    def _take_rows(self) -> np.ndarray:
        log = self.context.violation_log
        rows = log.rows()
        self.guard.stats["ring_rows"] += log.total
        self.guard.stats["rows_dropped"] += log.dropped
        for row in rows:
            self.guard.log.raw_rows.append((self.step, row))
        if log.total:
            log.clear()
        return rows

    def after_step(self, processor) -> None:
        g, xp, io, batch = self.guard, self.xp, processor.inputs_and_outputs, self.batch
        total = sum(b.query for b in batch)
        if io.use_block_table:
            written = np.concatenate([b.table[b.engine_past:b.engine_past + b.query]
                                      for b in batch])
        else:
            written = self.to_slots(_host(io.write_index_storage[0, :total]))
        input_ids = _host(io.input_ids[:total]).astype(np.int64)
        positions = _host(io.position_ids[:total]).astype(np.int64)
        expected_tokens = np.concatenate(
            [_padded(tokens, past, q) for _, q, _, past, _, _, tokens in batch])
        # A position past the request's tokens has no known token: nothing to compare there.
        expected_tokens = np.where(expected_tokens < 0, input_ids, expected_tokens)
        expected_positions = np.concatenate(
            [np.arange(past, past + q, dtype=np.int64) for _, q, _, past, _, _, _ in batch])
        api.write(self.context, self.write_plan, input_ids=xp.asarray(input_ids),
                 positions=xp.asarray(positions), out_cache_loc=xp.asarray(written),
                 expected_input_tokens=xp.asarray(expected_tokens),
                 expected_input_positions=xp.asarray(expected_positions))
        g.stats["tokens_written"] += total
        owners = np.repeat(np.arange(len(batch)), [b.query for b in batch])
        table = np.concatenate([b.table[b.past:b.past + b.query] for b in batch])
        events = {}
        for e in np.flatnonzero(written != table):
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
            event[1] = event[1] if event[1] is not None else Violation.from_row(row)
        # Who wrote each slot (findings name the writer) and where each request wrote.
        keys = list(zip(owners.tolist(), expected_positions.tolist()))
        followed = (written == table).tolist()
        self._record(events, batch, written=dict(zip(keys, zip(written.tolist(), followed))),
                     engine_positions=dict(zip(keys, positions.tolist())))
        inside = written < self.num_slots
        uids = np.array([self._uid(b.rec.request_id) for b in batch], dtype=np.int64)
        self.writer_request[written[inside]] = uids[owners[inside]]
        self.writer_position[written[inside]] = expected_positions[inside]
        self.writer_step[written[inside]] = self.step
        self.writer_followed[written[inside]] = (written == table)[inside]
        for i, (rec, q, engine_past, past, _, _, _) in enumerate(batch):
            mine = np.flatnonzero(owners == i).tolist()
            for pos, e in zip(range(past, past + q), mine):
                rec.own[pos] = (int(written[e]), followed[e])
            rec.length = engine_past + q      # follow the engine once its step is checked
        self.last = [(rec.request_id, list(self.allocator.block_table.get(rec.request_id, ())),
                      rec.length, tokens) for rec, _, _, _, _, _, tokens in batch]
        if g._error is not None:
            raise g._error

    def _uid(self, request_id: str) -> int:
        uid = self.uid_of.get(request_id)
        if uid is None:
            uid = self.uid_of[request_id] = len(self.request_names)
            self.request_names.append(request_id)
        return uid

    def _record(self, events: dict, batch, written=None, engine_positions=None) -> None:
        """Turn one launch's events ``(batch index, position, slot) -> [bits, first row,
        guard checks]`` into findings. ``written``/``engine_positions``: the write launch's
        slot and position id of each ``(batch index, position)``."""
        g = self.guard
        for (i, position, slot), (bits, violation, checks) in events.items():
            rec, table = batch[i].rec, batch[i].table
            reasons = row_reasons(bits, sorted(checks))

            def evidence(key=(i, position), rec=rec, slot=slot, table=table):
                own = (written or {}).get(key) or rec.own.get(key[1]) or (None, True)
                return self._evidence(rec, key[1], slot, table, own,
                                      (engine_positions or {}).get(key),
                                      (i, key[1] - 1) in self.misread)

            found = g.log.add(self.step, rec.request_id, position, slot,
                              slot // self.page, reasons, violation, evidence)
            if found is not None:
                g._report(found)

    def _evidence(self, rec, position, slot, table, own_write, engine_position,
                  misread_before) -> Evidence:
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
        return Evidence(
            request_id=rec.request_id, position=position, slot=slot,
            table_slot=int(table[position]) if position < table.size else -1,
            writer=writer, own_slot=own, engine_position=engine_position, trash=trash,
            near_slots=near, sources="+".join(name for name, _ in self.real_kv) or "no source",
            own_followed=followed, misread_before=misread_before)

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

    def dump_arrays(self) -> dict:
        last = self.last
        n = len(last)
        width = max(1, max(len(blocks) for _, blocks, _, _ in last))
        block_table = np.zeros((n + 1, width), dtype=np.int64)
        for i, (_, blocks, _, _) in enumerate(last):
            block_table[i + 1, :len(blocks)] = blocks
        arrays = dict(
            kvcanary_dump_version=1,
            canary=np.ascontiguousarray(to_host(self.context.canary_buf)),
            block_table=block_table, block_size=self.page,
            req_pool_indices=np.arange(1, n + 1, dtype=np.int64),
            seq_lens=np.array([length for _, _, length, _ in last], dtype=np.int64),
            launch_tag=LaunchTag.TAIL_K_FULL.name)
        if self.real_kv and self.guard.hash_mode != RealKvHashMode.NONE:
            for i, (_, source) in enumerate(self.real_kv):
                arrays[f"real_kv_{i}"] = np.ascontiguousarray(to_host(source.tensor))
            arrays["real_kv_params"] = np.array(
                [[s.page_size, s.num_bytes_per_token, s.read_bytes] for _, s in self.real_kv],
                dtype=np.int64)
            arrays["real_kv_hash_mode"] = self.guard.hash_mode.name.lower()
        if self.guard.check_tokens:
            length = max(1, max(t.size for _, _, _, t in last))
            expected = np.full((n + 1, length), -1, dtype=np.int32)
            for i, (_, _, _, tokens) in enumerate(last):
                expected[i + 1, :tokens.size] = tokens
            arrays["expected_tokens"] = expected
            arrays["expected_tokens_valid_lens"] = np.array(
                [t.size for _, _, _, t in last], dtype=np.int64)
        return arrays


def _host(tensor) -> np.ndarray:
    """A torch tensor as a numpy array (a view on the CPU)."""
    return tensor.detach().cpu().numpy()


def _padded(tokens: np.ndarray, start: int, count: int) -> np.ndarray:
    out = np.full(count, -1, dtype=np.int64)
    part = tokens[start:start + count]
    out[:part.size] = part
    return out


__all__ = ["GuardError", "Guard", "SUPPORTED_RANGE", "SUPPORTED_VERSIONS", "guard",
           "supported_version"]
