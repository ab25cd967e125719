"""The CUDA kernels on a GPU, on cupy arrays: random multi-step batches against the
reference (the CPU property test's generator), bounds above 4 with that many sources,
out-of-range indices, a verify larger than the persistent grid, and module caching.
Skipped, with the reason, when cupy sees no device."""

import numpy as np
import pytest

import kvcanary as kc
from builders import H0, make_context, make_sources, make_verify_plan, stamp
from kernel_harness import Differential, numpy_runs
from kernel_harness.gpu import GpuKernels, gpu_kernels, require_gpu  # noqa: F401
from test_kernels_cpu_properties import run_steps

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("bound", [4, 16])
def test_random_steps_match_reference(gpu_kernels, seed, bound):  # noqa: F811
    differential = Differential(gpu_kernels)
    with numpy_runs(differential):
        run_steps(np.random.default_rng(1000 + seed), bound=bound)
    assert differential.compared == 12


def _to_cupy_context(cp, ctx):
    sources = [kc.RealKvSource(cp.asarray(s.tensor), page_size=s.page_size,
                               num_bytes_per_token=s.num_bytes_per_token,
                               read_bytes=s.read_bytes) for s in ctx.real_kv_sources]
    return kc.CanaryContext(
        cp.asarray(ctx.canary_buf), kernel_kind=ctx.kernel_kind,
        violation_log=kc.ViolationLog(cp.asarray(ctx.violation_log.ring),
                                      cp.asarray(ctx.violation_log.write_index)),
        slot_run_counter=cp.asarray(ctx.slot_run_counter),
        kernel_run_counter=cp.asarray(ctx.kernel_run_counter), real_kv_sources=sources,
        real_kv_hash_mode=ctx.real_kv_hash_mode,
        enable_chain_position_assert=cp.asarray(ctx.enable_chain_position_assert),
        max_real_kv_sources=ctx.max_real_kv_sources)


@pytest.mark.parametrize("bound,count", [(8, 8), (16, 11), (64, 64)])
@pytest.mark.parametrize("mode", [kc.RealKvHashMode.PARTIAL, kc.RealKvHashMode.ALL])
def test_many_sources_on_cupy_arrays(bound, count, mode):
    cp = require_gpu()
    num_slots = 64
    sources = make_sources(count, num_slots, bytes_per_token=32, fill="random", seed=count)
    host = make_context(num_slots=num_slots, sources=sources, mode=mode,
                        max_real_kv_sources=bound)
    device = _to_cupy_context(cp, host)
    plan = kc.WritePlan.allocate(2)
    plan.write_offsets[:] = [0, 5, 9]
    plan.write_num_valid_reqs[0] = 2
    tokens = np.arange(9, dtype=np.int64) + 7
    positions = np.array([0, 1, 2, 3, 4, 0, 1, 2, 3], dtype=np.int64)
    slots = np.array([3, 9, 20, 33, 63, 1, 2, 5, 8], dtype=np.int64)
    kc.write(host, plan, input_ids=tokens, positions=positions, out_cache_loc=slots)
    device_plan = kc.WritePlan(*(cp.asarray(a) for a in (plan.write_offsets,
                                                         plan.write_seed_slot_indices,
                                                         plan.write_num_valid_reqs)))
    kc.write(device, device_plan, input_ids=cp.asarray(tokens), positions=cp.asarray(positions),
             out_cache_loc=cp.asarray(slots))
    np.testing.assert_array_equal(device.canary_buf.get(), host.canary_buf)
    # flip one byte in the last source on both sides; verify reports exactly that slot
    host.real_kv_sources[-1].tensor[20, 0] ^= 1  # page_size 1: row 20 is slot 20
    device.real_kv_sources[-1].tensor[20, 0] ^= 1
    verify = make_verify_plan(slots.tolist(), positions.tolist(), [-1, 3, 9, 20, 33, -1, 1, 2, 5])
    kc.verify(host, verify)
    kc.verify(device, kc.VerifyPlan(*(cp.asarray(getattr(verify, n)) for n in (
        "verify_slot_indices", "verify_expected_tokens", "verify_expected_positions",
        "verify_prev_slot_indices", "verify_num_valid", "enable"))))
    assert sorted(map(tuple, device.violation_log.rows())) == sorted(map(tuple, host.violation_log.rows()))
    assert [r.slot_idx for r in host.violation_log.violations()] == [20]
    np.testing.assert_array_equal(device.slot_run_counter.get(), host.slot_run_counter)
    np.testing.assert_array_equal(device.kernel_run_counter.get(), host.kernel_run_counter)


def test_too_many_sources_rejected_before_launch():
    cp = require_gpu()
    ctx = _to_cupy_context(cp, make_context(num_slots=8, sources=make_sources(5, 8),
                                            mode=kc.RealKvHashMode.ALL))
    with pytest.raises(ValueError, match="at most 4 RealKvSource entries"):
        kc.verify(ctx, kc.VerifyPlan.allocate(4, xp=cp))


def test_verify_beyond_the_persistent_grid(gpu_kernels):  # noqa: F811
    n = 3_000_000
    differential = Differential(gpu_kernels)
    ctx = make_context(num_slots=n + 1, ring_capacity=16)
    slots = np.arange(1, n + 1, dtype=np.int64)
    fields = ctx.canary_buf.view("<i8")
    fields[1:, 1] = np.arange(n)
    fields[1:, 2] = np.int64(H0 - (1 << 64))
    plan = make_verify_plan(slots, np.arange(n), np.full(n, -1))
    plan.verify_expected_positions[12345] = -7
    with numpy_runs(differential):
        kc.verify(ctx, plan)
    assert [r.slot_idx for r in ctx.violation_log.violations()] == [12346]
    assert int(ctx.slot_run_counter[0]) == n


def test_out_of_range_indices_on_gpu(gpu_kernels):  # noqa: F811
    differential = Differential(gpu_kernels)
    with numpy_runs(differential):
        ctx = make_context(num_slots=8)
        stamp(ctx.canary_buf, 2, 5, 4, 0x1234)
        kc.verify(ctx, make_verify_plan([2, 9, -3, (1 << 63) - 1], [4, 0, 0, 0], [8, -1, -1, -1]))
        assert int(ctx.violation_log.write_index[0]) == 4


def test_modules_are_cached_per_bound_and_variant():
    require_gpu()
    from kvcanary.backends.cuda import launch as L

    assert L.module("verify", 4, True) is L.module("verify", 4, True)
    assert L.module("verify", 4, True) is not L.module("verify", 4, False)
    assert L.module("write", 4, False) is not L.module("write", 8, False)
