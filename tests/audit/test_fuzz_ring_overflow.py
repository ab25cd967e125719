"""Ring overflow in the audit: one noisy source floods the report ring; the summary still
gives the true total, the dropped count and exact counts by reason and by tag, so the quiet
source stays visible (text and JSON), whatever the ring capacity and chunking."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from fuzz_support import fuzz_settings
from kvcanary.audit import audit
from kvcanary.cli import main
from kvcanary.dump import load, save

pytestmark = pytest.mark.fuzz


def two_sources(path, flood: int, quiet: int) -> str:
    """Request row 1 holds ``flood`` entries on zeroed records (position 0 breaks the chain,
    every later position has the wrong stored position): ``flood`` TAIL_K_FULL rows. The sweep
    holds ``quiet`` entries on slots past the buffer: ``quiet`` SWEEP_K_FULL out-of-range rows."""
    num_slots = flood + 2
    table = np.zeros((2, flood), np.int64)
    table[1] = np.arange(1, flood + 1)
    return save(path, canary=np.zeros((num_slots, 32), np.uint8), req_to_token=table,
                req_pool_indices=np.array([1], np.int64), seq_lens=np.array([flood], np.int64),
                sweep_slot_indices=np.arange(quiet, dtype=np.int64) + num_slots + 5,
                sweep_prev_slot_indices=np.full(quiet, -1, np.int64),
                sweep_positions=np.zeros(quiet, np.int64))


def expected_counts(flood: int, quiet: int):
    reasons = {"slot_out_of_range": quiet, "verify_chain_hash": 1}
    if flood > 1:
        reasons["verify_position"] = flood - 1
    return dict(sorted(reasons.items())), {"SWEEP_K_FULL": quiet, "TAIL_K_FULL": flood}


@fuzz_settings(40)
@given(flood=st.integers(1, 400), quiet=st.integers(1, 6), data=st.data())
def test_counts_are_exact_whatever_the_ring_and_chunks(tmp_path_factory, flood, quiet, data):
    ring = data.draw(st.integers(1, flood + quiet + 3), label="ring_capacity")
    chunk = data.draw(st.integers(1, flood + 8), label="chunk_entries")
    path = two_sources(str(tmp_path_factory.mktemp("ring") / "d.npz"), flood, quiet)
    result = audit(load(path), backend="numpy", ring_capacity=ring, chunk_entries=chunk)
    total = flood + quiet
    reasons, tags = expected_counts(flood, quiet)
    assert result.total_violations == total
    assert result.dropped == max(0, total - ring)
    assert result.ring_overflow == (total > ring)
    assert len(result.findings) == min(total, ring)
    assert result.counts_by_reason == reasons
    assert result.counts_by_tag == tags
    summary = result.summary_record()
    assert (summary["violations"], summary["dropped"], summary["reported"]) == \
        (total, max(0, total - ring), min(total, ring))


def test_flooding_source_does_not_hide_the_quiet_one_in_text_and_json(tmp_path):
    path = two_sources(str(tmp_path / "d.npz"), 1000, 3)
    text = CliRunner().invoke(main, ["audit", "--backend", "numpy", "--ring-capacity", "3", path])
    assert text.exit_code == 1, text.output
    findings = [line for line in text.output.splitlines() if line.startswith("kv_canary")]
    assert len(findings) == 3 and all("TAIL_K_FULL" in line for line in findings)
    summary = [line for line in text.output.splitlines() if line.startswith("summary ")][0]
    assert "1003 violation(s)" in summary
    assert "[slot_out_of_range 3, verify_chain_hash 1, verify_position 999]" in summary
    assert "by tag [SWEEP_K_FULL 3, TAIL_K_FULL 1000]" in summary
    assert "ring overflow: 1000 of 1003 rows dropped (ring capacity 3)" in summary

    js = CliRunner().invoke(main, ["audit", "--backend", "numpy", "--ring-capacity", "3",
                                   "--format", "json", path])
    records = [json.loads(line) for line in js.output.splitlines()]
    record = records[-1]
    assert record["record"] == "summary"
    assert (record["violations"], record["dropped"], record["reported"]) == (1003, 1000, 3)
    assert record["ring_overflow"] is True
    assert record["counts_by_reason"] == {"slot_out_of_range": 3, "verify_chain_hash": 1,
                                          "verify_position": 999}
    assert record["counts_by_tag"] == {"SWEEP_K_FULL": 3, "TAIL_K_FULL": 1000}
    assert sum(1 for r in records if r["record"] == "violation") == 3
