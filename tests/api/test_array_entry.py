"""Arrays entering the API: DLPack objects zero-copy, and backend="cupy" without a GPU."""

import numpy as np
import pytest

import kvcanary as kc
from builders import H0, DLPackOnly, i64, make_context, make_verify_plan, make_write_plan, signed


def test_dlpack_objects_work_zero_copy():
    canary = np.zeros((8, 32), np.uint8)
    ring = np.zeros((4, 8), np.int64)
    index = np.zeros(1, np.int32)
    slot_counter, kernel_counter = np.zeros(1, np.int64), np.zeros(1, np.int64)
    log = kc.ViolationLog(DLPackOnly(ring), DLPackOnly(index))
    ctx = kc.CanaryContext(DLPackOnly(canary), kernel_kind=kc.LaunchTag.TAIL_K_FULL,
                           violation_log=log, slot_run_counter=DLPackOnly(slot_counter),
                           kernel_run_counter=DLPackOnly(kernel_counter))
    plan = make_write_plan([2], [-1])
    kc.write(ctx, plan, input_ids=DLPackOnly(i64([7, 8])), positions=DLPackOnly(i64([0, 1])),
             out_cache_loc=DLPackOnly(i64([3, 4])))
    records = canary.view("<i8")
    assert [int(v) for v in records[3]] == [7, 0, signed(H0), 0]
    assert int(records[4, 0]) == 8
    assert int(slot_counter[0]) == 2 and int(kernel_counter[0]) == 1
    kc.verify(ctx, make_verify_plan([3, 4], [5, 1], [-1, 3]))
    assert int(index[0]) == 1 and int(ring[0, 1]) == 3 and int(ring[0, 7]) == 2


def test_dlpack_plan_and_source():
    table = np.arange(16, dtype=np.int32).reshape(2, 8)
    slots = np.zeros(8, np.int64)
    plan = kc.VerifyPlan(DLPackOnly(slots), np.full(8, -1, np.int64), np.zeros(8, np.int64),
                         np.zeros(8, np.int64), np.zeros(1, np.int32), np.ones(1, np.int32))
    kc.plan(req_pool_indices=DLPackOnly(i64([1])), prefix_lens=i64([3]),
            extend_seq_lens=i64([0]), req_to_token=DLPackOnly(table), verify_plan=plan,
            write_plan=kc.WritePlan.allocate(1))
    assert [int(v) for v in slots[:3]] == [8, 9, 10]
    kv = np.zeros((8, 16), np.uint8)
    src = kc.RealKvSource(DLPackOnly(kv), page_size=1, num_bytes_per_token=16, read_bytes=16)
    assert np.shares_memory(src.tensor, kv)


def test_cupy_backend_without_gpu_raises_clearly():
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            pytest.skip("a CUDA device is present")
    except Exception:
        pass
    from kvcanary.backends.cuda import CudaUnavailable

    ctx = make_context()
    with pytest.raises((CudaUnavailable, ValueError)) as info:
        kc.verify(ctx, make_verify_plan([1], [0], [-1]), backend="cupy")
    message = str(info.value).lower()
    assert "cupy" in message or "device" in message
    assert int(ctx.kernel_run_counter[0]) == 0
