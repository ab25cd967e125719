"""Audit a dump: verify every live request's prefix (and the sweep entries) the way the
runtime would, then explain each violation.

Data flows plan -> verify -> violations -> findings:

1. For every live request (``req_pool_indices != 0``) the verify plan covers positions
   ``[window_start, seq_len)``, built by ``kvcanary.plan`` with ``prefix_lens = seq_lens``
   and ``extend_seq_lens = 0``, in groups of requests so memory stays bounded; a request
   longer than one launch (``chunk_entries``) is planned in pieces by the reference's rule.
2. ``kvcanary.verify`` checks them on the chosen backend (numpy reference or CUDA kernels),
   with the token check on when the dump carries ``expected_tokens``.
3. kvcanary's slot-zero extension (off with ``compat=True``) adds a
   ``SLOT_ZERO_IN_PREFIX`` row for every live prefix entry mapped to padding slot 0.
4. Each row is attributed to the plan entry that produced it (request row and position, or
   sweep entry) and gets the failed checks in words.
5. Each kept finding gets its :func:`~kvcanary.diagnosis.diagnose`: the cause, from the
   other live entries on its slot and the records its own record continues.

Every row counts: totals, counts by reason, by tag and by request, and the first and last
affected positions of each request cover every row and are computed over whole arrays. Only
the first ``max_findings`` rows (default 1024, 0 for all) become :class:`Finding` objects, so a
dump whose every record is corrupt audits about as fast as a clean one; rows beyond
``ring_capacity`` count as dropped by upstream's fill-once ring. Checking zero entries is an
error.

The steps, one function each: :func:`_live_launches` and :func:`_sweep_launches` build the
entries, :func:`_verify` runs one launch, :func:`_attribute` names the entry of each row and
:class:`_Tally` summarises, :func:`_diagnose` explains; :func:`audit` runs the one loop
over both kinds of launches.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import numpy as np

from . import api
from .consts import (
    EXPECTED_TOKEN_UNKNOWN,
    MAX_REAL_KV_SOURCES,
    FailReason,
    LaunchTag,
)
from .diagnosis import (CHECK_WORDS, Diagnosis, Entry, Evidence, diagnose,  # noqa: F401
                        failed_checks, likely_cause, record_links)
from .dump import Dump, load
from .reference.plan import verify_entries
from .reference.verify import entry_rows
from .rules import canary_fields, violation_rows, window_start
from .types import (CanaryContext, RealKvSource, VerifyPlan, ViolationLog, WritePlan,
                    check_source_bound, check_source_count, to_host)
from .violations import Violation, reason_labels, tag_name

BACKENDS = ("auto", "numpy", "cupy")
# Plan entries per verify launch: bounds the plan and ring memory of one chunk.
CHUNK_ENTRIES = 1 << 16
# Findings kept per audit by default: upstream's default violation-ring capacity.
DEFAULT_MAX_FINDINGS = 1024

class AuditError(ValueError):
    """The audit cannot run or would prove nothing (e.g. zero entries to check)."""


def resolve_backend(name: str) -> str:
    """``auto`` -> ``cupy`` when a CUDA device is usable, else ``numpy``."""
    if name not in BACKENDS:
        raise AuditError(f"backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    if name == "numpy":
        return "numpy"
    from .cuda import CudaUnavailable, require_cupy

    try:
        require_cupy()
    except CudaUnavailable as exc:
        if name == "cupy":
            raise AuditError(f"backend cupy is not usable: {str(exc).removeprefix('kv-canary: ')}") from None
        return "numpy"
    return "cupy"


def sweep_tag(tag: LaunchTag) -> LaunchTag:
    """The SWEEP tag of the same half and group (``TAIL_K_FULL`` -> ``SWEEP_K_FULL``)."""
    _, half, group = tag.name.split("_")
    return LaunchTag[f"SWEEP_{half}_{group}"]


@dataclass(frozen=True)
class Finding:
    """One violation row with where it came from and what it probably means."""

    violation: Violation
    kind: str                 # "request", "sweep" or "unattributed"
    batch_index: int = -1     # index into req_pool_indices
    request_row: int = -1     # slot-table row
    position: int = -1        # the entry's expected position
    prev_slot: int = -1       # the entry's predecessor slot
    sweep_index: int = -1
    checks: tuple = ()
    cause: str = ""
    block_index: int = -1     # paged dumps: the position's entry in the row's block table
    block: int = -1           # paged dumps: the block id there (-1: past the table)
    diagnosis: Diagnosis | None = None   # the cause with its evidence (``cause`` is its text)

    def entry(self) -> Entry:
        """The finding's verify entry as the diagnosis names it."""
        return Entry(kind=self.kind, batch_index=self.batch_index,
                     request_row=self.request_row, position=self.position,
                     prev_slot=self.prev_slot, sweep_index=self.sweep_index,
                     block_index=self.block_index, block=self.block)

    def where(self) -> str:
        if self.kind == "request":
            block = ""
            if self.block_index >= 0:
                block = (f", block {self.block} (block-table entry {self.block_index}"
                         f"{', the null block' if self.block == 0 else ''})")
            return (f"request row {self.request_row} (batch index {self.batch_index}), "
                    f"position {self.position}{block}, slot {self.violation.slot_idx}")
        if self.kind == "sweep":
            return (f"sweep entry {self.sweep_index}, position {self.position}, "
                    f"slot {self.violation.slot_idx}")
        return f"slot {self.violation.slot_idx} (no plan entry reproduces this row)"

    def to_dict(self) -> dict:
        record = self.violation.to_dict()
        record.update(entry=self.kind, batch_index=self.batch_index,
                      request_row=self.request_row, expected_position=self.position,
                      prev_slot=self.prev_slot, sweep_index=self.sweep_index,
                      failed_checks=list(self.checks), likely_cause=self.cause)
        if self.diagnosis is not None:
            record["diagnosis"] = self.diagnosis.to_dict(text=False)
        if self.block_index >= 0:
            record.update(block_index=self.block_index, block=self.block)
        return record


@dataclass(frozen=True)
class RequestSummary:
    """The rows attributed to one live request: how many, and the first and last expected
    positions among them."""

    batch_index: int
    request_row: int
    violations: int
    first_position: int
    last_position: int

    def to_dict(self) -> dict:
        return {"batch_index": self.batch_index, "request_row": self.request_row,
                "violations": self.violations, "first_position": self.first_position,
                "last_position": self.last_position}


@dataclass(frozen=True)
class CheckedLaunch:
    """One verify launch as the audit checked it, handed to ``audit(..., observe=...)`` for a
    consumer that aggregates every row (the HTML report's maps). Host int64 arrays; read them,
    do not keep or change them.

    ``slots``, ``positions``: ``(entries,)`` the launch's plan entries (slot and expected
    position); ``batch_index``: ``(entries,)`` the live request of each entry, ``None`` for
    sweep entries; ``rows``: ``(n, 8)`` the launch's violation rows in ring column order;
    ``entry_of``: ``(n,)`` the entry index of each row, -1 where no entry reproduces it."""

    slots: np.ndarray
    positions: np.ndarray
    batch_index: np.ndarray | None
    rows: np.ndarray
    entry_of: np.ndarray


@dataclass
class AuditResult:
    path: str
    backend: str
    launch_tag: str
    num_slots: int
    live_requests: int
    live_entries: int
    sweep_entries: int
    real_kv_sources: int
    real_kv_hash_mode: str
    swa_window_size: int
    check_expected_token: bool
    compat: bool
    ring_capacity: int
    max_findings: int = DEFAULT_MAX_FINDINGS
    total_violations: int = 0
    findings: list = field(default_factory=list)
    counts_by_reason: dict = field(default_factory=dict)
    counts_by_tag: dict = field(default_factory=dict)
    counts_by_entry: dict = field(default_factory=dict)
    requests: list = field(default_factory=list)   # RequestSummary of every affected request
    counts_by_cause: dict = field(default_factory=dict)   # over the kept findings
    zero_records: int = 0     # live entries whose record is all zeros (counted when dirty)
    unattributed: int = 0
    elapsed_s: float = 0.0

    @property
    def entries_checked(self) -> int:
        return self.live_entries + self.sweep_entries

    @property
    def dropped(self) -> int:
        return max(0, self.total_violations - self.ring_capacity)

    @property
    def ring_overflow(self) -> bool:
        return self.total_violations > self.ring_capacity

    @property
    def clean(self) -> bool:
        return self.total_violations == 0

    @property
    def findings_omitted(self) -> int:
        """Rows counted but not kept as findings (ring overflow or ``max_findings``)."""
        return self.total_violations - len(self.findings)

    @property
    def findings_cut(self) -> bool:
        return self.findings_omitted > 0

    def config_record(self) -> dict:
        return {"record": "config", "dump": self.path, "backend": self.backend,
                "launch_tag": self.launch_tag, "num_slots": self.num_slots,
                "live_requests": self.live_requests, "real_kv_sources": self.real_kv_sources,
                "real_kv_hash_mode": self.real_kv_hash_mode,
                "swa_window_size": self.swa_window_size,
                "check_expected_token": self.check_expected_token,
                "extensions": not self.compat, "ring_capacity": self.ring_capacity,
                "max_findings": self.max_findings}

    def summary_record(self) -> dict:
        return {"record": "summary", "dump": self.path, "entries_checked": self.entries_checked,
                "live_entries": self.live_entries, "sweep_entries": self.sweep_entries,
                "violations": self.total_violations, "reported": len(self.findings),
                "ring_overflow": self.ring_overflow, "dropped": self.dropped,
                "findings_cut": self.findings_cut, "findings_omitted": self.findings_omitted,
                "unattributed": self.unattributed,
                "counts_by_reason": dict(self.counts_by_reason),
                "counts_by_tag": dict(self.counts_by_tag),
                "counts_by_entry": dict(self.counts_by_entry),
                "counts_by_cause": dict(self.counts_by_cause),
                "zero_records": self.zero_records,
                "requests": [r.to_dict() for r in self.requests],
                "elapsed_s": round(self.elapsed_s, 3)}

    def findings_at(self, request_row: int, position: int) -> list:
        return [f for f in self.findings
                if f.kind == "request" and f.request_row == request_row and f.position == position]


# --------------------------------------------------------------------------- the audit


class _Launcher:
    """Contexts on the chosen backend plus a host context used to attribute rows."""

    def __init__(self, dump: Dump, backend: str, max_real_kv_sources: int):
        self.dump, self.backend = dump, backend
        if backend == "cupy":
            import cupy

            self.xp = cupy
        else:
            self.xp = np
        self.host_sources = self._sources(np)
        self.sources = self.host_sources if self.xp is np else self._sources(self.xp)
        self.canary = dump.canary if self.xp is np else self.xp.asarray(dump.canary)
        self.max_sources = max_real_kv_sources
        self._first = self._last = None

    def _sources(self, xp):
        d = self.dump
        result = []
        for tensor, params in zip(d.real_kv, [] if d.real_kv_params is None else d.real_kv_params):
            page, per_token, read = (int(v) for v in params)
            result.append(RealKvSource(tensor if xp is np else xp.asarray(tensor), page_size=page,
                                       num_bytes_per_token=per_token, read_bytes=read))
        return tuple(result)

    def context(self, tag: int, capacity: int, *, host: bool = False) -> CanaryContext:
        xp = np if host else self.xp
        return CanaryContext(
            self.dump.canary if host else self.canary, kernel_kind=tag,
            violation_log=ViolationLog.allocate(capacity, xp=xp),
            slot_run_counter=xp.zeros(1, dtype=xp.int64),
            kernel_run_counter=xp.zeros(1, dtype=xp.int64),
            real_kv_sources=self.host_sources if host else self.sources,
            real_kv_hash_mode=self.dump.real_kv_hash_mode,
            max_real_kv_sources=self.max_sources)

    def device(self, array):
        return None if array is None else (array if self.xp is np else self.xp.asarray(array))

    def slot_users(self, slots: np.ndarray) -> tuple:
        """``(first, last)``: per canary slot, the first and last index of ``slots`` holding
        it. Slots outside the buffer are left out; the tables are reused from launch to
        launch, so a slot this launch does not use holds a stale index."""
        # int32 halves the tables' cache footprint; launches past 2**31 entries get int64.
        dtype = np.int32 if slots.size <= np.iinfo(np.int32).max else np.int64
        if self._first is None or self._first.dtype != dtype:
            self._first = np.full(self.dump.num_slots, -1, dtype=dtype)
            self._last = np.full(self.dump.num_slots, -1, dtype=dtype)
        index = np.flatnonzero((slots >= 0) & (slots < self.dump.num_slots)).astype(dtype)
        self._last[slots[index]] = index
        self._first[slots[index[::-1]]] = index[::-1]
        return self._first, self._last


@dataclass
class _Entries:
    """Host copy of one launch's plan entries."""

    slots: np.ndarray
    prevs: np.ndarray
    positions: np.ndarray
    tokens: np.ndarray

    def plan(self, device) -> VerifyPlan:
        return VerifyPlan(verify_slot_indices=device(self.slots),
                          verify_expected_tokens=device(self.tokens),
                          verify_expected_positions=device(self.positions),
                          verify_prev_slot_indices=device(self.prevs),
                          verify_num_valid=device(np.array([self.slots.size], dtype=np.int32)),
                          enable=device(np.ones(1, dtype=np.int32)))


@dataclass
class _Launch:
    """One verify launch: its plan on the backend and a host copy of its entries, plus what
    names an entry: the batch index of every entry (live requests) or the sweep index of the
    first one."""

    tag: int
    plan: VerifyPlan
    entries: _Entries
    check_token: bool
    batch_index: np.ndarray | None = None
    sweep_begin: int = 0

    @property
    def size(self) -> int:
        return int(self.entries.slots.shape[0])

    @property
    def live(self) -> bool:
        return self.batch_index is not None


# ------------------------------------------------------------ step 1: build the entries


# Batch rows scanned at a time when finding the live requests: bounds the temporaries of a
# batch of millions of (mostly padding) rows.
_SCAN_ROWS = 1 << 20


@dataclass
class _LiveRequests:
    """The batch indices that verify at least one entry, and how many each verifies
    (``[window_start, seq_len)``); padding rows and empty prefixes are left out."""

    batch_index: np.ndarray
    lengths: np.ndarray

    @property
    def entries(self) -> int:
        return int(self.lengths.sum())


def _live_requests(d: Dump) -> _LiveRequests:
    """The live requests, scanned ``_SCAN_ROWS`` batch rows at a time (memory stays within
    the size of the tables read, whatever the batch size)."""
    indices, lengths = [], []
    for begin in range(0, d.batch_size, _SCAN_ROWS):
        seq_lens = np.asarray(d.seq_lens[begin:begin + _SCAN_ROWS])
        length = np.maximum(0, seq_lens - window_start(seq_lens, d.swa_window_size))
        live = np.flatnonzero((np.asarray(d.req_pool_indices[begin:begin + _SCAN_ROWS]) != 0)
                              & (length > 0))
        indices.append(live + begin)
        lengths.append(length[live].astype(np.int64))
    return _LiveRequests(np.concatenate(indices or [np.zeros(0, np.int64)]),
                         np.concatenate(lengths or [np.zeros(0, np.int64)]))


def _plan_groups(lengths: np.ndarray, limit: int):
    """``(begin, end)`` ranges of consecutive live requests whose entries fit ``limit``
    together, each as long as fits; a request longer than ``limit`` is a range of its own,
    planned in pieces (:func:`_piece_launches`). One search per range, never a loop over the
    requests."""
    ends = np.cumsum(lengths)
    begin = 0
    while begin < lengths.size:
        before = int(ends[begin - 1]) if begin else 0
        end = max(begin + 1, int(np.searchsorted(ends, before + limit, side="right")))
        yield begin, end
        begin = end


def _live_launches(d: Dump, launcher: _Launcher, live: _LiveRequests, chunk: int):
    """The live requests' prefixes, planned by ``kvcanary.plan`` in groups of requests;
    a request longer than ``chunk`` in pieces of ``chunk`` entries."""
    device, xp = launcher.device, launcher.xp
    table = d.plan_table(device)
    lut = device(d.full_to_swa_index_mapping)
    pool = device(d.expected_tokens)
    check_token = pool is not None
    for begin, end in _plan_groups(live.lengths, chunk):
        batch = live.batch_index[begin:end]
        total = int(live.lengths[begin:end].sum())
        if total > chunk and batch.size == 1:
            yield from _piece_launches(d, launcher, int(batch[0]), total, chunk)
            continue
        verify_plan = VerifyPlan.allocate(total, xp=xp)
        write_plan = WritePlan.allocate(batch.size, xp=xp)
        valid_lens = None if pool is None else device(d.expected_tokens_valid_lens[batch])
        with _plan_errors(d):
            api.plan(req_pool_indices=device(d.req_pool_indices[batch]),
                     prefix_lens=device(d.seq_lens[batch]),
                     extend_seq_lens=xp.zeros(batch.size, dtype=xp.int64), **table,
                     verify_plan=verify_plan, write_plan=write_plan,
                     swa_window_size=d.swa_window_size, full_to_swa_index_mapping=lut,
                     req_to_verify_expected_tokens=pool,
                     req_to_verify_expected_tokens_valid_lens=valid_lens)
        entries = _Entries(*(to_host(a)[:total].copy() for a in (
            verify_plan.verify_slot_indices, verify_plan.verify_prev_slot_indices,
            verify_plan.verify_expected_positions, verify_plan.verify_expected_tokens)))
        batch_index = np.repeat(batch, live.lengths[begin:end])
        yield _Launch(int(d.launch_tag), verify_plan, entries, check_token, batch_index)


def _piece_launches(d: Dump, launcher: _Launcher, b: int, total: int, chunk: int):
    """One long request in pieces of ``chunk`` consecutive positions, each planned on the
    host by the reference's per-entry rule (``kvcanary.plan`` plans whole prefixes only),
    so no launch holds more than ``chunk`` entries however long the request claims to be."""
    seq_len = int(d.seq_lens[b])
    first = seq_len - total
    check_token = d.expected_tokens is not None
    valid_lens = None if not check_token else d.expected_tokens_valid_lens[b:b + 1]
    for start in range(first, seq_len, chunk):
        size = min(chunk, seq_len - start)
        with _plan_errors(d):
            slots, positions, prevs, tokens = verify_entries(
                d.slot_table, d.block_size, d.full_to_swa_index_mapping,
                d.req_pool_indices[b:b + 1], np.array([start], np.int64),
                np.array([size], np.int64), size, d.expected_tokens, valid_lens, 0)
        entries = _Entries(slots, prevs, positions, tokens)
        yield _Launch(int(d.launch_tag), entries.plan(launcher.device), entries, check_token,
                      np.full(size, b, dtype=np.int64))


@contextmanager
def _plan_errors(d: Dump):
    """A plan refusal (an SWA slot outside the mapping) as an :class:`AuditError` naming
    the dump."""
    try:
        yield
    except ValueError as exc:
        text = str(exc).removeprefix("kv-canary: ")
        where = "key full_to_swa_index_mapping: " if "full_to_swa" in text else ""
        raise AuditError(f"{d.path}: {where}{text}") from None


def _sweep_launches(d: Dump, launcher: _Launcher, chunk: int):
    """The dump's sweep entries as they are, with the SWEEP tag and no token check."""
    tag = int(sweep_tag(d.launch_tag)) if d.num_sweep_entries else 0
    for begin in range(0, d.num_sweep_entries, chunk):
        end = min(d.num_sweep_entries, begin + chunk)
        entries = _Entries(*(np.ascontiguousarray(a[begin:end], dtype=np.int64) for a in (
            d.sweep_slot_indices, d.sweep_prev_slot_indices, d.sweep_positions)),
            np.full(end - begin, EXPECTED_TOKEN_UNKNOWN, dtype=np.int64))
        yield _Launch(tag, entries.plan(launcher.device), entries, False, sweep_begin=begin)


# ------------------------------------------------------------ step 2: verify


def _verify(launcher: _Launcher, launch: _Launch) -> np.ndarray:
    """The launch's ring rows on the chosen backend (a ring with room for every entry)."""
    context = launcher.context(launch.tag, launch.size)
    api.verify(context, launch.plan, check_expected_token=launch.check_token)
    return context.violation_log.rows()


def _slot_zero_rows(entries: _Entries, tag: int, check_token: bool):
    """kvcanary's extension: a row for every live prefix entry mapped to padding slot 0."""
    zero = np.flatnonzero(entries.slots == 0)
    tokens = entries.tokens[zero] if check_token else EXPECTED_TOKEN_UNKNOWN
    rows = violation_rows(tag, 0, entries.positions[zero], 0, tokens, 0, 0,
                          int(FailReason.SLOT_ZERO_IN_PREFIX))
    return rows, zero


# ------------------------------------------------------------ step 3: attribute


def _attribute(rows: np.ndarray, launch: _Launch, launcher: _Launcher) -> np.ndarray:
    """Entry index of each ring row (-1 where no entry reproduces it).

    A row on a slot that exactly one entry of the launch uses belongs to that entry (its
    expected-token field must agree). Rows on a slot outside the buffer are matched by
    content against the rows their entries must produce; rows on a slot several entries
    share are matched by content against a re-check of those entries on the host reference."""
    result = np.full(rows.shape[0], -1, dtype=np.int64)
    if rows.shape[0] == 0:
        return result
    entries, num_slots = launch.entries, launcher.dump.num_slots
    row_slots = np.ascontiguousarray(rows[:, 1])
    in_range = (row_slots >= 0) & (row_slots < num_slots)
    first, last = launcher.slot_users(entries.slots)
    slot = np.where(in_range, row_slots, 0)
    candidate, earliest = np.take(last, slot), np.take(first, slot)
    # The tables outlive the launch: an entry of this launch must hold the row's slot.
    candidate = np.where(in_range & (candidate >= 0) & (candidate < launch.size), candidate,
                         0).astype(np.int64)
    used = in_range & (np.take(entries.slots, candidate) == row_slots)
    single = used & (earliest == candidate)
    expected = np.take(entries.tokens, candidate) if launch.check_token else EXPECTED_TOKEN_UNKNOWN
    single &= rows[:, 4] == expected
    result[single] = candidate[single]

    outside = np.flatnonzero(~in_range)
    if outside.size:
        result[outside] = _match_outside(rows[outside], launch)
    shared = np.flatnonzero(used & (earliest != candidate))
    if shared.size:
        result[shared] = _match_shared(rows[shared], launch, launcher)
    return result


def _match_outside(rows: np.ndarray, launch: _Launch) -> np.ndarray:
    """Rows on slots outside the buffer: such an entry's row is fixed by the entry alone."""
    e = launch.entries
    candidates = np.flatnonzero(np.isin(e.slots, np.unique(rows[:, 1])))
    tokens = e.tokens[candidates] if launch.check_token else EXPECTED_TOKEN_UNKNOWN
    predicted = violation_rows(launch.tag, e.slots[candidates], e.positions[candidates], 0,
                               tokens, 0, e.slots[candidates], int(FailReason.SLOT_OUT_OF_RANGE))
    return _match_rows(rows, predicted, candidates)


def _match_shared(rows: np.ndarray, launch: _Launch, launcher: _Launcher) -> np.ndarray:
    """Rows on slots several entries use: the candidates' rows are predicted on the host
    reference in one pass (an entry's row depends on the entry alone, so each predicted row
    names its entry) and matched by content."""
    e = launch.entries
    candidates = np.flatnonzero(np.isin(e.slots, np.unique(rows[:, 1])))
    tokens = e.tokens[candidates] if launch.check_token else np.full(
        candidates.size, EXPECTED_TOKEN_UNKNOWN, dtype=np.int64)
    context = launcher.context(launch.tag, 1, host=True)
    failed, predicted = entry_rows(context, e.slots[candidates], e.positions[candidates],
                                   e.prevs[candidates], tokens)
    return _match_rows(rows, predicted, candidates[failed])


def _occurrence(groups: np.ndarray, order_key: np.ndarray) -> np.ndarray:
    """Rank of each element among equal ``groups``, counted in ``order_key`` order."""
    order = np.lexsort((order_key, groups))
    sorted_groups = groups[order]
    rank_sorted = np.arange(order.size) - np.searchsorted(sorted_groups, sorted_groups, "left")
    rank = np.empty_like(rank_sorted)
    rank[order] = rank_sorted
    return rank


def _row_groups(rows: np.ndarray) -> np.ndarray:
    """A group id per row, equal for identical rows (``np.unique(axis=0)`` sorts the rows as
    opaque bytes, many times slower than a lexsort of the columns)."""
    order = np.lexsort(rows.T[::-1])
    ordered = rows[order]
    starts = np.ones(order.size, dtype=np.int64)
    starts[1:] = np.any(ordered[1:] != ordered[:-1], axis=1)
    groups = np.empty(order.size, dtype=np.int64)
    groups[order] = np.cumsum(starts) - 1
    return groups


def _match_rows(rows: np.ndarray, predicted: np.ndarray, entries: np.ndarray) -> np.ndarray:
    """For each ring row, the entry of an identical predicted row: the k-th copy of a row
    content (ring order) takes the k-th entry predicting it (entry order); -1 if none."""
    result = np.full(rows.shape[0], -1, dtype=np.int64)
    if predicted.shape[0] == 0:
        return result
    if predicted.shape == rows.shape and np.array_equal(predicted, rows):
        return entries.astype(np.int64, copy=True)   # rows in entry order (the reference's)
    n = rows.shape[0]
    groups = _row_groups(np.concatenate([rows, predicted]))
    span = max(n, predicted.shape[0]) + 1
    row_keys = groups[:n] * span + _occurrence(groups[:n], np.arange(n))
    predicted_keys = groups[n:] * span + _occurrence(groups[n:], entries)
    order = np.argsort(predicted_keys, kind="stable")
    sorted_keys = predicted_keys[order]
    at = np.minimum(np.searchsorted(sorted_keys, row_keys), sorted_keys.size - 1)
    found = sorted_keys[at] == row_keys
    result[found] = entries[order][at[found]]
    return result


# ------------------------------------------------------------ step 4: summarise


def _value_counts(values: np.ndarray) -> tuple:
    """``(distinct values, counts)`` of an int64 column."""
    if values.size and 0 <= int(values.min()) and int(values.max()) < 1 << 16:
        counts = np.bincount(values)
        present = np.flatnonzero(counts)
        return present, counts[present]
    return np.unique(values, return_counts=True)


class _Tally:
    """Exact totals over every row, and the findings of the first ``keep`` rows."""

    def __init__(self, d: Dump, keep: int):
        self.dump, self.keep = d, keep
        self.total = self.unattributed = self.sweep = 0
        self.reasons, self.tags = Counter(), Counter()
        self.findings: list = []
        self.requests: list = []
        # Fail bits ORed per canary slot (allocated at the first row), and per launch which
        # entries had a row.
        self.slot_bits = np.zeros(0, dtype=np.int64)
        self.failing_entries: list = []

    def add(self, rows: np.ndarray, entry_of: np.ndarray, launch: _Launch) -> None:
        if rows.shape[0] == 0:
            self.failing_entries.append(None)
            return
        self.total += rows.shape[0]
        for value, count in zip(*(a.tolist() for a in _value_counts(rows[:, 7]))):
            for label in reason_labels(value) or ["none"]:
                self.reasons[label] += count
        for value, count in zip(*(a.tolist() for a in _value_counts(rows[:, 0]))):
            self.tags[tag_name(value)] += count
        # Row of each failing entry. An entry yields at most one row: a second row naming the
        # same entry (only a faulty backend emits one) counts as unattributed.
        claims = np.flatnonzero(entry_of >= 0)[::-1]
        row_of = np.full(launch.size, -1, dtype=np.int64)
        row_of[entry_of[claims]] = claims          # reversed: the first claim wins
        failing = np.flatnonzero(row_of >= 0)
        attributed = np.zeros(rows.shape[0], dtype=bool)
        attributed[row_of[failing]] = True
        entry_of = np.where(attributed, entry_of, -1)
        self.unattributed += int(rows.shape[0] - failing.size)
        if self.slot_bits.size == 0:
            self.slot_bits = np.zeros(self.dump.num_slots, dtype=np.int64)
        inside = (rows[:, 1] >= 0) & (rows[:, 1] < self.dump.num_slots)
        slots, bits = rows[inside, 1], rows[inside, 7]
        for value in _value_counts(bits)[0].tolist():   # a few distinct reason sets
            self.slot_bits[slots[bits == value]] |= value
        mask = np.zeros(launch.size, dtype=bool)
        mask[failing] = True
        self.failing_entries.append(mask)
        if launch.live:
            self._add_requests(failing, launch)
        else:
            self.sweep += int(failing.size)
        room = self.keep - len(self.findings)
        if room <= 0:
            return
        order = np.concatenate([row_of[failing[:room]], np.flatnonzero(~attributed)[:room]])[:room]
        for index in order.tolist():
            entry = int(entry_of[index])
            self.findings.append(self._finding(Violation(*rows[index].tolist()), entry, launch))

    def _add_requests(self, failing: np.ndarray, launch: _Launch) -> None:
        """Per affected request: count and first/last position (entries of a request are
        consecutive and in position order)."""
        if failing.size == 0:
            return
        batch = launch.batch_index[failing]
        heads = np.flatnonzero(np.diff(batch, prepend=-1))
        tails = np.append(heads[1:], batch.size) - 1
        positions = launch.entries.positions
        rows_table = self.dump.req_pool_indices
        for head, tail in zip(heads.tolist(), tails.tolist()):
            b = int(batch[head])
            summary = RequestSummary(
                batch_index=b, request_row=int(rows_table[b]), violations=tail - head + 1,
                first_position=int(positions[failing[head]]),
                last_position=int(positions[failing[tail]]))
            if self.requests and self.requests[-1].batch_index == b:   # a long request's piece
                earlier = self.requests.pop()
                summary = replace(summary, violations=earlier.violations + summary.violations,
                                  first_position=earlier.first_position)
            self.requests.append(summary)

    def _finding(self, v: Violation, entry: int, launch: _Launch) -> Finding:
        d, e = self.dump, launch.entries
        if entry < 0:
            return _finding(v, "unattributed")
        where = dict(position=int(e.positions[entry]), prev_slot=int(e.prevs[entry]))
        if not launch.live:
            return _finding(v, "sweep", sweep_index=launch.sweep_begin + entry,
                            **where)
        b = int(launch.batch_index[entry])
        row = int(d.req_pool_indices[b])
        return _finding(v, "request", batch_index=b, request_row=row, **where,
                        **_block_of(d, row, where["position"]))

    def fill(self, result: "AuditResult") -> None:
        result.total_violations = self.total
        result.findings = self.findings
        result.counts_by_reason = dict(sorted(self.reasons.items()))
        result.counts_by_tag = dict(sorted(self.tags.items()))
        requests = sum(r.violations for r in self.requests)
        result.counts_by_entry = {name: count for name, count in (
            ("request", requests), ("sweep", self.sweep), ("unattributed", self.unattributed))
            if count}
        result.requests = self.requests
        result.unattributed = self.unattributed


class _DumpTables:
    """What a dump's tables say at (request row, position), for the diagnosis."""

    def __init__(self, d: Dump):
        self.dump = d

    def slot(self, row: int, position: int) -> int | None:
        """The table's full slot (before any SWA translation), or None past the table."""
        d = self.dump
        table = d.slot_table
        column = position // d.block_size
        if not (0 <= row < table.shape[0] and 0 <= column < table.shape[1] and position >= 0):
            return None
        slot = int(table[row, column])
        if d.block_table is not None:
            slot = slot * d.block_size + position % d.block_size if slot else 0
        return slot

    def token(self, row: int, position: int) -> int | None:
        """The expected token at ``position`` of a batch's request row, or None."""
        d = self.dump
        pool = d.expected_tokens
        if pool is None or not (0 <= row < pool.shape[0] and 0 <= position < pool.shape[1]):
            return None
        batch = np.flatnonzero(np.asarray(d.req_pool_indices) == row)
        if batch.size == 0 or position >= int(d.expected_tokens_valid_lens[batch[0]]):
            return None
        return int(pool[row, position])


def _block_of(d: Dump, row: int, position: int) -> dict:
    """Where a paged dump's position goes through its block table (nothing for per-token)."""
    if d.block_table is None:
        return {}
    index = position // d.block_size
    inside = 0 <= row < d.block_table.shape[0] and index < d.block_table.shape[1]
    return {"block_index": index, "block": int(d.block_table[row, index]) if inside else -1}


def _finding(v: Violation, kind: str, **where) -> Finding:
    """A finding without its diagnosis yet (:func:`_diagnose` adds it after the loop)."""
    return Finding(violation=v, kind=kind, checks=failed_checks(v.fail_reason_bits), **where)


# ------------------------------------------------------------ step 5: diagnose


def _diagnose(tally: _Tally, d: Dump, launcher: _Launcher, live: _LiveRequests,
              chunk: int) -> tuple:
    """Every kept finding with its :func:`~kvcanary.diagnosis.diagnose`; returns
    ``(findings, zero records among the live entries)``.

    The other users of a finding's slot and the records its stored link continues may sit
    in any chunk, so the live entries are planned once more, keeping only those that read a
    finding's slot or whose record a finding's record continues."""
    findings = tally.findings
    if not findings:
        return findings, 0
    rows = np.stack([f.violation.to_row() for f in findings])
    fields = canary_fields(d.canary)
    # Zero records are counted only when a finding reads one (the wrong-buffer question).
    zero = None
    if np.any((rows[:, 2] == 0) & (rows[:, 3] == 0) & (rows[:, 5] == 0)):
        zero = ~fields.any(axis=1)
        zero[:1] = False   # slot 0 is padding: never counted
    # Records whose link a finding's stored link equals: their readers are its parents.
    parents = _equal_to_any(_slot_links(fields), rows[:, 5])
    interest = np.concatenate([rows[:, 1], [f.prev_slot for f in findings], parents])
    marked = np.zeros(d.num_slots, dtype=bool)
    marked[interest[(interest >= 0) & (interest < d.num_slots)]] = True
    parts, zero_entries, checked = [], 0, 0
    launches = itertools.chain(_live_launches(d, launcher, live, chunk),
                               _sweep_launches(d, launcher, chunk))
    for launch, failing in zip(launches, tally.failing_entries):
        e = launch.entries
        inside = (e.slots > 0) & (e.slots < d.num_slots)
        at_slot = np.where(inside, e.slots, 0)
        if launch.live and zero is not None:
            zero_entries += int(np.count_nonzero(np.take(zero, at_slot)))
            checked += int(np.count_nonzero(e.slots > 0))
        keep = np.flatnonzero(np.take(marked, at_slot))
        outside = np.flatnonzero(~inside)
        if outside.size:
            keep = np.union1d(keep, outside[np.isin(e.slots[outside], interest)])
        # Sweep entries belong to no request: batch index and row -1 (one cached chain).
        batch = launch.batch_index[keep] if launch.live else np.full(keep.size, -1, np.int64)
        parts.append(Evidence.from_entries(
            slots=e.slots[keep], positions=e.positions[keep], tokens=e.tokens[keep],
            batch_index=batch,
            request_rows=np.asarray(d.req_pool_indices)[batch] if launch.live else batch,
            records=fields, failing=None if failing is None else failing[keep],
            prev_slots=e.prevs[keep]))
    evidence = Evidence.merge(parts)
    asked = np.unique(np.concatenate([interest, evidence.prev_slots]).astype(np.int64))
    asked = asked[(asked >= 0) & (asked < d.num_slots)]
    evidence.failing_slots, evidence.failing_bits = asked[tally.slot_bits[asked] != 0], \
        tally.slot_bits[asked][tally.slot_bits[asked] != 0].astype(np.int64)
    evidence.zero_entries, evidence.checked_entries = zero_entries, checked
    stored = {(f.batch_index, f.position): f.violation.position for f in findings
              if f.kind == "request"}
    swa = d.full_to_swa_index_mapping is not None
    table = "req_to_token" if d.block_table is None else "block_table"
    tables = _DumpTables(d)
    result = []
    for f in findings:
        entry = f.entry()
        if f.kind == "request" and f.block_index >= 0 and f.position > 0:
            prev = _block_of(d, f.request_row, f.position - 1)
            entry = dataclasses.replace(entry, prev_block_index=prev["block_index"],
                                        prev_block=prev["block"])
        diagnosis = diagnose(f.violation, entry, evidence, num_slots=d.num_slots, swa=swa,
                             table=table, swapped_with=lambda b, q: stored.get((b, q)),
                             tables=tables)
        result.append(dataclasses.replace(f, diagnosis=diagnosis, cause=diagnosis.text))
    return result, zero_entries


# Low bits of a hash that index the filter of :func:`_equal_to_any`.
_FILTER_BITS = 20


def _equal_to_any(values: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Indices of ``values`` (uniform hashes) equal to one of a few ``targets``: a bit table
    on the low bits picks the candidates in one pass, an exact test confirms them."""
    mask = (1 << _FILTER_BITS) - 1
    table = np.zeros(1 << _FILTER_BITS, dtype=bool)
    table[targets & mask] = True
    candidates = np.flatnonzero(np.take(table, values & mask))
    return candidates[np.isin(values[candidates], targets)]


def _slot_links(fields: np.ndarray) -> np.ndarray:
    """The chain link of every slot's record, block by block (bounded scratch memory)."""
    links = np.empty(fields.shape[0], dtype=np.int64)
    for begin in range(0, fields.shape[0], CHUNK_ENTRIES):
        links[begin:begin + CHUNK_ENTRIES] = record_links(fields[begin:begin + CHUNK_ENTRIES])
    return links


# ------------------------------------------------------------ the loop


def audit(dump, *, backend: str = "auto", max_real_kv_sources: int = MAX_REAL_KV_SOURCES,
          ring_capacity: int | None = None, max_findings: int = DEFAULT_MAX_FINDINGS,
          compat: bool = False, chunk_entries: int = CHUNK_ENTRIES, progress=None,
          observe=None) -> AuditResult:
    """Audit a :class:`~kvcanary.dump.Dump` (or a path to one); see the module docstring.

    ``max_findings`` bounds the rows kept as findings (0 keeps every row); the totals and
    counts always cover every row. ``progress(done_entries, total_entries)`` is called after
    every launch when given; ``observe(CheckedLaunch)`` too, with every row of the launch.

    Example (every row, however many findings are kept)::

        launches = []
        result = audit("dump.npz", backend="numpy", observe=launches.append)
        assert sum(l.rows.shape[0] for l in launches) == result.total_violations"""
    started = time.perf_counter()
    if isinstance(dump, (str, os.PathLike)):
        dump = load(dump)
    d = dump
    chosen = resolve_backend(backend)
    live = _live_requests(d)
    live_entries = live.entries
    total_entries = live_entries + d.num_sweep_entries
    if total_entries == 0:
        raise AuditError(f"{d.path}: nothing to check: no live request has a written prefix "
                         "(req_pool_indices / seq_lens) and there are no sweep entries; "
                         "an audit of zero entries proves nothing")
    ring_capacity = total_entries if ring_capacity is None else int(ring_capacity)
    if ring_capacity < 1:
        raise AuditError(f"ring capacity must be at least 1, got {ring_capacity}")
    if max_findings < 0:
        raise AuditError(f"max_findings must be 0 (keep every finding) or more, got {max_findings}")
    bound = check_source_bound(max_real_kv_sources)
    try:
        check_source_count(len(d.real_kv), bound,
                           raise_with="kvcanary audit --max-real-kv-sources N")
    except ValueError as exc:   # one line: the CLI shows a single line per error
        text = " ".join(str(exc).removeprefix("kv-canary: ").splitlines())
        raise AuditError(f"{d.path}: key real_kv_params: {text}") from None

    launcher = _Launcher(d, chosen, max_real_kv_sources)
    check_token = d.expected_tokens is not None
    result = AuditResult(
        path=d.path, backend=chosen, launch_tag=d.launch_tag.name, num_slots=d.num_slots,
        live_requests=int(np.count_nonzero(np.asarray(d.req_pool_indices))),
        live_entries=live_entries, sweep_entries=d.num_sweep_entries,
        real_kv_sources=len(d.real_kv), real_kv_hash_mode=d.real_kv_hash_mode.name.lower(),
        swa_window_size=d.swa_window_size, check_expected_token=check_token, compat=compat,
        ring_capacity=ring_capacity, max_findings=int(max_findings))
    keep = min(ring_capacity, max_findings or ring_capacity)
    tally = _Tally(d, keep)
    chunk = max(1, int(chunk_entries))
    done = 0
    launches = itertools.chain(_live_launches(d, launcher, live, chunk),
                               _sweep_launches(d, launcher, chunk))
    for launch in launches:
        rows = _verify(launcher, launch)
        entry_of = _attribute(rows, launch, launcher)
        if launch.live and not compat:
            zero_rows, zero_entries = _slot_zero_rows(launch.entries, launch.tag, check_token)
            rows = np.concatenate([rows, zero_rows])
            entry_of = np.concatenate([entry_of, zero_entries])
        tally.add(rows, entry_of, launch)
        if observe:
            observe(CheckedLaunch(launch.entries.slots, launch.entries.positions,
                                  launch.batch_index, rows, entry_of))
        done += launch.size
        if progress:
            progress(done, total_entries)
    tally.findings, result.zero_records = _diagnose(tally, d, launcher, live, chunk)
    tally.fill(result)
    result.counts_by_cause = dict(sorted(Counter(
        f.diagnosis.cause for f in tally.findings).items()))
    result.elapsed_s = time.perf_counter() - started
    return result
