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
than :data:`MAX_LINE` characters are skipped (counted as unparsed when they look like
violation output). A line that looks like a violation report and cannot be read is counted,
never dropped: it is a reported violation all the same.

Only a log that shows the canary ran can be clean: SGLang logs ``install_canary: ...`` when
it installs the canary (``--kv-canary log`` or ``raise``), and its periodic ``[canary] step=``
and sweep lines while it runs; ``kvcanary audit --format json`` a summary of the entries it
checked.
:attr:`Explanation.verdict` is ``no-canary-output`` for inputs without any of these.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from ..findings.attribution import merge_key
from ..findings.diagnosis import Diagnosis, diagnose, failed_checks
from ..findings.evidence import Entry
from ..format.consts import FailReason
from ..format.violations import Violation
from .explain_parse import (  # noqa: F401  (the reading API, re-exported)
    MAX_LINE, ExplainError, Marks, Overlong, Row, looks_like_violation, parse_json_record,
    parse_structured, read_rows)

# Distinct slots at one position from which that position is called a pattern.
POSITION_SLOTS = 3
# Distinct findings kept; rows of further new corruptions are counted, not kept (memory).
MAX_DISTINCT = 100_000


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

    def seen(self) -> str:
        """``seen N time(s) by TAGS, step S`` (or ``steps F..L``) ``, in SOURCES``."""
        steps = ("" if self.first_step is None else
                 f", step {self.first_step}" if self.first_step == self.last_step
                 else f", steps {self.first_step}..{self.last_step}")
        return (f"seen {self.count} time(s) by {', '.join(self.launch_tags)}{steps}, in "
                f"{', '.join(self.sources)}")

    def describe(self) -> str:
        """The frozen line, then ``  seen ...`` (:meth:`seen`), ``  at: ...`` where a JSON
        record named the entry, ``  failed checks: ...``, ``  likely cause: ...`` and the
        patterns, labelled as every finding's :meth:`describe` is."""
        where = self.where()
        lines = [self.violation.log_line(), f"  {self.seen()}"]
        if where:
            lines.append(f"  at: {where}")
        lines.append(f"  failed checks: {', '.join(self.checks())}")
        lines.append(f"  likely cause: {self.diagnosis.text}")
        if self.patterns:
            lines.append(f"  patterns: {', '.join(self.patterns)}")
        return "\n".join(lines)

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

    def to_dict(self, shown: int | None = None) -> dict:
        """The JSON record; ``shown``: only the indices of the first ``shown`` findings (the
        ones reported), with ``findings_total`` counting them all."""
        kept = [i for i in self.findings if shown is None or i < shown]
        return {"record": "pattern", "pattern": self.kind, "text": self.text,
                "findings": kept, "findings_total": len(self.findings)}


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
        self.canary_marks = 0            # lines showing the canary ran (see the module doc)
        self.verify_skipped = 0          # SGLang's "per-forward verify skipped" warnings
        self.stats_violations: dict = {}  # source -> largest count of SGLang's stats lines

    def read(self, lines, source: str) -> None:
        """Read one input's ``lines`` (str, or :class:`Overlong`) as ``source``."""
        if source not in self.sources:
            self.sources.append(source)
        marks = Marks()
        for row in read_rows(lines, source, marks=marks):
            self.add(row)
        self.unparsed += marks.unparsed
        self.canary_marks += marks.canary
        self.verify_skipped += marks.verify_skipped
        if marks.stats_violations:
            self.stats_violations[source] = max(self.stats_violations.get(source, 0),
                                                marks.stats_violations)

    @property
    def canary_output(self) -> bool:
        """Whether the inputs show the canary ran: a mark, a violation row or an unparsed
        violation line."""
        return bool(self.canary_marks or self.rows or self.unparsed)

    @property
    def unlogged_violations(self) -> int:
        """Violations SGLang's stats lines count in inputs that log no row of them."""
        return sum(n for s, n in self.stats_violations.items() if not self.rows_by_source[s])

    @property
    def verdict(self) -> str:
        """``violations`` (rows, unparsed violation lines, or violations the stats lines
        count), ``clean`` (the canary ran and reported nothing), or ``no-canary-output``."""
        if self.rows or self.unparsed or self.unlogged_violations:
            return "violations"
        return "clean" if self.canary_marks else "no-canary-output"

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
        """Records that failed in one stage's canary buffer only. SGLang keeps a HEAD and a
        TAIL buffer, written for the same slots by every forward, and gives only the TAIL
        launches real-KV sources: so rows are compared without their real-KV bit, and a
        failure of the real-KV hash alone (which HEAD launches cannot see) is no
        disagreement."""
        stages = {tag_family(t)[0] for t in self.tags}
        if not {"HEAD", "TAIL"} <= stages:
            return None
        real = int(FailReason.VERIFY_REAL_KV_HASH_MISMATCH)
        records: dict = {}   # the row's record and its non-real-KV checks -> stages, findings
        for i, f in enumerate(findings):
            v = f.violation
            bits = v.fail_reason_bits & ~real
            if not bits:
                continue
            key = (v.slot_idx, bits, v.position, v.stored_token, v.stored_chain_hash)
            seen, members = records.setdefault(key, (set(), []))
            seen.update(tag_family(t)[0] for t in f.launch_tags)
            members.append(i)
        head_only = [i for seen, members in records.values()
                     if "HEAD" in seen and "TAIL" not in seen for i in members]
        tail_only = [i for seen, members in records.values()
                     if "TAIL" in seen and "HEAD" not in seen for i in members]
        if not head_only and not tail_only:
            return None
        return Pattern("head-tail", (
            f"the HEAD and TAIL canary copies disagree: {len(head_only)} finding(s) failed "
            f"only in the HEAD launches' buffer and {len(tail_only)} only in the TAIL "
            "launches', though both ran: each stage has its own canary buffer and every "
            "forward writes both for the same slots, so a table, allocator or write fault "
            "shows in both; one copy failing alone was changed by a stray write into that "
            "buffer (real-KV hash failures are left out: HEAD launches carry no real-KV "
            "sources)"), tuple(sorted(head_only + tail_only)))

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
