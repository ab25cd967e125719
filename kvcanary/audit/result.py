"""What an audit returns: :class:`AuditResult` with its :class:`Finding` and
:class:`RequestSummary` objects, and the :class:`CheckedLaunch` handed to ``observe``."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..findings.diagnosis import Diagnosis, failed_checks
from ..format.consts import PLAN_SLOT_OUT_OF_TABLE
from ..format.errors import ToolError
from ..findings.evidence import Entry
from ..format.violations import Violation

# Plan entries per verify launch: bounds the plan and ring memory of one chunk.
CHUNK_ENTRIES = 1 << 16
# Findings kept per audit by default: upstream's default violation-ring capacity.
DEFAULT_MAX_FINDINGS = 1024


class AuditError(ToolError):
    """The audit cannot run or would prove nothing (e.g. zero entries to check)."""


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

    def __post_init__(self):
        # A cause reaches an audit finding only with its diagnosis, whose cause is a
        # member of findings.causes.Cause (a Diagnosis refuses any other).
        if self.cause and self.diagnosis is None:
            raise ValueError("an audit Finding's cause is the text of its diagnosis "
                             "(a kvcanary.Diagnosis); give the diagnosis")

    def entry(self) -> Entry:
        """The finding's verify entry as the diagnosis names it."""
        return Entry(kind=self.kind, batch_index=self.batch_index,
                     request_row=self.request_row, position=self.position,
                     prev_slot=self.prev_slot, sweep_index=self.sweep_index,
                     block_index=self.block_index, block=self.block)

    def where(self) -> str:
        slot = self.violation.slot_idx
        # The plan's marker for a position past the table is no slot: say so, not 2**63 - 1.
        at = "past the table (no slot)" if slot == PLAN_SLOT_OUT_OF_TABLE else f"slot {slot}"
        if self.kind == "request":
            block = ""
            if self.block_index >= 0 and self.block < 0:
                block = f", block-table entry {self.block_index} (past the block table)"
            elif self.block_index >= 0:
                block = (f", block {self.block} (block-table entry {self.block_index}"
                         f"{', the null block' if self.block == 0 else ''})")
            return (f"request row {self.request_row} (batch index {self.batch_index}), "
                    f"position {self.position}{block}, {at}")
        if self.kind == "sweep":
            return f"sweep entry {self.sweep_index}, position {self.position}, {at}"
        return f"{at} (no plan entry reproduces this row)"

    def describe(self) -> str:
        """The frozen line, then ``  at: ...``, ``  failed checks: ...`` and ``  likely
        cause: ...``, labelled as every finding's :meth:`describe` is."""
        return "\n".join((self.violation.log_line(), f"  at: {self.where()}",
                          f"  failed checks: {', '.join(self.checks) or 'none'}",
                          f"  likely cause: {self.cause}"))

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


_KINDS = ("request", "sweep", "unattributed")
# Kept findings up to which the audit returns a plain list (more stay a FindingList).
EAGER_FINDINGS = 1 << 16
# Findings built (and diagnosed) at a time when a long list is read.
FINDINGS_BATCH = 4096


class FindingList(Sequence):
    """The kept findings of an audit, held as arrays (72 bytes of ring row and a few
    integers each) and made :class:`Finding` objects with their diagnosis only when read, a
    batch at a time: a million findings iterate in bounded memory (``--max-findings 0``).

    ``columns``: ``rows`` (int64 ``[n, 8]``), ``kind`` (index into ``request``, ``sweep``,
    ``unattributed``), ``batch_index``, ``request_row``, ``position``, ``prev_slot``,
    ``sweep_index``, ``block_index``, ``block``; ``explain(findings)`` gives them their
    diagnosis (identity when None)."""

    def __init__(self, columns: dict, explain=None):
        self.columns, self.explain = columns, explain
        self.causes = None   # counted by the first whole pass (Counter of diagnosis causes)

    def __len__(self) -> int:
        return int(self.columns["rows"].shape[0])

    def _build(self, begin: int, end: int) -> list:
        c = self.columns
        fields = [c[name][begin:end].tolist() for name in (
            "kind", "batch_index", "request_row", "position", "prev_slot", "sweep_index",
            "block_index", "block")]
        findings = [Finding(violation=Violation(*row), kind=_KINDS[kind], batch_index=b,
                            request_row=r, position=q, prev_slot=prev, sweep_index=sweep,
                            checks=failed_checks(row[7]), block_index=bi, block=block)
                    for row, kind, b, r, q, prev, sweep, bi, block in zip(
                        c["rows"][begin:end].tolist(), *fields)]
        return self.explain(findings) if self.explain else findings

    def __getitem__(self, index):
        if isinstance(index, slice):
            begin, end, step = index.indices(len(self))
            if step != 1:
                return self._build(0, len(self))[index]
            return self._build(begin, max(begin, end))
        position = index + len(self) if index < 0 else index
        if not 0 <= position < len(self):
            raise IndexError("finding index out of range")
        return self._build(position, position + 1)[0]

    def __iter__(self):
        causes = Counter()
        for begin in range(0, len(self), FINDINGS_BATCH):
            batch = self._build(begin, min(len(self), begin + FINDINGS_BATCH))
            causes.update(f.diagnosis.cause for f in batch if f.diagnosis is not None)
            yield from batch
        self.causes = causes

    def cause_counts(self) -> dict:
        """Findings per diagnosis cause, sorted by cause (a pass of its own only when no
        whole pass has run yet)."""
        if self.causes is None:
            for _ in self:
                pass
        return dict(sorted(self.causes.items()))


class CauseCounts(dict):
    """``AuditResult.counts_by_cause`` of a :class:`FindingList`: filled when first read, from
    the pass that printed the findings when there was one (so a million findings are
    diagnosed once, not twice)."""

    def __init__(self, findings: FindingList):
        super().__init__()
        self._findings = findings

    def _fill(self):
        if self._findings is not None:
            findings, self._findings = self._findings, None
            self.update(findings.cause_counts())

    def __getitem__(self, key):
        self._fill()
        return super().__getitem__(key)

    def __iter__(self):
        self._fill()
        return super().__iter__()

    def __len__(self):
        self._fill()
        return super().__len__()

    def __contains__(self, key):
        self._fill()
        return super().__contains__(key)

    def __eq__(self, other):
        self._fill()
        return super().__eq__(other)

    __hash__ = None

    def __repr__(self):
        self._fill()
        return super().__repr__()

    def keys(self):
        self._fill()
        return super().keys()

    def items(self):
        self._fill()
        return super().items()

    def values(self):
        self._fill()
        return super().values()

    def get(self, key, default=None):
        self._fill()
        return super().get(key, default)

    def __eq__(self, other):
        return list(self) == list(other)


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
    # Live entries verified when requests share them (each once, attributed to every
    # reader); 0 when every request was planned as it is.
    distinct_live_entries: int = 0

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
                "distinct_live_entries": self.distinct_live_entries or self.live_entries,
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
