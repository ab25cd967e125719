"""Paged layouts in ``plan``: a block table gives exactly the plan of the per-token table it
stands for (entries, predecessors, seeds, expected tokens, SWA lookup on the resulting slot),
on the reference and on the kernel source run on the CPU (byte-compared after every launch);
block size 1 with the per-token table as block table is today's plan bit for bit; bad table
arguments get one clear error."""

from __future__ import annotations

import numpy as np
import pytest

import kvcanary as kc
from builders import i64
from kernel_harness.fixtures import cpu_kernels, kernels_behind_numpy  # noqa: F401

OUT_OF_TABLE = (1 << 63) - 1
INT64_MIN = -(1 << 63)


@pytest.fixture(params=["reference", "kernels"])
def backend(request):
    """Each test runs on the reference, then with the CPU kernels behind numpy."""
    if request.param == "kernels":
        request.getfixturevalue("kernels_behind_numpy")
    return request.param


def per_token(block_table: np.ndarray, block_size: int) -> np.ndarray:
    """The per-token table a block table stands for, element by element in Python ints
    (slot 0 for the null block; the out-of-table marker where a slot does not fit int64)."""
    rows, blocks = block_table.shape
    table = np.zeros((rows, blocks * block_size), dtype=np.int64)
    for r in range(rows):
        for p in range(blocks * block_size):
            block = int(block_table[r, p // block_size])
            slot = 0 if block == 0 else block * block_size + p % block_size
            table[r, p] = slot if INT64_MIN <= slot <= OUT_OF_TABLE else OUT_OF_TABLE
    return table


def plan_with(table_kwargs: dict, *, rows, prefix, extend, capacity, **extra):
    verify_plan, write_plan = kc.VerifyPlan.allocate(capacity), kc.WritePlan.allocate(len(rows))
    kc.plan(req_pool_indices=rows, prefix_lens=prefix, extend_seq_lens=extend,
            verify_plan=verify_plan, write_plan=write_plan, **table_kwargs, **extra)
    return {k.removeprefix("plan."): v.copy()
            for k, v in {**verify_plan.arrays(), **write_plan.arrays()}.items()}


def assert_same_plan(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def random_case(rng, block_size: int, dtype, *, window: int, wild: bool):
    rows_in_table, max_blocks = 7, 5
    high = 40
    block_table = rng.integers(1, high, size=(rows_in_table, max_blocks))
    if wild:  # null blocks, negative blocks, blocks past any buffer, int64 extremes
        picks = rng.random(block_table.shape)
        block_table[picks < 0.15] = 0
        block_table[(picks >= 0.15) & (picks < 0.2)] = -3
        block_table[(picks >= 0.2) & (picks < 0.25)] = 10_000
        if dtype == np.int64:
            block_table[0, 0], block_table[1, 1] = OUT_OF_TABLE, INT64_MIN
            block_table[2, 2] = OUT_OF_TABLE // block_size
    block_table = block_table.astype(dtype)
    bs = 6
    rows = rng.choice(rows_in_table, size=bs, replace=False).astype(np.int64)
    width = max_blocks * block_size
    prefix = rng.integers(0, width + 3, size=bs).astype(np.int64)  # some run past the table
    extend = rng.integers(0, 3, size=bs).astype(np.int64)
    extra = dict(req_to_verify_expected_tokens=rng.integers(1, 100, size=(rows_in_table, width))
                 .astype(np.int32),
                 req_to_verify_expected_tokens_valid_lens=rng.integers(0, width + 1, size=bs)
                 .astype(np.int64))
    if window:
        lut_len = 64 * block_size
        extra.update(swa_window_size=window,
                     full_to_swa_index_mapping=rng.permutation(lut_len).astype(np.int64))
    return block_table, dict(rows=rows, prefix=prefix, extend=extend,
                             capacity=int(prefix.sum()) + 1, **extra)


@pytest.mark.parametrize("block_size", [1, 2, 16])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("seed", range(4))
def test_block_table_plan_is_the_per_token_plan(backend, block_size, dtype, window, seed):
    rng = np.random.default_rng(seed)
    block_table, case = random_case(rng, block_size, dtype, window=window, wild=not window)
    paged = plan_with(dict(block_table=block_table, block_size=block_size), **case)
    flat = plan_with(dict(req_to_token=per_token(block_table, block_size)), **case)
    assert_same_plan(paged, flat)
    assert int(paged["enable"][0]) == 1


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_block_size_one_is_todays_plan_bit_for_bit(backend, dtype):
    rng = np.random.default_rng(11)
    table = rng.integers(-4, 50, size=(6, 9)).astype(dtype)   # negatives and zeros too
    case = dict(rows=i64([3, 0, 1, 5]), prefix=i64([9, 4, 12, 0]), extend=i64([1, 2, 0, 3]),
                capacity=40)
    assert_same_plan(plan_with(dict(block_table=table, block_size=1), **case),
                     plan_with(dict(req_to_token=table), **case))


def test_null_block_negative_and_overflowing_blocks_become_padding_or_marker(backend):
    block_table = np.array([[0, 0], [5, 0], [-1, 2], [OUT_OF_TABLE // 4 + 1, 3]], dtype=np.int64)
    plan = plan_with(dict(block_table=block_table, block_size=4),
                     rows=i64([1, 2, 3]), prefix=i64([8, 8, 9]), extend=i64([1, 1, 1]),
                     capacity=25)
    slots = plan["verify_slot_indices"][:25].tolist()
    assert slots[:8] == [20, 21, 22, 23, 0, 0, 0, 0]             # block 5, then the null block
    assert slots[8:16] == [-4, -3, -2, -1, 8, 9, 10, 11]          # negative block: negative slots
    assert slots[16:20] == [OUT_OF_TABLE] * 4                     # slots past int64: the marker
    assert slots[20:24] == [12, 13, 14, 15] and slots[24] == OUT_OF_TABLE  # past max_blocks * 4
    assert plan["write_seed_slot_indices"][:3].tolist() == [0, 11, OUT_OF_TABLE]


def test_table_arguments_are_checked():
    table = np.ones((2, 4), dtype=np.int32)
    case = dict(rows=i64([1]), prefix=i64([2]), extend=i64([1]), capacity=4)
    with pytest.raises(ValueError, match="exactly one of req_to_token or block_table, got both"):
        plan_with(dict(req_to_token=table, block_table=table, block_size=4), **case)
    with pytest.raises(ValueError, match="exactly one of req_to_token or block_table, got neither"):
        plan_with({}, **case)
    with pytest.raises(ValueError, match="block_table needs block_size"):
        plan_with(dict(block_table=table), **case)
    with pytest.raises(ValueError, match="block_size goes with block_table"):
        plan_with(dict(req_to_token=table, block_size=4), **case)
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        plan_with(dict(block_table=table, block_size=0), **case)
    with pytest.raises(ValueError, match="block_table must have dtype int32 or int64"):
        plan_with(dict(block_table=table.astype(np.float32), block_size=4), **case)
    with pytest.raises(ValueError, match="block_table"):
        plan_with(dict(block_table=table[0], block_size=4), **case)
