// Write (docs/format.md §8): stamp each new token's record and advance its request's chain.
// Same rules as kvcanary/reference/write.py, one thread per request (the chain is serial):
//   seed link      H0 without a seed (seed < 0), else link(seed record)
//   skip           out_cache_loc < 0: no store, no chain advance, not counted
//   input assert   token / position against the expected inputs (when given)
//   position chain with a seed and the flag set: each position is the previous + 1
//   store          (token, position, running hash, real-KV hash); then the running hash
//                  advances over the actual token and position
//   out of range   kvcanary extension: a slot or seed outside the buffer, or a request whose
//                  range leaves the token arrays, is reported as SLOT_OUT_OF_RANGE, never touched
#include "kvc_realkv.cuh"

namespace kvc {

struct WriteInputs {
  const int64_t* input_ids;
  const int64_t* positions;
  const int64_t* out_cache_loc;
  const int64_t* expected_input_tokens;     // null: input assert off
  const int64_t* expected_input_positions;  // null together with the tokens
  int64_t num_tokens;
};

// Returns how many records the request stored.
KVC_DEVICE int64_t write_request(uint8_t* canary_buf, int64_t stride, int64_t num_slots,
                                 int64_t start, int64_t end, int64_t seed,
                                 const WriteInputs& in, bool position_assert_flag,
                                 int64_t kernel_kind, const Ring& ring,
                                 const RealKvSources& sources) {
  const int64_t oor = bit(FailReason::kSlotOutOfRange);
  if (start < 0 || end > in.num_tokens) {  // the request's range leaves the token arrays
    append_violation(ring, kernel_kind, -1, 0, 0, 0, 0, start < 0 ? start : end, oor);
    return 0;
  }
  uint64_t running = chain_head();
  bool do_pos_assert = false;
  int64_t running_pos = 0;
  if (seed >= num_slots) {
    append_violation(ring, kernel_kind, seed, 0, 0, 0, 0, seed, oor);
  } else if (seed >= 0) {
    const Record s = load_record(canary_buf, stride, seed);
    running = link(s);
    do_pos_assert = position_assert_flag;
    running_pos = s.position;
  }
  int64_t written = 0;
  for (int64_t i = start; i < end; ++i) {
    const int64_t slot = in.out_cache_loc[i];
    if (slot < 0) continue;  // skipped entirely
    const int64_t tok = in.input_ids[i];
    const int64_t pos = in.positions[i];
    const int64_t prev_hash = static_cast<int64_t>(running);
    if (in.expected_input_tokens != nullptr) {
      const int64_t et = in.expected_input_tokens[i];
      const int64_t ep = in.expected_input_positions[i];
      int64_t bits = 0;
      if (tok != et) bits |= bit(FailReason::kWriteTokenMismatch);
      if (pos != ep) bits |= bit(FailReason::kWritePositionMismatch);
      if (bits != 0) append_violation(ring, kernel_kind, slot, pos, tok, et, prev_hash, ep, bits);
    }
    if (do_pos_assert) {
      const int64_t expected = wrap_add(running_pos, 1);  // wraps at int64 max, like numpy
      if (pos != expected) {
        append_violation(ring, kernel_kind, slot, pos, tok, tok, prev_hash, expected,
                         bit(FailReason::kWritePositionMismatch));
      }
      running_pos = pos;  // the actual position: one bad token is one violation
    }
    if (slot >= num_slots) {
      append_violation(ring, kernel_kind, slot, pos, tok, tok, prev_hash, slot, oor);
    } else {
      Record r;
      r.token = tok;
      r.position = pos;
      r.prev_hash = prev_hash;
      r.real_kv_hash = static_cast<int64_t>(real_kv_hash(sources, slot));
      store_record(canary_buf, stride, slot, r);
      ++written;
    }
    // Always over the actual token and position, so a downstream verify does not cascade.
    running = mix3(running, static_cast<uint64_t>(tok), static_cast<uint64_t>(pos));
  }
  return written;
}

}  // namespace kvc

extern "C" __global__ void kvc_write(
    uint8_t* __restrict__ canary_buf, int64_t num_slots, int64_t slot_stride_bytes,
    const int64_t* __restrict__ write_offsets, const int64_t* __restrict__ write_seed_slot_indices,
    const int32_t* __restrict__ write_num_valid_reqs, int64_t write_req_capacity,
    const int64_t* __restrict__ input_ids, const int64_t* __restrict__ positions,
    const int64_t* __restrict__ out_cache_loc, int64_t num_tokens,
    const int64_t* __restrict__ expected_input_tokens,
    const int64_t* __restrict__ expected_input_positions, int64_t kernel_kind,
    int64_t* __restrict__ violation_ring, int64_t ring_capacity, int32_t* violation_write_index,
    int64_t* __restrict__ slot_run_counter, int64_t* __restrict__ kernel_run_counter,
    const int32_t* __restrict__ enable_chain_position_assert, kvc::RealKvSources sources) {
  using namespace kvc;
  const int64_t r = global_thread();
  if (r == 0) add_counter(kernel_run_counter, 1);  // every launch, even an empty one
  int64_t active = write_num_valid_reqs[0];
  if (active > write_req_capacity) active = write_req_capacity;
  // The reference's early return: nothing active, or no entries in total.
  if (active <= 0 || write_offsets[active] <= 0) return;
  if (r >= active) return;
  const int64_t start = write_offsets[r];
  const int64_t end = write_offsets[r + 1];
  if (end <= start) return;  // no entries: no counter contribution
  const WriteInputs in{input_ids, positions, out_cache_loc, expected_input_tokens,
                       expected_input_positions, num_tokens};
  const Ring ring{violation_ring, ring_capacity, violation_write_index};
  const int64_t written = write_request(
      canary_buf, slot_stride_bytes, num_slots, start, end, write_seed_slot_indices[r], in,
      enable_chain_position_assert[0] != 0, kernel_kind, ring, sources);
  if (written != 0) add_counter(slot_run_counter, written);
}
