"""Upstream's hand scenarios for write (docs/format.md §8), through kc.write on numpy arrays."""

import numpy as np
import pytest

import kvcanary as kc
from builders import (H0, counters, fields, i64, make_context, make_sources, make_verify_plan,
                      make_write_plan, ring_rows, signed, stamp, write_tokens)

F = kc.FailReason
W_TOKEN, W_POSITION = int(F.WRITE_TOKEN_MISMATCH), int(F.WRITE_POSITION_MISMATCH)
ALL, PARTIAL, NONE = kc.RealKvHashMode.ALL, kc.RealKvHashMode.PARTIAL, kc.RealKvHashMode.NONE
M = (1 << 64) - 1


def prev_hashes(ctx, slots):
    return [int(v) & M for v in fields(ctx.canary_buf)[slots, 2]]


# ------------------------------------------------------------------ seed

def test_seed_minus_one_stores_h0():
    ctx = make_context()
    write_tokens(ctx, [3], [5], [0])
    assert [int(v) for v in fields(ctx.canary_buf)[3]] == [5, 0, signed(H0), 0]
    assert counters(ctx) == (0, 1, 1)


def test_seed_slot_links_and_verifies():
    ctx = make_context()
    stamp(ctx.canary_buf, 7, 100, 4, H0)
    write_tokens(ctx, [8], [101], [5], seed=7)
    assert prev_hashes(ctx, [8]) == [kc.splitmix64_mix3(H0, 100, 4)]
    kc.verify(ctx, make_verify_plan([8], [5], [7]))
    assert counters(ctx)[0] == 0


def test_resume_after_seed_42():
    ctx = make_context(num_slots=64)
    stamp(ctx.canary_buf, 42, 7, 10, H0)
    write_tokens(ctx, [0, 1, 2, 3, 4], [101, 202, 303, 404, 505], [11, 12, 13, 14, 15], seed=42)
    h = kc.splitmix64_mix3(H0, 7, 10)
    expected = []
    for tok, pos in zip([101, 202, 303, 404, 505], [11, 12, 13, 14, 15]):
        expected.append(h)
        h = kc.splitmix64_mix3(h, tok, pos)
    assert prev_hashes(ctx, [0, 1, 2, 3, 4]) == expected
    assert [int(v) for v in fields(ctx.canary_buf)[0:5, 3]] == [0] * 5
    assert counters(ctx) == (0, 5, 1)


def test_continue_from_seed_position_one():
    ctx = make_context()
    stamp(ctx.canary_buf, 9, 7, 1, H0)
    write_tokens(ctx, [10], [8], [2], seed=9)
    assert prev_hashes(ctx, [10]) == [kc.splitmix64_mix3(H0, 7, 1)]


def test_seed_zero_is_loaded_like_any_slot():
    ctx = make_context()
    stamp(ctx.canary_buf, 0, 3, 6, 0x77)
    write_tokens(ctx, [4], [1], [7], seed=0)
    assert prev_hashes(ctx, [4]) == [kc.splitmix64_mix3(0x77, 3, 6)]


# ------------------------------------------------------------------ chain

def test_hand_computed_chain():
    ctx = make_context()
    write_tokens(ctx, [1, 2, 3, 4, 5], [101, 202, 303, 404, 505], [0, 1, 2, 3, 4])
    assert prev_hashes(ctx, [1, 2, 3, 4, 5]) == [
        0xDE7FAE23A9A1B716, 0x542FE5061275A6AB, 0x9890D56BDE53142E, 0x5213C65EEE8A1DD1,
        0xC749AFFE5A5A9634]


def test_all_mode_chain_ignores_real_kv():
    plain = make_context()
    write_tokens(plain, [1, 2, 3], [1, 2, 3], [0, 1, 2])
    hashed = make_context(sources=make_sources(2, 32, fill="random"), mode=ALL)
    write_tokens(hashed, [1, 2, 3], [1, 2, 3], [0, 1, 2])
    assert prev_hashes(plain, [1, 2, 3]) == prev_hashes(hashed, [1, 2, 3])
    assert all(int(v) != 0 for v in fields(hashed.canary_buf)[1:4, 3])


# ------------------------------------------------------------------ input assert

def test_input_assert_off_ignores_garbage_via_absence():
    ctx = make_context()
    write_tokens(ctx, [1, 2], [5, 6], [0, 1])
    assert counters(ctx) == (0, 2, 1)


def test_input_assert_equal_is_clean():
    ctx = make_context()
    write_tokens(ctx, [1, 2], [5, 6], [0, 1], expected_tokens=[5, 6], expected_positions=[0, 1])
    assert counters(ctx) == (0, 2, 1)


def test_input_assert_token_mismatch():
    ctx = make_context()
    write_tokens(ctx, [1], [42], [0], expected_tokens=[99], expected_positions=[0])
    assert ring_rows(ctx) == [(0, 1, 0, 42, 99, signed(H0), 0, W_TOKEN)]
    assert int(fields(ctx.canary_buf)[1, 0]) == 42


def test_input_assert_position_mismatch():
    ctx = make_context()
    write_tokens(ctx, [1], [5], [7], expected_tokens=[5], expected_positions=[0])
    assert ring_rows(ctx) == [(0, 1, 7, 5, 5, signed(H0), 0, W_POSITION)]
    assert int(fields(ctx.canary_buf)[1, 1]) == 7


def test_input_assert_all_mismatch_then_verify_is_clean():
    ctx = make_context()
    write_tokens(ctx, [1, 2, 3], [5, 6, 7], [0, 1, 2], expected_tokens=[9, 9, 9],
                 expected_positions=[0, 1, 2])
    assert counters(ctx)[0] == 3
    ctx.violation_log.clear()
    kc.verify(ctx, make_verify_plan([1, 2, 3], [0, 1, 2], [-1, 1, 2]))
    assert ring_rows(ctx) == []


@pytest.mark.parametrize("which", ["token", "position"])
@pytest.mark.parametrize("where", [0, 2, 4])
def test_input_assert_matrix(which, where):
    ctx = make_context()
    tokens, positions = [1, 2, 3, 4, 5], [0, 1, 2, 3, 4]
    exp_t, exp_p = list(tokens), list(positions)
    if which == "token":
        exp_t[where] += 100
    else:
        exp_p[where] += 100
    write_tokens(ctx, [1, 2, 3, 4, 5], tokens, positions, expected_tokens=exp_t,
                 expected_positions=exp_p)
    (row,) = ring_rows(ctx)
    assert row[1] == where + 1
    assert row[7] == (W_TOKEN if which == "token" else W_POSITION)


# ------------------------------------------------------------------ chain-position assert

def test_chain_position_assert_fires_once_for_one_bad_token():
    ctx = make_context()
    stamp(ctx.canary_buf, 9, 7, 10, H0)
    write_tokens(ctx, [1, 2, 3], [1, 2, 3], [11, 20, 21], seed=9)
    running = kc.splitmix64_mix3(kc.splitmix64_mix3(H0, 7, 10), 1, 11)
    assert ring_rows(ctx) == [(0, 2, 20, 2, 2, signed(running), 12, W_POSITION)]


def test_chain_position_assert_off_by_flag_or_without_seed():
    ctx = make_context(chain_position_assert=0)
    stamp(ctx.canary_buf, 9, 7, 10, H0)
    write_tokens(ctx, [1, 2], [1, 2], [50, 60], seed=9)
    assert counters(ctx)[0] == 0
    ctx = make_context()
    write_tokens(ctx, [1, 2], [1, 2], [50, 60], seed=-1)
    assert counters(ctx)[0] == 0


def test_input_row_before_chain_position_row():
    ctx = make_context()
    stamp(ctx.canary_buf, 9, 7, 10, H0)
    write_tokens(ctx, [1], [1], [30], seed=9, expected_tokens=[1], expected_positions=[11])
    assert [r[7] for r in ring_rows(ctx)] == [W_POSITION, W_POSITION]
    assert [r[6] for r in ring_rows(ctx)] == [11, 11]


# ------------------------------------------------------------------ slots

def test_negative_slot_skipped():
    ctx = make_context()
    write_tokens(ctx, [4, -1], [5, 6], [0, 1])
    assert counters(ctx) == (0, 1, 1)
    assert int(fields(ctx.canary_buf)[4, 0]) == 5
    assert not fields(ctx.canary_buf)[[0, 1, 2, 3, 5]].any()


def test_skipped_slot_does_not_advance_the_chain():
    ctx = make_context()
    write_tokens(ctx, [5, -1, 7], [1, 2, 3], [0, 1, 2])
    changed = np.flatnonzero(fields(ctx.canary_buf).any(axis=1)).tolist()
    assert changed == [5, 7]
    assert prev_hashes(ctx, [7]) == [kc.splitmix64_mix3(H0, 1, 0)]


def test_only_active_requests_are_written():
    ctx = make_context()
    plan = make_write_plan([1, 1, 1, 1], [-1] * 4, num_valid=1)
    kc.write(ctx, plan, input_ids=i64([1, 2, 3, 4]), positions=i64([0, 0, 0, 0]),
             out_cache_loc=i64([0, 1, 2, 3]))
    assert np.flatnonzero(fields(ctx.canary_buf).any(axis=1)).tolist() == [0]
    assert counters(ctx) == (0, 1, 1)


def test_slot_zero_is_written():
    ctx = make_context()
    write_tokens(ctx, [0], [9], [3])
    assert [int(v) for v in fields(ctx.canary_buf)[0, :2]] == [9, 3]


def test_batch_8_then_3_leaves_earlier_slots():
    ctx = make_context()
    plan = make_write_plan([1] * 8, [-1] * 8)
    kc.write(ctx, plan, input_ids=i64(range(8)), positions=i64([0] * 8),
             out_cache_loc=i64(range(1, 9)))
    before = ctx.canary_buf.copy()
    plan = make_write_plan([1] * 3, [-1] * 3, capacity=8)
    kc.write(ctx, plan, input_ids=i64([50, 51, 52]), positions=i64([0] * 3),
             out_cache_loc=i64([1, 2, 3]))
    assert (ctx.canary_buf[4:] == before[4:]).all()
    assert [int(v) for v in fields(ctx.canary_buf)[1:4, 0]] == [50, 51, 52]


def test_duplicate_slot_last_write_wins_and_the_other_write_is_a_conflict():
    ctx = make_context()
    write_tokens(ctx, [3, 3], [1, 2], [0, 1])
    assert [int(v) for v in fields(ctx.canary_buf)[3, :3]] == [
        2, 1, signed(kc.splitmix64_mix3(H0, 1, 0))]
    # The losing write: (tag, slot, its position, its token, the kept token, its
    # prev_hash, the kept position, WRITE_SLOT_CONFLICT).
    assert ring_rows(ctx) == [(0, 3, 0, 1, 2, signed(H0), 1, int(F.WRITE_SLOT_CONFLICT))]
    assert counters(ctx) == (1, 2, 1)


def test_conflict_across_requests_keeps_the_later_request():
    ctx = make_context()
    plan = make_write_plan([1, 1, 1], [-1, -1, -1])
    kc.write(ctx, plan, input_ids=i64([10, 11, 12]), positions=i64([0, 0, 0]),
             out_cache_loc=i64([6, 7, 6]))
    assert [int(v) for v in fields(ctx.canary_buf)[6, :2]] == [12, 0]
    assert ring_rows(ctx) == [(0, 6, 0, 10, 12, signed(H0), 0, int(F.WRITE_SLOT_CONFLICT))]


def test_three_writers_of_one_slot_are_two_conflicts():
    ctx = make_context()
    write_tokens(ctx, [5, 5, 5], [1, 2, 3], [0, 1, 2])
    assert [row[1:5] + row[6:] for row in ring_rows(ctx)] == [
        (5, 0, 1, 3, 2, int(F.WRITE_SLOT_CONFLICT)), (5, 1, 2, 3, 2, int(F.WRITE_SLOT_CONFLICT))]
    assert int(fields(ctx.canary_buf)[5, 0]) == 3


def test_no_conflict_without_a_shared_slot():
    ctx = make_context()
    write_tokens(ctx, [3, 4, -1, -1], [1, 2, 3, 4], [0, 1, 2, 3])
    assert ring_rows(ctx) == []


def test_seeds_are_read_before_the_launch_stores():
    # Request 1's seed is slot 4, which request 0 writes in the same launch: the seed is
    # the record slot 4 held before the launch, whatever order the requests run in.
    ctx = make_context()
    stamp(ctx.canary_buf, 4, 100, 0, H0)
    plan = make_write_plan([1, 1], [-1, 4])
    kc.write(ctx, plan, input_ids=i64([10, 11]), positions=i64([0, 1]),
             out_cache_loc=i64([4, 5]))
    assert prev_hashes(ctx, [5]) == [kc.splitmix64_mix3(H0, 100, 0)]
    assert prev_hashes(ctx, [4]) == [H0]
    assert counters(ctx) == (0, 2, 1)


# ------------------------------------------------------------------ real KV

def test_none_mode_with_sources_stores_zero():
    ctx = make_context(sources=make_sources(2, 32, fill="random"), mode=NONE)
    write_tokens(ctx, [1, 2], [1, 2], [0, 1])
    assert [int(v) for v in fields(ctx.canary_buf)[1:3, 3]] == [0, 0]


@pytest.mark.parametrize("count", [1, 2, 3, 4])
@pytest.mark.parametrize("mode", [PARTIAL, ALL])
def test_sources_equal_oracle(count, mode):
    from oracle import real_kv

    sources = make_sources(count, 32, bytes_per_token=48, read_bytes=32, fill="random",
                           seed=count)
    ctx = make_context(sources=sources, mode=mode)
    write_tokens(ctx, [1, 2, 3], [1, 2, 3], [0, 1, 2])
    assert [int(v) for v in fields(ctx.canary_buf)[1:4, 3]] == [
        real_kv(sources, int(mode), s) for s in (1, 2, 3)]


def test_reversing_two_sources_changes_the_hash():
    sources = make_sources(2, 32, fill="random")
    a = make_context(sources=sources, mode=ALL)
    b = make_context(sources=sources[::-1], mode=ALL)
    write_tokens(a, [1], [1], [0])
    write_tokens(b, [1], [1], [0])
    assert fields(a.canary_buf)[1, 3] != fields(b.canary_buf)[1, 3]
    assert fields(a.canary_buf)[1, 2] == fields(b.canary_buf)[1, 2]


def test_non_byte_dtype_source_reads_bytes():
    src16 = make_sources(1, 32, fill="random", dtype=np.float16)[0]
    src8 = kc.RealKvSource(src16.tensor.view(np.uint8), page_size=1, num_bytes_per_token=16,
                           read_bytes=16)
    a = make_context(sources=[src16], mode=ALL)
    b = make_context(sources=[src8], mode=ALL)
    write_tokens(a, [1, 2], [1, 2], [0, 1])
    write_tokens(b, [1, 2], [1, 2], [0, 1])
    assert (a.canary_buf == b.canary_buf).all()


# ------------------------------------------------------------------ counters / misc

def test_three_launches_with_zero_active():
    ctx = make_context()
    for _ in range(3):
        kc.write(ctx, make_write_plan([2], [-1], num_valid=0), input_ids=i64([1, 2]),
                 positions=i64([0, 1]), out_cache_loc=i64([1, 2]))
    assert counters(ctx) == (0, 0, 3)
    assert not ctx.canary_buf.any()


def test_offsets_0_2_5_count_five():
    ctx = make_context()
    plan = make_write_plan([2, 3], [-1, -1])
    assert [int(v) for v in plan.write_offsets] == [0, 2, 5]
    kc.write(ctx, plan, input_ids=i64(range(5)), positions=i64([0, 1, 0, 1, 2]),
             out_cache_loc=i64([1, 2, 3, 4, 5]))
    assert counters(ctx) == (0, 5, 1)


def test_zero_total_entries_returns_early():
    ctx = make_context()
    kc.write(ctx, make_write_plan([0, 0], [-1, -1]), input_ids=i64([1]), positions=i64([0]),
             out_cache_loc=i64([1]))
    assert counters(ctx) == (0, 0, 1)
    assert not ctx.canary_buf.any()


def test_write_rows_keep_ring_fill_once():
    ctx = make_context(ring_capacity=2)
    write_tokens(ctx, [1, 2, 3], [1, 2, 3], [0, 1, 2], expected_tokens=[0, 0, 0],
                 expected_positions=[0, 1, 2])
    assert counters(ctx)[0] == 3
    assert [r[1] for r in ring_rows(ctx)] == [1, 2]


@pytest.mark.parametrize("token", [0, 1, 0xFFFFFFFF, -1, 0x80000000, 0x7FFFFFFF])
@pytest.mark.parametrize("position", [0, 1, 127, 128, 129, 0x7FFFFFFF])
def test_boundary_values_stored_verbatim(token, position):
    ctx = make_context()
    write_tokens(ctx, [1], [token], [position])
    assert [int(v) for v in fields(ctx.canary_buf)[1, :2]] == [token, position]
    h = prev_hashes(ctx, [1])[0]
    assert h == H0
    write_tokens(ctx, [2], [token], [position + 1], seed=1)
    assert prev_hashes(ctx, [2]) == [kc.splitmix64_mix3(H0, token, position)]


def test_padding_slot_zero_written_repeatedly_is_not_a_conflict():
    # Padded tokens all write their dummy KV to slot 0: upstream's example launch leaves
    # the ring empty, and slot 0 keeps the last padded token's record.
    ctx = make_context()
    plan = make_write_plan([4], [-1])
    kc.write(ctx, plan, input_ids=i64([11, 12, 13, 14]), positions=i64([0, 1, 2, 3]),
             out_cache_loc=i64([3, 0, 0, 6]))
    assert ring_rows(ctx) == []
    running = kc.splitmix64_mix3(kc.splitmix64_mix3(H0, 11, 0), 12, 1)
    assert [int(v) for v in fields(ctx.canary_buf)[0, :3]] == [13, 2, signed(running)]
    assert counters(ctx) == (0, 4, 1)


def test_padding_slot_zero_across_requests_keeps_the_last_request():
    ctx = make_context()
    plan = make_write_plan([2, 2], [-1, -1])
    kc.write(ctx, plan, input_ids=i64([1, 2, 3, 4]), positions=i64([0, 0, 0, 0]),
             out_cache_loc=i64([0, 5, 0, 0]))
    assert ring_rows(ctx) == []
    assert [int(v) for v in fields(ctx.canary_buf)[0, :3]] == [
        4, 0, signed(kc.splitmix64_mix3(H0, 3, 0))]


def test_extensions_off_drops_the_conflict_row_and_keeps_the_last_writer():
    ctx = make_context(extensions=False)
    write_tokens(ctx, [3, 3], [1, 2], [0, 1])
    assert ring_rows(ctx) == []
    assert [int(v) for v in fields(ctx.canary_buf)[3, :3]] == [
        2, 1, signed(kc.splitmix64_mix3(H0, 1, 0))]
    assert counters(ctx) == (0, 2, 1)


def test_extensions_off_still_reports_out_of_range():
    ctx = make_context(num_slots=8, extensions=False)
    write_tokens(ctx, [3, 8], [1, 2], [0, 1])
    assert ring_rows(ctx) == [(0, 8, 1, 2, 2, signed(kc.splitmix64_mix3(H0, 1, 0)), 8,
                               int(F.SLOT_OUT_OF_RANGE))]
