"""Seeds chained across the requests of one write launch (``chain_across_requests``): a
seed slot an earlier request of the launch writes links to that write. The CPU-compiled
kernels run beside the reference in forward, reverse and shuffled thread order and must
give the same bytes (kernel_harness.Differential); the reference equals the sequential
oracle (tests/oracle.py) there too."""

import numpy as np
import pytest

import kvcanary as kc
import oracle
from builders import i64
from kernel_harness.fixtures import assert_compared, cpu_kernels, kernels_behind_numpy  # noqa: F401


def _context(num_slots, chain):
    return kc.CanaryContext(
        np.zeros((num_slots, kc.CANARY_SLOT_BYTES), np.uint8),
        kernel_kind=kc.LaunchTag.TAIL_K_FULL, violation_log=kc.ViolationLog.allocate(64),
        slot_run_counter=np.zeros(1, np.int64), kernel_run_counter=np.zeros(1, np.int64),
        chain_across_requests=chain)


def _same_step_prefix_hit(ctx):
    """Request 0 writes positions 0..3 into slots 1..4; request 1 shares positions 0..2 and
    writes its own position 3 into slot 8, seeded by slot 3 (position 2), which request 0
    writes in this same launch: vLLM's same-step prefix hit."""
    plan = kc.WritePlan(write_offsets=i64([0, 4, 5]), write_seed_slot_indices=i64([-1, 3]),
                        write_num_valid_reqs=np.array([2], np.int32))
    kc.write(ctx, plan, input_ids=i64([5, 6, 7, 8, 9]), positions=i64([0, 1, 2, 3, 3]),
             out_cache_loc=i64([1, 2, 3, 4, 8]))
    verify = kc.VerifyPlan.allocate(4)
    verify.verify_slot_indices[:] = [1, 2, 3, 8]
    verify.verify_prev_slot_indices[:] = [-1, 1, 2, 3]
    verify.verify_expected_positions[:] = [0, 1, 2, 3]
    verify.verify_expected_tokens[:] = [5, 6, 7, 9]
    verify.verify_num_valid[0] = 4
    kc.verify(ctx, verify, check_expected_token=True)
    return ctx.violation_log.rows()


def test_same_step_seed_reads_the_record_stored_before_by_default():
    rows = _same_step_prefix_hit(_context(16, chain=False))
    # the seed was read before request 0 stored slot 3 (an empty record): the write's
    # chain-position row, then verify's chain-link row, both at slot 8
    assert [int(r[1]) for r in rows] == [8, 8]
    assert [int(r[7]) for r in rows] == [int(kc.FailReason.WRITE_POSITION_MISMATCH),
                                         int(kc.FailReason.VERIFY_CHAIN_HASH_MISMATCH)]


@pytest.mark.parametrize("backend", ["reference", "kernels"])
def test_same_step_seed_chains_across_requests(backend, request):
    if backend == "kernels":
        request.getfixturevalue("kernels_behind_numpy")
    ctx = _context(16, chain=True)
    assert len(_same_step_prefix_hit(ctx)) == 0
    # the position assert follows the chained seed: position 2 then 3, no row
    assert ctx.violation_log.total == 0


def _random_launch(rng, num_slots):
    capacity = int(rng.integers(1, 7))
    counts = rng.integers(0, 5, size=capacity)
    offsets = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    num_tokens = max(1, int(offsets[-1]))
    loc = rng.integers(-1, num_slots + 1, size=num_tokens)
    if rng.random() < 0.5:
        loc = rng.choice(loc[: max(1, num_tokens // 2)], size=num_tokens)
    seeds = rng.integers(-1, num_slots + 1, size=capacity)
    for r in range(capacity):
        if rng.random() < 0.6:        # a seed another request of the launch writes
            seeds[r] = int(rng.choice(loc))
    tokens = rng.integers(0, 9, size=num_tokens)
    positions = np.arange(num_tokens) + rng.integers(-1, 2, size=num_tokens)
    plan = kc.WritePlan(write_offsets=offsets, write_seed_slot_indices=i64(seeds),
                        write_num_valid_reqs=np.array([capacity], np.int32))
    return plan, dict(input_ids=i64(tokens), positions=i64(positions), out_cache_loc=i64(loc))


def test_chained_seeds_equal_the_oracle_and_the_kernels(kernels_behind_numpy):
    rng = np.random.default_rng(34)
    for _ in range(60):
        num_slots = int(rng.integers(2, 20))
        ctx = _context(num_slots, chain=True)
        ctx.canary_buf[:] = rng.integers(0, 256, size=ctx.canary_buf.shape, dtype=np.uint8)
        for _ in range(3):
            plan, arrays = _random_launch(rng, num_slots)
            state = oracle.snapshot(ctx)
            oracle.write(state, ctx, plan, arrays["input_ids"], arrays["positions"],
                         arrays["out_cache_loc"])
            kc.write(ctx, plan, **arrays)     # reference and kernels, every thread order
            oracle.assert_matches(ctx, state)
    assert_compared(kernels_behind_numpy)
