"""One rule for integer inputs on every entry point: kvcanary converts an integer array only
where it copies it anyway. Launches run in place and refuse another dtype, saying why; Python
lists are copied into int64 arrays on every platform; dumps widen narrower integers."""

import numpy as np
import pytest

import kvcanary as kc
from kvcanary.model import arrays as A
from kvcanary.dump import DumpError, load, save


def plan_of(**batch):
    table = np.zeros((3, 8), np.int32)
    table[1, :4] = [5, 6, 7, 8]
    table[2, :4] = [9, 10, 11, 12]
    verify_plan, write_plan = kc.VerifyPlan.allocate(16), kc.WritePlan.allocate(2)
    kc.plan(req_to_token=table, verify_plan=verify_plan, write_plan=write_plan, **batch)
    return [a.tolist() for a in (*verify_plan.arrays().values(), *write_plan.arrays().values())]


def test_a_launch_refuses_a_narrower_integer_array_and_says_why():
    with pytest.raises(ValueError, match=r"^kv-canary: prefix_lens must have dtype int64, got "
                                         r"int32 \(kvcanary converts no array it is given: "
                                         r"plan, write and verify run in place"):
        plan_of(req_pool_indices=np.array([1, 2]), prefix_lens=np.array([2, 1], np.int32),
                extend_seq_lens=np.array([1, 1]))


def test_python_lists_are_int64_arrays_on_every_platform():
    # np.int32 elements stand for a platform whose default integer is 32 bits.
    assert A.as_array([np.int32(1), np.int32(2)], "x").dtype == np.int64
    assert A.as_array([1, 2], "x").dtype == np.int64
    arrays = dict(req_pool_indices=np.array([1, 2]), prefix_lens=np.array([2, 1]),
                  extend_seq_lens=np.array([1, 1]))
    assert plan_of(**{k: [np.int32(v) for v in a] for k, a in arrays.items()}) == plan_of(**arrays)


def test_an_integer_array_is_never_converted_by_as_array():
    given = np.arange(3, dtype=np.int32)
    assert A.as_array(given, "x") is given


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.uint8, np.uint32])
def test_dump_save_widens_narrower_integers(tmp_path, dtype):
    table = np.zeros((2, 4), np.int32)
    table[1, :2] = [1, 2]
    dump = load(save(str(tmp_path / "d.npz"), canary=np.zeros((4, 32), np.uint8),
                     req_to_token=table, req_pool_indices=np.array([1], dtype),
                     seq_lens=np.array([2], dtype)))
    assert dump.seq_lens.dtype == np.int64 and dump.seq_lens.tolist() == [2]


@pytest.mark.parametrize("dtype", [np.uint64, np.float64, np.bool_])
def test_dump_save_refuses_what_does_not_widen_losslessly(tmp_path, dtype):
    with pytest.raises(DumpError, match=r"key seq_lens: dtype must be int64"):
        save(str(tmp_path / "d.npz"), canary=np.zeros((4, 32), np.uint8),
             req_to_token=np.zeros((2, 4), np.int32), req_pool_indices=np.array([1]),
             seq_lens=np.array([1], dtype))
