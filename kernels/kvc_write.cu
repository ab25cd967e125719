// SPDX-License-Identifier: Apache-2.0
// Write (docs/format.md §8): stamp each new token's record and advance its request's chain.
// Same rules as kvcanary/reference/write.py, one thread per request (the chain is serial):
//   seed link      H0 without a seed (seed < 0), else link(seed record)
//   skip           out_cache_loc < 0: no store, no chain advance, not counted
//   input assert   token / position against the expected inputs (when given)
//   position chain with a seed and the flag set: each position is the previous + 1
//   store          (token, position, running hash, real-KV hash); then the running hash
//                  advances over the actual token and position
//   out of range   kvcanary extension: a slot or seed outside the buffer, or a request whose
//                  range leaves the token arrays, is reported as SLOT_OUT_OF_RANGE, never touched;
//                  so is a slot outside a real-KV source, stored with real-KV hash 0
//   conflict       writes of one launch sharing a slot: the last one in (request, entry) order
//                  keeps the slot; kvcanary extension: every other reports WRITE_SLOT_CONFLICT,
//                  except on padding slot 0 and with the context's extensions off
//
// Threads of a launch are not ordered, so the result must not depend on which runs first.
// Four launches, each one complete before the next starts:
//   kvc_write_seeds    reads every seed (link and position) into the plan's scratch and
//                      clears the claim word of every slot the launch writes
//   kvc_write_claims   every write claims its slot: atomicMax of its write id
//   kvc_write          the chain and the asserts; the claim holder stores token, position
//                      and prev_hash, every other writer of the slot reports the conflict
//   kvc_write_real_kv  every writer stores its slot's real-KV hash (the same value), which
//                      replaces the claim word
// The claim word is the record's real_kv_hash field: a seed read never needs it, and the
// last launch overwrites it.
//
// Chaining across requests (the context's chain_across_requests, bit 1 of kvc_write's
// report_conflicts word; bit 0 is the conflict report): a seed slot an earlier request of
// the launch writes links to the last such write, as if requests ran one after another.
// kvc_write's threads do not wait for each other: each recomputes the writer's running
// hash from the launch's inputs, following the writer's own seed the same way.
#include "kvc_realkv.cuh"

namespace kvc {

// Where one launch's writes are: the plan and the token arrays.
struct WriteBatch {
  const int64_t* offsets;
  const int32_t* num_valid_reqs;
  int64_t capacity;
  const int64_t* out_cache_loc;
  int64_t num_tokens;
};

// The requests a launch writes: none when the reference returns early (nothing active or
// no entries in total).
KVC_DEVICE int64_t active_requests(const WriteBatch& b) {
  int64_t active = b.num_valid_reqs[0];
  if (active > b.capacity) active = b.capacity;
  if (active <= 0 || b.offsets[active] <= 0) return 0;
  return active;
}

// Request r's token range; false when it writes nothing (past the active requests or empty).
KVC_DEVICE bool request_span(const WriteBatch& b, int64_t r, int64_t* start, int64_t* end) {
  if (r >= active_requests(b)) return false;
  *start = b.offsets[r];
  *end = b.offsets[r + 1];
  return *end > *start;
}

KVC_DEVICE bool span_inside(const WriteBatch& b, int64_t start, int64_t end) {
  return start >= 0 && end <= b.num_tokens;
}

// Calls write(i, slot) for each entry of request r whose slot lies inside the buffer, when
// the request writes at all (a range leaving the token arrays writes nothing).
template <class Write>
KVC_DEVICE void for_each_write(const WriteBatch& b, int64_t num_slots, int64_t r, Write write) {
  int64_t start, end;
  if (!request_span(b, r, &start, &end) || !span_inside(b, start, end)) return;
  for (int64_t i = start; i < end; ++i) {
    const int64_t slot = b.out_cache_loc[i];
    if (slot_in_range(slot, num_slots)) write(i, slot);
  }
}

// Unique per write and increasing in (request, entry) order: the largest one keeps a slot.
KVC_DEVICE unsigned long long write_id(const WriteBatch& b, int64_t r, int64_t i) {
  return static_cast<unsigned long long>(r) * static_cast<unsigned long long>(b.num_tokens) +
         static_cast<unsigned long long>(i) + 1ULL;
}

KVC_DEVICE int64_t* claim_word(uint8_t* canary_buf, int64_t stride, int64_t slot) {
  return reinterpret_cast<int64_t*>(canary_buf + slot * stride) + kCanaryFieldRealKvHash;
}

struct WriteInputs {
  const int64_t* input_ids;
  const int64_t* positions;
  const int64_t* expected_input_tokens;     // null: input assert off
  const int64_t* expected_input_positions;  // null together with the tokens
};

// The seed as read by kvc_write_seeds.
struct Seed {
  int64_t slot;
  int64_t link;
  int64_t position;
};

// Returns how many writes of the request landed inside the buffer.
KVC_DEVICE int64_t write_request(uint8_t* canary_buf, int64_t stride, int64_t num_slots,
                                 const WriteBatch& b, int64_t r, int64_t start, int64_t end,
                                 const Seed& seed, const WriteInputs& in,
                                 bool position_assert_flag, bool report_conflicts,
                                 const RealKvSources& sources, int64_t kernel_kind,
                                 const Ring& ring) {
  const int64_t oor = bit(FailReason::kSlotOutOfRange);
  uint64_t running = chain_head();
  bool do_pos_assert = false;
  int64_t running_pos = 0;
  if (seed.slot >= num_slots) {
    append_violation(ring, kernel_kind, seed.slot, 0, 0, 0, 0, seed.slot, oor);
  } else if (seed.slot >= 0) {
    running = static_cast<uint64_t>(seed.link);
    do_pos_assert = position_assert_flag;
    running_pos = seed.position;
  }
  int64_t written = 0;
  for (int64_t i = start; i < end; ++i) {
    const int64_t slot = b.out_cache_loc[i];
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
      if (!slot_in_sources(sources, slot)) {  // stored, with real-KV hash 0
        append_violation(ring, kernel_kind, slot, pos, tok, tok, prev_hash, slot, oor);
      }
      const unsigned long long claim =
          static_cast<unsigned long long>(*claim_word(canary_buf, stride, slot));
      if (claim == write_id(b, r, i)) {
        int64_t* f = reinterpret_cast<int64_t*>(canary_buf + slot * stride);
        f[kCanaryFieldToken] = tok;
        f[kCanaryFieldPosition] = pos;
        f[kCanaryFieldPrevHash] = prev_hash;
      } else if (report_conflicts && slot != kTokenToKvSlotPadding) {
        // a later write of this launch keeps the slot
        const int64_t keeper = static_cast<int64_t>((claim - 1ULL) %
                                                    static_cast<unsigned long long>(b.num_tokens));
        append_violation(ring, kernel_kind, slot, pos, tok, in.input_ids[keeper], prev_hash,
                         in.positions[keeper], bit(FailReason::kWriteSlotConflict));
      }
      ++written;
    }
    // Always over the actual token and position, so a downstream verify does not cascade.
    running = mix3(running, static_cast<uint64_t>(tok), static_cast<uint64_t>(pos));
  }
  return written;
}

// kvc_write's parameters, passed as one __grid_constant__ struct (the host packs it as
// kvcanary/backends/cuda/write_args.py's WRITE_ARGS_FIELDS; tests/kernels check the two agree).
struct WriteArgs {
  uint8_t* canary_buf;
  int64_t num_slots;
  int64_t slot_stride_bytes;
  const int64_t* write_offsets;
  const int64_t* write_seed_slot_indices;
  const int32_t* write_num_valid_reqs;
  int64_t write_req_capacity;
  const int64_t* input_ids;
  const int64_t* positions;
  const int64_t* out_cache_loc;
  int64_t num_tokens;
  const int64_t* expected_input_tokens;     // null: input assert off
  const int64_t* expected_input_positions;  // null together with the tokens
  int64_t kernel_kind;
  int64_t* violation_ring;
  int64_t ring_capacity;
  int32_t* violation_write_index;
  int64_t* slot_run_counter;
  int64_t* kernel_run_counter;
  const int32_t* enable_chain_position_assert;
  int32_t report_conflicts;  // flag bits: kReportConflicts, kChainAcrossRequests
  const int64_t* seed_links;
  const int64_t* seed_positions;
  RealKvSources sources;
};

// bits of kvc_write's report_conflicts word
constexpr int32_t kReportConflicts = 1;
constexpr int32_t kChainAcrossRequests = 2;

// The last write of a request before r to r's seed slot, in (request, entry) order: false
// when no earlier request of the launch writes it.
KVC_DEVICE bool earlier_seed_write(uint8_t* canary_buf, int64_t stride, int64_t num_slots,
                                   const WriteBatch& b, const int64_t* seeds, int64_t r,
                                   int64_t* writer, int64_t* entry) {
  const int64_t seed = seeds[r];
  if (!slot_in_range(seed, num_slots)) return false;
  // A slot the launch writes holds its last writer's claim; any other slot's word names no
  // write of the launch to it (that write would have claimed the slot).
  const unsigned long long claim =
      static_cast<unsigned long long>(*claim_word(canary_buf, stride, seed));
  if (claim == 0ULL) return false;
  const unsigned long long n = static_cast<unsigned long long>(b.num_tokens);
  const unsigned long long claimer = (claim - 1ULL) / n;
  const int64_t claimed = static_cast<int64_t>((claim - 1ULL) % n);
  if (claimer >= static_cast<unsigned long long>(active_requests(b))) return false;
  int64_t start, end;
  const int64_t q = static_cast<int64_t>(claimer);
  if (!request_span(b, q, &start, &end) || !span_inside(b, start, end) || claimed < start ||
      claimed >= end || b.out_cache_loc[claimed] != seed) {
    return false;
  }
  if (q < r) {  // the slot's last writer comes before r
    *writer = q;
    *entry = claimed;
    return true;
  }
  for (int64_t p = r - 1; p >= 0; --p) {
    if (!request_span(b, p, &start, &end) || !span_inside(b, start, end)) continue;
    for (int64_t i = end - 1; i >= start; --i) {
      if (b.out_cache_loc[i] == seed) {
        *writer = p;
        *entry = i;
        return true;
      }
    }
  }
  return false;
}

// Request r's seed with chaining across requests: the link and position of the earlier
// write to its seed slot, whose running hash starts from its own request's seed, resolved
// the same way (writers come strictly earlier, so the walk ends).
KVC_DEVICE Seed chained_seed(uint8_t* canary_buf, int64_t stride, int64_t num_slots,
                             const WriteBatch& b, const int64_t* seeds, const int64_t* positions,
                             const int64_t* input_ids, const int64_t* seed_links, int64_t r,
                             const Seed& read) {
  int64_t depth = 0, node = r, writer, entry;
  while (earlier_seed_write(canary_buf, stride, num_slots, b, seeds, node, &writer, &entry)) {
    ++depth;
    node = writer;
  }
  if (depth == 0) return read;
  // node is the first writer of the walk whose own seed no earlier write names
  uint64_t running =
      slot_in_range(seeds[node], num_slots) ? static_cast<uint64_t>(seed_links[node])
                                            : chain_head();
  int64_t position = 0;
  for (int64_t level = depth; level >= 1; --level) {
    int64_t at = r;
    for (int64_t k = 0; k < level; ++k) {
      earlier_seed_write(canary_buf, stride, num_slots, b, seeds, at, &writer, &entry);
      at = writer;
    }
    int64_t start, end;
    request_span(b, writer, &start, &end);
    for (int64_t i = start; i <= entry; ++i) {
      if (b.out_cache_loc[i] < 0) continue;
      running = mix3(running, static_cast<uint64_t>(input_ids[i]),
                     static_cast<uint64_t>(positions[i]));
    }
    position = positions[entry];
  }
  return Seed{read.slot, static_cast<int64_t>(running), position};
}

}  // namespace kvc

extern "C" __global__ void kvc_write_seeds(
    uint8_t* __restrict__ canary_buf, int64_t num_slots, int64_t slot_stride_bytes,
    const int64_t* __restrict__ write_offsets, const int64_t* __restrict__ write_seed_slot_indices,
    const int32_t* __restrict__ write_num_valid_reqs, int64_t write_req_capacity,
    const int64_t* __restrict__ out_cache_loc, int64_t num_tokens,
    int64_t* __restrict__ seed_links, int64_t* __restrict__ seed_positions) {
  const kvc::WriteBatch b{write_offsets, write_num_valid_reqs, write_req_capacity, out_cache_loc,
                          num_tokens};
  const int64_t r = kvc::global_thread();
  int64_t start, end;
  if (!kvc::request_span(b, r, &start, &end) || !kvc::span_inside(b, start, end)) return;
  const int64_t seed = write_seed_slot_indices[r];
  if (kvc::slot_in_range(seed, num_slots)) {
    // The link needs token, position and prev_hash; the real_kv_hash field may be another
    // request's claim word by now and is not read.
    const int64_t* f = kvc::record_fields(canary_buf, slot_stride_bytes, seed);
    const kvc::Record s{f[kvc::kCanaryFieldToken], f[kvc::kCanaryFieldPosition],
                        f[kvc::kCanaryFieldPrevHash], 0};
    seed_links[r] = static_cast<int64_t>(kvc::link(s));
    seed_positions[r] = s.position;
  }
  kvc::for_each_write(b, num_slots, r, [&](int64_t, int64_t slot) {
    *kvc::claim_word(canary_buf, slot_stride_bytes, slot) = 0;
  });
}

extern "C" __global__ void kvc_write_claims(
    uint8_t* __restrict__ canary_buf, int64_t num_slots, int64_t slot_stride_bytes,
    const int64_t* __restrict__ write_offsets, const int32_t* __restrict__ write_num_valid_reqs,
    int64_t write_req_capacity, const int64_t* __restrict__ out_cache_loc, int64_t num_tokens) {
  const kvc::WriteBatch b{write_offsets, write_num_valid_reqs, write_req_capacity, out_cache_loc,
                          num_tokens};
  const int64_t r = kvc::global_thread();
  kvc::for_each_write(b, num_slots, r, [&](int64_t i, int64_t slot) {
    int64_t* claim = kvc::claim_word(canary_buf, slot_stride_bytes, slot);
    atomicMax(reinterpret_cast<unsigned long long*>(claim), kvc::write_id(b, r, i));
  });
}

extern "C" __global__ void kvc_write(const __grid_constant__ kvc::WriteArgs args) {
  const kvc::WriteBatch b{args.write_offsets, args.write_num_valid_reqs, args.write_req_capacity,
                          args.out_cache_loc, args.num_tokens};
  const int64_t r = kvc::global_thread();
  if (r == 0) kvc::add_counter(args.kernel_run_counter, 1);  // every launch, even an empty one
  int64_t start, end;
  if (!kvc::request_span(b, r, &start, &end)) return;  // no entries: no counter contribution
  const kvc::Ring ring{args.violation_ring, args.ring_capacity, args.violation_write_index};
  if (!kvc::span_inside(b, start, end)) {  // the request's range leaves the token arrays
    kvc::append_violation(ring, args.kernel_kind, -1, 0, 0, 0, 0, start < 0 ? start : end,
                          kvc::bit(kvc::FailReason::kSlotOutOfRange));
    return;
  }
  const int64_t seed_slot = args.write_seed_slot_indices[r];
  const bool seeded = kvc::slot_in_range(seed_slot, args.num_slots);
  kvc::Seed seed{seed_slot, seeded ? args.seed_links[r] : 0,
                 seeded ? args.seed_positions[r] : 0};
  if (seeded && (args.report_conflicts & kvc::kChainAcrossRequests) != 0) {
    seed = kvc::chained_seed(args.canary_buf, args.slot_stride_bytes, args.num_slots, b,
                             args.write_seed_slot_indices, args.positions, args.input_ids,
                             args.seed_links, r, seed);
  }
  const kvc::WriteInputs in{args.input_ids, args.positions, args.expected_input_tokens,
                            args.expected_input_positions};
  const int64_t written = kvc::write_request(
      args.canary_buf, args.slot_stride_bytes, args.num_slots, b, r, start, end, seed, in,
      args.enable_chain_position_assert[0] != 0,
      (args.report_conflicts & kvc::kReportConflicts) != 0, args.sources,
      args.kernel_kind, ring);
  if (written != 0) kvc::add_counter(args.slot_run_counter, written);
}

extern "C" __global__ void kvc_write_real_kv(
    uint8_t* __restrict__ canary_buf, int64_t num_slots, int64_t slot_stride_bytes,
    const int64_t* __restrict__ write_offsets, const int32_t* __restrict__ write_num_valid_reqs,
    int64_t write_req_capacity, const int64_t* __restrict__ out_cache_loc, int64_t num_tokens,
    kvc::RealKvSources sources) {
  const kvc::WriteBatch b{write_offsets, write_num_valid_reqs, write_req_capacity, out_cache_loc,
                          num_tokens};
  kvc::for_each_write(b, num_slots, kvc::global_thread(), [&](int64_t, int64_t slot) {
    *kvc::claim_word(canary_buf, slot_stride_bytes, slot) =
        static_cast<int64_t>(kvc::real_kv_hash(sources, slot));
  });
}
