"""A flooded dump (every record corrupt) audits fast and small: a bounded number of findings,
exact totals, counts by reason, tag and request, and the first and last affected positions
of every request; the same whatever the chunking and the order the backend emits rows in."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

import kvcanary as kc
import kvcanary.audit.engine as audit_module
from kvcanary.audit import DEFAULT_MAX_FINDINGS, AuditError, audit
from kvcanary.cli import main
from kvcanary.dump import load, save

REQUESTS, TOKENS = 3, 700   # 2,100 entries: more than the default bound of 1,024 findings


def written(requests=REQUESTS, tokens=TOKENS) -> dict:
    """``requests x tokens`` prefilled through plan + write on shuffled slots."""
    num_slots = requests * tokens + 1
    table = np.zeros((requests + 1, tokens), np.int64)
    table[1:] = np.random.default_rng(0).permutation(np.arange(1, num_slots)).reshape(requests, -1)
    canary = np.zeros((num_slots, 32), np.uint8)
    context = kc.CanaryContext(canary, kernel_kind=kc.LaunchTag.TAIL_K_FULL,
                               violation_log=kc.ViolationLog.allocate(1),
                               slot_run_counter=np.zeros(1, np.int64),
                               kernel_run_counter=np.zeros(1, np.int64))
    rows, lens = np.arange(1, requests + 1), np.full(requests, tokens)
    write_plan = kc.WritePlan.allocate(requests)
    kc.plan(req_pool_indices=rows, prefix_lens=np.zeros(requests, np.int64), extend_seq_lens=lens,
            req_to_token=table, verify_plan=kc.VerifyPlan.allocate(1), write_plan=write_plan)
    positions = np.tile(np.arange(tokens), requests)
    kc.write(context, write_plan, input_ids=positions + 100, positions=positions,
             out_cache_loc=table[1:].reshape(-1))
    return dict(canary=canary, req_to_token=table, req_pool_indices=rows, seq_lens=lens)


def flip_positions(arrays: dict, row: int, positions) -> None:
    slots = arrays["req_to_token"][row, positions]
    arrays["canary"].view(np.int64)[slots, 1] ^= 1


@pytest.fixture(scope="module")
def flooded(tmp_path_factory) -> str:
    arrays = written()
    arrays["canary"].view(np.int64)[1:, 1] ^= 1   # every record's stored position
    return save(str(tmp_path_factory.mktemp("flood") / "flood.npz"), **arrays)


@pytest.mark.parametrize("chunk", [audit_module.CHUNK_ENTRIES, 256])
def test_flood_keeps_the_first_findings_and_exact_totals(flooded, chunk):
    result = audit(flooded, backend="numpy", chunk_entries=chunk)
    entries = REQUESTS * TOKENS
    assert result.total_violations == entries
    assert len(result.findings) == DEFAULT_MAX_FINDINGS == 1024
    assert result.findings_cut and result.findings_omitted == entries - 1024
    # Every position mismatches; every link but the three chain heads' breaks too.
    assert result.counts_by_reason == {"verify_chain_hash": entries - REQUESTS,
                                       "verify_position": entries}
    assert result.counts_by_tag == {"TAIL_K_FULL": entries}
    assert result.counts_by_entry == {"request": entries}
    assert [r.to_dict() for r in result.requests] == [
        dict(batch_index=b, request_row=b + 1, violations=TOKENS, first_position=0,
             last_position=TOKENS - 1) for b in range(REQUESTS)]
    # The kept findings are the first rows in entry order: request row 1, then row 2.
    assert [(f.request_row, f.position) for f in result.findings] == \
        [(1 + i // TOKENS, i % TOKENS) for i in range(1024)]
    summary = result.summary_record()
    assert (summary["violations"], summary["reported"], summary["findings_cut"],
            summary["findings_omitted"]) == (entries, 1024, True, entries - 1024)
    assert len(summary["requests"]) == REQUESTS


def test_max_findings_zero_keeps_every_finding_and_n_keeps_n(flooded):
    every = audit(flooded, backend="numpy", max_findings=0)
    assert len(every.findings) == REQUESTS * TOKENS and not every.findings_cut
    five = audit(flooded, backend="numpy", max_findings=5)
    assert [f.to_dict() for f in five.findings] == [f.to_dict() for f in every.findings[:5]]
    assert five.counts_by_reason == every.counts_by_reason
    with pytest.raises(AuditError, match="max_findings must be 0"):
        audit(flooded, backend="numpy", max_findings=-1)


def test_first_and_last_affected_position_per_request(tmp_path):
    arrays = written()
    flip_positions(arrays, 2, np.arange(100, 200))
    flip_positions(arrays, 3, [TOKENS - 1])
    result = audit(load(save(str(tmp_path / "d.npz"), **arrays)), backend="numpy",
                   chunk_entries=512)
    # Positions 100..199 of row 2 mismatch; the link of 200 hashes the flipped record at 199.
    assert [r.to_dict() for r in result.requests] == [
        dict(batch_index=1, request_row=2, violations=101, first_position=100, last_position=200),
        dict(batch_index=2, request_row=3, violations=1, first_position=TOKENS - 1,
             last_position=TOKENS - 1)]
    assert not result.findings_cut and result.summary_record()["findings_omitted"] == 0


def test_attribution_does_not_depend_on_the_order_rows_arrive_in(flooded, monkeypatch):
    """The kernels fill the ring in any order: the findings must not change."""
    reference = audit(flooded, backend="numpy", max_findings=0, chunk_entries=512)
    verify = audit_module.verify_rows

    def shuffled(launcher, launch):
        rows = verify(launcher, launch)
        return rows[np.random.default_rng(launch.size).permutation(rows.shape[0])]

    monkeypatch.setattr(audit_module, "verify_rows", shuffled)
    result = audit(flooded, backend="numpy", max_findings=0, chunk_entries=512)
    key = lambda f: (f.request_row, f.position)   # noqa: E731
    assert sorted(map(key, result.findings)) == sorted(map(key, reference.findings))
    assert sorted((key(f), f.violation) for f in result.findings) == \
        sorted((key(f), f.violation) for f in reference.findings)
    assert result.unattributed == 0 and result.requests == reference.requests


def test_cli_bounds_the_output_and_says_so(flooded):
    runner = CliRunner()
    text = runner.invoke(main, ["audit", flooded, "--backend", "numpy", "--max-findings", "5"])
    assert text.exit_code == 1
    lines = text.output.splitlines()
    assert sum(line.startswith("kv_canary violation:") for line in lines) == 5
    assert f"the first 5 of {REQUESTS * TOKENS} are shown" in text.output
    assert f"affected requests: {REQUESTS}: row 1 (batch index 0) {TOKENS} at positions " \
           f"0..{TOKENS - 1}" in text.output
    default = runner.invoke(main, ["audit", flooded, "--backend", "numpy", "--format", "json"])
    records = [json.loads(line) for line in default.output.splitlines()]
    assert [r["record"] for r in records].count("violation") == DEFAULT_MAX_FINDINGS
    summary = records[-1]
    assert summary["findings_cut"] and summary["findings_omitted"] == REQUESTS * TOKENS - 1024
    assert records[0]["max_findings"] == DEFAULT_MAX_FINDINGS


def test_several_dumps_end_with_one_total_line(flooded, tmp_path):
    clean = save(str(tmp_path / "clean.npz"), **written(2, 8))
    result = CliRunner().invoke(main, ["audit", clean, flooded, "--backend", "numpy", "-j", "1",
                                       "--max-findings", "1"])
    assert result.exit_code == 1
    last = result.output.splitlines()[-1]
    assert last == (f"total: 2 dumps: 1 clean, 1 with violations ({flooded}), 0 not audited; "
                    f"{16 + REQUESTS * TOKENS} entries checked, {REQUESTS * TOKENS} violation(s)")


def test_a_duplicated_row_is_counted_but_not_attributed_twice(flooded, monkeypatch):
    """A faulty backend that reports one entry twice: the total counts both rows, the
    request counts one, the copy is unattributed."""
    verify = audit_module.verify_rows

    def doubled(launcher, launch):
        rows = verify(launcher, launch)
        return np.concatenate([rows, rows[:1]])

    monkeypatch.setattr(audit_module, "verify_rows", doubled)
    result = audit(flooded, backend="numpy", max_findings=0, ring_capacity=1 << 20)
    launches = -(-REQUESTS * TOKENS // audit_module.CHUNK_ENTRIES)
    assert result.total_violations == REQUESTS * TOKENS + launches
    assert result.unattributed == launches
    assert sum(r.violations for r in result.requests) == REQUESTS * TOKENS
    assert result.counts_by_entry == {"request": REQUESTS * TOKENS, "unattributed": launches}
    assert sum(f.kind == "unattributed" for f in result.findings) == launches


def test_rows_on_shared_slots_find_their_entries_in_any_order(tmp_path, monkeypatch):
    """Two requests read the same slots at other positions (as many rows as predictions, all
    on shared slots): a GPU's ring gives them in any order; each still goes to its entry."""
    arrays = written(2, 64)
    arrays["req_to_token"][2] = arrays["req_to_token"][1][::-1]   # row 2 reads row 1's slots
    flip_positions(arrays, 1, np.arange(64))                       # and both fail on each
    path = save(str(tmp_path / "shared.npz"), **arrays)
    reference = audit(path, backend="numpy", max_findings=0)
    assert reference.total_violations == 128 and reference.unattributed == 0
    verify = audit_module.verify_rows

    def reversed_rows(launcher, launch):
        return verify(launcher, launch)[::-1].copy()

    monkeypatch.setattr(audit_module, "verify_rows", reversed_rows)
    result = audit(path, backend="numpy", max_findings=0)
    key = lambda f: (f.request_row, f.position, f.violation)   # noqa: E731
    assert result.unattributed == 0
    assert sorted(map(key, result.findings)) == sorted(map(key, reference.findings))
