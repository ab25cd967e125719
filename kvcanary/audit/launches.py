"""Steps 1 and 2 of the audit: the verify launches (the live requests' prefixes planned by
``kvcanary.plan`` in groups, a long request in pieces, then the sweep entries) and running one
on the chosen backend."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from ..api import launches as api
from ..format.consts import EXPECTED_TOKEN_UNKNOWN, FailReason, LaunchTag
from ..dump import Dump
from ..backends.reference.plan import verify_entries
from ..format.rules import violation_rows, window_start
from ..model.types import CanaryContext, RealKvSource, VerifyPlan, ViolationLog, WritePlan, to_host
from .result import AuditError


def sweep_tag(tag: LaunchTag) -> LaunchTag:
    """The SWEEP tag of the same half and group (``TAIL_K_FULL`` -> ``SWEEP_K_FULL``)."""
    _, half, group = tag.name.split("_")
    return LaunchTag[f"SWEEP_{half}_{group}"]


class Launcher:
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

    @staticmethod
    def slot_users(slots: np.ndarray, asked: np.ndarray) -> tuple:
        """``(first, last)``: per slot of ``asked``, the first and last index of ``slots``
        holding it (-1 where none does). A sort of the launch's own entries: the work and
        memory follow the launch, not the pool (a 16M-slot pool costs what a small one does)."""
        if slots.size == 0:
            return np.full(asked.shape, -1, np.int64), np.full(asked.shape, -1, np.int64)
        order = np.argsort(slots, kind="stable")
        ordered = slots[order]
        low = np.searchsorted(ordered, asked, side="left")
        high = np.searchsorted(ordered, asked, side="right")
        present = high > low
        first = np.where(present, order[np.minimum(low, order.size - 1)], -1)
        last = np.where(present, order[np.maximum(high - 1, 0)], -1)
        return first, last


@dataclass
class Entries:
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
class Launch:
    """One verify launch: its plan on the backend and a host copy of its entries, plus what
    names an entry: the batch index of every entry (live requests) or the sweep index of the
    first one."""

    tag: int
    plan: VerifyPlan
    entries: Entries
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

_SCAN_ROWS = 1 << 20


@dataclass
class LiveRequests:
    """The batch indices that verify at least one entry, and how many each verifies
    (``[window_start, seq_len)``); padding rows and empty prefixes are left out."""

    batch_index: np.ndarray
    lengths: np.ndarray

    @property
    def entries(self) -> int:
        return int(self.lengths.sum())


def live_requests(d: Dump) -> LiveRequests:
    """The live requests, scanned ``_SCAN_ROWS`` batch rows at a time (memory stays within
    the size of the tables read, whatever the batch size) over the rows that hold data (a
    sparse file's holes are padding rows, never read)."""
    indices, lengths = [], []
    for begin, end in d.row_ranges("req_pool_indices", _SCAN_ROWS):
        seq_lens = np.asarray(d.seq_lens[begin:end])
        length = np.maximum(0, seq_lens - window_start(seq_lens, d.swa_window_size))
        live = np.flatnonzero((np.asarray(d.req_pool_indices[begin:end]) != 0)
                              & (length > 0))
        indices.append(live + begin)
        lengths.append(length[live].astype(np.int64))
    return LiveRequests(np.concatenate(indices or [np.zeros(0, np.int64)]),
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


def live_launches(d: Dump, launcher: Launcher, live: LiveRequests, chunk: int):
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
        with plan_errors(d):
            api.plan(req_pool_indices=device(d.req_pool_indices[batch]),
                     prefix_lens=device(d.seq_lens[batch]),
                     extend_seq_lens=xp.zeros(batch.size, dtype=xp.int64), **table,
                     verify_plan=verify_plan, write_plan=write_plan,
                     swa_window_size=d.swa_window_size, full_to_swa_index_mapping=lut,
                     req_to_verify_expected_tokens=pool,
                     req_to_verify_expected_tokens_valid_lens=valid_lens)
        entries = Entries(*(to_host(a)[:total].copy() for a in (
            verify_plan.verify_slot_indices, verify_plan.verify_prev_slot_indices,
            verify_plan.verify_expected_positions, verify_plan.verify_expected_tokens)))
        batch_index = np.repeat(batch, live.lengths[begin:end])
        yield Launch(int(d.launch_tag), verify_plan, entries, check_token, batch_index)


def _piece_launches(d: Dump, launcher: Launcher, b: int, total: int, chunk: int):
    """One long request in pieces of ``chunk`` consecutive positions, each planned on the
    host by the reference's per-entry rule (``kvcanary.plan`` plans whole prefixes only),
    so no launch holds more than ``chunk`` entries however long the request claims to be."""
    seq_len = int(d.seq_lens[b])
    first = seq_len - total
    check_token = d.expected_tokens is not None
    valid_lens = None if not check_token else d.expected_tokens_valid_lens[b:b + 1]
    for start in range(first, seq_len, chunk):
        size = min(chunk, seq_len - start)
        with plan_errors(d):
            slots, positions, prevs, tokens = verify_entries(
                d.slot_table, d.block_size, d.full_to_swa_index_mapping,
                d.req_pool_indices[b:b + 1], np.array([start], np.int64),
                np.array([size], np.int64), size, d.expected_tokens, valid_lens, 0)
        entries = Entries(slots, prevs, positions, tokens)
        yield Launch(int(d.launch_tag), entries.plan(launcher.device), entries, check_token,
                      np.full(size, b, dtype=np.int64))


@contextmanager
def plan_errors(d: Dump):
    """A plan refusal (an SWA slot outside the mapping) as an :class:`AuditError` naming
    the dump."""
    try:
        yield
    except ValueError as exc:
        text = getattr(exc, "detail", str(exc))
        where = "key full_to_swa_index_mapping: " if "full_to_swa" in text else ""
        raise AuditError(f"{d.path}: {where}{text}") from None


def sweep_launches(d: Dump, launcher: Launcher, chunk: int):
    """The dump's sweep entries as they are, with the SWEEP tag and no token check; the
    entries in a sparse file's holes read slot 0, padding, which verify skips: they are not
    launched."""
    tag = int(sweep_tag(d.launch_tag)) if d.num_sweep_entries else 0
    for begin, end in (d.row_ranges("sweep_slot_indices", chunk) if d.num_sweep_entries
                       else ()):
        entries = Entries(*(np.ascontiguousarray(a[begin:end], dtype=np.int64) for a in (
            d.sweep_slot_indices, d.sweep_prev_slot_indices, d.sweep_positions)),
            np.full(end - begin, EXPECTED_TOKEN_UNKNOWN, dtype=np.int64))
        yield Launch(tag, entries.plan(launcher.device), entries, False, sweep_begin=begin)


# ------------------------------------------------------------ step 2: verify


def verify_rows(launcher: Launcher, launch: Launch) -> np.ndarray:
    """The launch's ring rows on the chosen backend (a ring with room for every entry)."""
    context = launcher.context(launch.tag, launch.size)
    api.verify(context, launch.plan, check_expected_token=launch.check_token)
    return context.violation_log.rows()


def slot_zero_rows(entries: Entries, tag: int, check_token: bool):
    """kvcanary's extension: a row for every live prefix entry mapped to padding slot 0."""
    zero = np.flatnonzero(entries.slots == 0)
    tokens = entries.tokens[zero] if check_token else EXPECTED_TOKEN_UNKNOWN
    rows = violation_rows(tag, 0, entries.positions[zero], 0, tokens, 0, 0,
                          int(FailReason.SLOT_ZERO_IN_PREFIX))
    return rows, zero


# ------------------------------------------------------------ step 3: attribute
