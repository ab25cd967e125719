"""Reading violation reports line by line: SGLang's ``--kv-canary log`` blocks (the frozen
structured line, then the block's lines up to its ``total_violations=`` footer), kvcanary's
JSON Lines records, and the lines that show the canary ran. Every number is checked against
the ring's int64 fields; a line that looks like a violation report and cannot be read is
counted as unparsed, never dropped or raised."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from ..format.consts import FailReason, LaunchTag
from ..format.errors import ToolError
from ..format.violations import Violation, reason_label

MAX_LINE = 1 << 16
# Lines after a structured line within which its block's last line must appear.
BLOCK_LINES = 8

# Decimal fields are int64 (at most 19 digits), hashes 64-bit (at most 16 hex digits): a
# longer number is no row SGLang's reporter writes.
_INT = r"(-?\d{1,19})"
_HEX = r"(0x[0-9a-fA-F]{1,16})(?![0-9a-fA-F])"
_STRUCTURED = re.compile(
    r"kv_canary violation: launch_tag=(\S+) fail_reason=(\S+) slot_idx=" + _INT +
    r" position=" + _INT + r" stored_token=" + _INT + r" expected_token=" + _INT +
    r" stored_chain_hash=" + _HEX + r" expected_aux=" + _HEX)
_FOOTER = re.compile(r"total_violations=(\d{1,19}) ring_overflow=(True|False) "
                     r"step_when_pumped=(-?\d{1,19})")
_LABEL_BITS = {reason_label(member): int(member) for member in FailReason}
_UNKNOWN_TAG = re.compile(r"unknown\((-?\d{1,19})\)")
_BIT_LABEL = re.compile(r"bit(\d{1,2})")
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
# What SGLang logs only while its canary is installed (its boot summary, the periodic stats
# and sweep lines, the skipped-verify warning), and kvcanary's own audit output.
_CANARY_ON = re.compile(
    r"install_canary: disaggregation_mode=\S+ config=CanaryConfig\(mode=<CanaryMode\.(?:LOG|RAISE)"
    r"|\[canary\] step=\d+ protected_tokens=\d+ sweep_passes=\d+ violations=(\d{1,19})"
    r"|\[canary\] sweep succeeded \d+ times"
    r"|(kv-canary: per-forward verify skipped this step due to overflow)")
# Marks of a violation report: a line holding one and not read as a row is counted unparsed.
VIOLATION_MARKS = ("kv_canary violation:", '"fail_reason_bits"', '"launch_tag"')


class ExplainError(ToolError):
    """An input cannot be read (missing, a directory, not text)."""


class Overlong:
    """A line longer than :data:`MAX_LINE`, skipped; ``canary`` says whether it held a mark
    of a violation report (:data:`VIOLATION_MARKS`), which makes it an unparsed row."""

    __slots__ = ("canary",)

    def __init__(self, canary: bool):
        self.canary = canary


def looks_like_violation(text: str) -> bool:
    """Whether ``text`` holds a mark of a violation report (SGLang's or kvcanary's JSON)."""
    return any(mark in text for mark in VIOLATION_MARKS)


def _int64(text: str) -> int | None:
    value = int(text)
    return value if INT64_MIN <= value <= INT64_MAX else None


def _signed(hex_text: str) -> int:
    value = int(hex_text, 16) & ((1 << 64) - 1)
    return value - (1 << 64) if value >= 1 << 63 else value


def _tag_value(name: str) -> int | None:
    if name in LaunchTag.__members__:
        return int(LaunchTag[name])
    match = _UNKNOWN_TAG.fullmatch(name)
    return _int64(match.group(1)) if match else None


def _bits(text: str) -> int | None:
    if text == "none":
        return 0
    bits = 0
    for label in text.split("+"):
        unknown = _BIT_LABEL.fullmatch(label)
        if label in _LABEL_BITS:
            bits |= _LABEL_BITS[label]
        elif unknown and int(unknown.group(1)) < 64:   # the ring's field is 64 bits wide
            bits |= 1 << int(unknown.group(1))
        else:
            return None
    return bits - (1 << 64) if bits >= 1 << 63 else bits


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
    numbers = [_int64(match.group(i)) for i in range(3, 7)]
    if tag is None or reasons is None or None in numbers:
        return None
    slot, position, stored, expected = numbers
    return Violation(tag, slot, position, stored, expected, _signed(match.group(7)),
                     _signed(match.group(8)), reasons)


_JSON_KEYS = ("launch_tag", "slot_idx", "position", "stored_token", "expected_token",
              "stored_chain_hash", "expected_aux", "fail_reason_bits")
_ATTRIBUTION_KEYS = ("entry", "batch_index", "request_row", "expected_position", "prev_slot",
                     "sweep_index", "block_index", "block", "dump")


def _json_int(value) -> int | None:
    """``value`` when it is a JSON integer within int64 (never a bool, float or string)."""
    if isinstance(value, int) and not isinstance(value, bool) and INT64_MIN <= value <= INT64_MAX:
        return value
    return None


def _json_hash(value) -> int | None:
    if isinstance(value, str):
        return _signed(value) if re.fullmatch(_HEX, value) else None
    return _json_int(value)


_ATTRIBUTION_TEXT = {"entry": ("request", "sweep"), "dump": None}


def _attribution(record: dict) -> dict | None:
    """The attribution fields of ``record`` if every one present has its type (integers
    within int64; ``entry`` one of its words; ``dump`` a string); else None."""
    out = {}
    for key in _ATTRIBUTION_KEYS:
        if key not in record:
            continue
        value = record[key]
        if key in _ATTRIBUTION_TEXT:
            allowed = _ATTRIBUTION_TEXT[key]
            if not isinstance(value, str) or (allowed and value not in allowed):
                return None
        elif _json_int(value) is None:
            return None
        out[key] = value
    return out


def parse_json_record(record) -> tuple | None:
    """``(violation, step, attribution)`` of a kvcanary violation record (``audit --format
    json``, :meth:`kvcanary.LaunchFinding.to_dict`, ``explain --format json``), else None
    (also for a record with a field of the wrong type or outside int64)."""
    if not isinstance(record, dict) or record.get("record", "violation") != "violation":
        return None
    if not all(key in record for key in _JSON_KEYS):
        return None
    tag = record["launch_tag"]
    tag = _tag_value(tag) if isinstance(tag, str) else _json_int(tag)
    hashes = [_json_hash(record[k]) for k in ("stored_chain_hash", "expected_aux")]
    values = [_json_int(record[k]) for k in ("slot_idx", "position", "stored_token",
                                              "expected_token", "fail_reason_bits")]
    attribution = _attribution(record)
    if tag is None or None in hashes or None in values or attribution is None:
        return None
    v = Violation(tag, values[0], values[1], values[2], values[3], hashes[0], hashes[1],
                  values[4])
    step = _json_int(record.get("launch", record.get("first_step")))
    return v, step, attribution or None


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number a report holds")


def parse_json_line(text: str):
    """The JSON value of one line, or None when it is not JSON (or holds NaN/Infinity, or
    nests past the parser's depth)."""
    try:
        return json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return None


def canary_mark(record) -> bool:
    """Whether a JSON ``record`` shows kvcanary checked something: an ``audit`` summary that
    checked entries, or an ``explain`` summary that saw canary output."""
    if not isinstance(record, dict) or record.get("record") != "summary":
        return False
    checked = _json_int(record.get("entries_checked"))
    return bool(checked and checked > 0) or record.get("canary_output") is True


class Marks:
    """What a read saw besides rows: the canary's marks (lines showing it ran), skipped
    verifies, the largest violation count of SGLang's stats lines, and unparsed lines."""

    def __init__(self):
        self.canary = 0
        self.verify_skipped = 0
        self.stats_violations = 0
        self.unparsed = 0


def _note_canary_line(line: str, marks: Marks) -> None:
    if "canary" not in line:
        return
    match = _CANARY_ON.search(line)
    if match:
        marks.canary += 1
        if match.group(1):
            marks.stats_violations = max(marks.stats_violations, int(match.group(1)))
        if match.group(2):
            marks.verify_skipped += 1


def read_rows(lines, source: str, on_unparsed=None, marks: Marks | None = None):
    """Every reported row of one input's ``lines`` (an iterable of str, or :class:`Overlong`
    for a line cut by the reader), in order; ``marks`` collects what else the lines show."""
    marks = marks if marks is not None else Marks()

    def unparsed():
        marks.unparsed += 1
        if on_unparsed:
            on_unparsed()

    pending: list = []   # rows whose footer has not been seen yet: (row, lines left)
    for number, line in enumerate(lines, 1):
        if isinstance(line, Overlong) or len(line) > MAX_LINE:
            if line.canary if isinstance(line, Overlong) else looks_like_violation(line):
                unparsed()
            continue
        stripped = line.strip()
        if stripped.startswith("{"):
            record = parse_json_line(stripped)
            parsed = parse_json_record(record)
            if parsed:
                v, step, attribution = parsed
                yield Row(v, source, number, step=step, attribution=attribution, json=True)
                continue
            if canary_mark(record) and "kv_canary violation:" not in stripped:
                marks.canary += 1
                continue
            if record is not None and isinstance(record, dict) and (
                    record.get("record") == "violation" or "fail_reason_bits" in record):
                unparsed()   # a violation record of the wrong shape: counted, not dropped
                continue
            if record is None and looks_like_violation(stripped) and (
                    "kv_canary violation:" not in stripped):
                unparsed()
                continue
        if "kv_canary violation:" in line:
            yield from (row for row, _ in pending)
            pending = []
            v = parse_structured(line)
            if v is None:
                unparsed()
                continue
            pending.append((Row(v, source, number), BLOCK_LINES))
            continue
        _note_canary_line(line, marks)
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


