// SPDX-License-Identifier: Apache-2.0
// Plan (docs/format.md §7): turn a batch into a VerifyPlan and a WritePlan.
// Three launches (rows, offsets, entries). Same rules as kvcanary/reference/plan.py,
// per batch row r (table row rp, prefix P, extend E):
//   active         rp != 0 (row 0 is the padding row)
//   window start   max(0, P - window) with a sliding window, else 0
//   verify entries positions [window_start, P): slot T(table[rp, pos]), expected position
//                  pos, predecessor T(table[rp, pos-1]) or -1 at position 0, expected token
//                  from the token pool at pos + offset when inside the valid length, else -1
//   overflow       more entries than capacity: num_valid = capacity, enable = 0, nothing
//                  scattered
//   write          offsets = exclusive prefix sum of E over active rows, seed
//                  T(table[rp, P-1]) when P > 0 and E > 0, else -1; num_valid_reqs = bs
//   T              the SWA LUT when given (negative slots pass through)
//   table[rp, pos] a per-token table's entry, or from a block table with block size B:
//                  block b = table[rp, pos / B], slot b * B + pos % B; the null block 0
//                  gives slot 0 (padding) at every offset; a slot past int64 gives the
//                  out-of-table marker. B = 1 is the per-token table.
//   out of table   a table read outside the table yields PLAN_SLOT_OUT_OF_TABLE; so does a
//                  LUT index past the LUT (the reference raises there; a kernel cannot)
// No source-count bound is needed here.
#include "kvc_common.cuh"

namespace kvc {

// A row-major, contiguous int32 or int64 table: req_to_token (with block_size > 1 a block
// table, one entry per block_size positions) or the expected-token pool (block_size 1).
// Each index type has its own entry points (kvc_plan_rows_i32, kvc_plan_entries_i64_i32, ...).
template <class Index>
struct Table {
  const Index* data;
  int64_t rows;
  int64_t cols;
  int64_t block_size;
};

template <class Index>
KVC_DEVICE bool table_inside(const Table<Index>& t, int64_t row, int64_t col) {
  return t.data != nullptr && row >= 0 && row < t.rows && col >= 0 && col < t.cols;
}

// Element (row, col) sign-extended to int64; the caller checked table_inside.
template <class Index>
KVC_DEVICE int64_t table_at(const Table<Index>& t, int64_t row, int64_t col) {
  return static_cast<int64_t>(t.data[row * t.cols + col]);
}

// Slot `offset` of a block (block_size >= 2): the null block 0 is padding slot 0; a block
// whose slots do not fit int64 gives the out-of-table marker.
KVC_DEVICE int64_t block_slot(int64_t block, int64_t offset, int64_t block_size) {
  if (block == 0) return 0;
  const int64_t highest = (kPlanSlotOutOfTable - (block_size - 1)) / block_size;
  const int64_t lowest =
      -static_cast<int64_t>((static_cast<uint64_t>(1) << 63) / static_cast<uint64_t>(block_size));
  if (block > highest || block < lowest) return kPlanSlotOutOfTable;
  return block * block_size + offset;
}

// The slot of (row, pos), or the out-of-table marker.
template <class Index>
KVC_DEVICE int64_t table_slot(const Table<Index>& table, int64_t row, int64_t pos) {
  if (table.block_size == 1) {
    return table_inside(table, row, pos) ? table_at(table, row, pos) : kPlanSlotOutOfTable;
  }
  if (table.block_size < 1 || pos < 0) return kPlanSlotOutOfTable;
  const int64_t col = pos / table.block_size;
  if (!table_inside(table, row, col)) return kPlanSlotOutOfTable;
  return block_slot(table_at(table, row, col), pos % table.block_size, table.block_size);
}

// SWA translation: negatives and the marker pass through; past the LUT becomes the marker.
KVC_DEVICE int64_t translate(int64_t slot, const int64_t* lut, int64_t lut_len) {
  if (lut == nullptr || slot < 0 || slot == kPlanSlotOutOfTable) return slot;
  if (slot >= lut_len) return kPlanSlotOutOfTable;
  return lut[slot];
}

KVC_DEVICE int64_t window_start(int64_t prefix_len, int64_t swa_window_size) {
  if (swa_window_size <= 0) return 0;
  const int64_t start = wrap_sub(prefix_len, swa_window_size);
  return start > 0 ? start : 0;
}

// Entries of one row, clamped to capacity + 1 so the sum cannot overflow and still
// exceeds the capacity whenever the true sum does.
KVC_DEVICE int64_t verify_len(int64_t rp, int64_t prefix_len, int64_t swa_window_size,
                              int64_t capacity) {
  if (rp == kReqPoolIdxPadding) return 0;
  int64_t n = wrap_sub(prefix_len, window_start(prefix_len, swa_window_size));
  if (n < 0) n = 0;
  if (n > capacity + 1) n = capacity + 1;
  return n;
}

// Per row, in parallel (grid-stride over max(bs, write_req_capacity + 1)): the row's
// verify length into verify_offsets_scratch[r], its write length into write_offsets[r + 1]
// (both turned into prefix sums by kvc_plan_offsets), its seed, and the zeroed tail
// write_offsets[bs + 1 ..]. No serial dependency, so the table gathers run in parallel.
template <class TableIndex>
KVC_DEVICE void plan_rows(
    const int64_t* __restrict__ req_pool_indices, const int64_t* __restrict__ prefix_lens,
    const int64_t* __restrict__ extend_seq_lens, int64_t bs,
    const TableIndex* __restrict__ req_to_token, int64_t table_rows, int64_t table_cols,
    int64_t block_size, const int64_t* __restrict__ full_to_swa_index_mapping, int64_t lut_len,
    int64_t swa_window_size, int64_t* __restrict__ verify_offsets_scratch,
    int64_t verify_capacity, int64_t* __restrict__ write_offsets, int64_t write_req_capacity,
    int64_t* __restrict__ write_seed_slot_indices) {
  const Table<TableIndex> table{req_to_token, table_rows, table_cols, block_size};
  const int64_t work = bs > write_req_capacity + 1 ? bs : write_req_capacity + 1;
  for (int64_t t = global_thread(); t < work; t += grid_threads()) {
    if (t == 0) write_offsets[0] = 0;
    if (t > bs && t <= write_req_capacity) write_offsets[t] = 0;  // stale tail of a bigger batch
    if (t >= bs) continue;
    const int64_t rp = req_pool_indices[t];
    const int64_t prefix = prefix_lens[t];
    const int64_t extend = extend_seq_lens[t];
    const bool active = rp != kReqPoolIdxPadding;
    verify_offsets_scratch[t] = verify_len(rp, prefix, swa_window_size, verify_capacity);
    write_offsets[t + 1] = active && extend > 0 ? extend : 0;
    int64_t seed = -1;
    if (active && prefix > 0 && extend > 0) {
      seed = translate(table_slot(table, rp, prefix - 1), full_to_swa_index_mapping, lut_len);
    }
    write_seed_slot_indices[t] = seed;
  }
}

// Grid-stride over the flat verify entries: find the owning row by binary search on the
// exclusive offsets, then gather slot, predecessor, position and expected token.
template <class TableIndex, class PoolIndex>
KVC_DEVICE void plan_entries(
    const int64_t* __restrict__ req_pool_indices, const int64_t* __restrict__ prefix_lens, int64_t bs,
    const TableIndex* __restrict__ req_to_token, int64_t table_rows, int64_t table_cols,
    int64_t block_size, const int64_t* __restrict__ full_to_swa_index_mapping, int64_t lut_len,
    int64_t swa_window_size, const PoolIndex* __restrict__ req_to_verify_expected_tokens,
    int64_t pool_rows, int64_t pool_cols,
    const int64_t* __restrict__ req_to_verify_expected_tokens_valid_lens,
    int64_t kv_token_id_vs_position_offset, const int64_t* __restrict__ verify_offsets_scratch,
    int64_t verify_capacity, int64_t* __restrict__ verify_slot_indices,
    int64_t* __restrict__ verify_expected_tokens, int64_t* __restrict__ verify_expected_positions,
    int64_t* __restrict__ verify_prev_slot_indices) {
  if (bs <= 0) return;
  const int64_t total = verify_offsets_scratch[bs];
  if (total <= 0 || total > verify_capacity) return;  // overflow: nothing scattered
  const Table<TableIndex> table{req_to_token, table_rows, table_cols, block_size};
  const Table<PoolIndex> pool{req_to_verify_expected_tokens, pool_rows, pool_cols, 1};
  for (int64_t t = global_thread(); t < total; t += grid_threads()) {
    // Largest r with offsets[r] <= t (zero-length rows share their successor's offset).
    int64_t lo = 0, hi = bs - 1;
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo + 1) / 2;
      if (verify_offsets_scratch[mid] <= t) lo = mid; else hi = mid - 1;
    }
    const int64_t r = lo;
    const int64_t rp = req_pool_indices[r];
    const int64_t pos =
        wrap_add(window_start(prefix_lens[r], swa_window_size), t - verify_offsets_scratch[r]);
    verify_slot_indices[t] = translate(table_slot(table, rp, pos), full_to_swa_index_mapping, lut_len);
    verify_expected_positions[t] = pos;
    // A window head keeps its real predecessor: the chain runs over the whole prefix.
    verify_prev_slot_indices[t] =
        pos > 0 ? translate(table_slot(table, rp, pos - 1), full_to_swa_index_mapping, lut_len) : -1;
    int64_t expected = kExpectedTokenUnknown;
    const int64_t column = wrap_add(pos, kv_token_id_vs_position_offset);
    if (pool.data != nullptr && column < req_to_verify_expected_tokens_valid_lens[r] &&
        table_inside(pool, rp, column)) {
      expected = table_at(pool, rp, column);
    }
    verify_expected_tokens[t] = expected;
  }
}

}  // namespace kvc

// One thread turns the per-row lengths into prefix sums in place (exclusive verify
// offsets with the total at [bs]; inclusive write offsets after write_offsets[0] = 0),
// then applies the overflow rule. Only additions: the loads stream through the cache.
// Launched as 1 x 1 after kvc_plan_rows_*.
extern "C" __global__ void kvc_plan_offsets(int64_t bs, int64_t* __restrict__ verify_offsets_scratch,
                                            int64_t verify_capacity,
                                            int32_t* __restrict__ verify_num_valid,
                                            int32_t* __restrict__ enable,
                                            int64_t* __restrict__ write_offsets,
                                            int32_t* __restrict__ write_num_valid_reqs) {
  if (kvc::global_thread() != 0) return;
  int64_t verify_total = 0;
  uint64_t write_total = 0;  // unsigned: wraps like numpy's int64 cumsum
  for (int64_t r = 0; r < bs; ++r) {
    const int64_t len = verify_offsets_scratch[r];
    verify_offsets_scratch[r] = verify_total;
    verify_total += len;  // each length <= capacity + 1: cannot overflow
    write_total += static_cast<uint64_t>(write_offsets[r + 1]);
    write_offsets[r + 1] = static_cast<int64_t>(write_total);
  }
  verify_offsets_scratch[bs] = verify_total;
  if (verify_total > verify_capacity) {
    verify_num_valid[0] = static_cast<int32_t>(verify_capacity);
    enable[0] = 0;
  } else {
    verify_num_valid[0] = static_cast<int32_t>(verify_total);
    enable[0] = 1;
  }
  write_num_valid_reqs[0] = static_cast<int32_t>(bs);
}

// The named entry points of each index type (extern "C" names cannot be templates):
// kvc_plan_rows_<table> and kvc_plan_entries_<table>_<pool>, i32 or i64 each.
#define KVC_PLAN_ROWS(suffix, TableIndex)                                                         \
  extern "C" __global__ void kvc_plan_rows_##suffix(                                              \
      const int64_t* __restrict__ req_pool_indices, const int64_t* __restrict__ prefix_lens,      \
      const int64_t* __restrict__ extend_seq_lens, int64_t bs,                                    \
      const TableIndex* __restrict__ req_to_token, int64_t table_rows, int64_t table_cols,        \
      int64_t block_size, const int64_t* __restrict__ full_to_swa_index_mapping, int64_t lut_len, \
      int64_t swa_window_size, int64_t* __restrict__ verify_offsets_scratch,                      \
      int64_t verify_capacity, int64_t* __restrict__ write_offsets, int64_t write_req_capacity,   \
      int64_t* __restrict__ write_seed_slot_indices) {                                            \
    kvc::plan_rows<TableIndex>(req_pool_indices, prefix_lens, extend_seq_lens, bs, req_to_token, \
                               table_rows, table_cols, block_size, full_to_swa_index_mapping,     \
                               lut_len, swa_window_size, verify_offsets_scratch, verify_capacity, \
                               write_offsets, write_req_capacity, write_seed_slot_indices);       \
  }

#define KVC_PLAN_ENTRIES(suffix, TableIndex, PoolIndex)                                           \
  extern "C" __global__ void kvc_plan_entries_##suffix(                                           \
      const int64_t* __restrict__ req_pool_indices, const int64_t* __restrict__ prefix_lens,      \
      int64_t bs, const TableIndex* __restrict__ req_to_token, int64_t table_rows,                \
      int64_t table_cols, int64_t block_size,                                                     \
      const int64_t* __restrict__ full_to_swa_index_mapping, int64_t lut_len,                     \
      int64_t swa_window_size, const PoolIndex* __restrict__ req_to_verify_expected_tokens,       \
      int64_t pool_rows, int64_t pool_cols,                                                       \
      const int64_t* __restrict__ req_to_verify_expected_tokens_valid_lens,                       \
      int64_t kv_token_id_vs_position_offset, const int64_t* __restrict__ verify_offsets_scratch, \
      int64_t verify_capacity, int64_t* __restrict__ verify_slot_indices,                         \
      int64_t* __restrict__ verify_expected_tokens,                                               \
      int64_t* __restrict__ verify_expected_positions,                                            \
      int64_t* __restrict__ verify_prev_slot_indices) {                                           \
    kvc::plan_entries<TableIndex, PoolIndex>(                                                     \
        req_pool_indices, prefix_lens, bs, req_to_token, table_rows, table_cols, block_size,      \
        full_to_swa_index_mapping, lut_len, swa_window_size, req_to_verify_expected_tokens,       \
        pool_rows, pool_cols, req_to_verify_expected_tokens_valid_lens,                           \
        kv_token_id_vs_position_offset, verify_offsets_scratch, verify_capacity,                  \
        verify_slot_indices, verify_expected_tokens, verify_expected_positions,                   \
        verify_prev_slot_indices);                                                                \
  }

KVC_PLAN_ROWS(i32, int32_t)
KVC_PLAN_ROWS(i64, int64_t)
KVC_PLAN_ENTRIES(i32_i32, int32_t, int32_t)
KVC_PLAN_ENTRIES(i32_i64, int32_t, int64_t)
KVC_PLAN_ENTRIES(i64_i32, int64_t, int32_t)
KVC_PLAN_ENTRIES(i64_i64, int64_t, int64_t)

#undef KVC_PLAN_ROWS
#undef KVC_PLAN_ENTRIES
