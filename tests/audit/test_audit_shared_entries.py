"""Requests that read the same blocks at the same positions (a shared prefix, a copied table
row, batch entries on one row): each distinct entry is verified once and its rows counted for
every reader, so the audit's work follows what is distinct, not what the requests claim. The
grouped audit reports what planning every request as it is reports; a claim no engine state
could make is refused."""

from __future__ import annotations

import time

import numpy as np
import pytest

import kvcanary as kc
import kvcanary.audit.distinct as distinct
from kvcanary.audit import AuditError, audit
from kvcanary.dump import validate


def random_dump(seed: int, *, block_size: int, tokens: bool) -> dict:
    """Rows sharing prefix blocks (written once each, identically), batch entries drawn from
    the rows with repetition and lengths up to twice the table (past it: out of range), a few
    records corrupted."""
    rng = np.random.default_rng(seed)
    width, rows = int(rng.integers(2, 5)), int(rng.integers(2, 6))
    shared = int(rng.integers(0, width))
    blocks = np.zeros((rows + 1, width), np.int64)
    blocks[1:, :shared] = 1 + np.arange(shared)
    tails = rows * (width - shared)
    blocks[1:, shared:] = 1 + shared + rng.permutation(tails).reshape(rows, -1)
    num_slots = (1 + shared + tails) * block_size
    canary = np.zeros((num_slots, 32), np.uint8)
    context = kc.CanaryContext(canary, kernel_kind=kc.LaunchTag.TAIL_K_FULL,
                               violation_log=kc.ViolationLog.allocate(1),
                               slot_run_counter=np.zeros(1, np.int64),
                               kernel_run_counter=np.zeros(1, np.int64))
    per_token = (blocks[:, :, None] * block_size + np.arange(block_size)).reshape(rows + 1, -1)
    per_token[0] = 0
    positions = width * block_size
    for row in range(1, rows + 1):
        write_plan = kc.WritePlan.allocate(1)
        kc.plan(req_pool_indices=np.array([row]), prefix_lens=np.array([0]),
                extend_seq_lens=np.array([positions]), req_to_token=per_token,
                verify_plan=kc.VerifyPlan.allocate(1), write_plan=write_plan)
        kc.write(context, write_plan, input_ids=np.arange(positions) + 100,
                 positions=np.arange(positions), out_cache_loc=per_token[row])
    fields = canary.view(np.int64)
    for slot in rng.choice(np.arange(1, num_slots), size=3, replace=False):
        fields[slot, int(rng.integers(0, 3))] ^= 1
    batch = int(rng.integers(3, 9))
    arrays = dict(canary=canary, kvcanary_dump_version=np.array(1),
                  req_pool_indices=rng.integers(0, rows + 1, size=batch),
                  seq_lens=rng.integers(1, 2 * positions + 1, size=batch))
    if block_size == 1:
        arrays["req_to_token"] = per_token
    else:
        arrays.update(block_table=blocks, block_size=np.array(block_size))
    if tokens:
        arrays.update(expected_tokens=np.tile(np.arange(positions) + 100, (rows + 1, 1)),
                      expected_tokens_valid_lens=rng.integers(0, positions + 1, size=batch))
    return arrays


def both_ways(arrays: dict, monkeypatch, **options):
    dump = validate("shared.npz", "npz", arrays)
    monkeypatch.setattr(distinct, "GROUPING_THRESHOLD", 1 << 62)
    planned = audit(dump, backend="numpy", max_findings=0, **options)
    monkeypatch.setattr(distinct, "GROUPING_THRESHOLD", 0)
    monkeypatch.setattr(distinct, "MIN_SHARING", 0)
    grouped = audit(dump, backend="numpy", max_findings=0, **options)
    assert grouped.distinct_live_entries > 0
    return planned, grouped


def finding_key(f):
    return (f.kind, f.batch_index, f.request_row, f.position, f.prev_slot, f.block_index,
            f.block, f.violation)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("block_size", [1, 4])
def test_the_grouped_audit_reports_what_planning_every_request_reports(seed, block_size,
                                                                       monkeypatch):
    arrays = random_dump(seed, block_size=block_size, tokens=seed % 2 == 0)
    planned, grouped = both_ways(arrays, monkeypatch, compat=seed % 3 == 0)
    assert grouped.total_violations == planned.total_violations
    assert grouped.counts_by_reason == planned.counts_by_reason
    assert grouped.counts_by_tag == planned.counts_by_tag
    assert grouped.counts_by_entry == planned.counts_by_entry
    assert grouped.unattributed == planned.unattributed
    assert [r.to_dict() for r in grouped.requests] == [r.to_dict() for r in planned.requests]
    assert sorted(map(finding_key, grouped.findings)) == sorted(map(finding_key, planned.findings))
    assert grouped.zero_records == planned.zero_records
    rows = arrays["req_pool_indices"]
    if len(set(rows[rows != 0].tolist())) == np.count_nonzero(rows):   # one batch entry a row
        causes = {finding_key(f): f.diagnosis.cause for f in planned.findings}
        assert {finding_key(f): f.diagnosis.cause for f in grouped.findings} == causes


def ones_table_dump(requests: int, block_size: int, *, one_row: bool) -> dict:
    """The hostile shape: every request reads block 1 at the same positions and claims twice
    the table (the second half past it); as distinct rows of ones, or all on one row."""
    rows = 1 if one_row else requests
    return dict(canary=np.zeros((2 * block_size, 32), np.uint8),
                kvcanary_dump_version=np.array(1),
                block_table=np.ones((rows + 1, 1), np.int64), block_size=np.array(block_size),
                req_pool_indices=np.ones(requests, np.int64) if one_row
                else np.arange(1, requests + 1),
                seq_lens=np.full(requests, 2 * block_size, np.int64))


@pytest.mark.parametrize("one_row", [False, True])
def test_many_requests_on_one_block_cost_what_the_block_costs(one_row):
    # 4,096 requests x 131,072 positions claimed (537M entries); 131,072 are distinct.
    dump = validate("ones.npz", "npz", ones_table_dump(4096, 1 << 16, one_row=one_row))
    started = time.perf_counter()
    result = audit(dump, backend="numpy")
    elapsed = time.perf_counter() - started
    claimed = 4096 * (1 << 17)
    assert result.live_entries == claimed
    assert result.distinct_live_entries == 1 << 17
    # Every record is zero (never written) and every position past the table is out of
    # range, for every request.
    assert result.total_violations == claimed
    assert len(result.requests) == 4096
    assert all(r.violations == 1 << 17 and r.first_position == 0
               and r.last_position == (1 << 17) - 1 for r in result.requests)
    assert result.counts_by_entry == {"request": claimed}
    assert len(result.findings) == 1024
    assert {f.batch_index for f in result.findings} == {0}
    assert elapsed < 20, elapsed    # before: 30 s covered 13.6 % of the claim


def test_more_distinct_entries_than_any_engine_could_map_is_refused(monkeypatch):
    monkeypatch.setattr(distinct, "DISTINCT_ENTRIES_FLOOR", 1 << 12)
    # 64 distinct rows, each its own block of 4,096 positions, in a canary of 8,192 slots.
    arrays = ones_table_dump(64, 1 << 12, one_row=False)
    arrays["block_table"][1:, 0] = np.arange(2, 66)
    arrays["seq_lens"][:] = 1 << 12
    with pytest.raises(AuditError, match=r"key seq_lens: the live requests read 262144 "
                                         r"distinct entries"):
        audit(validate("many.npz", "npz", arrays), backend="numpy")


def test_batch_entries_on_one_per_token_row_cost_what_the_row_costs():
    # 4,096 batch entries on one 16,384-slot row, each claiming twice the row (134M entries).
    width, requests = 1 << 14, 4096
    table = np.zeros((2, width), np.int64)
    table[1] = np.arange(1, width + 1)
    arrays = dict(canary=np.zeros((width + 1, 32), np.uint8), kvcanary_dump_version=np.array(1),
                  req_to_token=table, req_pool_indices=np.ones(requests, np.int64),
                  seq_lens=np.full(requests, 2 * width, np.int64))
    started = time.perf_counter()
    result = audit(validate("row.npz", "npz", arrays), backend="numpy")
    assert time.perf_counter() - started < 20
    assert result.distinct_live_entries == 2 * width
    assert result.total_violations == requests * 2 * width
    assert result.counts_by_reason["slot_out_of_range"] == requests * width


def test_a_finding_past_the_block_table_says_so_not_the_marker_slot():
    arrays = ones_table_dump(1, 4, one_row=False)       # positions 4..7 are past the table
    result = audit(validate("past.npz", "npz", arrays), backend="numpy")
    past = [f for f in result.findings if f.position >= 4]
    assert past and all(f.where().endswith(
        f"position {f.position}, block-table entry 1 (past the block table), past the table "
        "(no slot)") for f in past), past[0].where()
    assert "9223372036854775807" not in past[0].where()
