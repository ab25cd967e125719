"""Read violation reports back: SGLang's ``--kv-canary log`` blocks and kvcanary's own JSON
Lines, merged into distinct findings with their causes and the patterns the launch tags show.

An SGLang server in log mode writes one multi-line block per ring row (the frozen structured
line, with the log's prefix before it, then a header, the canary kind, the fail reasons, the
stored and expected lines and ``total_violations=N ring_overflow=B step_when_pumped=S``).
The same corruption is reported again by every later step and by each launch tag that
verifies it, so :class:`Explanation` merges rows with the same slot, fail reasons and
stored record (:func:`kvcanary.findings.attribution.merge_key`) into one :class:`ExplainedFinding`
with every tag that saw it, its count and its first and last step.

Reading is streamed line by line; memory grows with the distinct findings (at most
:data:`MAX_DISTINCT`; rows of further ones are only counted), not with the log. Lines longer
than :data:`MAX_LINE` characters are skipped (counted as unparsed).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field

from ..findings.attribution import merge_key
from ..format.consts import FailReason, LaunchTag
from ..findings.diagnosis import Diagnosis, Entry, diagnose, failed_checks
from ..format.errors import ToolError
from ..format.violations import Violation, reason_label

MAX_LINE = 1 << 16
# Lines after a structured line within which its block's last line must appear.
BLOCK_LINES = 8
# Distinct slots at one position from which that position is called a pattern.
POSITION_SLOTS = 3
# Distinct findings kept; rows of further new corruptions are counted, not kept (memory).
MAX_DISTINCT = 100_000

_STRUCTURED = re.compile(
    r"kv_canary violation: launch_tag=(\S+) fail_reason=(\S+) slot_idx=(-?\d+) "
    r"position=(-?\d+) stored_token=(-?\d+) expected_token=(-?\d+) "
    r"stored_chain_hash=(0x[0-9a-fA-F]+) expected_aux=(0x[0-9a-fA-F]+)")
_FOOTER = re.compile(r"total_violations=(\d+) ring_overflow=(True|False) "
                     r"step_when_pumped=(-?\d+)")
_LABEL_BITS = {reason_label(member): int(member) for member in FailReason}
_UNKNOWN_TAG = re.compile(r"unknown\((-?\d+)\)")


class ExplainError(ToolError):
    """An input cannot be read (missing, a directory, not text)."""


def _signed(hex_text: str) -> int:
    value = int(hex_text, 16) & ((1 << 64) - 1)
    return value - (1 << 64) if value >= 1 << 63 else value


def _tag_value(name: str) -> int | None:
    if name in LaunchTag.__members__:
        return int(LaunchTag[name])
    match = _UNKNOWN_TAG.fullmatch(name)
    return int(match.group(1)) if match else None


def _bits(text: str) -> int | None:
    if text == "none":
        return 0
    bits = 0
    for label in text.split("+"):
        if label in _LABEL_BITS:
            bits |= _LABEL_BITS[label]
        elif label.startswith("bit") and label[3:].isdigit():
            bits |= 1 << int(label[3:])
        else:
            return None
    return bits


@dataclass
class Row:
    """One reported row: the violation and what its report adds."""

    violation: Violation
    source: str
    line: int
    step: int | None = None
    total_violations: int | None = None
    ring_overflow: bool = False
    attribution: dict | None = None   # request_row, batch_index, ... from kvcanary JSON
    json: bool = False                # a kvcanary JSON record (else a log block)


def parse_structured(text: str) -> Violation | None:
    """The violation of a frozen structured line found anywhere in ``text`` (None if none)."""
    match = _STRUCTURED.search(text)
    if not match:
        return None
    tag, reasons = _tag_value(match.group(1)), _bits(match.group(2))
    if tag is None or reasons is None:
        return None
    slot, position, stored, expected = (int(match.group(i)) for i in range(3, 7))
    return Violation(tag, slot, position, stored, expected, _signed(match.group(7)),
                     _signed(match.group(8)), reasons)


_JSON_KEYS = ("launch_tag", "slot_idx", "position", "stored_token", "expected_token",
              "stored_chain_hash", "expected_aux", "fail_reason_bits")
_ATTRIBUTION_KEYS = ("entry", "batch_index", "request_row", "expected_position", "prev_slot",
                     "sweep_index", "block_index", "block", "dump")


def parse_json_record(record) -> tuple | None:
    """``(violation, step, attribution)`` of a kvcanary violation record (``audit --format
    json``, :meth:`kvcanary.LaunchFinding.to_dict`, ``explain --format json``), else None."""
    if not isinstance(record, dict) or record.get("record", "violation") != "violation":
        return None
    if not all(key in record for key in _JSON_KEYS):
        return None
    try:
        tag = _tag_value(str(record["launch_tag"]))
        hashes = [_signed(str(record[k])) if isinstance(record[k], str) else int(record[k])
                  for k in ("stored_chain_hash", "expected_aux")]
        values = [int(record[k]) for k in ("slot_idx", "position", "stored_token",
                                             "expected_token", "fail_reason_bits")]
    except (TypeError, ValueError):
        return None
    if tag is None:
        return None
    v = Violation(tag, values[0], values[1], values[2], values[3], hashes[0], hashes[1],
                  values[4])
    step = record.get("launch", record.get("first_step"))
    step = step if isinstance(step, int) and not isinstance(step, bool) else None
    attribution = {k: record[k] for k in _ATTRIBUTION_KEYS if k in record}
    return v, step, attribution or None


def read_rows(lines, source: str, on_unparsed=None):
    """Every reported row of one input's ``lines`` (an iterable of str), in order."""
    pending: list = []   # rows whose footer has not been seen yet: (row, lines left)
    for number, line in enumerate(lines, 1):
        if len(line) > MAX_LINE:
            if on_unparsed:
                on_unparsed()
            continue
        stripped = line.strip()
        if stripped.startswith("{"):
            try:
                parsed = parse_json_record(json.loads(stripped))
            except ValueError:
                parsed = None
            if parsed:
                v, step, attribution = parsed
                yield Row(v, source, number, step=step, attribution=attribution, json=True)
                continue
        if "kv_canary violation:" in line:
            yield from (row for row, _ in pending)
            pending = []
            v = parse_structured(line)
            if v is None:
                if on_unparsed:
                    on_unparsed()
                continue
            pending.append((Row(v, source, number), BLOCK_LINES))
            continue
        if pending:
            footer = _FOOTER.search(line)
            if footer:
                row, _ = pending.pop()
                row.total_violations = int(footer.group(1))
                row.ring_overflow = footer.group(2) == "True"
                row.step = int(footer.group(3))
                yield row
                continue
            left = [(row, n - 1) for row, n in pending]
            yield from (row for row, n in left if n <= 0)
            pending = [(row, n) for row, n in left if n > 0]
    yield from (row for row, _ in pending)


def tag_family(tag: str) -> tuple:
    """``("TAIL", "K", "FULL")`` of ``TAIL_K_FULL``; unknown tags give ``("?", "?", "?")``."""
    parts = tag.split("_")
    return tuple(parts) if len(parts) == 3 else ("?", "?", "?")


@dataclass
class ExplainedFinding:
    """One distinct corruption: its first row, how often and where it was reported, and its
    diagnosis from the row alone (and the attribution a kvcanary JSON record carried)."""

    row: Row
    count: int = 0
    first_step: int | None = None
    last_step: int | None = None
    launch_tags: list = field(default_factory=list)
    sources: list = field(default_factory=list)
    tag_counts: Counter = field(default_factory=Counter)
    diagnosis: Diagnosis | None = None
    patterns: list = field(default_factory=list)

    @property
    def violation(self) -> Violation:
        return self.row.violation

    def add(self, row: Row) -> None:
        self.count += 1
        tag = row.violation.launch_tag
        self.tag_counts[tag] += 1
        if tag not in self.launch_tags:
            self.launch_tags.append(tag)
        if row.source not in self.sources:
            self.sources.append(row.source)
        if row.step is not None:
            self.first_step = row.step if self.first_step is None else min(self.first_step,
                                                                           row.step)
            self.last_step = row.step if self.last_step is None else max(self.last_step,
                                                                         row.step)

    def checks(self) -> tuple:
        return failed_checks(self.violation.fail_reason_bits)

    def entry(self) -> Entry | None:
        a = self.row.attribution
        if not a or a.get("entry") not in (None, "request", "sweep") or "expected_position" not in a:
            return None
        return Entry(kind=a.get("entry", "request"), batch_index=int(a.get("batch_index", -1)),
                     request_row=int(a.get("request_row", -1)),
                     position=int(a["expected_position"]), prev_slot=int(a.get("prev_slot", -1)),
                     sweep_index=int(a.get("sweep_index", -1)))

    def where(self) -> str | None:
        e = self.entry()
        if e is None:
            return None
        if e.kind == "sweep":
            return f"sweep entry {e.sweep_index}, position {e.position}"
        return (f"request row {e.request_row} (batch index {e.batch_index}), position "
                f"{e.position}")

    def to_dict(self) -> dict:
        record = self.violation.to_dict()
        record.update(count=self.count, first_step=self.first_step, last_step=self.last_step,
                      launch_tags=list(self.launch_tags), counts_by_tag=dict(self.tag_counts),
                      sources=list(self.sources),
                      failed_checks=list(failed_checks(self.violation.fail_reason_bits)),
                      likely_cause=self.diagnosis.text, diagnosis=self.diagnosis.to_dict(text=False),
                      patterns=list(self.patterns))
        if self.row.attribution:
            record.update({k: v for k, v in self.row.attribution.items() if k != "dump"})
        return record


@dataclass(frozen=True)
class Pattern:
    """What the tags and findings reveal together: ``kind`` (``head-tail``, ``pd-real-kv``,
    ``one-position``, ``ring-overflow``, ``sweep-only``) and the words."""

    kind: str
    text: str
    findings: tuple = ()

    def to_dict(self) -> dict:
        return {"record": "pattern", "pattern": self.kind, "text": self.text,
                "findings": list(self.findings)}


class Explanation:
    """Rows in, distinct findings, counts and patterns out."""

    def __init__(self):
        self._findings: dict = {}
        self.rows = 0
        self.json_records = 0
        self.unparsed = 0
        self.sources: list = []
        self.rows_by_source: Counter = Counter()
        self.tags: Counter = Counter()
        self.reasons: Counter = Counter()
        self.max_total: dict = {}        # source -> largest total_violations reported
        self.overflow_sources: set = set()
        self.rows_not_kept = 0           # rows of new corruptions past MAX_DISTINCT

    def read(self, lines, source: str) -> None:
        if source not in self.sources:
            self.sources.append(source)

        def unparsed():
            self.unparsed += 1

        for row in read_rows(lines, source, unparsed):
            self.add(row)

    def add(self, row: Row) -> None:
        v = row.violation
        self.rows += 1
        self.rows_by_source[row.source] += 1
        self.json_records += row.json
        self.tags[v.launch_tag] += 1
        for label in v.labels or ["none"]:
            self.reasons[label] += 1
        if row.total_violations is not None:
            self.max_total[row.source] = max(self.max_total.get(row.source, 0),
                                             row.total_violations)
        if row.ring_overflow:
            self.overflow_sources.add(row.source)
        key = merge_key(v)
        finding = self._findings.get(key)
        if finding is None:
            if len(self._findings) >= MAX_DISTINCT:
                self.rows_not_kept += 1
                return
            finding = self._findings[key] = ExplainedFinding(row)
        finding.add(row)

    @property
    def findings(self) -> list:
        return list(self._findings.values())

    def finish(self) -> list:
        """Diagnose every finding and return the patterns (in a fixed order)."""
        findings = self.findings
        for f in findings:
            f.diagnosis = diagnose(f.violation, f.entry())
        patterns = [p for p in (self._head_tail(findings), self._pd_real_kv(findings),
                                self._sweep_only(findings)) if p]
        patterns += self._one_position(findings)
        overflow = self._overflow()
        if overflow:
            patterns.append(overflow)
        for p in patterns:
            for index in p.findings:
                findings[index].patterns.append(p.kind)
        return patterns

    # ---------------------------------------------------------------- patterns

    def _head_tail(self, findings) -> Pattern | None:
        stages = {tag_family(t)[0] for t in self.tags}
        if not {"HEAD", "TAIL"} <= stages:
            return None
        head_only, tail_only = [], []
        for i, f in enumerate(findings):
            seen = {tag_family(t)[0] for t in f.launch_tags}
            if "HEAD" in seen and "TAIL" not in seen:
                head_only.append(i)
            elif "TAIL" in seen and "HEAD" not in seen:
                tail_only.append(i)
        if not head_only and not tail_only:
            return None
        return Pattern("head-tail", (
            f"head and tail disagree: {len(tail_only)} finding(s) seen only by TAIL launches "
            f"and {len(head_only)} only by HEAD launches, though both kinds ran: the KV "
            "changed between the head and tail verify of a forward (a truncated or reordered "
            "layer transfer, or a write racing the forward)"), tuple(head_only + tail_only))

    def _pd_real_kv(self, findings) -> Pattern | None:
        if len(self.sources) < 2:
            return None
        real = int(FailReason.VERIFY_REAL_KV_HASH_MISMATCH)
        hit = [i for i, f in enumerate(findings) if f.violation.fail_reason_bits & real]
        sides = {s for i in hit for s in findings[i].sources}
        if not hit or sides == set(self.sources):
            return None
        clean = [s for s in self.sources if s not in sides]
        return Pattern("pd-real-kv", (
            f"real-KV hash failures only in {', '.join(sorted(sides))} and none in "
            f"{', '.join(clean)}: if these logs are the two sides of a prefill/decode pair, "
            "the KV bytes changed in the transfer between them (the canary records arrived "
            "intact, the KV did not)"), tuple(hit))

    def _sweep_only(self, findings) -> Pattern | None:
        only = [i for i, f in enumerate(findings)
                if {tag_family(t)[0] for t in f.launch_tags} == {"SWEEP"}]
        if not only:
            return None
        return Pattern("sweep-only", (
            f"{len(only)} finding(s) seen only by the sweep: cached prefix blocks no running "
            "request reads are corrupt (an eviction, offload or reuse of a cached block)"),
            tuple(only))

    def _one_position(self, findings) -> list:
        slots: dict = {}
        chain = int(FailReason.VERIFY_CHAIN_HASH_MISMATCH)
        for i, f in enumerate(findings):
            if f.violation.fail_reason_bits == chain:
                continue   # a successor's broken link follows from its predecessor's finding
            slots.setdefault(f.violation.position, {}).setdefault(f.violation.slot_idx, i)
        out = []
        for position, by_slot in sorted(slots.items()):
            if len(by_slot) >= POSITION_SLOTS:
                out.append(Pattern("one-position", (
                    f"position {position} fails at {len(by_slot)} different slots: a "
                    "position-dependent bug (e.g. at a chunk, page or speculative-decoding "
                    "boundary), not one corrupt slot"), tuple(sorted(by_slot.values()))))
        return out

    def _overflow(self) -> Pattern | None:
        lost = {s: total - self.rows_by_source[s] for s, total in self.max_total.items()
                if total > self.rows_by_source[s]}
        if not lost and not self.overflow_sources:
            return None
        parts = [f"{s}: {self.max_total[s]} violations reported, {self.rows_by_source[s]} "
                 f"rows logged" for s in sorted(set(lost) | self.overflow_sources)
                 if s in self.max_total]
        return Pattern("ring-overflow", (
            "the violation ring overflowed (" + "; ".join(parts) + "): rows were lost and "
            "nothing is logged once the ring is full, so every count here is a lower bound"))

    # ---------------------------------------------------------------- summary

    @property
    def total_reported(self) -> int:
        """Violations the reports claim (the largest ``total_violations`` per input)."""
        return sum(self.max_total.values())

    @property
    def ring_overflow(self) -> bool:
        return bool(self.overflow_sources) or any(
            total > self.rows_by_source[s] for s, total in self.max_total.items())

    def families(self) -> dict:
        counts: Counter = Counter()
        for tag, count in self.tags.items():
            for part in tag_family(tag):
                counts[part] += count
        return dict(sorted(counts.items()))
