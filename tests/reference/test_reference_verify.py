"""Upstream's hand scenarios for verify (docs/format.md §9), through kc.verify on numpy arrays."""

import numpy as np
import pytest

import kvcanary as kc
import oracle
from builders import (H0, counters, fields, i64, make_context, make_sources, make_verify_plan,
                      make_write_plan, ring_bits, ring_rows, signed, source_slot_bytes, stamp,
                      write_tokens)

F = kc.FailReason
CHAIN, POSITION, REAL_KV, TOKEN = (int(F.VERIFY_CHAIN_HASH_MISMATCH),
                                   int(F.VERIFY_POSITION_MISMATCH),
                                   int(F.VERIFY_REAL_KV_HASH_MISMATCH),
                                   int(F.VERIFY_TOKEN_MISMATCH))
ALL, PARTIAL, NONE = kc.RealKvHashMode.ALL, kc.RealKvHashMode.PARTIAL, kc.RealKvHashMode.NONE
OOR = int(F.SLOT_OUT_OF_RANGE)


def five_step_chain(ctx, tokens=(11, 22, 33, 44, 55)):
    write_tokens(ctx, [1, 2, 3, 4, 5], list(tokens), [0, 1, 2, 3, 4])
    return make_verify_plan([1, 2, 3, 4, 5], [0, 1, 2, 3, 4], [-1, 1, 2, 3, 4])


# ------------------------------------------------------------------ chain

def test_head_with_anchor_is_clean():
    ctx = make_context()
    stamp(ctx.canary_buf, 3, 9, 0, H0)
    kc.verify(ctx, make_verify_plan([3], [0], [-1]))
    assert counters(ctx) == (0, 1, 1)


@pytest.mark.parametrize("tokens", [(11, 22, 33, 44, 55), (101, 202, 303, 404, 505)])
def test_five_step_clean_chain(tokens):
    ctx = make_context()
    kc.verify(ctx, five_step_chain(ctx, tokens))
    assert counters(ctx) == (0, 5 + 5, 2)  # the write's 5 records, then 5 verified


def test_hand_computed_chain_verifies_clean():
    ctx = make_context()
    hashes = [0xDE7FAE23A9A1B716, 0x542FE5061275A6AB, 0x9890D56BDE53142E, 0x5213C65EEE8A1DD1,
              0xC749AFFE5A5A9634]
    for slot, (tok, h) in enumerate(zip([101, 202, 303, 404, 505], hashes), start=1):
        stamp(ctx.canary_buf, slot, tok, slot - 1, h)
    kc.verify(ctx, make_verify_plan([1, 2, 3, 4, 5], [0, 1, 2, 3, 4], [-1, 1, 2, 3, 4]))
    assert ring_rows(ctx) == []


def test_head_with_wrong_stored_prev_is_chain():
    ctx = make_context()
    stamp(ctx.canary_buf, 3, 9, 0, 0xDEADBEEF)
    kc.verify(ctx, make_verify_plan([3], [0], [-1]))
    assert ring_rows(ctx) == [(0, 3, 0, 9, -1, 0xDEADBEEF, signed(H0), CHAIN)]


def test_fifty_random_heads_are_clean():
    rng = np.random.default_rng(1)
    ctx = make_context(num_slots=16)
    for _ in range(50):
        slot = int(rng.integers(0, 16))
        tok, pos = (int(v) for v in rng.integers(0, 2**31, size=2))
        stamp(ctx.canary_buf, slot, tok, pos, H0)
        kc.verify(ctx, make_verify_plan([slot], [pos], [-1]))
    assert counters(ctx) == (0, 50, 50)


def test_prev_zero_skips_the_chain_check():
    ctx = make_context()
    stamp(ctx.canary_buf, 4, 1, 0, 0x1234)
    kc.verify(ctx, make_verify_plan([4], [0], [0]))
    assert ring_rows(ctx) == []
    kc.verify(ctx, make_verify_plan([4], [99], [0]))
    assert ring_rows(ctx) == [(0, 4, 0, 1, -1, 0x1234, 0x1234, POSITION)]


# ------------------------------------------------------------------ violation fields

def test_corrupted_token_shows_at_successor():
    ctx = make_context()
    five_step_chain(ctx)
    fields(ctx.canary_buf)[2, 0] = 999
    fields(ctx.canary_buf)[2, 2] = 0
    kc.verify(ctx, make_verify_plan([3], [2], [2]))
    (row,) = ring_rows(ctx)
    assert row[7] == CHAIN
    assert row[1] == 3 and row[2] == 2 and row[3] == 33
    assert row[6] == signed(kc.splitmix64_mix3(0, 999, 1))


@pytest.mark.parametrize("plan_position", [5, 99])
def test_head_wrong_plan_position_is_exactly_position(plan_position):
    ctx = make_context()
    stamp(ctx.canary_buf, 1, 33, 0, H0)
    kc.verify(ctx, make_verify_plan([1], [plan_position], [-1]))
    assert ring_rows(ctx) == [(0, 1, 0, 33, -1, signed(H0), signed(H0), POSITION)]


def test_replaced_prev_hash_is_exactly_chain():
    ctx = make_context()
    plan = five_step_chain(ctx)
    fields(ctx.canary_buf)[2, 2] = 0x1234567812345678
    kc.verify(ctx, make_verify_plan([2], [1], [1]))
    (row,) = ring_rows(ctx)
    assert row[7] == CHAIN and row[1] == 2 and row[5] == 0x1234567812345678
    assert row[6] == signed(kc.splitmix64_mix3(H0, 11, 0))
    # the full plan also flags slot 3, whose link covers slot 2's prev_hash
    ctx.violation_log.clear()
    kc.verify(ctx, plan)
    assert [(r[1], r[7]) for r in ring_rows(ctx)] == [(2, CHAIN), (3, CHAIN)]


def test_real_kv_flipped_byte_is_exactly_real_kv():
    sources = make_sources(2, 8, bytes_per_token=32, fill="random")
    ctx = make_context(num_slots=8, sources=sources, mode=ALL)
    plan = five_step_chain(ctx)
    kc.verify(ctx, plan)
    assert ring_rows(ctx) == []
    source_slot_bytes(sources[1], 3)[17] ^= 0x01
    kc.verify(ctx, plan)
    assert [(r[1], r[7]) for r in ring_rows(ctx)] == [(3, REAL_KV)]


@pytest.mark.parametrize("kind", ["position", "prev_hash", "real_kv"])
@pytest.mark.parametrize("where", [0, 2, 4])
@pytest.mark.parametrize("ring", ["open", "full"])
def test_injection_matrix(kind, where, ring):
    """Exactly the planted check fires (open ring: the rows; full ring: earlier rows stay,
    the index counts exactly those rows, and an open twin of the context shows them)."""
    sources = make_sources(1, 8, fill="random")
    ctx = make_context(num_slots=8, ring_capacity=4, sources=sources, mode=PARTIAL)
    plan = five_step_chain(ctx)
    slot = where + 1
    if ring == "full":
        for _ in range(4):
            kc.verify(ctx, make_verify_plan([1], [77], [-1]))
        assert counters(ctx)[0] == 4
    earlier = ring_rows(ctx)
    if kind == "position":
        plan.verify_expected_positions[where] += 3
        expected = [(slot, POSITION)]
    elif kind == "prev_hash":
        fields(ctx.canary_buf)[slot, 2] ^= 0x40
        expected = [(slot, CHAIN)] + ([(slot + 1, CHAIN)] if where < 4 else [])
    else:
        source_slot_bytes(sources[0], slot)[5] ^= 0x80
        expected = [(slot, REAL_KV)]
    twin = make_context(num_slots=8, sources=sources, mode=PARTIAL,
                        canary=ctx.canary_buf.copy())
    kc.verify(twin, plan)
    assert [(r[1], r[7]) for r in ring_rows(twin)] == expected
    kc.verify(ctx, plan)
    if ring == "open":
        assert [(r[1], r[7]) for r in ring_rows(ctx)] == expected
    else:
        assert ring_rows(ctx) == earlier  # fill-once: nothing overwritten
        assert counters(ctx)[0] == 4 + len(expected)


def test_head_stored_position_10_vs_plan_99_is_position_without_chain():
    ctx = make_context()
    stamp(ctx.canary_buf, 6, 1, 10, H0)
    kc.verify(ctx, make_verify_plan([6], [99], [-1]))
    assert ring_bits(ctx) == [POSITION]


# ------------------------------------------------------------------ real KV

def test_none_mode_with_sources_and_stored_zero_is_clean():
    ctx = make_context(num_slots=8, sources=make_sources(2, 8), mode=NONE)
    kc.verify(ctx, five_step_chain(ctx))
    assert ring_rows(ctx) == []
    assert [int(v) for v in fields(ctx.canary_buf)[1:6, 3]] == [0] * 5


@pytest.mark.parametrize("mode", [PARTIAL, ALL])
def test_three_step_chains_with_two_sources_are_clean(mode):
    ctx = make_context(num_slots=8, sources=make_sources(2, 8, bytes_per_token=64,
                                                         fill="random"), mode=mode)
    write_tokens(ctx, [1, 2, 3], [7, 8, 9], [0, 1, 2])
    kc.verify(ctx, make_verify_plan([1, 2, 3], [0, 1, 2], [-1, 1, 2]))
    assert ring_rows(ctx) == []


@pytest.mark.parametrize("count", [1, 2, 3, 4])
def test_one_to_four_sources_all_mode_clean(count):
    ctx = make_context(num_slots=8, sources=make_sources(count, 8, fill="random"), mode=ALL)
    kc.verify(ctx, five_step_chain(ctx))
    assert ring_rows(ctx) == []


def test_pinned_pattern_then_flip():
    tensor = np.zeros((8, 16), dtype=np.uint8)
    tensor[2] = [0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40, 0x80,
                 0x81, 0x82, 0x84, 0x88, 0x90, 0xA0, 0xC0, 0xFF]
    src = kc.RealKvSource(tensor, page_size=1, num_bytes_per_token=16, read_bytes=16)
    ctx = make_context(num_slots=8, sources=[src], mode=ALL)
    stamp(ctx.canary_buf, 2, 5, 0, H0, 0x6041580849E6407D)
    plan = make_verify_plan([2], [0], [-1])
    kc.verify(ctx, plan)
    assert ring_rows(ctx) == []
    tensor[2, 15] ^= 1
    kc.verify(ctx, plan)
    assert ring_bits(ctx) == [REAL_KV]


def test_two_sources_128_bytes_page_16_clean():
    sources = make_sources(2, 64, bytes_per_token=128, page_size=16, fill="random")
    ctx = make_context(num_slots=64, sources=sources, mode=ALL)
    slots = [14, 15, 16, 17, 40]
    write_tokens(ctx, slots, [1, 2, 3, 4, 5], [0, 1, 2, 3, 4])
    kc.verify(ctx, make_verify_plan(slots, [0, 1, 2, 3, 4], [-1] + slots[:-1]))
    assert ring_rows(ctx) == []


def test_partial_single_bit_flip_in_first_16_bytes():
    sources = make_sources(1, 8, bytes_per_token=64, fill="random")
    ctx = make_context(num_slots=8, sources=sources, mode=PARTIAL)
    plan = five_step_chain(ctx)
    source_slot_bytes(sources[0], 4)[40] ^= 1  # beyond 16 bytes: not hashed in PARTIAL
    kc.verify(ctx, plan)
    assert ring_rows(ctx) == []
    source_slot_bytes(sources[0], 4)[15] ^= 4
    kc.verify(ctx, plan)
    assert [(r[1], r[7]) for r in ring_rows(ctx)] == [(4, REAL_KV)]


def test_none_mode_garbage_source_never_dereferenced():
    garbage = np.full((1, 16), 0xDE, dtype=np.uint8)  # covers one slot only
    src = kc.RealKvSource(garbage, page_size=1, num_bytes_per_token=16, read_bytes=16)
    ctx = make_context(num_slots=8, sources=[src], mode=NONE)
    kc.verify(ctx, five_step_chain(ctx))
    assert ring_rows(ctx) == []


def test_non_zero_stored_real_kv_without_sources_fires():
    ctx = make_context()
    stamp(ctx.canary_buf, 1, 1, 0, H0, 5)
    kc.verify(ctx, make_verify_plan([1], [0], [-1]))
    assert ring_bits(ctx) == [REAL_KV]


def test_two_sources_padded_to_four_and_holey_rows():
    sources = make_sources(2, 8, bytes_per_token=32, row_gap=16, fill="random")
    assert sources[0].row_stride_bytes == 48
    ctx = make_context(num_slots=8, sources=sources, mode=ALL)
    kc.verify(ctx, five_step_chain(ctx))
    assert ring_rows(ctx) == []


# ------------------------------------------------------------------ layout / scheduling

def test_page_size_4_slot_signatures():
    sources = make_sources(1, 8, page_size=4, fill="random")
    ctx = make_context(num_slots=8, sources=sources, mode=ALL)
    write_tokens(ctx, [1, 5], [3, 4], [0, 1])
    kc.verify(ctx, make_verify_plan([1, 5], [0, 1], [-1, 1]))
    assert ring_rows(ctx) == []
    assert fields(ctx.canary_buf)[1, 3] != fields(ctx.canary_buf)[5, 3]


def test_empty_plan():
    ctx = make_context()
    kc.verify(ctx, make_verify_plan([], [], [], capacity=4, num_valid=0))
    assert counters(ctx) == (0, 0, 1)


def test_single_entry_at_slot_zero_is_skipped_but_counted():
    ctx = make_context()
    stamp(ctx.canary_buf, 0, 0x5555, 77, 0x1234, 9)
    kc.verify(ctx, make_verify_plan([0], [3], [-1]))
    assert counters(ctx) == (0, 1, 1)


def test_disabled_plan_only_counts_the_launch():
    ctx = make_context()
    plan = make_verify_plan([1, 2], [5, 6], [-1, 1], enable=0)
    kc.verify(ctx, plan)
    assert counters(ctx) == (0, 0, 1)
    assert not ctx.violation_log.ring.any()


def test_alternating_empty_and_full_plans():
    ctx = make_context()
    full = five_step_chain(ctx)
    empty = make_verify_plan([], [], [], capacity=4, num_valid=0)
    for i in range(30):
        kc.verify(ctx, full if i % 2 else empty)
    assert counters(ctx) == (0, 5 + 15 * 5, 31)  # write, then 15 full verifies


def test_counters():
    ctx = make_context(num_slots=8)
    for _ in range(3):
        kc.verify(ctx, make_verify_plan([], [], [], capacity=2, num_valid=0))
    assert counters(ctx) == (0, 0, 3)
    plan = five_step_chain(ctx)
    plan.verify_num_valid[0] = 4
    kc.verify(ctx, plan)
    assert counters(ctx) == (0, 5 + 4, 5)  # 5 written, 4 verified


def test_forty_thousand_entries_and_replays():
    n = 40_000
    ctx = make_context(num_slots=8)
    plan = make_verify_plan(np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, np.int64))
    kc.verify(ctx, plan)
    assert counters(ctx) == (0, n, 1)
    kc.verify(ctx, plan)
    assert counters(ctx) == (0, 2 * n, 2)


def test_num_valid_beyond_capacity_is_clamped():
    ctx = make_context()
    plan = make_verify_plan([0, 0], [0, 0], [0, 0], num_valid=10)
    kc.verify(ctx, plan)
    assert counters(ctx) == (0, 2, 1)


def test_negative_num_valid_is_zero():
    ctx = make_context()
    kc.verify(ctx, make_verify_plan([1], [0], [-1], num_valid=-3))
    assert counters(ctx) == (0, 0, 1)


# ------------------------------------------------------------------ ring

def test_three_position_violations():
    ctx = make_context()
    five_step_chain(ctx)
    kc.verify(ctx, make_verify_plan([1, 2, 3], [9, 9, 9], [0, 0, 0]))
    assert counters(ctx)[0] == 3
    assert ring_rows(ctx)[0][7] == POSITION
    assert [r[1] for r in ring_rows(ctx)] == [1, 2, 3]


def test_ten_violations_capacity_four():
    ctx = make_context(ring_capacity=4)
    kc.verify(ctx, make_verify_plan(list(range(1, 11)), [0] * 10, [-1] * 10))
    assert counters(ctx)[0] == 10
    assert [r[1] for r in ring_rows(ctx)] == [1, 2, 3, 4]
    assert ctx.violation_log.ring_overflow and ctx.violation_log.dropped == 6


@pytest.mark.parametrize("tag", [kc.LaunchTag.HEAD_K_FULL, kc.LaunchTag.SWEEP_V_SWA,
                                 kc.LaunchTag.HEAD_V_SWA])
def test_kernel_kind_stamping(tag):
    ctx = make_context(kernel_kind=tag)
    kc.verify(ctx, make_verify_plan([3, 4], [0, 0], [-1, -1]))
    assert [r[0] for r in ring_rows(ctx)] == [int(tag)] * 2
    assert [r[1] for r in ring_rows(ctx)] == [3, 4]


def test_golden_row_bytes():
    ctx = make_context(kernel_kind=kc.LaunchTag.HEAD_K_FULL)
    write_tokens(ctx, [5], [33], [0])
    kc.verify(ctx, make_verify_plan([5], [99], [-1]), check_expected_token=True)
    assert ring_rows(ctx) == [(0, 5, 0, 33, -1, -2414019407054260458, -2414019407054260458, 2)]
    assert ctx.violation_log.ring[0].tobytes().hex() == (
        "0000000000000000" "0500000000000000" "0000000000000000" "2100000000000000"
        "ffffffffffffffff" "16b7a1a923ae7fde" "16b7a1a923ae7fde" "0200000000000000")


def test_fifty_zero_buffer_heads():
    ctx = make_context(num_slots=64)
    kc.verify(ctx, make_verify_plan(list(range(1, 51)), [0] * 50, [-1] * 50))
    assert counters(ctx)[0] == 50
    assert set(ring_bits(ctx)) == {CHAIN}


def test_fresh_log_is_zero():
    log = kc.ViolationLog.allocate(8)
    assert not log.ring.any() and int(log.write_index[0]) == 0
    assert log.violations() == [] and not log.is_errored


# ------------------------------------------------------------------ boundaries (oracle)

@pytest.mark.parametrize("token", [0, 1, 0xFFFFFFFF, -1, 0x80000000, 0x7FFFFFFF])
@pytest.mark.parametrize("position", [0, 1, 127, 128, 129, 0x7FFFFFFF])
def test_boundary_tokens_and_positions_round_trip(token, position):
    ctx = make_context(num_slots=8)
    write_tokens(ctx, [2, 3], [token, token], [position, position + 1])
    kc.verify(ctx, make_verify_plan([2, 3], [position, position + 1], [-1, 2],
                                    [token, token]), check_expected_token=True)
    assert ring_rows(ctx) == []


@pytest.mark.parametrize("stored_prev", [0, 0xFFFFFFFFFFFFFFFF, 0x8000000000000000])
@pytest.mark.parametrize("stored_rkv", [0, 1, 0xFFFFFFFFFFFFFFFF, 0x8000000000000000])
def test_boundary_stored_hashes(stored_prev, stored_rkv):
    from oracle import assert_matches, snapshot, verify as oracle_verify

    sources = make_sources(1, 8, fill="random")
    ctx = make_context(num_slots=8, sources=sources, mode=PARTIAL)
    stamp(ctx.canary_buf, 1, 3, 0, stored_prev, stored_rkv)
    stamp(ctx.canary_buf, 2, 4, 1, kc.splitmix64_mix3(stored_prev, 3, 0), stored_rkv)
    plan = make_verify_plan([1, 2], [0, 1], [-1, 1])
    state = snapshot(ctx)
    oracle_verify(state, ctx, plan, False)
    kc.verify(ctx, plan)
    assert_matches(ctx, state)
    assert ring_rows(ctx)[0][7] & REAL_KV


# ------------------------------------------------------------------ token-id check

def _token_ctx(stored=42):
    ctx = make_context()
    stamp(ctx.canary_buf, 1, stored, 0, H0)
    return ctx


def test_token_sentinel_skips():
    ctx = _token_ctx()
    kc.verify(ctx, make_verify_plan([1], [0], [-1], [-1]), check_expected_token=True)
    assert ring_rows(ctx) == []


def test_token_equal_is_clean():
    ctx = _token_ctx()
    kc.verify(ctx, make_verify_plan([1], [0], [-1], [42]), check_expected_token=True)
    assert ring_rows(ctx) == []


def test_token_mismatch_is_exactly_verify_token():
    ctx = _token_ctx()
    kc.verify(ctx, make_verify_plan([1], [0], [-1], [99]), check_expected_token=True)
    assert ring_rows(ctx) == [(0, 1, 0, 42, 99, signed(H0), signed(H0), TOKEN)]


def test_token_check_disabled_never_reads_expected():
    ctx = _token_ctx()
    kc.verify(ctx, make_verify_plan([1], [0], [-1], [2**63 - 1]), check_expected_token=False)
    assert ring_rows(ctx) == []


def test_token_and_position_both_wrong():
    ctx = _token_ctx()
    kc.verify(ctx, make_verify_plan([1], [5], [-1], [123]), check_expected_token=True)
    assert ring_rows(ctx) == [(0, 1, 0, 42, 123, signed(H0), signed(H0), TOKEN | POSITION)]


# ------------------------------------------------------------------ real-KV sources smaller than the buffer


def _small_sources(page_size=1):
    """A 16-slot source, then one of 8 slots (``8 // page_size`` rows): random bytes."""
    return [make_sources(1, 16, fill="random", seed=3)[0],
            make_sources(1, 8, fill="random", seed=4, page_size=page_size)[0]]


@pytest.mark.parametrize("mode", [ALL, PARTIAL])
def test_sources_smaller_than_the_buffer_hash_the_slots_inside(mode):
    # Upstream's multi-source fold-order test: 8-slot sources under a 16-slot canary.
    sources = make_sources(2, 8, fill="random", seed=5)
    ctx = make_context(num_slots=16, sources=sources, mode=mode)
    slots = list(range(1, 8))
    kc.write(ctx, make_write_plan([7], [-1]), input_ids=i64(range(7)), positions=i64(range(7)),
             out_cache_loc=i64(slots))
    assert [int(v) for v in fields(ctx.canary_buf)[slots, 3]] == [
        oracle.real_kv(sources, int(mode), s) for s in slots]
    kc.verify(ctx, make_verify_plan(slots, list(range(7)), [-1] + slots[:-1]))
    assert ring_rows(ctx) == []


@pytest.mark.parametrize("page_size", [1, 4])
def test_write_slot_outside_a_source_is_stored_with_hash_zero_and_reported(page_size):
    sources = _small_sources(page_size)
    ctx = make_context(num_slots=16, sources=sources, mode=ALL)
    kc.write(ctx, make_write_plan([3], [-1]), input_ids=i64([21, 22, 23]),
             positions=i64([0, 1, 2]), out_cache_loc=i64([7, 8, 12]))
    h1 = kc.splitmix64_mix3(H0, 21, 0)
    h2 = kc.splitmix64_mix3(h1, 22, 1)
    assert [int(v) for v in fields(ctx.canary_buf)[7]] == [
        21, 0, signed(H0), oracle.real_kv(sources, int(ALL), 7)]
    assert [int(v) for v in fields(ctx.canary_buf)[8]] == [22, 1, signed(h1), 0]
    assert [int(v) for v in fields(ctx.canary_buf)[12]] == [23, 2, signed(h2), 0]
    assert ring_rows(ctx) == [(0, 8, 1, 22, 22, signed(h1), 8, OOR),
                              (0, 12, 2, 23, 23, signed(h2), 12, OOR)]
    assert counters(ctx) == (2, 3, 1)


def test_verify_slot_outside_a_source_runs_the_other_checks():
    sources = _small_sources()
    ctx = make_context(num_slots=16, sources=sources, mode=ALL)
    stamp(ctx.canary_buf, 9, 5, 4, 0x1234, 77)  # the real-KV field is never compared
    stamp(ctx.canary_buf, 10, 6, 0, H0, 99)
    stamp(ctx.canary_buf, 3, 7, 0, H0, oracle.real_kv(sources, int(ALL), 3))
    kc.verify(ctx, make_verify_plan([9, 10, 3], [3, 0, 0], [-1, -1, -1]))
    assert ring_rows(ctx) == [(0, 9, 4, 5, -1, 0x1234, 9, CHAIN | POSITION | OOR),
                              (0, 10, 0, 6, -1, signed(H0), 10, OOR)]
    assert counters(ctx) == (2, 3, 1)


def test_verify_predecessor_out_of_range_names_the_predecessor_over_the_source():
    ctx = make_context(num_slots=16, sources=_small_sources(), mode=ALL)
    stamp(ctx.canary_buf, 9, 5, 4, 0x1234)
    kc.verify(ctx, make_verify_plan([9], [4], [40]))
    assert ring_rows(ctx) == [(0, 9, 4, 5, -1, 0x1234, 40, OOR)]


def test_small_sources_are_never_read_without_hashing():
    ctx = make_context(num_slots=16, sources=_small_sources(), mode=NONE)
    write_tokens(ctx, [12], [5], [0])
    kc.verify(ctx, make_verify_plan([12], [0], [-1]))
    assert ring_rows(ctx) == []
