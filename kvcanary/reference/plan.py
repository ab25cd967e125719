"""Plan (docs/format.md §7): turn a batch into a VerifyPlan and a WritePlan.

Per batch row r with table row rp, prefix P and extend E, the rules:
  active         rp != 0 (row 0 is the padding row)
  window start   max(0, P - window) with a sliding window, else 0
  verify entries positions [window_start, P): slot T(table[rp, pos]), expected position
                 pos, predecessor T(table[rp, pos-1]) or -1 at position 0, expected token
                 from the token pool at pos + offset when inside the valid length, else -1
  overflow       more entries than capacity: num_valid = capacity, enable = 0, nothing
                 scattered
  write          offsets = exclusive prefix sum of E over active rows, seed
                 T(table[rp, P-1]) when P > 0 and E > 0, else -1; num_valid_reqs = bs
  T              the SWA LUT when given (negative slots pass through)
  out of table   kvcanary extension: a table read outside the table yields the marker
                 PLAN_SLOT_OUT_OF_TABLE, which verify and write report as out of range
"""

from __future__ import annotations

import numpy as np

from ..consts import EXPECTED_TOKEN_UNKNOWN, PLAN_SLOT_OUT_OF_TABLE, REQ_POOL_IDX_PADDING


def window_start(prefix_lens: np.ndarray, swa_window_size: int) -> np.ndarray:
    if swa_window_size > 0:
        return np.maximum(0, prefix_lens - swa_window_size)
    return np.zeros_like(prefix_lens)


def table_slots(req_to_token: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """``req_to_token[rows, cols]`` as int64; reads outside the table give the marker."""
    inside = ((rows >= 0) & (rows < req_to_token.shape[0])
              & (cols >= 0) & (cols < req_to_token.shape[1]))
    result = np.full(rows.shape, PLAN_SLOT_OUT_OF_TABLE, dtype=np.int64)
    result[inside] = req_to_token[rows[inside], cols[inside]]
    return result


def translate(slots: np.ndarray, lut) -> np.ndarray:
    """SWA translation; negatives and the out-of-table marker pass through unchanged."""
    if lut is None:
        return slots
    lut_len = lut.shape[0]
    lookup = (slots >= 0) & (slots != PLAN_SLOT_OUT_OF_TABLE)
    beyond = lookup & (slots >= lut_len)
    if beyond.any():
        raise ValueError(
            f"kv-canary: SWA slot {int(slots[beyond][0])} is outside full_to_swa_index_mapping "
            f"length {lut_len}"
        )
    result = slots.copy()
    result[lookup] = lut[slots[lookup]]
    return result


def expected_tokens(pool, valid_lens, batch_row, table_row, position, offset) -> np.ndarray:
    """Expected token per entry from the token pool (int32 sign-extended), -1 outside
    ``[0, valid_len)`` or outside the pool."""
    result = np.full(position.shape, EXPECTED_TOKEN_UNKNOWN, dtype=np.int64)
    if pool is None:
        return result
    column = position + offset
    known = ((column >= 0) & (column < valid_lens[batch_row]) & (column < pool.shape[1])
             & (table_row >= 0) & (table_row < pool.shape[0]))
    result[known] = pool[table_row[known], column[known]]
    return result


def plan_reference(*, req_pool_indices, prefix_lens, extend_seq_lens, req_to_token,
                   verify_plan, write_plan, swa_window_size=0, full_to_swa_index_mapping=None,
                   req_to_verify_expected_tokens=None,
                   req_to_verify_expected_tokens_valid_lens=None,
                   kv_token_id_vs_position_offset=0) -> None:
    lut = full_to_swa_index_mapping
    bs = req_pool_indices.shape[0]
    row = req_pool_indices
    active = row != REQ_POOL_IDX_PADDING
    start = window_start(prefix_lens, swa_window_size)
    capacity = verify_plan.verify_capacity
    # Clamp each length to capacity + 1 first: the sum then cannot overflow int64 and
    # still exceeds the capacity whenever the true sum does.
    verify_len = np.where(active, np.clip(prefix_lens - start, 0, capacity + 1), 0)
    total = int(verify_len.sum())

    if total > capacity:
        verify_plan.verify_num_valid[0] = capacity
        verify_plan.enable[0] = 0
    else:
        verify_plan.verify_num_valid[0] = total
        verify_plan.enable[0] = 1
        batch_row = np.repeat(np.arange(bs), verify_len)
        offsets = np.cumsum(verify_len) - verify_len
        position = start[batch_row] + (np.arange(total) - offsets[batch_row])
        table_row = row[batch_row]
        slot = translate(table_slots(req_to_token, table_row, position), lut)
        prev = np.full(total, -1, dtype=np.int64)
        has_prev = position > 0
        prev[has_prev] = translate(
            table_slots(req_to_token, table_row[has_prev], position[has_prev] - 1), lut)
        verify_plan.verify_slot_indices[:total] = slot
        verify_plan.verify_expected_positions[:total] = position
        verify_plan.verify_prev_slot_indices[:total] = prev
        verify_plan.verify_expected_tokens[:total] = expected_tokens(
            req_to_verify_expected_tokens, req_to_verify_expected_tokens_valid_lens,
            batch_row, table_row, position, kv_token_id_vs_position_offset)

    write_len = np.where(active, np.maximum(0, extend_seq_lens), 0)
    write_plan.write_offsets[0] = 0
    write_plan.write_offsets[1:bs + 1] = np.cumsum(write_len)
    write_plan.write_offsets[bs + 1:] = 0
    seeded = np.flatnonzero(active & (prefix_lens > 0) & (extend_seq_lens > 0))
    seeds = np.full(bs, -1, dtype=np.int64)
    seeds[seeded] = translate(
        table_slots(req_to_token, row[seeded], prefix_lens[seeded] - 1), lut)
    write_plan.write_seed_slot_indices[:bs] = seeds
    write_plan.write_num_valid_reqs[0] = bs
