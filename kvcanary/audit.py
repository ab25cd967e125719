"""Audit a dump: verify every live request's prefix (and the sweep entries) the way the
runtime would, then explain each violation.

Data flows plan -> verify -> violations -> findings:

1. For every live request (``req_pool_indices != 0``) the verify plan covers positions
   ``[window_start, seq_len)``, built by ``kvcanary.plan`` with ``prefix_lens = seq_lens``
   and ``extend_seq_lens = 0``, in chunks of requests so memory stays bounded.
2. ``kvcanary.verify`` checks them on the chosen backend (numpy reference or CUDA kernels),
   with the token check on when the dump carries ``expected_tokens``.
3. kvcanary's slot-zero extension (off with ``compat=True``) adds a
   ``SLOT_ZERO_IN_PREFIX`` row for every live prefix entry mapped to padding slot 0.
4. Each row is attributed to the plan entry that produced it (request row and position, or
   sweep entry) and gets the failed checks in words and a likely cause.

Every row counts; rows beyond ``ring_capacity`` are dropped from the report only, and the
result says how many (upstream's fill-once ring). Checking zero entries is an error.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from . import api
from .consts import (
    EXPECTED_TOKEN_UNKNOWN,
    MAX_REAL_KV_SOURCES,
    PLAN_SLOT_OUT_OF_TABLE,
    FailReason,
    LaunchTag,
)
from .dump import Dump, load
from .reference.plan import window_start
from .reference.ring import violation_rows
from .types import (CanaryContext, RealKvSource, VerifyPlan, ViolationLog, WritePlan,
                    check_source_bound, check_source_count)
from .violations import Violation, reason_labels, tag_name

BACKENDS = ("auto", "numpy", "cupy")
# Plan entries per verify launch: bounds the plan and ring memory of one chunk.
CHUNK_ENTRIES = 1 << 20

CHECK_WORDS = {
    FailReason.VERIFY_CHAIN_HASH_MISMATCH: "chain link to the predecessor",
    FailReason.VERIFY_POSITION_MISMATCH: "stored position",
    FailReason.VERIFY_REAL_KV_HASH_MISMATCH: "real-KV hash",
    FailReason.WRITE_TOKEN_MISMATCH: "written token",
    FailReason.WRITE_POSITION_MISMATCH: "written position",
    FailReason.VERIFY_TOKEN_MISMATCH: "expected token",
    FailReason.SLOT_OUT_OF_RANGE: "slot inside the canary buffer",
    FailReason.SLOT_ZERO_IN_PREFIX: "live entry not on padding slot 0",
}


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
    request_row: int = -1     # req_to_token row
    position: int = -1        # the entry's expected position
    prev_slot: int = -1       # the entry's predecessor slot
    sweep_index: int = -1
    checks: tuple = ()
    cause: str = ""

    def where(self) -> str:
        if self.kind == "request":
            return (f"request row {self.request_row} (batch index {self.batch_index}), "
                    f"position {self.position}, slot {self.violation.slot_idx}")
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
        return record


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
    total_violations: int = 0
    findings: list = field(default_factory=list)
    counts_by_reason: dict = field(default_factory=dict)
    counts_by_tag: dict = field(default_factory=dict)
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

    def config_record(self) -> dict:
        return {"record": "config", "dump": self.path, "backend": self.backend,
                "launch_tag": self.launch_tag, "num_slots": self.num_slots,
                "live_requests": self.live_requests, "real_kv_sources": self.real_kv_sources,
                "real_kv_hash_mode": self.real_kv_hash_mode,
                "swa_window_size": self.swa_window_size,
                "check_expected_token": self.check_expected_token,
                "extensions": not self.compat, "ring_capacity": self.ring_capacity}

    def summary_record(self) -> dict:
        return {"record": "summary", "dump": self.path, "entries_checked": self.entries_checked,
                "live_entries": self.live_entries, "sweep_entries": self.sweep_entries,
                "violations": self.total_violations, "reported": len(self.findings),
                "ring_overflow": self.ring_overflow, "dropped": self.dropped,
                "unattributed": self.unattributed,
                "counts_by_reason": dict(self.counts_by_reason),
                "counts_by_tag": dict(self.counts_by_tag), "elapsed_s": round(self.elapsed_s, 3)}

    def findings_at(self, request_row: int, position: int) -> list:
        return [f for f in self.findings
                if f.kind == "request" and f.request_row == request_row and f.position == position]


# --------------------------------------------------------------------------- explanation


def failed_checks(bits: int) -> tuple:
    words = []
    for bit, text in CHECK_WORDS.items():
        if bits & int(bit):
            words.append(text)
    unknown = bits & ~sum(int(b) for b in CHECK_WORDS)
    if unknown:
        words.append(f"unknown bits {unknown:#x}")
    return tuple(words)


def likely_cause(v: Violation, *, position: int, prev_slot: int, num_slots: int,
                 swa: bool = False) -> str:
    bits, s = v.fail_reason_bits, v.slot_idx
    causes = []
    if bits & FailReason.SLOT_OUT_OF_RANGE:
        if s == PLAN_SLOT_OUT_OF_TABLE:
            causes.append(f"position {position} lies outside req_to_token: seq_len is larger "
                          "than the table, or the request row is not in the table")
        elif s < 0 or s >= num_slots:
            causes.append(f"the table entry points outside the canary buffer (slot {s}, the "
                          f"buffer has {num_slots} slots): a corrupt or stale req_to_token entry")
        else:
            causes.append(f"the predecessor entry (position {position - 1}) points outside the "
                          f"canary buffer (slot {v.expected_aux})")
    if bits & FailReason.SLOT_ZERO_IN_PREFIX and swa:
        causes.append("a live entry inside the sliding window maps to SWA slot 0: its SWA slot "
                      "was freed (full_to_swa_index_mapping holds 0) or never assigned, or the "
                      "table entry itself is 0")
    elif bits & FailReason.SLOT_ZERO_IN_PREFIX:
        causes.append("a live prefix entry is mapped to padding slot 0: the slot was never "
                      "assigned, or its mapping was cleared while the request still uses it "
                      "(lost write or premature free)")
    if bits & FailReason.VERIFY_POSITION_MISMATCH:
        causes.append(f"slot {s} holds the record of position {v.position}, not {position}: "
                      "the slot was reused by another sequence while this request still maps "
                      "it, or the mapping is shifted or swapped")
    if bits & FailReason.VERIFY_TOKEN_MISMATCH:
        causes.append(f"slot {s} holds token {v.stored_token} where the request's history has "
                      f"{v.expected_token}: another token's KV was written here, or the slot "
                      "was reused by a sequence with different content")
    if bits & FailReason.VERIFY_CHAIN_HASH_MISMATCH and not causes:
        if prev_slot < 0:
            causes.append(f"chain head at position {position} does not start from the anchor: "
                          "the slot holds a record written as the continuation of another "
                          "sequence")
        else:
            causes.append(f"chain link broken at position {position}: the record at the "
                          f"predecessor slot {prev_slot} (position {position - 1}) was "
                          "overwritten or remapped after this token was written, or this "
                          "record's own prev-hash was altered")
    elif bits & FailReason.VERIFY_CHAIN_HASH_MISMATCH:
        causes.append("the chain link to the predecessor fails too")
    if bits & FailReason.VERIFY_REAL_KV_HASH_MISMATCH:
        if causes:
            causes.append("and the slot's real KV bytes no longer match its record")
        else:
            causes.append(f"the real KV bytes of slot {s} changed after its canary record was "
                          "written (the record itself is intact): an in-place overwrite, a "
                          "stray write into this slot, or transfer/offload corruption")
    if bits & (FailReason.WRITE_TOKEN_MISMATCH | FailReason.WRITE_POSITION_MISMATCH):
        causes.append("the forward consumed different input tokens or positions than expected")
    return "; ".join(causes) or "unknown"


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


@dataclass
class _Entries:
    """Host copy of one launch's plan entries."""

    slots: np.ndarray
    prevs: np.ndarray
    positions: np.ndarray
    tokens: np.ndarray


def _host(array) -> np.ndarray:
    return array.get() if hasattr(array, "get") and not isinstance(array, np.ndarray) else np.asarray(array)


def _plan_chunks(lengths: np.ndarray, limit: int):
    """Consecutive batch ranges whose entry totals stay within ``limit`` (one long request
    may exceed it alone)."""
    begin, total = 0, 0
    for index, length in enumerate(lengths.tolist()):
        if total and total + length > limit:
            yield begin, index, total
            begin, total = index, 0
        total += length
    if begin < lengths.shape[0]:
        yield begin, lengths.shape[0], total


def _attribute(rows: np.ndarray, entries: _Entries, launcher: _Launcher, tag: int,
               check_token: bool) -> np.ndarray:
    """Entry index of each ring row (-1 where no entry reproduces it).

    Candidates are the entries whose slot appears in a row. They are re-verified on the host
    reference in batches where every slot occurs once, so each predicted row names its entry
    without ambiguity; rows are then matched by their full contents, in entry order."""
    result = np.full(rows.shape[0], -1, dtype=np.int64)
    if rows.shape[0] == 0:
        return result
    candidates = np.flatnonzero(np.isin(entries.slots, np.unique(rows[:, 1])))
    if candidates.size == 0:
        return result
    cand_slots = entries.slots[candidates]
    order = np.argsort(cand_slots, kind="stable")
    sorted_slots = cand_slots[order]
    rank_sorted = np.arange(order.size) - np.searchsorted(sorted_slots, sorted_slots, "left")
    rank = np.empty_like(rank_sorted)
    rank[order] = rank_sorted
    predicted_rows, predicted_entries = [], []
    for k in range(int(rank.max()) + 1):
        batch = candidates[rank == k]
        plan = VerifyPlan(verify_slot_indices=entries.slots[batch].copy(),
                          verify_expected_tokens=entries.tokens[batch].copy(),
                          verify_expected_positions=entries.positions[batch].copy(),
                          verify_prev_slot_indices=entries.prevs[batch].copy(),
                          verify_num_valid=np.array([batch.size], dtype=np.int32),
                          enable=np.ones(1, dtype=np.int32))
        context = launcher.context(tag, batch.size, host=True)
        api.verify(context, plan, check_expected_token=check_token, backend="numpy")
        got = context.violation_log.rows()
        by_slot = np.argsort(entries.slots[batch], kind="stable")
        predicted_rows.append(got)
        predicted_entries.append(
            batch[by_slot][np.searchsorted(entries.slots[batch][by_slot], got[:, 1])])
    return _match_rows(rows, np.concatenate(predicted_rows), np.concatenate(predicted_entries))


def _occurrence(groups: np.ndarray, order_key: np.ndarray) -> np.ndarray:
    """Rank of each element among equal ``groups``, counted in ``order_key`` order."""
    order = np.lexsort((order_key, groups))
    sorted_groups = groups[order]
    rank_sorted = np.arange(order.size) - np.searchsorted(sorted_groups, sorted_groups, "left")
    rank = np.empty_like(rank_sorted)
    rank[order] = rank_sorted
    return rank


def _match_rows(rows: np.ndarray, predicted: np.ndarray, entries: np.ndarray) -> np.ndarray:
    """For each ring row, the entry of an identical predicted row: the k-th copy of a row
    content (ring order) takes the k-th entry predicting it (entry order); -1 if none."""
    result = np.full(rows.shape[0], -1, dtype=np.int64)
    if predicted.shape[0] == 0:
        return result
    n = rows.shape[0]
    _, groups = np.unique(np.concatenate([rows, predicted]), axis=0, return_inverse=True)
    groups = groups.reshape(-1).astype(np.int64)
    span = max(n, predicted.shape[0]) + 1
    row_keys = groups[:n] * span + _occurrence(groups[:n], np.arange(n))
    predicted_keys = groups[n:] * span + _occurrence(groups[n:], entries)
    order = np.argsort(predicted_keys, kind="stable")
    sorted_keys = predicted_keys[order]
    at = np.minimum(np.searchsorted(sorted_keys, row_keys), sorted_keys.size - 1)
    found = sorted_keys[at] == row_keys
    result[found] = entries[order][at[found]]
    return result


def _slot_zero_rows(entries: _Entries, tag: int, check_token: bool):
    zero = np.flatnonzero(entries.slots == 0)
    tokens = entries.tokens[zero] if check_token else EXPECTED_TOKEN_UNKNOWN
    rows = violation_rows(tag, 0, entries.positions[zero], 0, tokens, 0, 0,
                          int(FailReason.SLOT_ZERO_IN_PREFIX))
    return rows, zero


def audit(dump, *, backend: str = "auto", max_real_kv_sources: int = MAX_REAL_KV_SOURCES,
          ring_capacity: int | None = None, compat: bool = False,
          chunk_entries: int = CHUNK_ENTRIES, progress=None) -> AuditResult:
    """Audit a :class:`~kvcanary.dump.Dump` (or a path to one); see the module docstring.

    ``progress(done_entries, total_entries)`` is called after every launch when given."""
    started = time.perf_counter()
    if isinstance(dump, (str, os.PathLike)):
        dump = load(dump)
    chosen = resolve_backend(backend)
    d = dump
    rows_table = np.asarray(d.req_pool_indices)
    seq_lens = np.asarray(d.seq_lens)
    active = rows_table != 0
    starts = window_start(seq_lens, d.swa_window_size)
    lengths = np.where(active, np.maximum(0, seq_lens - starts), 0).astype(np.int64)
    live_entries = int(lengths.sum())
    sweep_entries = d.num_sweep_entries
    total_entries = live_entries + sweep_entries
    if total_entries == 0:
        raise AuditError(f"{d.path}: nothing to check: no live request has a written prefix "
                         "(req_pool_indices / seq_lens) and there are no sweep entries; "
                         "an audit of zero entries proves nothing")
    if ring_capacity is None:
        ring_capacity = total_entries
    if ring_capacity < 1:
        raise AuditError(f"ring capacity must be at least 1, got {ring_capacity}")
    bound = check_source_bound(max_real_kv_sources)
    try:
        check_source_count(len(d.real_kv), bound,
                           raise_with="kvcanary audit --max-real-kv-sources N")
    except ValueError as exc:
        raise AuditError(f"{d.path}: key real_kv_params: {str(exc).removeprefix('kv-canary: ')}"
                         ) from None
    launcher = _Launcher(d, chosen, max_real_kv_sources)
    check_token = d.expected_tokens is not None
    tag = int(d.launch_tag)
    result = AuditResult(
        path=d.path, backend=chosen, launch_tag=d.launch_tag.name, num_slots=d.num_slots,
        live_requests=int(active.sum()), live_entries=live_entries, sweep_entries=sweep_entries,
        real_kv_sources=len(d.real_kv), real_kv_hash_mode=d.real_kv_hash_mode.name.lower(),
        swa_window_size=d.swa_window_size, check_expected_token=check_token, compat=compat,
        ring_capacity=int(ring_capacity))
    capacity = int(ring_capacity)
    kept = []  # findings of the first `capacity` rows (the report's fill-once ring)
    reasons, tags = Counter(), Counter()
    done = total_rows = 0  # a Python int: the report ring's int32 index could wrap

    def account(rows: np.ndarray, entry_of: np.ndarray, describe) -> None:
        nonlocal done, total_rows
        order = np.argsort(np.where(entry_of < 0, np.iinfo(np.int64).max, entry_of), kind="stable")
        rows, entry_of = rows[order], entry_of[order]
        base = len(kept)
        total_rows += rows.shape[0]
        bits, bit_counts = np.unique(rows[:, 7], return_counts=True)
        for value, count in zip(bits.tolist(), bit_counts.tolist()):
            for label in reason_labels(value) or ["none"]:
                reasons[label] += count
        kinds, kind_counts = np.unique(rows[:, 0], return_counts=True)
        for value, count in zip(kinds.tolist(), kind_counts.tolist()):
            tags[tag_name(value)] += count
        room = max(0, min(rows.shape[0], capacity - base))
        for row, entry in zip(rows[:room].tolist(), entry_of[:room].tolist()):
            kept.append(describe(Violation(*row), entry))

    device = launcher.device
    table = device(d.req_to_token)
    lut = device(d.full_to_swa_index_mapping)
    pool = device(d.expected_tokens)
    xp = launcher.xp
    for begin, end, total in _plan_chunks(lengths, max(1, int(chunk_entries))):
        if total == 0:
            continue
        bs = end - begin
        verify_plan = VerifyPlan.allocate(total, xp=xp)
        write_plan = WritePlan.allocate(bs, xp=xp)
        valid_lens = None if pool is None else device(
            np.ascontiguousarray(d.expected_tokens_valid_lens[begin:end]))
        try:
            api.plan(req_pool_indices=device(np.ascontiguousarray(rows_table[begin:end])),
                     prefix_lens=device(np.ascontiguousarray(seq_lens[begin:end])),
                     extend_seq_lens=xp.zeros(bs, dtype=xp.int64), req_to_token=table,
                     verify_plan=verify_plan, write_plan=write_plan,
                     swa_window_size=d.swa_window_size, full_to_swa_index_mapping=lut,
                     req_to_verify_expected_tokens=pool,
                     req_to_verify_expected_tokens_valid_lens=valid_lens)
        except ValueError as exc:
            text = str(exc).removeprefix("kv-canary: ")
            where = "key full_to_swa_index_mapping: " if "full_to_swa" in text else ""
            raise AuditError(f"{d.path}: {where}{text}") from None
        context = launcher.context(tag, total)
        api.verify(context, verify_plan, check_expected_token=check_token)
        entries = _Entries(*(_host(a)[:total].copy() for a in (
            verify_plan.verify_slot_indices, verify_plan.verify_prev_slot_indices,
            verify_plan.verify_expected_positions, verify_plan.verify_expected_tokens)))
        rows = context.violation_log.rows()
        entry_of = _attribute(rows, entries, launcher, tag, check_token)
        if not compat:
            zero_rows, zero_entries = _slot_zero_rows(entries, tag, check_token)
            rows = np.concatenate([rows, zero_rows])
            entry_of = np.concatenate([entry_of, zero_entries])
        chunk_lengths = lengths[begin:end]
        nonempty = np.flatnonzero(chunk_lengths > 0)
        offsets = (np.cumsum(chunk_lengths) - chunk_lengths)[nonempty]

        def describe(v, entry, entries=entries, offsets=offsets, nonempty=nonempty, begin=begin):
            if entry < 0:
                return _finding(v, "unattributed", d.num_slots)
            b = int(nonempty[np.searchsorted(offsets, entry, "right") - 1])
            return _finding(v, "request", d.num_slots, swa=d.full_to_swa_index_mapping is not None,
                            batch_index=begin + b,
                            request_row=int(rows_table[begin + b]),
                            position=int(entries.positions[entry]),
                            prev_slot=int(entries.prevs[entry]))

        account(rows, entry_of, describe)
        done += total
        if progress:
            progress(done, total_entries)

    if sweep_entries:
        stag = int(sweep_tag(d.launch_tag))
        step = max(1, int(chunk_entries))
        for begin in range(0, sweep_entries, step):
            end = min(sweep_entries, begin + step)
            m = end - begin
            entries = _Entries(*(np.ascontiguousarray(a[begin:end], dtype=np.int64) for a in (
                d.sweep_slot_indices, d.sweep_prev_slot_indices, d.sweep_positions)),
                np.full(m, EXPECTED_TOKEN_UNKNOWN, dtype=np.int64))
            plan = VerifyPlan(
                verify_slot_indices=device(entries.slots),
                verify_expected_tokens=device(entries.tokens),
                verify_expected_positions=device(entries.positions),
                verify_prev_slot_indices=device(entries.prevs),
                verify_num_valid=xp.array([m], dtype=xp.int32), enable=xp.ones(1, dtype=xp.int32))
            context = launcher.context(stag, m)
            api.verify(context, plan, check_expected_token=False)
            rows = context.violation_log.rows()
            entry_of = _attribute(rows, entries, launcher, stag, False)

            def describe_sweep(v, entry, entries=entries, begin=begin):
                if entry < 0:
                    return _finding(v, "unattributed", d.num_slots)
                return _finding(v, "sweep", d.num_slots, sweep_index=begin + entry,
                                position=int(entries.positions[entry]),
                                prev_slot=int(entries.prevs[entry]))

            account(rows, entry_of, describe_sweep)
            done += m
            if progress:
                progress(done, total_entries)

    result.total_violations = total_rows
    result.findings = kept
    result.counts_by_reason = dict(sorted(reasons.items()))
    result.counts_by_tag = dict(sorted(tags.items()))
    result.unattributed = sum(1 for f in kept if f.kind == "unattributed")
    result.elapsed_s = time.perf_counter() - started
    return result


def _finding(v: Violation, kind: str, num_slots: int, swa: bool = False, **where) -> Finding:
    position = where.get("position", v.position)
    prev = where.get("prev_slot", -1)
    return Finding(violation=v, kind=kind, checks=failed_checks(v.fail_reason_bits),
                   cause=likely_cause(v, position=position, prev_slot=prev, num_slots=num_slots,
                                      swa=swa),
                   **where)
