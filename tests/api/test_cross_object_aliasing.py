"""An array a launch writes shares no byte with any other array of the launch, across
objects (a plan's slots over the ring, ``input_ids`` over the canary, a source over the
canary): each case of tests/alias_cases.py is refused naming both arguments, on the numpy
reference here and on the CUDA path in tests/cupy_stub.py ("aliasing"); arrays the launch
only reads may share memory."""

from __future__ import annotations

import numpy as np
import pytest

import kvcanary as kc
from alias_cases import CASES, NumpyWorld, numpy_alias, run_case


@pytest.mark.parametrize("case", CASES)
def test_each_pair_on_the_reference(case):
    assert run_case(kc, NumpyWorld(), numpy_alias, case) == "ok"


def test_a_refused_launch_writes_nothing():
    world = NumpyWorld()
    world.context.violation_log.ring[:] = 7
    inputs = world.token_inputs()
    inputs["input_ids"] = numpy_alias(world.context.violation_log.ring, (world.tokens,), np.int64)
    before = world.context.canary_buf.copy()
    with pytest.raises(ValueError, match="violation_ring and input_ids share memory"):
        kc.write(world.context, world.write_plan, **inputs)
    assert (world.context.canary_buf == before).all()
    assert (world.context.violation_log.ring == 7).all()


def test_the_check_runs_again_after_a_launch_that_passed():
    """A launch that passed remembers its objects' pair; an array changed afterwards (a new
    object, or one rewired onto the ring) is compared again."""
    world = NumpyWorld()
    kc.verify(world.context, world.verify_plan)
    kc.verify(world.context, world.verify_plan)
    world.verify_plan.verify_expected_tokens = numpy_alias(
        world.context.violation_log.ring, (world.capacity,), np.int64)
    with pytest.raises(ValueError, match="violation_ring and plan.verify_expected_tokens"):
        kc.verify(world.context, world.verify_plan)


def test_a_partial_overlap_is_refused():
    """The extents overlap by one element: the end of the canary, the start of a plan array."""
    world = NumpyWorld()
    backing = np.zeros(world.num_slots * 4 + world.capacity, np.int64)
    canary = backing[: world.num_slots * 4].view(np.uint8).reshape(world.num_slots, 32)
    ctx = kc.CanaryContext(canary, kernel_kind=0, violation_log=kc.ViolationLog.allocate(8),
                           slot_run_counter=np.zeros(1, np.int64),
                           kernel_run_counter=np.zeros(1, np.int64))
    world.verify_plan.verify_slot_indices = backing[world.num_slots * 4 - 1:-1]
    with pytest.raises(ValueError, match="canary_buf and plan.verify_slot_indices share memory"):
        kc.verify(ctx, world.verify_plan)
    world.verify_plan.verify_slot_indices = backing[world.num_slots * 4:]
    kc.verify(ctx, world.verify_plan)                 # adjacent is apart
