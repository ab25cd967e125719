"""The violation write index saturates at 2**31 - 1 and never wraps to negative (which
would read as a clean log that stores no further row), on the numpy reference and on the
CUDA kernels compiled for the CPU, byte-compared launch by launch."""

import pytest

import kvcanary as kc
from kvcanary.format import consts
from builders import i64, make_context, make_verify_plan, make_write_plan
from kernel_harness.fixtures import cpu_kernels, kernels_behind_numpy  # noqa: F401

TOP = consts.VIOLATION_WRITE_INDEX_MAX


def near_the_top(start: int):
    ctx = make_context(num_slots=8, ring_capacity=4)
    ctx.violation_log.write_index[0] = start
    return ctx


def assert_saturated(log) -> None:
    assert log.total == TOP and log.saturated
    assert log.is_errored and log.ring_overflow and log.dropped == TOP - log.ring_capacity


@pytest.mark.parametrize("start", [TOP - 3, TOP])
def test_verify_saturates_the_index(start):
    ctx = near_the_top(start)
    kc.verify(ctx, make_verify_plan([1, 2, 3, 4, 5], [9] * 5, [-1] * 5))
    assert_saturated(ctx.violation_log)


def test_write_saturates_the_index():
    ctx = near_the_top(TOP - 1)
    plan = make_write_plan([3], [9])   # a seed outside the buffer and slots outside it too
    kc.write(ctx, plan, input_ids=i64([1, 2, 3]), positions=i64([0, 1, 2]),
             out_cache_loc=i64([9, 10, 11]))
    assert_saturated(ctx.violation_log)


def test_a_saturated_index_stays_put():
    ctx = near_the_top(TOP)
    kc.verify(ctx, make_verify_plan([1], [9], [-1]))
    kc.verify(ctx, make_verify_plan([2, 3], [9, 9], [-1, -1]))
    assert_saturated(ctx.violation_log)


@pytest.mark.parametrize("test", [test_verify_saturates_the_index.__name__,
                                  test_write_saturates_the_index.__name__])
def test_the_cpu_kernels_saturate_alike(kernels_behind_numpy, test):  # noqa: F811
    """Every launch above reruns on the CPU-compiled kernels and must match byte for byte."""
    if test == test_verify_saturates_the_index.__name__:
        test_verify_saturates_the_index(TOP - 3)
    else:
        test_write_saturates_the_index()
    assert kernels_behind_numpy.compared > 0
