"""``--max-findings 0`` on a flooded dump streams: the findings are kept as arrays and built
and diagnosed a batch at a time while they are printed, so memory stays flat however many
there are; the HTML page caps its table and says how many it leaves out."""

from __future__ import annotations

import json
import tracemalloc

import pytest

import skip_reasons
from click.testing import CliRunner
from test_audit_flood import written

import kvcanary.audit.result as result_module
from kvcanary.audit import FindingList, audit
from kvcanary.cli.audit import render_json
from kvcanary.cli.main import main
from kvcanary.dump import save

REQUESTS, TOKENS = 4, 512      # 2,048 findings


@pytest.fixture(scope="module")
def flooded(tmp_path_factory) -> str:
    arrays = written(REQUESTS, TOKENS)
    arrays["canary"].view("int64")[1:, 1] ^= 1   # every record's stored position
    return save(str(tmp_path_factory.mktemp("flood") / "flood.npz"), **arrays)


def flood(tmp_path, requests: int) -> str:
    arrays = written(requests, TOKENS)
    arrays["canary"].view("int64")[1:, 1] ^= 1
    return save(str(tmp_path / f"flood{requests}.npz"), **arrays)


def peak_of_json(path) -> tuple:
    """Peak traced memory of an audit keeping every finding and its JSON rendering (the
    output itself discarded), and the records it gave."""
    records = []
    tracemalloc.start()
    try:
        result = audit(path, backend="numpy", max_findings=0)
        render_json(result, lambda text: records.append(text.count("\n") + 1))
        return tracemalloc.get_traced_memory()[1], sum(records)
    finally:
        tracemalloc.stop()


def test_every_finding_is_rendered_in_flat_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(result_module, "FINDINGS_BATCH", 256)
    monkeypatch.setattr("kvcanary.audit.engine.EAGER_FINDINGS", 256)
    small, small_records = peak_of_json(flood(tmp_path, 1))
    large, large_records = peak_of_json(flood(tmp_path, 4))
    assert (small_records, large_records) == (TOKENS + 2, 4 * TOKENS + 2)
    # Four times the findings, about the same peak (before: four times the peak, every
    # diagnosed Finding held and the whole output joined into one string).
    assert large < 2 * small, (small, large)


def test_every_finding_is_printed(flooded, monkeypatch):
    monkeypatch.setattr(result_module, "FINDINGS_BATCH", 256)
    monkeypatch.setattr("kvcanary.audit.engine.EAGER_FINDINGS", 256)
    result = CliRunner().invoke(main, ["audit", flooded, "--max-findings", "0", "--format", "json"])
    records = [json.loads(line) for line in result.output.splitlines()]
    violations = [r for r in records if r["record"] == "violation"]
    assert len(violations) == REQUESTS * TOKENS
    assert {(v["batch_index"], v["expected_position"]) for v in violations} == {
        (b, q) for b in range(REQUESTS) for q in range(TOKENS)}
    assert all(v["diagnosis"]["cause"] for v in violations)
    summary = records[-1]
    assert summary["reported"] == REQUESTS * TOKENS and not summary["findings_cut"]
    assert sum(summary["counts_by_cause"].values()) == REQUESTS * TOKENS


def test_a_long_finding_list_reads_like_a_list(flooded, monkeypatch):
    monkeypatch.setattr("kvcanary.audit.engine.EAGER_FINDINGS", 100)
    result = audit(flooded, backend="numpy", max_findings=0)
    findings = result.findings
    assert isinstance(findings, FindingList) and len(findings) == REQUESTS * TOKENS
    assert findings[5] == list(findings)[5] == findings[:10][5] and findings[-1].position == TOKENS - 1
    assert findings[5].diagnosis is not None


def test_the_page_caps_its_table_and_says_how_many_it_leaves_out(flooded, tmp_path, monkeypatch):
    pytest.importorskip("jinja2", reason=skip_reasons.REPORT)
    monkeypatch.setattr("kvcanary.report.model.TABLE_FINDINGS", 100)
    page = tmp_path / "r.html"
    result = CliRunner().invoke(main, ["audit", flooded, "--max-findings", "0", "--html", str(page)])
    assert result.exit_code == 1, result.output
    html = page.read_text()
    assert f"{REQUESTS * TOKENS - 100} more are kept but not listed here" in html
    assert html.count('<tr data-reasons=') == 100


def test_a_long_list_is_diagnosed_once_when_printed(flooded, monkeypatch):
    monkeypatch.setattr("kvcanary.audit.engine.EAGER_FINDINGS", 100)
    import kvcanary.audit.diagnose as diagnose_module
    calls = []
    real = diagnose_module.diagnose
    monkeypatch.setattr(diagnose_module, "diagnose", lambda *a, **k: calls.append(1) or real(*a, **k))
    CliRunner().invoke(main, ["audit", flooded, "--max-findings", "0", "--format", "json"])
    assert len(calls) == REQUESTS * TOKENS
