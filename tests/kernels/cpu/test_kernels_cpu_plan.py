"""Plan kernels on the CPU beyond the hand scenarios: an empty batch, a batch larger than
upstream's 4096-row tile, both table and token-pool widths, byte-compared with the
reference after every launch."""

import numpy as np
import pytest

import kvcanary as kc
from builders import i64
from kernel_harness.fixtures import cpu_kernels, kernels_behind_numpy  # noqa: F401


@pytest.fixture(autouse=True)
def _kernels(kernels_behind_numpy):  # noqa: F811
    yield kernels_behind_numpy


def test_empty_batch_zeroes_the_write_offsets():
    verify_plan, write_plan = kc.VerifyPlan.allocate(8), kc.WritePlan.allocate(4)
    write_plan.write_offsets[:] = 9
    write_plan.write_seed_slot_indices[:] = 5
    kc.plan(req_pool_indices=i64([]), prefix_lens=i64([]), extend_seq_lens=i64([]),
            req_to_token=np.zeros((2, 4), np.int32), verify_plan=verify_plan,
            write_plan=write_plan)
    assert write_plan.write_offsets.tolist() == [0] * 5
    assert int(write_plan.write_num_valid_reqs[0]) == 0 and int(verify_plan.enable[0]) == 1


@pytest.mark.parametrize("table_dtype,pool_dtype", [(np.int32, np.int32), (np.int64, np.int64),
                                                    (np.int32, np.int64)])
def test_batch_of_5000_rows(table_dtype, pool_dtype):
    rng = np.random.default_rng(5)
    bs, width = 5000, 12
    table = rng.integers(1, 1 << 20, size=(bs + 1, width)).astype(table_dtype)
    pool = rng.integers(-5, 1 << 16, size=(bs + 1, width)).astype(pool_dtype)
    rows = rng.permutation(np.arange(bs + 1))[:bs].astype(np.int64)
    prefix = rng.integers(0, width + 1, size=bs).astype(np.int64)
    extend = rng.integers(-1, 4, size=bs).astype(np.int64)
    verify_plan = kc.VerifyPlan.allocate(int(prefix[rows != 0].sum()) + 3)
    write_plan = kc.WritePlan.allocate(bs + 7)
    kc.plan(req_pool_indices=rows, prefix_lens=prefix, extend_seq_lens=extend,
            req_to_token=table, verify_plan=verify_plan, write_plan=write_plan,
            req_to_verify_expected_tokens=pool,
            req_to_verify_expected_tokens_valid_lens=rng.integers(0, width + 2, size=bs),
            kv_token_id_vs_position_offset=1)
    assert int(verify_plan.enable[0]) == 1
    assert int(write_plan.write_offsets[bs]) == int(np.maximum(extend[rows != 0], 0).sum())


def test_every_index_type_entry_point_matches_the_reference(cpu_kernels):  # noqa: F811
    """Each (table, token pool) index type has its own entry points; a small batch through
    each, block table and sliding window included, byte-compared in every thread order."""
    from kvcanary.backends.cuda import launch as L

    rng = np.random.default_rng(7)
    start = len(cpu_kernels.launches)
    for table_dtype in (np.int32, np.int64):
        for pool_dtype in (None, np.int32, np.int64):
            for block_size, window in ((1, 0), (4, 3)):
                table = rng.integers(1, 60, size=(5, 12)).astype(table_dtype)
                pool = None if pool_dtype is None else \
                    rng.integers(-3, 1000, size=(5, 16)).astype(pool_dtype)
                verify_plan, write_plan = kc.VerifyPlan.allocate(64), kc.WritePlan.allocate(4)
                kc.plan(req_pool_indices=i64([3, 0, 1]), prefix_lens=i64([9, 4, 12]),
                        extend_seq_lens=i64([2, 1, 3]), verify_plan=verify_plan,
                        write_plan=write_plan, swa_window_size=window,
                        full_to_swa_index_mapping=np.arange(256, dtype=np.int64)[::-1].copy()
                        if window else None,
                        **({"req_to_token": table} if block_size == 1 else
                           {"block_table": table, "block_size": block_size}),
                        **({} if pool is None else dict(
                            req_to_verify_expected_tokens=pool,
                            req_to_verify_expected_tokens_valid_lens=i64([16, 3, 10]))))
    names = {name for name, _, _ in cpu_kernels.launches[start:]}
    assert names == set(L.KERNEL_FILES["plan"][1])


@pytest.mark.parametrize("window", [0, 3])
def test_extreme_prefix_and_extend_values(window):
    """int64 extremes wrap like numpy's arithmetic (the sanitizer run checks no UB)."""
    big, small = (1 << 63) - 1, -(1 << 63)
    table = np.arange(40, dtype=np.int64).reshape(4, 10)
    lut = None if window == 0 else np.arange(40, dtype=np.int64)[::-1].copy()
    verify_plan, write_plan = kc.VerifyPlan.allocate(16), kc.WritePlan.allocate(4)
    kc.plan(req_pool_indices=i64([1, 2, 3, 1]), prefix_lens=i64([big, small, 4, 2]),
            extend_seq_lens=i64([small, big, big, 1]), req_to_token=table,
            verify_plan=verify_plan, write_plan=write_plan, swa_window_size=window,
            full_to_swa_index_mapping=lut,
            req_to_verify_expected_tokens=np.ones((4, 10), np.int32),
            req_to_verify_expected_tokens_valid_lens=i64([big, big, big, big]),
            kv_token_id_vs_position_offset=big,
            check_capacity=False)   # the API refuses a count past int64; the kernel must wrap
