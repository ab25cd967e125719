"""What ``kvcanary explain`` makes of things that are not (only) canary output: dumps and
binary files, text without the canary, unreadable inputs, and hostile violation lines. None
of them may read as CLEAN, end in a traceback, or cost more than its bytes."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from kvcanary.cli.main import main

DATA = Path(__file__).resolve().parents[1] / "data" / "explain"
BLOCK = ("kv_canary violation: launch_tag=TAIL_K_FULL fail_reason={reason} slot_idx=3 "
         "position={position} stored_token=19713 expected_token=19713 "
         "stored_chain_hash=0x839e033e9ba16cdc expected_aux=0x839e033e9ba16cdc\n")
INSTALL = (DATA / "pd-prefill.log").read_text().splitlines(keepends=True)[0]


def explain(*args, input=None):
    return CliRunner().invoke(main, ["explain", *map(str, args)], input=input)


def assert_not_clean(out, code):
    assert out.exit_code == code, out.output
    assert "Traceback" not in out.output and "CLEAN:" not in out.output


# ------------------------------------------------------------------ not canary output


def test_a_dump_is_refused_naming_audit_with_no_summary(tmp_path):
    from test_audit import build

    from kvcanary.dump import save

    npz = save(str(tmp_path / "d.npz"), **build())
    np.save(tmp_path / "seq_lens.npy", np.arange(3))
    for path in (npz, tmp_path / "seq_lens.npy"):
        out = explain(path)
        assert_not_clean(out, 2)
        assert "kvcanary audit" in out.output and "summary" not in out.output


def test_a_directory_is_refused_naming_audit(tmp_path):
    out = explain(tmp_path)
    assert_not_clean(out, 2)
    assert "a directory, not a log" in out.output and "kvcanary audit" in out.output


@pytest.mark.parametrize("head", [b"\0" * 100, b"text\n\x00\x01\x02 binary"])
def test_a_binary_file_is_refused(tmp_path, head):
    path = tmp_path / "blob"
    path.write_bytes(head + bytes(range(256)) * 4)
    out = explain(path)
    assert_not_clean(out, 2)
    assert "a binary file" in out.output and "summary" not in out.output


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero here")
def test_dev_zero_is_refused_at_once():
    started = time.monotonic()
    out = explain("/dev/zero")
    assert_not_clean(out, 2)
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("text", ["", "INFO server started\nINFO request done\n"])
def test_text_without_canary_output_is_not_clean(tmp_path, text):
    path = tmp_path / "server.log"
    path.write_text(text)
    out = explain(path)
    assert_not_clean(out, 3)
    assert "NO CANARY OUTPUT" in out.output and "not a clean result" in out.output
    summary = json.loads(explain(path, "--format", "json").output.splitlines()[-1])
    assert summary["verdict"] == "no-canary-output" and not summary["canary_output"]


def test_dev_null_is_no_canary_output():
    if not os.path.exists("/dev/null"):
        pytest.skip("no /dev/null here")
    assert_not_clean(explain("/dev/null"), 3)


def test_a_clean_log_is_clean_only_with_the_canary_install_line(tmp_path):
    log = (DATA / "pd-prefill.log").read_text()
    assert explain(DATA / "pd-prefill.log").exit_code == 0
    stripped = tmp_path / "no-install.log"
    stripped.write_text("".join(line for line in log.splitlines(keepends=True)
                                if "install_canary" not in line))
    assert_not_clean(explain(stripped), 3)


def test_sglang_stats_and_sweep_lines_show_the_canary_ran(tmp_path):
    path = tmp_path / "rotated.log"
    path.write_text("[2026-12-01 10:00:00 TP0] [canary] step=100 protected_tokens=4096 "
                    "sweep_passes=3 violations=0 launch_tags_active=4/12\n")
    assert explain(path).exit_code == 0
    path.write_text("[2026-12-01 10:00:00 TP0] [canary] sweep succeeded 5 times "
                    "(last_step=90)\n")
    assert explain(path).exit_code == 0


def test_violations_counted_by_the_stats_line_with_no_row_logged_are_not_clean(tmp_path):
    path = tmp_path / "rotated.log"
    path.write_text("[2026-12-01 10:00:00 TP0] [canary] step=100 protected_tokens=4096 "
                    "sweep_passes=3 violations=7 launch_tags_active=4/12\n")
    out = explain(path)
    assert_not_clean(out, 1)
    assert "count 7 violation(s)" in out.output


def test_skipped_verifies_are_said(tmp_path):
    path = tmp_path / "server.log"
    path.write_text(INSTALL + "[2026-12-01 10:00:00 TP0] kv-canary: per-forward verify "
                    "skipped this step due to overflow (total=2, capacity=96); check "
                    "ServerArgs / pool sizing\n")
    out = explain(path)
    assert out.exit_code == 0 and "1 step(s) skipped their verify" in out.output


def test_clean_audit_json_is_clean_and_explain_json_round_trips(tmp_path):
    from test_audit import build

    from kvcanary.dump import save

    path = save(str(tmp_path / "d.npz"), **build())
    audited = CliRunner().invoke(main, ["audit", path, "--backend", "numpy", "--format", "json"])
    log = tmp_path / "audit.jsonl"
    log.write_text(audited.output)
    assert explain(log).exit_code == 0
    again = tmp_path / "explain.jsonl"
    again.write_text(explain(DATA / "pd-prefill.log", "--format", "json").output)
    assert explain(again).exit_code == 0
    nothing = tmp_path / "nothing.jsonl"
    nothing.write_text(explain(tmp_path / "audit.jsonl", "--format", "json").output
                       .replace('"canary_output": true', '"canary_output": false'))
    assert explain(nothing).exit_code == 3


def test_an_unreadable_input_among_good_ones_gives_no_summary(tmp_path):
    blob = tmp_path / "d.npz"
    blob.write_bytes(b"PK\x03\x04" + b"\0" * 64)
    out = explain(DATA / "decode.log", blob, tmp_path / "nope.log")
    assert_not_clean(out, 2)
    assert out.output.count("kvcanary: error:") == 2 and "summary" not in out.output
    assert "finding 1" not in out.output


def test_stdin_is_sniffed_too():
    assert_not_clean(explain("-", input=b"\0\0\0\0"), 2)
    assert explain("-", input=INSTALL).exit_code == 0


# ------------------------------------------------------------------ hostile violation lines


def _log(tmp_path, body: str) -> Path:
    path = tmp_path / "hostile.log"
    path.write_text(INSTALL + body)
    return path


@pytest.mark.parametrize("reason", ["bit3000000000", "bit64", "bit99", "verify_token+bit-1"])
def test_a_bit_label_outside_the_64_bit_field_is_an_unparsed_line(tmp_path, reason):
    started = time.monotonic()
    out = explain(_log(tmp_path, BLOCK.format(reason=reason, position=2)))
    assert_not_clean(out, 1)
    assert "1 unparsable violation line(s)" in out.output
    assert time.monotonic() - started < 5 and len(out.output) < 4000


def test_a_bit_label_inside_the_field_is_read(tmp_path):
    out = explain(_log(tmp_path, BLOCK.format(reason="bit63", position=2)), "--format", "json")
    (finding,) = [r for r in map(json.loads, out.output.splitlines())
                  if r["record"] == "violation"]
    assert finding["fail_reason"] == "bit63"


@pytest.mark.parametrize("position", ["9" * 5000, "9223372036854775808", "-" + "9" * 19])
def test_a_number_outside_int64_is_an_unparsed_line(tmp_path, position):
    out = explain(_log(tmp_path, BLOCK.format(reason="verify_token", position=position)))
    assert_not_clean(out, 1)
    assert "1 unparsable violation line(s)" in out.output


def _record(**changes) -> str:
    record = {"record": "violation", "launch_tag": "TAIL_K_FULL", "slot_idx": 3, "position": 2,
              "stored_token": 5, "expected_token": 5, "stored_chain_hash": "0x1",
              "expected_aux": "0x1", "fail_reason_bits": 2, "entry": "request",
              "batch_index": 0, "request_row": 1, "expected_position": 2}
    record.update(changes)
    return json.dumps(record)


@pytest.mark.parametrize("line", [
    _record(expected_position="x"), _record(batch_index=[1]), _record(slot_idx=True),
    _record(position=2.5), _record(stored_token=2 ** 64), _record(entry="elsewhere"),
    _record().replace('"position": 2', '"position": Infinity'),
    _record().replace('"position": 2', '"position": NaN'),
    _record().replace('"position": 2', '"position": ' + "9" * 5000),
    _record(stored_chain_hash="0x" + "f" * 17),
    '{"fail_reason_bits": ' + "[" * 30000 + "]" * 30000 + "}",
    '{"record": "violation", "launch_tag": "TAIL_K_FULL", "slot_idx": 3',
], ids=lambda line: line[:40])
def test_a_json_record_of_the_wrong_shape_is_an_unparsed_line(tmp_path, line):
    out = explain(_log(tmp_path, line + "\n"))
    assert_not_clean(out, 1)
    assert "1 unparsable violation line(s)" in out.output


def test_blocks_joined_onto_one_overlong_line_are_counted(tmp_path):
    joined = "".join(BLOCK.format(reason="verify_token", position=p).rstrip("\n") + " | "
                     for p in range(2000))
    assert len(joined) > 1 << 16
    out = explain(_log(tmp_path, joined + "\n"))
    assert_not_clean(out, 1)
    assert "1 unparsable violation line(s)" in out.output


def test_an_overlong_ordinary_line_is_not_a_violation(tmp_path):
    out = explain(_log(tmp_path, "INFO " + "y" * (1 << 18) + "\nINFO done\n"))
    assert out.exit_code == 0 and "unparsable" not in out.output


def test_a_nul_inside_a_block_is_not_clean(tmp_path):
    body = BLOCK.format(reason="verify_token", position=2).replace("slot_idx=3", "slot_idx=\x003")
    path = tmp_path / "nul.log"
    path.write_text(INSTALL + "INFO filler\n" * 2000 + body)   # the NUL past the sniffed head
    out = explain(path)
    assert_not_clean(out, 1)
    assert "1 unparsable violation line(s)" in out.output


def test_pattern_lines_are_bounded_by_max_findings(tmp_path):
    lines = [BLOCK.format(reason="verify_token", position=p).replace("slot_idx=3",
                                                                      f"slot_idx={p * 10 + s}")
             for p in range(200) for s in range(3)]
    path = _log(tmp_path, "".join(lines))
    out = explain(path, "--max-findings", "5")
    assert out.output.count("pattern one-position:") == 6   # five, then one saying the rest
    assert "195 more one-position pattern(s) not shown" in out.output
    rs = [json.loads(line) for line in explain(path, "--format", "json", "--max-findings",
                                               "5").output.splitlines()]
    patterns = [r for r in rs if r["record"] == "pattern"]
    assert len(patterns) == 6 and all(i < 5 for p in patterns for i in p["findings"])
    assert len(explain(path, "--max-findings", "0").output.split("pattern one-position:")) == 201
