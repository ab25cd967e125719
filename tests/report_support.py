"""Dumps with corruption planted where the report's tests know it: which request, which
positions, which slot is mapped twice."""

from __future__ import annotations

import numpy as np

import kvcanary as kc
from kvcanary.dump import save

# Per-token dump: 4 live requests of these lengths (batch index 1 is not live), slots shuffled.
LENGTHS = (64, 0, 40, 64, 64)
LIVE_ROWS = (1, 0, 3, 4, 5)          # req_pool_indices: 0 is the padding row (not live)
FLIPPED = (3, range(32, 48))          # batch index 3: stored position flipped at 32..47
# Batch index 4's position 5 is remapped to the slot batch index 0 holds at position 9.
REMAPPED = ((4, 5), (0, 9))
WIDTH = 64


def write_through_plan(table: np.ndarray, rows: np.ndarray, lens: np.ndarray,
                       num_slots: int) -> np.ndarray:
    """The canary after prefilling ``lens`` tokens of each row of ``table`` (req_to_token)."""
    canary = np.zeros((num_slots, kc.CANARY_SLOT_BYTES), np.uint8)
    context = kc.CanaryContext(canary, kernel_kind=kc.LaunchTag.TAIL_K_FULL,
                               violation_log=kc.ViolationLog.allocate(1),
                               slot_run_counter=np.zeros(1, np.int64),
                               kernel_run_counter=np.zeros(1, np.int64))
    live = rows != 0
    rows, lens = rows[live], lens[live]
    write_plan = kc.WritePlan.allocate(rows.size)
    kc.plan(req_pool_indices=rows, prefix_lens=np.zeros(rows.size, np.int64),
            extend_seq_lens=lens, req_to_token=table, verify_plan=kc.VerifyPlan.allocate(1),
            write_plan=write_plan)
    positions = np.concatenate([np.arange(n) for n in lens])
    slots = np.concatenate([table[r, :n] for r, n in zip(rows, lens)])
    kc.write(context, write_plan, input_ids=positions * 3 + 7, positions=positions,
             out_cache_loc=slots.astype(np.int64))
    return canary


def per_token_arrays(faults: bool = True) -> dict:
    """The known per-token dump's arrays (see the constants above; ``faults=False``: the
    same workload intact)."""
    rows, lens = np.array(LIVE_ROWS), np.array(LENGTHS)
    num_slots = int(lens.sum()) + 1
    table = np.zeros((max(LIVE_ROWS) + 1, WIDTH), np.int32)
    slots = np.random.default_rng(1).permutation(np.arange(1, num_slots))
    at = 0
    for row, n in zip(rows, lens):
        if row:
            table[row, :n] = slots[at:at + n]
            at += n
    canary = write_through_plan(table, rows, lens, num_slots)
    if not faults:
        return dict(canary=canary, req_to_token=table, req_pool_indices=rows, seq_lens=lens)
    batch, positions = FLIPPED
    canary.view(np.int64)[table[rows[batch], list(positions)], 1] ^= 1
    (b, p), (b0, p0) = REMAPPED
    table[rows[b], p] = table[rows[b0], p0]
    return dict(canary=canary, req_to_token=table, req_pool_indices=rows, seq_lens=lens)


def twice_slot(arrays: dict) -> int:
    (b0, p0) = REMAPPED[1]
    return int(arrays["req_to_token"][arrays["req_pool_indices"][b0], p0])


def flipped_slots(arrays: dict) -> set:
    batch, positions = FLIPPED
    return {int(s) for s in arrays["req_to_token"][arrays["req_pool_indices"][batch],
                                                    list(positions)]}


BLOCK = 16
PAGED_LENGTHS = (64, 48)
PAGED_BAD = (1, 20)   # batch index 1, position 20 (block-table entry 1): stored position flipped


def paged_arrays() -> dict:
    """Two live requests on a block table of 16-slot blocks; one record corrupt."""
    rows, lens = np.array([1, 2]), np.array(PAGED_LENGTHS)
    blocks_per_row = -(-max(PAGED_LENGTHS) // BLOCK)
    block_ids = np.random.default_rng(2).permutation(np.arange(1, 2 * blocks_per_row + 1))
    block_table = np.zeros((3, blocks_per_row), np.int32)
    block_table[1:] = block_ids.reshape(2, blocks_per_row)
    positions = np.arange(blocks_per_row * BLOCK)
    table = np.ascontiguousarray(block_table[:, positions // BLOCK] * BLOCK + positions % BLOCK,
                                 dtype=np.int32)
    table[0] = 0
    num_slots = (2 * blocks_per_row + 1) * BLOCK
    canary = write_through_plan(table, rows, lens, num_slots)
    b, p = PAGED_BAD
    canary.view(np.int64)[table[rows[b], p], 1] ^= 1
    return dict(canary=canary, block_table=block_table, block_size=np.int64(BLOCK),
                req_pool_indices=rows, seq_lens=lens)


def paged_bad_block(arrays: dict) -> int:
    b, p = PAGED_BAD
    return int(arrays["block_table"][arrays["req_pool_indices"][b], p // BLOCK])


def save_dump(path, arrays: dict) -> str:
    return save(str(path), **arrays)


def sweep_only_arrays() -> dict:
    """No live request; batch index 0's prefix is checked as sweep entries, one corrupt."""
    arrays = per_token_arrays(faults=False)
    row = int(arrays["req_pool_indices"][0])
    slots = arrays["req_to_token"][row, :LENGTHS[0]].astype(np.int64)
    arrays["canary"].view(np.int64)[slots[3], 1] ^= 1
    arrays.update(req_pool_indices=np.zeros(len(LENGTHS), np.int64),
                  sweep_slot_indices=slots, sweep_positions=np.arange(slots.size),
                  sweep_prev_slot_indices=np.concatenate([[-1], slots[:-1]]))
    return arrays
