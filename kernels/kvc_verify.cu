// SPDX-License-Identifier: Apache-2.0
// Verify (docs/format.md §9): re-read each planned prefix slot and check its record.
// Same rules as kvcanary/reference/verify.py, one entry per loop iteration:
//   expected_chain   H0 for a chain head (prev < 0), link(prev record) for a reachable
//                    predecessor, the stored prev_hash itself when prev == 0 (unreachable)
//   check bits       chain / token / position / real-KV, ORed
//   out of range     kvcanary extension: a slot or predecessor outside the buffer is
//                    reported as SLOT_OUT_OF_RANGE and never read; a slot outside a real-KV
//                    source is reported too, its other checks run, its bytes are never read
// Persistent grid-stride loop; the host sizes the grid from the multiprocessor count.
#include "kvc_realkv.cuh"

#ifndef KVC_CHECK_VERIFY_EXPECTED_TOKEN
#error "KVC_CHECK_VERIFY_EXPECTED_TOKEN must be defined to 0 or 1"
#endif

namespace kvc {

struct VerifyPlanArgs {
  const int64_t* slot_indices;
  const int64_t* expected_tokens;
  const int64_t* expected_positions;
  const int64_t* prev_slot_indices;
  const int32_t* num_valid;
  const int32_t* enable;
  int64_t capacity;
};

// The chain link the entry's stored prev_hash must equal, and whether it is checked.
KVC_DEVICE uint64_t expected_chain(const uint8_t* canary_buf, int64_t stride, int64_t num_slots,
                                   int64_t prev, int64_t stored_prev_hash, bool* checked,
                                   bool* prev_out) {
  *checked = false;
  *prev_out = false;
  if (prev < 0) {
    *checked = true;
    return chain_head();
  }
  if (prev == 0) return static_cast<uint64_t>(stored_prev_hash);  // unreachable: vacuous
  if (prev >= num_slots) {
    *prev_out = true;  // never dereferenced; reported with the entry's other bits
    return static_cast<uint64_t>(stored_prev_hash);
  }
  *checked = true;
  return link(load_record(canary_buf, stride, prev));
}

KVC_DEVICE void verify_entry(const uint8_t* canary_buf, int64_t stride, int64_t num_slots,
                             const VerifyPlanArgs& plan, int64_t e, int64_t kernel_kind,
                             const Ring& ring, const RealKvSources& sources) {
  const int64_t slot = plan.slot_indices[e];
  if (slot == kTokenToKvSlotPadding) return;  // unfilled: skipped, still counted
  const int64_t exp_pos = plan.expected_positions[e];
  const int64_t prev = plan.prev_slot_indices[e];
  // The non-checking variant never reads the expected-token array.
  const int64_t exp_tok = KVC_CHECK_VERIFY_EXPECTED_TOKEN ? plan.expected_tokens[e]
                                                          : kExpectedTokenUnknown;
  if (!slot_in_range(slot, num_slots)) {
    append_violation(ring, kernel_kind, slot, exp_pos, 0, exp_tok, 0, slot,
                     bit(FailReason::kSlotOutOfRange));
    return;
  }
  const Record rec = load_record(canary_buf, stride, slot);
  bool chain_checked, prev_out;
  const uint64_t chain =
      expected_chain(canary_buf, stride, num_slots, prev, rec.prev_hash, &chain_checked, &prev_out);
  const bool source_out = !slot_in_sources(sources, slot);
  const int64_t exp_rkv = static_cast<int64_t>(real_kv_hash(sources, slot));

  int64_t bits = 0;
  if (chain_checked && static_cast<uint64_t>(rec.prev_hash) != chain)
    bits |= bit(FailReason::kVerifyChainHashMismatch);
  if (exp_tok != kExpectedTokenUnknown && rec.token != exp_tok)
    bits |= bit(FailReason::kVerifyTokenMismatch);
  if (rec.position != exp_pos) bits |= bit(FailReason::kVerifyPositionMismatch);
  if (!source_out && rec.real_kv_hash != exp_rkv)
    bits |= bit(FailReason::kVerifyRealKvHashMismatch);
  if (prev_out || source_out) bits |= bit(FailReason::kSlotOutOfRange);
  if (bits != 0) {
    // position is the stored one; expected_aux the expected chain (or the bad index).
    append_violation(ring, kernel_kind, slot, rec.position, rec.token, exp_tok, rec.prev_hash,
                     prev_out ? prev : source_out ? slot : static_cast<int64_t>(chain), bits);
  }
}

}  // namespace kvc

extern "C" __global__ void kvc_verify(
    const uint8_t* __restrict__ canary_buf, int64_t num_slots, int64_t slot_stride_bytes,
    const int64_t* __restrict__ verify_slot_indices, const int64_t* __restrict__ verify_expected_tokens,
    const int64_t* __restrict__ verify_expected_positions,
    const int64_t* __restrict__ verify_prev_slot_indices, const int32_t* __restrict__ verify_num_valid,
    const int32_t* __restrict__ enable, int64_t verify_capacity, int64_t kernel_kind,
    int64_t* __restrict__ violation_ring, int64_t ring_capacity, int32_t* violation_write_index,
    int64_t* __restrict__ slot_run_counter, int64_t* __restrict__ kernel_run_counter,
    kvc::RealKvSources sources) {
  const kvc::VerifyPlanArgs plan{verify_slot_indices, verify_expected_tokens,
                                 verify_expected_positions, verify_prev_slot_indices,
                                 verify_num_valid, enable, verify_capacity};
  const kvc::Ring ring{violation_ring, ring_capacity, violation_write_index};
  const int64_t tid = kvc::global_thread();
  // Exactly once per launch, before anything else (the health watchdog counts it).
  if (tid == 0) kvc::add_counter(kernel_run_counter, 1);
  if (plan.enable[0] == 0) return;  // plan overflow: the launch is skipped
  int64_t active = plan.num_valid[0];
  if (active > plan.capacity) active = plan.capacity;
  if (active <= 0) return;
  // Every active entry counts, slot-0 ones included: add the total once.
  if (tid == 0) kvc::add_counter(slot_run_counter, active);
  const int64_t stride = kvc::grid_threads();
  for (int64_t e = tid; e < active; e += stride) {
    kvc::verify_entry(canary_buf, slot_stride_bytes, num_slots, plan, e, kernel_kind, ring, sources);
  }
}
