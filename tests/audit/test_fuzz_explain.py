"""``explain``'s fuzz target: random and mutated SGLang log blocks and kvcanary JSON Lines.

hypothesis builds logs from real blocks (SGLang's own, from the fixture logs of
tests/data/explain, and kvcanary's rendering of random ring rows, byte for byte SGLang's) and
real violation records, then mutates them (byte flips, inserted bytes and hostile tokens such
as huge numbers, ``bitN`` labels, deep nesting, NUL, removed or duplicated spans, joined
lines); the JSON records also get hostile values (``Infinity``, ``NaN``, decimals of
thousands of digits, nesting thousands deep, attribution of the wrong type). Whatever comes
out, reading it:

* raises nothing (a binary head is refused with :class:`ExplainError`, nothing else);
* is never ``clean`` when a line still says ``kv_canary violation:``;
* takes time and memory bounded by the bytes (measured per example with ``tracemalloc``).
"""

from __future__ import annotations

import io
import json
import time
import tracemalloc
from pathlib import Path

import pytest
from fuzz_support import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from kvcanary import Violation
from kvcanary.cli.log_input import SNIFF_BYTES, log_lines, refuse_binary
from kvcanary.audit.explain import MAX_LINE, ExplainError, Explanation

pytestmark = pytest.mark.fuzz

PREFIX = "[2026-12-01 10:03:34 TP0] "
INSTALL = (PREFIX + "install_canary: disaggregation_mode=null config=CanaryConfig(mode="
           "<CanaryMode.LOG: 'log'>, ring_capacity=64, sweep_interval=0)")
HOSTILE = [b"9" * 5000, b"bit3000000000", b"bit63", b"+bit7", b"\x00", b"\n", b"\r",
           b"{" * 3000, b"[" * 3000, b"Infinity", b"NaN", b"-", b"0x" + b"f" * 40,
           b"kv_canary violation: ", b"total_violations=99999999999999999999 ",
           b'"fail_reason_bits": ', b"\xff\xfe", b"unknown(-1)", b"\t" * 100]
# Per example: fixed costs (the interpreter, the diagnosis tables) plus a cost per byte.
TIME_BASE_S, TIME_PER_BYTE_S = 0.5, 50e-6
MEMORY_BASE, MEMORY_PER_BYTE = 4 << 20, 400

DATA = Path(__file__).resolve().parents[1] / "data" / "explain"


def fixture_blocks() -> list:
    """Every block of SGLang's fixture logs (the violation line and its report lines, each
    with its log prefix) and every other line, as the log holds them."""
    blocks = []
    for log in sorted(DATA.glob("*.log")):
        for line in log.read_text().splitlines():
            if blocks and not line.startswith("[") and "kv_canary violation:" not in line:
                blocks[-1] += "\n" + line     # a report line continues its block
            else:
                blocks.append(line)
    return blocks


FIXTURE_BLOCKS = fixture_blocks()
# JSON values no encoder writes but a log may hold; each replaces a placeholder string.
JSON_HOSTILE = {"\x01inf": "Infinity", "\x01-inf": "-Infinity", "\x01nan": "NaN",
                "\x01digits": "9" * 5000, "\x01deep": "[" * 3000 + "]" * 3000,
                "\x01object": '{"a":' * 2000 + "1" + "}" * 2000, "\x01float": "1e400"}

int64 = st.integers(-(1 << 63), (1 << 63) - 1)
small = st.integers(-2, 200)
violations = st.builds(Violation, st.integers(0, 13), small, small, st.one_of(small, int64),
                       small, int64, int64, st.integers(0, (1 << 10) - 1) | int64)


@st.composite
def blocks(draw) -> str:
    v = draw(violations)
    return PREFIX + v.format_block(total_violations=draw(st.integers(0, 300)),
                                   ring_overflow=draw(st.booleans()),
                                   step_when_pumped=draw(st.integers(-1, 50)))


@st.composite
def json_lines(draw) -> str:
    record = {"record": "violation", **draw(violations).to_dict()}
    if draw(st.booleans()):
        record.update(entry="request", batch_index=draw(small), request_row=draw(small),
                      expected_position=draw(small), prev_slot=draw(small))
    for key in draw(st.lists(st.sampled_from(sorted(record)), max_size=3)):
        record[key] = draw(st.one_of(st.none(), st.booleans(), st.text(max_size=5),
                                     st.floats(allow_nan=False, allow_infinity=False),
                                     st.lists(small, max_size=2), int64,
                                     st.sampled_from(sorted(JSON_HOSTILE))))
    text = json.dumps(record)
    for placeholder, value in JSON_HOSTILE.items():
        text = text.replace(json.dumps(placeholder), value)
    return text


@st.composite
def mutated_logs(draw) -> bytes:
    parts = draw(st.lists(st.one_of(blocks(), st.sampled_from(FIXTURE_BLOCKS), json_lines(),
                                    st.just(INSTALL), st.text(max_size=60)),
                          min_size=1, max_size=12))
    data = bytearray("\n".join(parts).encode("utf-8", "surrogatepass"))
    for _ in range(draw(st.integers(0, 6))):
        at = draw(st.integers(0, len(data)))
        op = draw(st.sampled_from(["flip", "insert", "hostile", "delete", "duplicate", "join"]))
        if op == "flip" and at < len(data):
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif op == "hostile":
            data[at:at] = draw(st.sampled_from(HOSTILE))
        elif op == "delete":
            del data[at:at + draw(st.integers(1, 40))]
        elif op == "duplicate":
            data[at:at] = data[at:at + draw(st.integers(1, 400))]
        elif op == "join":
            data[:] = data.replace(b"\n", b" ", draw(st.integers(1, 20)))
    return bytes(data)


def read(data: bytes) -> Explanation | None:
    """What ``explain`` does with one input's bytes: the sniff, then the streamed read."""
    head = data[:SNIFF_BYTES]
    try:
        refuse_binary(head, "fuzz.log")
    except ExplainError:
        return None
    x = Explanation()
    x.read(log_lines(io.BytesIO(data[SNIFF_BYTES:]), head, MAX_LINE), "fuzz.log")
    x.finish()
    return x


def check(data: bytes) -> None:
    tracemalloc.start()
    started = time.perf_counter()
    try:
        x = read(data)
        elapsed = time.perf_counter() - started
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert elapsed <= TIME_BASE_S + TIME_PER_BYTE_S * len(data), (elapsed, len(data))
    assert peak <= MEMORY_BASE + MEMORY_PER_BYTE * len(data), (peak, len(data))
    if x is None:
        return
    said = any(b"kv_canary violation:" in line for line in data.split(b"\n"))
    assert not (said and x.verdict == "clean"), data[:300]
    if x.verdict == "clean":
        assert not x.rows and not x.unparsed


@fuzz_settings(100, deadline_ms=10_000)
@given(mutated_logs())
def test_fuzz_explain_of_mutated_logs(data):
    check(data)


@fuzz_settings(60, deadline_ms=10_000)
@given(st.binary(max_size=2000))
def test_fuzz_explain_of_random_bytes(data):
    check(data)


@pytest.mark.parametrize("token", HOSTILE, ids=lambda t: repr(t[:12]))
def test_a_long_run_of_each_hostile_token_costs_what_its_bytes_do(token):
    """Each hostile token repeated over 128 KiB (one line, or many), and inside a block."""
    block = (Violation(2, 3, 4, 5, 5, 1, 1, 2).format_block(
        total_violations=1, ring_overflow=False, step_when_pumped=0) + "\n").encode()
    body = (token * ((1 << 17) // len(token) + 1))[: 1 << 17]
    check(INSTALL.encode() + b"\n" + block + body + b"\n" + block.replace(b"=4 ", token, 1))


def test_the_fixture_blocks_are_sglangs_own_and_read_whole():
    violations = [b for b in FIXTURE_BLOCKS if "kv_canary violation:" in b]
    assert len(violations) > 100 and all(b.count("\n") == 6 for b in violations)
    x = read(("\n".join(FIXTURE_BLOCKS) + "\n").encode())
    assert x.rows == len(violations) and x.unparsed == 0


@pytest.mark.parametrize("field", ["slot_idx", "position", "fail_reason", "total_violations",
                                   "stored_chain_hash"])
def test_each_field_of_a_real_block_holding_each_hostile_token(field):
    """Each hostile token in place of one field's value, in SGLang's structured line and in
    the block's report lines alike: bounded, and never clean."""
    block = next(b for b in FIXTURE_BLOCKS if "kv_canary violation:" in b)
    for token in HOSTILE + [v.encode() for v in JSON_HOSTILE.values()]:
        data = bytearray(block.encode())
        at = data.find(field.encode() + b"=")
        while at >= 0:
            start = at + len(field) + 1
            end = start
            while end < len(data) and data[end:end + 1] not in (b" ", b"\n"):
                end += 1
            data[start:end] = token
            at = data.find(field.encode() + b"=", start + len(token))
        check(INSTALL.encode() + b"\n" + bytes(data) + b"\n")
