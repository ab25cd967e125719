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
  table[rp, pos] a per-token table's entry, or from a block table with block size B:
                 block b = table[rp, pos // B], slot b * B + pos % B; the null block 0
                 gives slot 0 (padding) at every offset; a slot past int64 gives the
                 out-of-table marker. B = 1 is the per-token table.
  out of table   kvcanary extension: a table read outside the table yields the marker
                 PLAN_SLOT_OUT_OF_TABLE, which verify and write report as out of range
"""

from __future__ import annotations

import numpy as np

from ...format.consts import EXPECTED_TOKEN_UNKNOWN, PLAN_SLOT_OUT_OF_TABLE, REQ_POOL_IDX_PADDING
from ...format.errors import CanaryError
from ...format.rules import window_start

# Verify entries per step when an overflowed plan's entries are checked against the LUT.
_CHECK_ENTRIES = 1 << 16


def table_slots(table: np.ndarray, rows: np.ndarray, positions: np.ndarray,
                block_size: int = 1) -> np.ndarray:
    """The slot of each (row, position) as int64; reads outside the table give the marker."""
    if block_size == 1:
        return table_entries(table, rows, positions)
    blocks = table_entries(table, rows, positions // block_size)
    return block_slots(blocks, positions % block_size, block_size)


def table_entries(table: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """``table[rows, cols]`` as int64; reads outside the table give the marker."""
    if rows.size and 0 <= int(rows.min()) and int(rows.max()) < table.shape[0] \
            and 0 <= int(cols.min()) and int(cols.max()) < table.shape[1]:
        return table[rows, cols].astype(np.int64, copy=False)   # every read inside (usual)
    inside = ((rows >= 0) & (rows < table.shape[0]) & (cols >= 0) & (cols < table.shape[1]))
    result = np.full(rows.shape, PLAN_SLOT_OUT_OF_TABLE, dtype=np.int64)
    result[inside] = table[rows[inside], cols[inside]]
    return result


def block_slots(blocks: np.ndarray, offsets: np.ndarray, block_size: int) -> np.ndarray:
    """Slot ``block * block_size + offset``; the null block 0 gives padding slot 0, the
    marker stays the marker, and so does a block whose slots do not fit int64."""
    fits = (blocks <= (PLAN_SLOT_OUT_OF_TABLE - (block_size - 1)) // block_size) \
        & (blocks >= -((1 << 63) // block_size))
    slots = np.where(fits, blocks, 0) * block_size + offsets
    slots[~fits] = PLAN_SLOT_OUT_OF_TABLE
    slots[blocks == 0] = 0
    return slots


def paged_entries(block_table, block_size, row, start, verify_len, position) -> tuple:
    """Slots and predecessors of the verify entries from a block table, a block at a time:
    a row's entries are the consecutive positions ``[start, start + verify_len)``, so each
    block is read once, and each predecessor is the slot of the entry before it (the row's
    first entry reads its own)."""
    nonempty = (verify_len > 0).nonzero()[0]
    first, count, table_row = start[nonempty], verify_len[nonempty], row[nonempty]
    first_block = first // block_size
    blocks_per_row = (first + count - 1) // block_size - first_block + 1
    block_row = table_row.repeat(blocks_per_row)
    row_offsets = blocks_per_row.cumsum() - blocks_per_row
    block_index = np.repeat(first_block - row_offsets, blocks_per_row) + np.arange(
        int(blocks_per_row.sum()))
    base = block_slots(table_entries(block_table, block_row, block_index), 0, block_size)
    begin = block_index * block_size
    entries_per_block = (np.minimum(np.repeat(first + count, blocks_per_row), begin + block_size)
                         - np.maximum(np.repeat(first, blocks_per_row), begin))
    expanded = base.repeat(entries_per_block)
    slot = expanded + position % block_size
    special = (base == 0) | (base == PLAN_SLOT_OUT_OF_TABLE)   # the null block, the marker
    if special.any():
        keep = np.repeat(special, entries_per_block)
        slot[keep] = expanded[keep]
    heads = count.cumsum() - count
    head_prev = np.full(heads.shape, -1, dtype=np.int64)
    has_prev = first > 0
    head_prev[has_prev] = table_slots(block_table, table_row[has_prev], first[has_prev] - 1,
                                      block_size)
    prev = np.empty_like(slot)
    prev[1:] = slot[:-1]
    prev[heads] = head_prev
    return slot, prev


def token_prev(table, row, start, verify_len, offsets, slot):
    """The predecessor slots of the verify entries from a per-token table without a second
    gather: a row's entries are the consecutive positions ``[start, start + verify_len)``,
    so each predecessor is the slot of the entry before it, but for the row's first entry
    (read from the table; -1 at position 0). None where a row's positions pass int64 (they
    wrap, and are no longer consecutive): the caller reads every predecessor then."""
    nonempty = (verify_len > 0).nonzero()[0]
    first = start[nonempty]
    if nonempty.size and int(first.max()) + int(verify_len.max()) > _INT64_MAX:
        return None
    prev = np.empty_like(slot)
    prev[1:] = slot[:-1]
    head_prev = np.full(nonempty.shape, -1, dtype=np.int64)
    has_prev = first > 0
    head_prev[has_prev] = table_slots(table, row[nonempty][has_prev], first[has_prev] - 1)
    prev[offsets[nonempty]] = head_prev
    return prev


_INT64_MAX = (1 << 63) - 1


def check_translatable(lut, *columns: np.ndarray) -> None:
    """Upstream's error for the first slot outside the SWA LUT, in upstream's order: entry
    by entry, and inside an entry the columns in the order given."""
    if lut is None:
        return
    lut_len = lut.shape[0]
    beyond = np.stack([(c >= lut_len) & (c != PLAN_SLOT_OUT_OF_TABLE) for c in columns], axis=-1)
    first = np.flatnonzero(beyond.ravel())
    if first.size:
        entry, column = divmod(int(first[0]), len(columns))
        raise CanaryError(
            f"SWA slot {int(columns[column][entry])} is outside "
            f"full_to_swa_index_mapping length {lut_len}", key="full_to_swa_index_mapping"
        )


def translate(slots: np.ndarray, lut) -> np.ndarray:
    """SWA translation; negatives and the out-of-table marker pass through unchanged."""
    check_translatable(lut, slots)
    return lookup(slots, lut)


def lookup(slots: np.ndarray, lut) -> np.ndarray:
    """SWA translation of slots already checked against the LUT's length."""
    if lut is None:
        return slots
    inside = (slots >= 0) & (slots != PLAN_SLOT_OUT_OF_TABLE)
    result = slots.copy()
    result[inside] = lut[slots[inside]]
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


def verify_entries(table, block_size, lut, row, start, verify_len, total, pool, valid_lens,
                   offset) -> tuple:
    """Slot, expected position, predecessor slot and expected token of every entry."""
    batch_row = np.arange(row.shape[0]).repeat(verify_len)
    offsets = verify_len.cumsum() - verify_len
    position = start[batch_row] + (np.arange(total) - offsets[batch_row])
    table_row = row[batch_row]
    if block_size == 1:
        slot = table_slots(table, table_row, position)
        prev = token_prev(table, row, start, verify_len, offsets, slot)
        if prev is None:
            prev = np.full(total, -1, dtype=np.int64)
            has_prev = position > 0
            prev[has_prev] = table_slots(table, table_row[has_prev], position[has_prev] - 1)
    else:
        slot, prev = paged_entries(table, block_size, row, start, verify_len, position)
    check_translatable(lut, slot, prev)  # an entry's slot, then its predecessor
    return (lookup(slot, lut), position, lookup(prev, lut),
            expected_tokens(pool, valid_lens, batch_row, table_row, position, offset))


def check_overflowed_entries(table, block_size, lut, row, start, prefix_lens, active) -> None:
    """Upstream gathers every verify entry even when the plan overflows, so a slot outside
    the SWA LUT raises there too: check them, a few rows at a time, in upstream's order.
    Only the table's own positions are read (a position past it is out of table, which
    never raises); a row whose window starts past the table still has its predecessor."""
    if lut is None:
        return
    table_positions = table.shape[1] * block_size
    end = np.minimum(prefix_lens, table_positions)
    length = np.where(active & (prefix_lens > start), np.maximum(1, end - start), 0)
    rows = np.flatnonzero(length)
    entries_before = np.concatenate(([0], np.cumsum(length[rows])))
    begin = 0
    while begin < rows.size:
        stop = max(begin + 1, int(np.searchsorted(
            entries_before, entries_before[begin] + _CHECK_ENTRIES, side="right")) - 1)
        chunk = rows[begin:stop]
        verify_entries(table, block_size, lut, row[chunk], start[chunk], length[chunk],
                       int(length[chunk].sum()), None, None, 0)
        begin = stop


def plan_reference(*, req_pool_indices, prefix_lens, extend_seq_lens, req_to_token,
                   verify_plan, write_plan, swa_window_size=0, full_to_swa_index_mapping=None,
                   req_to_verify_expected_tokens=None,
                   req_to_verify_expected_tokens_valid_lens=None,
                   kv_token_id_vs_position_offset=0, block_size=1) -> None:
    """``req_to_token`` is the slot table: per-token, or a block table when ``block_size``
    is above 1 (a block table with block size 1 is a per-token table)."""
    lut = full_to_swa_index_mapping
    bs = req_pool_indices.shape[0]
    row = req_pool_indices
    active = row != REQ_POOL_IDX_PADDING
    start = window_start(prefix_lens, swa_window_size)
    capacity = verify_plan.verify_capacity
    # Clamp each length to capacity + 1 first: the sum then cannot overflow int64 and
    # still exceeds the capacity whenever the true sum does.
    verify_len = np.where(active, np.minimum(np.maximum(prefix_lens - start, 0), capacity + 1),
                          0)   # np.clip, without its costly checks of the bounds' types
    total = int(verify_len.sum())

    # Every translation (the step that can raise) runs before any output changes, so a
    # call that raises leaves both plans as they were.
    if total > capacity:
        entries = None
        check_overflowed_entries(req_to_token, block_size, lut, row, start, prefix_lens, active)
    else:
        entries = verify_entries(
            req_to_token, block_size, lut, row, start, verify_len, total,
            req_to_verify_expected_tokens, req_to_verify_expected_tokens_valid_lens,
            kv_token_id_vs_position_offset)
    seeded = (active & (prefix_lens > 0) & (extend_seq_lens > 0)).nonzero()[0]
    seeds = np.full(bs, -1, dtype=np.int64)
    seeds[seeded] = translate(
        table_slots(req_to_token, row[seeded], prefix_lens[seeded] - 1, block_size), lut)

    if entries is None:
        verify_plan.verify_num_valid[0] = capacity
        verify_plan.enable[0] = 0
    else:
        verify_plan.verify_num_valid[0] = total
        verify_plan.enable[0] = 1
        (verify_plan.verify_slot_indices[:total], verify_plan.verify_expected_positions[:total],
         verify_plan.verify_prev_slot_indices[:total],
         verify_plan.verify_expected_tokens[:total]) = entries

    write_len = np.where(active, np.maximum(0, extend_seq_lens), 0)
    write_plan.write_offsets[0] = 0
    write_plan.write_offsets[1:bs + 1] = write_len.cumsum()
    write_plan.write_offsets[bs + 1:] = 0
    write_plan.write_seed_slot_indices[:bs] = seeds
    write_plan.write_num_valid_reqs[0] = bs
