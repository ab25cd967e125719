"""Behaviours the mutation run (scripts/mutation.py) found unpinned: each test here kills
mutants that survived the rest of the suite."""

import pytest

from kvcanary.hashing import to_signed, to_unsigned


@pytest.mark.parametrize("bits, value", [
    (0, 0), ((1 << 63) - 1, (1 << 63) - 1), (1 << 63, -(1 << 63)), ((1 << 64) - 1, -1),
    (1 << 64, 0), (-1, -1)])
def test_to_signed_at_the_int64_edges(bits, value):
    assert to_signed(bits) == value
    assert to_unsigned(value) == bits & ((1 << 64) - 1)


# --------------------------------------------------------------- plan kernels beside the reference

import numpy as np  # noqa: E402

import kvcanary as kc  # noqa: E402
from builders import i64, linear_req_to_token  # noqa: E402
from kernel_harness.fixtures import cpu_kernels, kernels_behind_numpy  # noqa: E402,F401

MARK = kc.consts.PLAN_SLOT_OUT_OF_TABLE


def _plan(rows, prefixes, table, **kwargs):
    verify_plan, write_plan = kc.VerifyPlan.allocate(64), kc.WritePlan.allocate(4)
    kc.plan(req_pool_indices=i64(rows), prefix_lens=i64(prefixes),
            extend_seq_lens=i64([1] * len(rows)), req_to_token=table, verify_plan=verify_plan,
            write_plan=write_plan, **kwargs)
    n = int(verify_plan.verify_num_valid[0])
    return verify_plan.verify_slot_indices[:n].tolist(), write_plan


def test_plan_row_one_past_the_table_is_out_of_table(kernels_behind_numpy):  # noqa: F811
    """Row index == number of rows: the first row outside (a `<=` bound would read past
    the table)."""
    slots, write_plan = _plan([4, 1], [2, 2], linear_req_to_token(4, 8))
    assert slots == [MARK, MARK, 8, 9]
    assert write_plan.write_seed_slot_indices[:2].tolist() == [MARK, 9]
    assert kernels_behind_numpy.compared == 1


def test_plan_translates_slot_zero_through_the_lut(kernels_behind_numpy):  # noqa: F811
    """Slot 0 is a slot like any other for the SWA table (only negatives pass through)."""
    table = linear_req_to_token(2, 8)
    table[1, :3] = [0, 5, -3]
    lut = np.arange(16, dtype=np.int64) + 100
    slots, write_plan = _plan([1], [3], table, swa_window_size=8, full_to_swa_index_mapping=lut)
    assert slots == [100, 105, -3]
    assert write_plan.write_seed_slot_indices[0] == -3
    assert kernels_behind_numpy.compared == 1


def test_write_to_the_slot_one_past_the_buffer_is_out_of_range(kernels_behind_numpy):  # noqa: F811
    from builders import make_context, make_write_plan, ring_rows

    ctx = make_context(num_slots=8)
    kc.write(ctx, make_write_plan([2], [-1]), input_ids=i64([5, 6]), positions=i64([0, 1]),
             out_cache_loc=i64([7, 8]))
    oor = int(kc.FailReason.SLOT_OUT_OF_RANGE)
    assert [(row[1], row[7]) for row in ring_rows(ctx)] == [(8, oor)]
    assert kernels_behind_numpy.compared == 1


def test_write_with_no_entries_in_total_writes_nothing(kernels_behind_numpy):  # noqa: F811
    """The early return reads the total at write_offsets[active]: a plan whose total is 0
    writes nothing, even when an earlier request's range looks non-empty."""
    from builders import counters, make_context

    ctx = make_context(num_slots=8)
    plan = kc.WritePlan.allocate(2)
    plan.write_offsets[:] = [0, 2, 0]
    plan.write_seed_slot_indices[:] = [-1, -1]
    plan.write_num_valid_reqs[0] = 2
    kc.write(ctx, plan, input_ids=i64([5, 6]), positions=i64([0, 1]), out_cache_loc=i64([1, 2]))
    assert not ctx.canary_buf.any()
    assert counters(ctx) == (0, 0, 1)
    assert kernels_behind_numpy.compared == 1
