"""Upstream's plan scenarios (docs/format.md §7), through kc.plan on numpy arrays."""

import numpy as np
import pytest

import kvcanary as kc
from builders import i64, linear_req_to_token, run_plan
from kvcanary.format.consts import PLAN_SLOT_OUT_OF_TABLE
from oracle import assert_plan_matches, plan as oracle_plan


def vp_entries(vp):
    n = int(vp.verify_num_valid[0])
    return ([int(v) for v in vp.verify_slot_indices[:n]],
            [int(v) for v in vp.verify_expected_positions[:n]],
            [int(v) for v in vp.verify_prev_slot_indices[:n]],
            [int(v) for v in vp.verify_expected_tokens[:n]])


def offsets(wp, n):
    return [int(v) for v in wp.write_offsets[:n]]


def test_prefix_zero_extend_five():
    table = linear_req_to_token(4, 16)
    vp, wp = run_plan([1], [0], [5], table)
    assert int(vp.verify_num_valid[0]) == 0 and int(vp.enable[0]) == 1
    assert int(wp.write_num_valid_reqs[0]) == 1
    assert offsets(wp, 2) == [0, 5]
    assert int(wp.write_seed_slot_indices[0]) == -1


def test_prefix_seven_extend_one():
    table = linear_req_to_token(4, 16)
    vp, wp = run_plan([2], [7], [1], table)
    slots, positions, prevs, tokens = vp_entries(vp)
    assert slots == [2 * 16 + p for p in range(7)]
    assert positions == list(range(7))
    assert prevs == [-1] + [2 * 16 + p for p in range(6)]
    assert tokens == [-1] * 7
    assert int(wp.write_seed_slot_indices[0]) == 2 * 16 + 6


def test_three_requests():
    table = linear_req_to_token(4, 16)
    vp, wp = run_plan([1, 2, 3], [0, 4, 10], [8, 1, 1], table, write_capacity=8)
    assert offsets(wp, 4) == [0, 8, 9, 10]
    assert [int(v) for v in wp.write_offsets[4:]] == [0] * 5
    assert int(vp.verify_num_valid[0]) == 14
    slots, positions, prevs, _ = vp_entries(vp)
    assert prevs[0] == -1 and positions[0] == 0 and slots[0] == 32
    assert prevs[1] == 32 and positions[1] == 1
    assert positions[4] == 0 and prevs[4] == -1 and slots[4] == 48
    assert [int(v) for v in wp.write_seed_slot_indices[:3]] == [-1, 35, 57]


def test_permuted_lut_seed():
    table = linear_req_to_token(4, 16)
    lut = np.random.default_rng(0).permutation(64).astype(np.int64)
    vp, wp = run_plan([2], [5], [1], table, swa_window_size=1000, full_to_swa_index_mapping=lut)
    assert int(wp.write_seed_slot_indices[0]) == int(lut[2 * 16 + 4])
    slots, _, prevs, _ = vp_entries(vp)
    assert slots == [int(lut[32 + p]) for p in range(5)]
    assert prevs == [-1] + [int(lut[32 + p]) for p in range(4)]


def test_swa_window_128_prefix_200():
    table = linear_req_to_token(2, 256)
    lut = np.arange(512, dtype=np.int64)
    vp, _ = run_plan([1], [200], [1], table, swa_window_size=128, full_to_swa_index_mapping=lut)
    slots, positions, prevs, _ = vp_entries(vp)
    assert len(slots) == 128
    assert positions[0] == 72 and prevs[0] == 256 + 71 and slots[0] == 256 + 72


def test_padding_row_contributes_nothing():
    table = linear_req_to_token(3, 8)
    vp, wp = run_plan([1, 0, 2], [0, 99999, 0], [1, 5, 1], table)
    assert int(vp.verify_num_valid[0]) == 0
    assert offsets(wp, 4) == [0, 1, 1, 2]
    assert [int(v) for v in wp.write_seed_slot_indices[:3]] == [-1, -1, -1]


def test_sparse_permuted_table_read_verbatim():
    rng = np.random.default_rng(3)
    table = np.zeros((3, 10), dtype=np.int32)
    table[1:] = rng.permutation(np.arange(1, 41))[:20].reshape(2, 10)
    vp, wp = run_plan([2, 1], [6, 3], [2, 2], table)
    slots, positions, prevs, _ = vp_entries(vp)
    assert slots == [int(v) for v in table[2, :6]] + [int(v) for v in table[1, :3]]
    assert prevs == [-1] + [int(v) for v in table[2, :5]] + [-1] + [int(v) for v in table[1, :2]]
    assert [int(v) for v in wp.write_seed_slot_indices[:2]] == [int(table[2, 5]),
                                                                int(table[1, 2])]


def test_swa_prefix_shorter_than_window():
    table = linear_req_to_token(2, 16)
    vp, _ = run_plan([1], [3], [1], table, swa_window_size=8,
                     full_to_swa_index_mapping=np.arange(32, dtype=np.int64))
    assert vp_entries(vp)[1] == [0, 1, 2]


def test_lut_shift_translates_slots_and_seeds():
    table = linear_req_to_token(2, 8)
    lut = np.arange(16, dtype=np.int64) + 100
    vp, wp = run_plan([1], [3], [2], table, swa_window_size=64, full_to_swa_index_mapping=lut)
    slots, _, prevs, _ = vp_entries(vp)
    assert slots == [108, 109, 110] and prevs == [-1, 108, 109]
    assert int(wp.write_seed_slot_indices[0]) == 110


def test_window_sum_of_min():
    prefixes = [50, 128, 200, 1024]
    table = linear_req_to_token(5, 1100)
    vp, _ = run_plan([1, 2, 3, 4], prefixes, [1] * 4, table, swa_window_size=128,
                     full_to_swa_index_mapping=np.arange(5 * 1100, dtype=np.int64))
    assert int(vp.verify_num_valid[0]) == sum(min(p, 128) for p in prefixes)


def test_zero_prefix_zero_entries():
    vp, _ = run_plan([1, 2], [0, 0], [3, 3], linear_req_to_token(3, 8))
    assert int(vp.verify_num_valid[0]) == 0 and int(vp.enable[0]) == 1


@pytest.mark.parametrize("capacity, num_valid, enable", [(10, 10, 1), pytest.param(
    9, 9, 0, marks=pytest.mark.filterwarnings("ignore::kvcanary.VerifyPlanTooSmall"))])
def test_capacity_exact_and_one_short(capacity, num_valid, enable):
    table = linear_req_to_token(3, 8)
    vp = kc.VerifyPlan.allocate(capacity)
    vp.verify_slot_indices[:] = 555  # overflow must not scatter
    wp = kc.WritePlan.allocate(4)
    kc.plan(req_pool_indices=i64([1, 2]), prefix_lens=i64([4, 6]), extend_seq_lens=i64([1, 1]),
            req_to_token=table, verify_plan=vp, write_plan=wp)
    assert int(vp.verify_num_valid[0]) == num_valid
    assert int(vp.enable[0]) == enable
    if enable == 0:
        assert (vp.verify_slot_indices == 555).all()
    # a verify of the overflowed plan only counts the launch
    from builders import counters, make_context

    ctx = make_context(num_slots=32)
    kc.verify(ctx, vp)
    assert counters(ctx)[2] == 1 and counters(ctx)[1] == (num_valid if enable else 0)


def test_extends_all_zero():
    vp, wp = run_plan([1, 2], [3, 2], [0, 0], linear_req_to_token(3, 8))
    assert offsets(wp, 3) == [0, 0, 0]
    assert [int(v) for v in wp.write_seed_slot_indices[:2]] == [-1, -1]
    assert int(vp.verify_num_valid[0]) == 5


def test_replay_determinism_and_smaller_batch_clears_stale_offsets():
    table = linear_req_to_token(5, 8)
    vp = kc.VerifyPlan.allocate(64)
    wp = kc.WritePlan.allocate(6)
    args = dict(req_to_token=table, verify_plan=vp, write_plan=wp)
    kc.plan(req_pool_indices=i64([1, 2, 3, 4]), prefix_lens=i64([1, 2, 3, 4]),
            extend_seq_lens=i64([2, 2, 2, 2]), **args)
    first = [a.copy() for a in (vp.verify_slot_indices, wp.write_offsets)]
    kc.plan(req_pool_indices=i64([1, 2, 3, 4]), prefix_lens=i64([1, 2, 3, 4]),
            extend_seq_lens=i64([2, 2, 2, 2]), **args)
    assert (first[0] == vp.verify_slot_indices).all() and (first[1] == wp.write_offsets).all()
    kc.plan(req_pool_indices=i64([1]), prefix_lens=i64([1]), extend_seq_lens=i64([3]), **args)
    assert [int(v) for v in wp.write_offsets] == [0, 3, 0, 0, 0, 0, 0]
    assert int(wp.write_num_valid_reqs[0]) == 1


def test_expected_token_gather_bounds_and_offset():
    table = linear_req_to_token(3, 8)
    pool = (np.arange(3 * 8, dtype=np.int32).reshape(3, 8) + 1000)
    pool[2, 0] = -5  # int32 sign-extended
    for offset in (0, 1):
        vp, _ = run_plan([2, 1], [4, 3], [1, 1], table, req_to_verify_expected_tokens=pool,
                         req_to_verify_expected_tokens_valid_lens=i64([3, 8]),
                         kv_token_id_vs_position_offset=offset)
        tokens = vp_entries(vp)[3]
        want = []
        for rp, p, valid in ((2, 4, 3), (1, 3, 8)):
            for pos in range(p):
                q = pos + offset
                want.append(int(pool[rp, q]) if 0 <= q < valid else -1)
        assert tokens == want
    assert -5 in vp_entries(run_plan([2], [2], [0], table, req_to_verify_expected_tokens=pool,
                                     req_to_verify_expected_tokens_valid_lens=i64([2]))[0])[3]


def test_int64_table_accepted():
    vp, wp = run_plan([1], [3], [1], linear_req_to_token(2, 8, dtype=np.int64))
    assert vp_entries(vp)[0] == [8, 9, 10]


def test_plans_match_the_oracle_on_a_mixed_batch():
    rng = np.random.default_rng(7)
    table = rng.integers(1, 500, size=(6, 40)).astype(np.int32)
    lut = rng.permutation(500).astype(np.int64)
    pool = rng.integers(-3, 1000, size=(6, 40)).astype(np.int32)
    vp = kc.VerifyPlan.allocate(200)
    wp = kc.WritePlan.allocate(8)
    args = dict(req_pool_indices=i64([3, 0, 5, 1, 2]), prefix_lens=i64([10, 7, 39, 0, 25]),
                extend_seq_lens=i64([1, 3, 0, 4, -2]))
    want = oracle_plan(vp, wp, *args.values(), table, swa_window_size=16, lut=lut, pool=pool,
                       valid_lens=i64([11, 40, 20, 3, 40]), offset=1)
    kc.plan(**args, req_to_token=table, verify_plan=vp, write_plan=wp, swa_window_size=16,
            full_to_swa_index_mapping=lut, req_to_verify_expected_tokens=pool,
            req_to_verify_expected_tokens_valid_lens=i64([11, 40, 20, 3, 40]),
            kv_token_id_vs_position_offset=1)
    assert_plan_matches(vp, wp, want)


def test_predecessors_of_positions_that_wrap_past_int64():
    # A window start that wraps (prefix near int64's floor) makes positions int64 max, then
    # its floor: the second has no predecessor (position <= 0), as the kernels have it, not
    # the entry before it.
    vp, _ = run_plan([1], [-(1 << 63) + 1], [0], np.zeros((2, 4), np.int32),
                     verify_capacity=2, swa_window_size=2,
                     full_to_swa_index_mapping=np.arange(8, dtype=np.int64))
    assert int(vp.verify_num_valid[0]) == 2
    assert vp.verify_expected_positions[:2].tolist() == [(1 << 63) - 1, -(1 << 63)]
    assert vp.verify_prev_slot_indices[:2].tolist() == [PLAN_SLOT_OUT_OF_TABLE, -1]


def test_predecessors_are_the_entries_before_but_for_each_rows_first():
    table = np.arange(100, 140, dtype=np.int32).reshape(4, 10)
    vp, _ = run_plan([1, 0, 3, 2], [3, 5, 2, 1], [1, 1, 1, 1], table, swa_window_size=2,
                     full_to_swa_index_mapping=np.arange(200, dtype=np.int64))
    n = int(vp.verify_num_valid[0])
    assert vp.verify_slot_indices[:n].tolist() == [111, 112, 130, 131, 120]
    assert vp.verify_prev_slot_indices[:n].tolist() == [110, 111, -1, 130, -1]
