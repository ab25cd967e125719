"""``kvcanary explain`` on logs written by SGLang's own violation reporter (tests/data/explain,
made by scripts/make-explain-fixtures.py) and on kvcanary's JSON Lines."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

import skip_reasons
from click.testing import CliRunner

from kvcanary.cli.main import main
from kvcanary.format.consts import FailReason

DATA = Path(__file__).resolve().parents[1] / "data" / "explain"


def explain(*args, input=None):
    return CliRunner().invoke(main, ["explain", *map(str, args)], input=input)


def records(output: str) -> list:
    return [json.loads(line) for line in output.splitlines()]


def test_repeated_blocks_merge_into_distinct_findings_with_tags_counts_and_steps():
    out = explain(DATA / "decode.log", "--format", "json", "--max-findings", "0")
    assert out.exit_code == 1
    rs = records(out.output)
    assert rs[0] == {"record": "config", "command": "explain", "inputs": [str(DATA / "decode.log")]}
    findings = [r for r in rs if r["record"] == "violation"]
    summary = rs[-1]
    assert summary["record"] == "summary" and summary["violations"] == 160
    assert summary["distinct_findings"] == len(findings) == 12
    assert summary["verdict"] == "violations" and summary["canary_output"]
    # The rewritten slot: both stages see the record, only TAIL (with real-KV sources) its KV.
    head, tail = (f for f in findings if (f["slot_idx"], f["position"]) == (4, 77))
    assert head["launch_tags"] == ["HEAD_K_FULL", "HEAD_V_FULL"] and head["count"] == 12
    assert tail["launch_tags"] == ["TAIL_K_FULL", "TAIL_V_FULL"] and tail["count"] == 11
    assert "verify_real_kv_hash" not in head["fail_reason"]
    assert "verify_real_kv_hash" in tail["fail_reason"]
    assert (head["first_step"], head["last_step"]) == (2, 7)
    assert head["diagnosis"]["cause"] == tail["diagnosis"]["cause"] == "overwritten"
    assert not head["diagnosis"]["certain"]   # a log row alone is ambiguous: it says so
    assert sum(f["count"] for f in findings) == 160
    assert summary["counts_by_tag"] == {"HEAD_K_FULL": 46, "HEAD_V_FULL": 42,
                                        "TAIL_K_FULL": 38, "TAIL_V_FULL": 34}


def test_patterns_head_tail_one_position_and_ring_overflow():
    out = explain(DATA / "decode.log", "--format", "json", "--max-findings", "0")
    rs = records(out.output)
    patterns = {r["pattern"]: r for r in rs if r["record"] == "pattern"}
    assert set(patterns) == {"head-tail", "one-position", "ring-overflow"}
    findings = [r for r in rs if r["record"] == "violation"]
    # Only the stray write into the HEAD K buffer (step 6) is a disagreement of the copies;
    # neither the rewritten slot (real-KV bit only in TAIL rows) nor the V byte changed
    # between steps (real-KV only) are.
    stray = [findings[i] for i in patterns["head-tail"]["findings"]]
    assert {(f["slot_idx"], f["position"]) for f in stray} == {(7, 6), (8, 7)}
    assert all(f["launch_tags"] == ["HEAD_K_FULL"] for f in stray)
    assert "stray write into that buffer" in patterns["head-tail"]["text"]
    assert "changed between the head and tail verify" not in out.output
    assert {findings[i]["position"] for i in patterns["one-position"]["findings"]} == {5}
    assert "lower bound" in patterns["ring-overflow"]["text"]
    summary = rs[-1]
    assert summary["ring_overflow"] and summary["total_violations_reported"] == 172


def test_every_head_row_in_a_fixture_has_only_checks_a_head_launch_can_make():
    """SGLang gives its HEAD launches no real-KV sources (they run before the forward writes
    the new tokens' KV): a HEAD row can never carry the real-KV hash bit."""
    from kvcanary.format.consts import FailReason
    from kvcanary.audit.explain import read_rows

    real = int(FailReason.VERIFY_REAL_KV_HASH_MISMATCH)
    heads = 0
    for log in sorted(DATA.glob("*.log")):
        for row in read_rows(log.read_text().splitlines(), log.name):
            if row.violation.launch_tag.startswith("HEAD_"):
                heads += 1
                assert not row.violation.fail_reason_bits & real, (log.name, row.line)
    assert heads > 0


def test_every_fixture_log_shows_the_canary_was_installed():
    for log in sorted(DATA.glob("*.log")):
        first = log.read_text().splitlines()[0]
        assert "install_canary: disaggregation_mode=" in first, log.name
        assert "config=CanaryConfig(mode=<CanaryMode.LOG: 'log'>" in first, log.name


def test_real_kv_failures_on_one_side_of_a_prefill_decode_pair():
    out = explain(DATA / "pd-prefill.log", DATA / "pd-decode.log")
    assert out.exit_code == 1
    assert "pattern pd-real-kv: real-KV hash failures only in" in out.output
    assert "KV bytes changed in the transfer" in out.output


def test_text_report_is_bounded_and_labels_per_check_counts():
    out = explain(DATA / "decode.log", "--max-findings", "2")
    assert "finding 2:" in out.output and "finding 3:" not in out.output
    assert "the first 2 of 12 are shown" in out.output
    assert "counted per check over rows" in out.output


def test_stdin_with_other_text_and_a_clean_log():
    text = (DATA / "pd-decode.log").read_text()
    out = explain("-", input="unrelated line\n" + text + "\nmore noise\n")
    assert out.exit_code == 1 and "2 distinct finding(s)" in out.output
    clean = explain(DATA / "pd-prefill.log")
    assert clean.exit_code == 0 and "summary: CLEAN" in clean.output


def test_missing_input_is_one_error_line_and_exit_2_with_no_summary(tmp_path):
    out = explain(tmp_path / "nope.log", DATA / "pd-decode.log")
    assert out.exit_code == 2 and "Traceback" not in out.output
    assert f"kvcanary: error: {tmp_path / 'nope.log'}: No such file" in out.output
    assert "summary" not in out.output and "CLEAN" not in out.output


def test_an_overlong_line_is_skipped_and_counted(tmp_path):
    MAX_LINE = 1 << 16   # kvcanary.audit.explain.MAX_LINE

    path = tmp_path / "long.log"
    path.write_text("kv_canary violation: " + "x" * (MAX_LINE * 3) + "\n"
                    + (DATA / "pd-decode.log").read_text())
    out = explain(path)
    assert out.exit_code == 1 and "1 unparsable violation line(s) skipped" in out.output


def test_kvcanary_audit_json_is_read_with_its_attribution(tmp_path):
    from test_audit import build, fields

    from kvcanary.dump import save

    arrays = build()
    fields(arrays)[32, 0] = 99
    path = save(str(tmp_path / "d.npz"), **arrays)
    audited = CliRunner().invoke(main, ["audit", path, "--backend", "numpy", "--format", "json"])
    log = tmp_path / "audit.jsonl"
    log.write_text(audited.output)
    out = explain(log)
    assert out.exit_code == 1
    assert "at: request row 3 (batch index 3), position 2" in out.output
    assert "(2 from kvcanary JSON)" in out.output


def test_every_fixture_block_parses_with_its_footer():
    from kvcanary.audit.explain import Explanation, parse_structured

    x = Explanation()
    text = (DATA / "decode.log").read_text()
    x.read(text.splitlines(keepends=True), "decode.log")
    assert x.rows == text.count("kv_canary violation:") and x.unparsed == 0
    assert x.max_total == {"decode.log": 172}
    line = next(line for line in text.splitlines() if "kv_canary violation:" in line)
    v = parse_structured(line)
    assert v.log_line() in line   # kvcanary's rendering of the row is SGLang's, byte for byte
    assert np.int64(v.stored_chain_hash) == v.stored_chain_hash


def test_engine_findings_as_json_lines_merge_across_launches(tmp_path):
    from test_diagnosis import toy_engine

    import kvcanary as kc
    from builders import i64

    context, table = toy_engine()
    table[2, 2] = 3
    lines = []
    for step in (5, 6, 7):
        before = context.violation_log.total
        vp = kc.VerifyPlan.allocate(64)
        kc.plan(req_pool_indices=i64([1, 2]), prefix_lens=i64([4, 4]), extend_seq_lens=i64([0, 0]),
                req_to_token=table, verify_plan=vp, write_plan=kc.WritePlan.allocate(2))
        kc.verify(context, vp)
        lines += [json.dumps(f.to_dict()) for f in kc.attribute(
            context, vp, req_pool_indices=i64([1, 2]), prefix_lens=i64([4, 4]), since=before,
            launch=step)]
    log = tmp_path / "engine.jsonl"
    log.write_text("\n".join(lines) + "\n")
    rs = records(explain(log, "--format", "json").output)
    findings = [r for r in rs if r["record"] == "violation"]
    assert findings and all((f["count"], f["first_step"], f["last_step"]) == (3, 5, 7)
                            for f in findings)
    assert findings[0]["request_row"] == 2 and findings[0]["expected_position"] == 2


def test_distinct_findings_kept_are_bounded(monkeypatch):
    import kvcanary.audit.explain as ex

    monkeypatch.setattr(ex, "MAX_DISTINCT", 3)
    x = ex.Explanation()
    lines = [f"kv_canary violation: launch_tag=TAIL_K_FULL fail_reason=verify_position "
             f"slot_idx={slot} position=1 stored_token=2 expected_token=-1 "
             f"stored_chain_hash=0x0000000000000001 expected_aux=0x0000000000000001\n"
             for slot in range(10)]
    x.read(lines, "many.log")
    assert len(x.findings) == 3 and x.rows == 10 and x.rows_not_kept == 7


def test_html_report_keeps_the_exit_code_and_holds_every_finding(tmp_path):
    pytest.importorskip("jinja2", reason=skip_reasons.REPORT)
    page = tmp_path / "explain.html"
    result = CliRunner().invoke(main, ["explain", str(DATA / "decode.log"), "--html", str(page)])
    assert result.exit_code == 1 and f"html report: {page}" in result.output
    text = page.read_text()
    assert text.count("<tr data-reasons=") == 12     # 160 rows, 12 distinct findings
    assert "pattern head-tail:" in text and "172 violations reported, 160 rows logged" in text


def test_html_without_the_extra_is_one_error_before_reading(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "jinja2", None)
    page = tmp_path / "explain.html"
    result = CliRunner().invoke(main, ["explain", str(DATA / "decode.log"), "--html", str(page)])
    assert result.exit_code == 2 and "pip install 'kvcanary[report]'" in result.output
    assert "finding 1" not in result.output and not page.exists()


@pytest.mark.parametrize("overflow", [True, False])
def test_the_footers_ring_overflow_is_reported_when_no_more_violations_than_rows(tmp_path,
                                                                               overflow):
    """The usual long log: every step re-logs the same rows, so the largest
    ``total_violations`` (2) is below the rows logged (6); the footer's own flag is what says
    the ring overflowed."""
    from kvcanary import Violation

    prefix = "[2026-12-01 16:02:55 TP0] "
    install = (DATA / "decode.log").read_text().splitlines()[0]
    rows = [Violation(2, 5, 4, 7, 7, 1, 2, int(FailReason.VERIFY_CHAIN_HASH_MISMATCH)),
            Violation(2, 6, 9, 8, 8, 3, 4, int(FailReason.VERIFY_POSITION_MISMATCH))]
    blocks = [prefix + v.format_block(total_violations=2, ring_overflow=overflow,
                                      step_when_pumped=step)
              for step in range(3) for v in rows]
    log = tmp_path / "relogged.log"
    log.write_text("\n".join([install, *blocks]) + "\n")
    rs = records(explain(log, "--format", "json").output)
    summary = rs[-1]
    assert summary["violations"] == 6 and summary["total_violations_reported"] == 2
    assert summary["ring_overflow"] is overflow
    assert ("ring-overflow" in summary["patterns"]) is overflow
    text = explain(log).output
    assert ("ring overflow: 2 violations reported" in text) is overflow
    assert ("pattern ring-overflow: the violation ring overflowed (" in text) is overflow
