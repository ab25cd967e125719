"""The launches' cheap paths refuse what the full checks refuse: an address read from an
array's C interface is the address numpy names; a plan launch after one that passed still
refuses a read-only plan array; an input checked one by one is still compared with the
arrays the launch writes, its address taken from that check."""

import numpy as np
import pytest

import kvcanary as kc
from kvcanary.model import arrays as A
from builders import i64, make_context, make_verify_plan, make_write_plan


@pytest.mark.parametrize("make", [
    lambda: np.zeros(5, np.int64),
    lambda: np.zeros(9, np.int64)[3:],
    lambda: np.zeros((4, 6), np.uint8)[:, 2:],
    lambda: np.zeros(8)[::-1],
    lambda: np.zeros((3, 5), np.int32).T,
    lambda: np.zeros(0, np.int64),
    lambda: np.zeros(7, np.uint8)[2:2],
    lambda: np.float64(3.0) * np.ones(()),
], ids=["owner", "offset", "strided", "reversed", "transposed", "empty", "empty view",
        "0-d"])
def test_the_address_is_numpys(make):
    array = make()
    assert A.data_address(array) == array.__array_interface__["data"][0]


def test_an_array_subclass_reads_its_interface(monkeypatch):
    class Tagged(np.ndarray):
        pass

    array = np.zeros(6, np.int64).view(Tagged)[2:]
    assert A.data_address(array) == array.__array_interface__["data"][0]
    monkeypatch.setattr(A, "_struct_data", None)     # the path without the C interface
    plain = np.zeros(4)[1:]
    assert A.data_address(plain) == plain.__array_interface__["data"][0]


def plan_args(verify_plan, write_plan, **changes):
    args = dict(req_pool_indices=i64([1]), prefix_lens=i64([2]), extend_seq_lens=i64([1]),
                req_to_token=np.arange(1, 9, dtype=np.int32).reshape(1, 8).repeat(2, 0),
                verify_plan=verify_plan, write_plan=write_plan)
    args.update(changes)
    return args


def plans():
    return kc.VerifyPlan.allocate(8), kc.WritePlan.allocate(2)


@pytest.mark.parametrize("plan_name,field", [
    ("verify", "verify_slot_indices"), ("verify", "enable"),
    ("write", "write_offsets"), ("write", "write_num_valid_reqs")])
def test_a_read_only_plan_array_is_refused_after_a_good_plan(plan_name, field):
    verify_plan, write_plan = plans()
    kc.plan(**plan_args(verify_plan, write_plan))
    target = verify_plan if plan_name == "verify" else write_plan
    getattr(target, field).flags.writeable = False
    with pytest.raises(kc.CanaryError, match=f"plan.{field} is read-only"):
        kc.plan(**plan_args(verify_plan, write_plan))
    getattr(target, field).flags.writeable = True
    kc.plan(**plan_args(verify_plan, write_plan))


def test_a_plan_input_over_a_plan_array_is_refused_after_a_good_plan():
    verify_plan, write_plan = plans()
    kc.plan(**plan_args(verify_plan, write_plan))
    aliased = write_plan.write_seed_slot_indices[:1]
    with pytest.raises(kc.CanaryError, match="share memory") as info:
        kc.plan(**plan_args(verify_plan, write_plan, prefix_lens=aliased))
    assert "prefix_lens" in str(info.value)
    assert "plan.write_seed_slot_indices" in str(info.value)


def test_a_write_input_over_the_canary_buffer_is_refused_after_a_good_write():
    ctx = make_context()
    plan = make_write_plan([2], [-1], capacity=2)
    tokens = dict(input_ids=i64([1, 2]), positions=i64([0, 1]), out_cache_loc=i64([3, 4]))
    kc.write(ctx, plan, **tokens)
    over = ctx.canary_buf.view(np.int64).reshape(-1)[:2]
    for name in ("positions", "expected_input_positions"):
        args = dict(tokens, expected_input_tokens=i64([1, 2]),
                    expected_input_positions=i64([0, 1]))
        args[name] = over
        with pytest.raises(kc.CanaryError, match="share memory") as info:
            kc.write(ctx, plan, **args)
        assert name in str(info.value) and "canary_buf" in str(info.value)


def test_a_verify_after_a_good_verify_refuses_a_read_only_counter():
    ctx = make_context()
    plan = make_verify_plan([1, 2], [0, 1], [-1, 1], capacity=4)
    kc.verify(ctx, plan)
    ctx.slot_run_counter.flags.writeable = False
    with pytest.raises(kc.CanaryError, match="slot_run_counter is read-only"):
        kc.verify(ctx, plan)
