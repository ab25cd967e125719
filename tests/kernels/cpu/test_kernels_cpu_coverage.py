"""Kernel branches the scenario reruns do not reach on their own, run next to the reference
(kernel_harness.Differential compares every byte): real-KV sources whose base pointer is
off the 16-byte boundary take the kernels' byte-load path instead of the 128-bit load."""

import numpy as np
import pytest

import kvcanary as kc
from builders import (make_context, make_sources, make_verify_plan, ring_rows, source_slot_bytes,
                      write_tokens)
from kernel_harness.fixtures import assert_compared, cpu_kernels, kernels_behind_numpy  # noqa: F401

REAL_KV = int(kc.FailReason.VERIFY_REAL_KV_HASH_MISMATCH)


def _shifted_sources(count, num_slots, offset, page_size, bytes_per_token=32):
    """Sources whose data starts ``offset`` bytes past a 16-byte boundary (same row stride
    and contents as aligned ones)."""
    shifted = []
    for source in make_sources(count, num_slots, bytes_per_token=bytes_per_token,
                               page_size=page_size, fill="random", seed=offset):
        rows, width = source.tensor.shape
        backing = np.zeros(rows * (width + 16) + 32, dtype=np.uint8)
        start = (-backing.ctypes.data) % 16 + offset
        view = np.lib.stride_tricks.as_strided(backing[start:], shape=(rows, width),
                                               strides=(width + 16, 1))
        view[...] = source.tensor
        assert view.ctypes.data % 16 == offset
        shifted.append(kc.RealKvSource(view, page_size=page_size,
                                       num_bytes_per_token=bytes_per_token,
                                       read_bytes=source.read_bytes))
    return shifted


@pytest.mark.parametrize("offset", [0, 1, 8, 15])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("mode", [kc.RealKvHashMode.PARTIAL, kc.RealKvHashMode.ALL])
def test_misaligned_real_kv_sources_hash_like_the_reference(kernels_behind_numpy, offset,  # noqa: F811
                                                           page_size, mode):
    sources = _shifted_sources(2, 16, offset, page_size)
    ctx = make_context(num_slots=16, sources=sources, mode=mode)
    slots = [3, 4, 5, 6, 7, 8]
    write_tokens(ctx, slots, [10, 11, 12, 13, 14, 15], list(range(6)))
    plan = make_verify_plan(slots, list(range(6)), [-1] + slots[:-1])
    kc.verify(ctx, plan)
    assert ring_rows(ctx) == []
    source_slot_bytes(sources[1], 5)[3] ^= 0x10  # inside the partial (16-byte) read
    kc.verify(ctx, plan)
    assert [(row[1], row[7]) for row in ring_rows(ctx)] == [(5, REAL_KV)]
    assert kernels_behind_numpy.compared == 3


class _WideOffsets:
    """CPU kernels that launch kvc_plan_offsets on a 3 x 4 grid instead of 1 x 1."""

    def __init__(self, kernels):
        self.kernels = kernels

    def plan(self, **kwargs):
        run = self.kernels._run

        def widened(key, name, geometry, args):
            run(key, name, (3, 4) if name == "kvc_plan_offsets" else geometry, args)

        self.kernels._launcher._run = widened
        try:
            self.kernels.plan(**kwargs)
        finally:
            self.kernels._launcher._run = run


def test_plan_offsets_on_a_wider_grid_runs_once(cpu_kernels):  # noqa: F811
    """The prefix sums run in thread 0 only: extra threads of a wider launch must return
    instead of summing the already summed offsets again."""
    from kernel_harness import Differential, numpy_runs

    differential = Differential(_WideOffsets(cpu_kernels))
    table = np.arange(64, dtype=np.int32).reshape(4, 16)
    with numpy_runs(differential):
        verify_plan, write_plan = kc.VerifyPlan.allocate(32), kc.WritePlan.allocate(4)
        kc.plan(req_pool_indices=np.array([1, 2, 3], np.int64),
                prefix_lens=np.array([3, 5, 2], np.int64),
                extend_seq_lens=np.array([1, 2, 3], np.int64), req_to_token=table,
                verify_plan=verify_plan, write_plan=write_plan)
    assert differential.compared == 1
    assert write_plan.write_offsets[:4].tolist() == [0, 1, 3, 6]
