"""kvcanary's extensions (docs/extensions.md): SLOT_OUT_OF_RANGE rows in verify, write and
plan, with exact rows."""

import numpy as np
import pytest

import kvcanary as kc
from builders import (H0, counters, fields, i64, linear_req_to_token, make_context,
                      make_verify_plan, make_write_plan, ring_rows, run_plan, signed, stamp,
                      write_tokens)

OOR = int(kc.FailReason.SLOT_OUT_OF_RANGE)
CHAIN = int(kc.FailReason.VERIFY_CHAIN_HASH_MISMATCH)
POSITION = int(kc.FailReason.VERIFY_POSITION_MISMATCH)
W_TOKEN = int(kc.FailReason.WRITE_TOKEN_MISMATCH)
W_POSITION = int(kc.FailReason.WRITE_POSITION_MISMATCH)
MARK = (1 << 63) - 1
TAG = int(kc.LaunchTag.TAIL_K_FULL)


def ctx8(**kw):
    return make_context(num_slots=8, kernel_kind=kc.LaunchTag.TAIL_K_FULL, **kw)


# ------------------------------------------------------------------ verify

def test_verify_slot_out_of_range_rows():
    ctx = ctx8()
    kc.verify(ctx, make_verify_plan([-3, 8, 0, 1000], [4, 5, 6, 7], [-1, 2, 3, 4],
                                    [11, 12, 13, 14]), check_expected_token=True)
    assert ring_rows(ctx) == [
        (TAG, -3, 4, 0, 11, 0, -3, OOR),
        (TAG, 8, 5, 0, 12, 0, 8, OOR),
        (TAG, 1000, 7, 0, 14, 0, 1000, OOR),
    ]
    assert counters(ctx) == (3, 4, 1)


def test_verify_slot_out_of_range_expected_token_unchecked():
    ctx = ctx8()
    kc.verify(ctx, make_verify_plan([9], [4], [-1], [11]), check_expected_token=False)
    assert ring_rows(ctx) == [(TAG, 9, 4, 0, -1, 0, 9, OOR)]


def test_verify_predecessor_out_of_range_runs_other_checks():
    ctx = ctx8()
    stamp(ctx.canary_buf, 2, 5, 3, 0x99)
    kc.verify(ctx, make_verify_plan([2], [3], [8]))
    assert ring_rows(ctx) == [(TAG, 2, 3, 5, -1, 0x99, 8, OOR)]
    ctx.violation_log.clear()
    kc.verify(ctx, make_verify_plan([2], [4], [MARK]))
    assert ring_rows(ctx) == [(TAG, 2, 3, 5, -1, 0x99, MARK, OOR | POSITION)]


def test_verify_rows_stay_in_entry_order():
    ctx = ctx8()
    stamp(ctx.canary_buf, 1, 5, 0, 0x1)  # chain head with a wrong link
    kc.verify(ctx, make_verify_plan([9, 1, -2], [0, 0, 0], [-1, -1, -1]))
    assert [(r[1], r[7]) for r in ring_rows(ctx)] == [(9, OOR), (1, CHAIN), (-2, OOR)]


# ------------------------------------------------------------------ write

def test_write_request_range_outside_token_arrays():
    ctx = ctx8()
    plan = kc.WritePlan(write_offsets=i64([-1, 1, 5]), write_seed_slot_indices=i64([-1, -1]),
                        write_num_valid_reqs=np.array([2], np.int32))
    kc.write(ctx, plan, input_ids=i64([1, 2, 3]), positions=i64([0, 1, 2]),
             out_cache_loc=i64([1, 2, 3]))
    assert ring_rows(ctx) == [(TAG, -1, 0, 0, 0, 0, -1, OOR), (TAG, -1, 0, 0, 0, 0, 5, OOR)]
    assert counters(ctx) == (2, 0, 1)
    assert not ctx.canary_buf.any()


def test_write_seed_out_of_range():
    ctx = ctx8()
    write_tokens(ctx, [3, 4], [7, 8], [40, 99], seed=12)
    assert ring_rows(ctx) == [(TAG, 12, 0, 0, 0, 0, 12, OOR)]
    # running hash starts at H0 and no chain-position assert runs
    assert int(fields(ctx.canary_buf)[3, 2]) == signed(H0)
    assert counters(ctx) == (1, 2, 1)


def test_write_slot_out_of_range_after_other_rows():
    ctx = ctx8()
    stamp(ctx.canary_buf, 5, 1, 9, H0)
    write_tokens(ctx, [1, 20, 2], [10, 11, 12], [10, 15, 16], seed=5,
                 expected_tokens=[10, 0, 12], expected_positions=[10, 15, 16])
    running0 = kc.splitmix64_mix3(H0, 1, 9)
    running1 = kc.splitmix64_mix3(running0, 10, 10)
    running2 = kc.splitmix64_mix3(running1, 11, 15)
    assert ring_rows(ctx) == [
        (TAG, 20, 15, 11, 0, signed(running1), 15, W_TOKEN),
        (TAG, 20, 15, 11, 11, signed(running1), 11, W_POSITION),
        (TAG, 20, 15, 11, 11, signed(running1), 20, OOR),
    ]
    # not stored, not counted, but the chain advanced over the token
    assert int(fields(ctx.canary_buf)[2, 2]) == signed(running2)
    assert counters(ctx) == (3, 2, 1)


def test_write_seed_row_precedes_entry_rows_and_requests_keep_order():
    ctx = ctx8()
    plan = make_write_plan([1, 1], [100, -1])
    kc.write(ctx, plan, input_ids=i64([1, 2]), positions=i64([0, 0]),
             out_cache_loc=i64([30, 31]))
    assert [(r[1], r[6]) for r in ring_rows(ctx)] == [(100, 100), (30, 30), (31, 31)]


# ------------------------------------------------------------------ plan

def test_plan_row_outside_table_marks_entries():
    table = linear_req_to_token(2, 4)
    vp, wp = run_plan([5], [2], [1], table)
    n = int(vp.verify_num_valid[0])
    assert [int(v) for v in vp.verify_slot_indices[:n]] == [MARK, MARK]
    assert [int(v) for v in vp.verify_prev_slot_indices[:n]] == [-1, MARK]
    assert int(wp.write_seed_slot_indices[0]) == MARK


def test_plan_prefix_longer_than_table_is_reported_by_verify_and_write():
    table = linear_req_to_token(2, 4)
    vp, wp = run_plan([1], [6], [1], table)
    n = int(vp.verify_num_valid[0])
    assert [int(v) for v in vp.verify_slot_indices[:n]] == [4, 5, 6, 7, MARK, MARK]
    assert [int(v) for v in vp.verify_prev_slot_indices[:n]] == [-1, 4, 5, 6, 7, MARK]
    assert int(wp.write_seed_slot_indices[0]) == MARK
    ctx = make_context(num_slots=8, kernel_kind=kc.LaunchTag.TAIL_K_FULL)
    write_tokens(ctx, [4, 5, 6, 7], [1, 2, 3, 4], [0, 1, 2, 3])
    kc.verify(ctx, vp)
    assert ring_rows(ctx) == [(TAG, MARK, 4, 0, -1, 0, MARK, OOR),
                              (TAG, MARK, 5, 0, -1, 0, MARK, OOR)]
    ctx.violation_log.clear()
    kc.write(ctx, wp, input_ids=i64([9]), positions=i64([6]), out_cache_loc=i64([3]))
    assert ring_rows(ctx) == [(TAG, MARK, 0, 0, 0, 0, MARK, OOR)]


def test_plan_marker_passes_through_the_lut():
    table = linear_req_to_token(2, 4)
    vp, _ = run_plan([1], [5], [0], table, swa_window_size=2,
                     full_to_swa_index_mapping=np.arange(8, dtype=np.int64) + 10)
    n = int(vp.verify_num_valid[0])
    assert [int(v) for v in vp.verify_slot_indices[:n]] == [17, MARK]
    assert [int(v) for v in vp.verify_prev_slot_indices[:n]] == [16, 17]


def test_negative_write_num_valid_is_zero():
    ctx = ctx8()
    kc.write(ctx, make_write_plan([1], [-1], num_valid=-2), input_ids=i64([1]),
             positions=i64([0]), out_cache_loc=i64([1]))
    assert counters(ctx) == (0, 0, 1)


def test_write_early_return_when_total_is_not_positive():
    """Upstream's reference returns when write_offsets[active] <= 0, even if one request's
    own range is positive; kept on every backend (docs/extensions.md)."""
    ctx = ctx8()
    plan = kc.WritePlan(write_offsets=i64([0, 2, 0]), write_seed_slot_indices=i64([-1, -1]),
                        write_num_valid_reqs=np.array([2], np.int32))
    kc.write(ctx, plan, input_ids=i64([1, 2]), positions=i64([0, 1]),
             out_cache_loc=i64([1, 2]))
    assert counters(ctx) == (0, 0, 1)
    assert not ctx.canary_buf.any()


def test_swa_lut_index_beyond_length_raises_in_the_reference():
    table = linear_req_to_token(2, 8)
    with pytest.raises(ValueError, match=r"^kv-canary: SWA slot 9 is outside "
                                         r"full_to_swa_index_mapping length 9$"):
        run_plan([1], [3], [1], table, swa_window_size=2,
                 full_to_swa_index_mapping=np.arange(9, dtype=np.int64))


# ------------------------------------------------------------------ which slot a LUT error names
# Upstream gathers entry by entry (an entry's slot, then its predecessor), every verify
# entry before any seed, and gathers the entries even when the plan overflows.

def _lut_error(req_pool_indices, prefix_lens, extend_seq_lens, table, window, lut_len,
               **kwargs):
    with pytest.raises(ValueError) as info:
        run_plan(req_pool_indices, prefix_lens, extend_seq_lens, table,
                 swa_window_size=window, full_to_swa_index_mapping=np.arange(lut_len),
                 **kwargs)
    return str(info.value)


def _message(slot, lut_len=20):
    return f"kv-canary: SWA slot {slot} is outside full_to_swa_index_mapping length {lut_len}"


def test_lut_error_names_a_window_head_predecessor_before_a_later_slot():
    table = np.zeros((2, 8), np.int32)
    table[1, :6] = [1, 2, 50, 3, 60, 4]  # window [3, 6): the head's predecessor is 50
    assert _lut_error([1], [6], [0], table, 3, 20) == _message(50)


def test_lut_error_names_the_first_request_before_a_later_one():
    table = np.zeros((3, 8), np.int32)
    table[1, :4] = [1, 70, 2, 3]  # request 0: its window head's predecessor is 70
    table[2, :4] = [80, 4, 5, 6]  # request 1: its first slot is 80
    assert _lut_error([1, 2], [4, 2], [0, 0], table, 2, 20) == _message(70)


def test_lut_error_names_a_verify_entry_before_a_seed_when_the_plan_overflows():
    table = np.zeros((2, 8), np.int32)
    table[1, :3] = [1, 85, 90]  # entries 1, 85, 90; the seed (position 2) is 90
    assert _lut_error([1], [3], [1], table, 8, 20, verify_capacity=2) == _message(85)


def test_lut_error_on_an_overflowed_plan_skips_positions_past_the_table():
    table = np.zeros((2, 4), np.int32)
    table[1] = [1, 2, 3, 30]  # prefix 9 runs past the table: the entries beyond never raise
    assert _lut_error([1], [9], [1], table, 16, 20, verify_capacity=2) == _message(30)
