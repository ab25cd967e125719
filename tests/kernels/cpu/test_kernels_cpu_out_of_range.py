"""Out-of-range indices through the CPU-compiled kernels (docs/extensions.md): every
index outside its array is reported as SLOT_OUT_OF_RANGE and never dereferenced. Each
launch is byte-compared with the reference (kernels_behind_numpy); the sanitizer test
reruns this module under AddressSanitizer/UBSan, where a stray access aborts."""

import numpy as np
import pytest

import kvcanary as kc
from kvcanary.format import consts
from builders import (H0, counters, i64, linear_req_to_token, make_context, make_sources,
                      make_verify_plan, make_write_plan, ring_rows, stamp)
from kernel_harness import CpuKernels, numpy_runs
from kernel_harness.fixtures import cpu_kernels, kernels_behind_numpy  # noqa: F401

OOR = int(kc.FailReason.SLOT_OUT_OF_RANGE)
MARK = consts.PLAN_SLOT_OUT_OF_TABLE
POSITION = int(kc.FailReason.VERIFY_POSITION_MISMATCH)
W_POSITION = int(kc.FailReason.WRITE_POSITION_MISMATCH)


@pytest.fixture(autouse=True)
def _kernels(kernels_behind_numpy):  # noqa: F811
    yield kernels_behind_numpy


@pytest.mark.parametrize("slot", [8, 9, 1000, -1, -5, (1 << 63) - 1, -(1 << 63)])
def test_verify_slot_outside_buffer(slot):
    ctx = make_context(num_slots=8, sources=make_sources(2, 8, fill="random"),
                       mode=kc.RealKvHashMode.ALL)
    kc.verify(ctx, make_verify_plan([slot], [3], [-1], [7]), check_expected_token=True)
    assert ring_rows(ctx) == [(0, slot, 3, 0, 7, 0, slot, OOR)]
    assert counters(ctx) == (1, 1, 1)


@pytest.mark.parametrize("prev", [8, 77, (1 << 63) - 1])
def test_verify_predecessor_outside_buffer(prev):
    ctx = make_context(num_slots=8)
    stamp(ctx.canary_buf, 2, 5, 4, 0x1234)
    kc.verify(ctx, make_verify_plan([2], [9], [prev]))
    assert ring_rows(ctx) == [(0, 2, 4, 5, -1, 0x1234, prev, POSITION | OOR)]


def test_verify_mixed_out_of_range_entries_many_blocks():
    ctx = make_context(num_slots=16, ring_capacity=256)
    slots = [3, 16, -2, 0, 5, 99, 15] * 10
    kc.verify(ctx, make_verify_plan(slots, [0] * 70, [-1, 40, 0, 0, 16, 1, 2] * 10))
    # Every non-zero slot fails except 15: its zero record links from slot 2's zero
    # record (mix3(0, 0, 0) == 0) at the expected position 0.
    assert counters(ctx)[0] == len([s for s in slots if s not in (0, 15)])
    assert sum(1 for r in ring_rows(ctx) if r[7] & OOR) == 40


def test_write_seed_and_slot_outside_buffer():
    ctx = make_context(num_slots=8)
    plan = make_write_plan([2, 2], [8, -1])
    kc.write(ctx, plan, input_ids=i64([1, 2, 3, 4]), positions=i64([0, 1, 0, 1]),
             out_cache_loc=i64([1, 2, 3, 9]))
    rows = ring_rows(ctx)
    assert (0, 8, 0, 0, 0, 0, 8, OOR) in rows
    assert [r[1] for r in rows if r[7] == OOR] == [8, 9]
    assert counters(ctx)[1] == 3


# Corrupt plans (offsets not from 0): a plan as kc.plan makes it that covers more tokens than
# the arrays hold is refused before the launch (tests/api/test_api_shapes.py).
@pytest.mark.parametrize("offsets,bad", [([1, 3, 9], 9), ([-2, 1, 2], -2), ([1, 9, 9], 9)])
def test_write_request_range_outside_token_arrays(offsets, bad):
    ctx = make_context(num_slots=8)
    plan = kc.WritePlan.allocate(2)
    plan.write_offsets[:] = offsets
    plan.write_num_valid_reqs[0] = 2
    kc.write(ctx, plan, input_ids=i64([1, 2, 3]), positions=i64([0, 1, 2]),
             out_cache_loc=i64([1, 2, 3]))
    assert (0, -1, 0, 0, 0, 0, bad, OOR) in ring_rows(ctx)


def test_write_huge_slot_and_seed_with_sources_and_assert():
    sources = make_sources(3, 8, fill="random", bytes_per_token=32)
    ctx = make_context(num_slots=8, sources=sources, mode=kc.RealKvHashMode.ALL)
    stamp(ctx.canary_buf, 4, 9, 10, H0)
    plan = make_write_plan([3], [4])
    kc.write(ctx, plan, input_ids=i64([1, 2, 3]), positions=i64([11, 13, 14]),
             out_cache_loc=i64([(1 << 63) - 1, 5, 1 << 40]),
             expected_input_tokens=i64([1, 2, 4]), expected_input_positions=i64([11, 12, 14]))
    bits = [r[7] for r in ring_rows(ctx)]
    assert bits.count(OOR) == 2 and W_POSITION in [b & W_POSITION for b in bits]


@pytest.mark.parametrize("rows", [[-1, 1], [1, 9], [2, 1 << 40]])
def test_plan_rows_and_prefixes_outside_table(rows):
    table = linear_req_to_token(4, 8)
    verify_plan, write_plan = kc.VerifyPlan.allocate(64), kc.WritePlan.allocate(4)
    kc.plan(req_pool_indices=i64(rows), prefix_lens=i64([3, 12]), extend_seq_lens=i64([1, 2]),
            req_to_token=table, verify_plan=verify_plan, write_plan=write_plan)
    n = int(verify_plan.verify_num_valid[0])
    assert MARK in verify_plan.verify_slot_indices[:n].tolist()
    ctx = make_context(num_slots=64)
    kc.verify(ctx, verify_plan)
    assert any(r[7] & OOR and r[1] == MARK for r in ring_rows(ctx))


@pytest.mark.parametrize("table_dtype", [np.int32, np.int64])
def test_swa_lut_index_outside_lut_is_marked_by_the_kernel(cpu_kernels, table_dtype):  # noqa: F811
    """The one allowed divergence: the reference raises, the kernel marks the entry.
    The kernel's plan equals the reference's plan with the LUT padded by markers."""
    table = linear_req_to_token(3, 8, table_dtype)  # slot ids up to 23
    lut = np.arange(20, dtype=np.int64) + 100
    args = dict(req_pool_indices=i64([1, 2]), prefix_lens=i64([6, 8]),
                extend_seq_lens=i64([1, 1]), req_to_token=table, swa_window_size=4)
    with pytest.raises(ValueError, match="outside full_to_swa_index_mapping length 20"):
        kc.plan(verify_plan=kc.VerifyPlan.allocate(32), write_plan=kc.WritePlan.allocate(2),
                full_to_swa_index_mapping=lut, **args)
    padded = np.concatenate([lut, np.full(8, MARK, dtype=np.int64)])
    expected = (kc.VerifyPlan.allocate(32), kc.WritePlan.allocate(2))
    kc.plan(verify_plan=expected[0], write_plan=expected[1], full_to_swa_index_mapping=padded,
            **args)
    actual = (kc.VerifyPlan.allocate(32), kc.WritePlan.allocate(2))
    with numpy_runs(cpu_kernels):
        kc.plan(verify_plan=actual[0], write_plan=actual[1], full_to_swa_index_mapping=lut,
                **args)
    for e, a in zip(expected, actual):
        for name, value in e.arrays().items():
            np.testing.assert_array_equal(a.arrays()[name], value, err_msg=name)
    assert MARK in actual[0].verify_slot_indices.tolist()
    assert actual[1].write_seed_slot_indices[1] == MARK


def test_expected_token_pool_outside_rows_reads_nothing():
    table = linear_req_to_token(4, 8)
    pool = np.arange(16, dtype=np.int32).reshape(2, 8)  # fewer rows than the table
    verify_plan, write_plan = kc.VerifyPlan.allocate(32), kc.WritePlan.allocate(2)
    kc.plan(req_pool_indices=i64([1, 3]), prefix_lens=i64([5, 4]), extend_seq_lens=i64([0, 0]),
            req_to_token=table, verify_plan=verify_plan, write_plan=write_plan,
            req_to_verify_expected_tokens=pool,
            req_to_verify_expected_tokens_valid_lens=i64([100, 100]),
            kv_token_id_vs_position_offset=1)
    assert verify_plan.verify_expected_tokens[5:9].tolist() == [-1] * 4


# Real-KV sources smaller than the canary buffer: a slot past a source is reported, and
# under the sanitizer build any read past the source's rows aborts the run.
from test_reference_verify import (  # noqa: E402,F401
    test_small_sources_are_never_read_without_hashing,
    test_sources_smaller_than_the_buffer_hash_the_slots_inside,
    test_verify_predecessor_out_of_range_names_the_predecessor_over_the_source,
    test_verify_slot_outside_a_source_runs_the_other_checks,
    test_write_slot_outside_a_source_is_stored_with_hash_zero_and_reported,
)
