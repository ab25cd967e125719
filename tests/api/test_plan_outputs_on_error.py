"""A plan call that raises leaves both plans as they were: the caller's previous step
stays intact instead of a half-updated plan (``enable`` and ``num_valid`` of the new
step beside the entries of the old one)."""

import numpy as np
import pytest

import kvcanary as kc
from builders import i64, linear_req_to_token


def _filled_plans(verify_capacity):
    verify_plan, write_plan = kc.VerifyPlan.allocate(verify_capacity), kc.WritePlan.allocate(4)
    for plan in (verify_plan, write_plan):
        for array in plan.arrays().values():
            array[...] = 77  # a previous step's values
    return verify_plan, write_plan


def _assert_all_77(*plans):
    for plan in plans:
        for name, array in plan.arrays().items():
            assert (array == 77).all(), f"{name} changed: {array.tolist()}"


def test_plan_that_raises_on_a_verify_slot_changes_nothing():
    verify_plan, write_plan = _filled_plans(16)
    lut = np.arange(8, dtype=np.int64)  # row 1 of the table holds slots 8..15
    with pytest.raises(ValueError, match="SWA slot 8 is outside full_to_swa_index_mapping"):
        kc.plan(req_pool_indices=i64([1]), prefix_lens=i64([3]), extend_seq_lens=i64([0]),
                req_to_token=linear_req_to_token(2, 8), verify_plan=verify_plan,
                write_plan=write_plan, swa_window_size=4, full_to_swa_index_mapping=lut)
    _assert_all_77(verify_plan, write_plan)


def test_overflowed_plan_that_raises_changes_nothing():
    """The verify entries overflow the capacity, and are still checked against the LUT as
    upstream checks them: the overflow rule's enable = 0 must not be written."""
    verify_plan, write_plan = _filled_plans(1)
    lut = np.arange(8, dtype=np.int64)
    with pytest.raises(ValueError, match="SWA slot 8 is outside full_to_swa_index_mapping"):
        kc.plan(req_pool_indices=i64([1]), prefix_lens=i64([5]), extend_seq_lens=i64([1]),
                req_to_token=linear_req_to_token(2, 8), verify_plan=verify_plan,
                write_plan=write_plan, swa_window_size=100, full_to_swa_index_mapping=lut)
    _assert_all_77(verify_plan, write_plan)


def test_the_same_plans_are_filled_when_nothing_raises():
    """Control: the fill pattern is overwritten by a successful call, so the checks above
    would see a write."""
    verify_plan, write_plan = _filled_plans(16)
    kc.plan(req_pool_indices=i64([1]), prefix_lens=i64([3]), extend_seq_lens=i64([1]),
            req_to_token=linear_req_to_token(2, 8), verify_plan=verify_plan,
            write_plan=write_plan, swa_window_size=4,
            full_to_swa_index_mapping=np.arange(16, dtype=np.int64))
    assert verify_plan.enable.tolist() == [1] and verify_plan.verify_num_valid.tolist() == [3]
    assert write_plan.write_seed_slot_indices[0] == 10
    with pytest.raises(AssertionError):
        _assert_all_77(verify_plan, write_plan)
