// SPDX-License-Identifier: Apache-2.0
// Helpers shared by every kernel: qualifiers, SplitMix64, the chain link, canary record
// access and the violation-ring append. Mirrors kvcanary/hashing.py and
// kvcanary/reference/ring.py; no source-count bound here (see kvc_realkv.cuh).
#pragma once

#include "kvc_consts.cuh"

// Device functions are inlined; the CPU test shim defines these qualifiers too.
#define KVC_DEVICE __device__ __forceinline__

namespace kvc {

// The SplitMix64 finalizer (no increment step), docs/format.md §3.
KVC_DEVICE uint64_t splitmix64(uint64_t x) {
  x ^= x >> kSplitmix64Shift1;
  x *= kSplitmix64Mul1;
  x ^= x >> kSplitmix64Shift2;
  x *= kSplitmix64Mul2;
  return x ^ (x >> kSplitmix64Shift3);
}

// mix3(a, b, c): fold a, b, c in that order; equal inputs do not cancel.
KVC_DEVICE uint64_t mix3(uint64_t a, uint64_t b, uint64_t c) {
  uint64_t h = splitmix64(a);
  h = splitmix64(h ^ b);
  return splitmix64(h ^ c);
}

// H0: the link of "no predecessor".
KVC_DEVICE uint64_t chain_head() { return splitmix64(kCanaryChainAnchor); }

// One canary record: four little-endian int64 fields at the start of the slot.
struct Record {
  int64_t token;
  int64_t position;
  int64_t prev_hash;
  int64_t real_kv_hash;
};

// The int64 fields of slot `slot`; callers check 0 <= slot < num_slots first.
KVC_DEVICE const int64_t* record_fields(const uint8_t* canary_buf, int64_t slot_stride_bytes,
                                         int64_t slot) {
  return reinterpret_cast<const int64_t*>(canary_buf + slot * slot_stride_bytes);
}

KVC_DEVICE Record load_record(const uint8_t* canary_buf, int64_t slot_stride_bytes, int64_t slot) {
  const int64_t* f = record_fields(canary_buf, slot_stride_bytes, slot);
  Record r;
  r.token = f[kCanaryFieldToken];
  r.position = f[kCanaryFieldPosition];
  r.prev_hash = f[kCanaryFieldPrevHash];
  r.real_kv_hash = f[kCanaryFieldRealKvHash];
  return r;
}

KVC_DEVICE void store_record(uint8_t* canary_buf, int64_t slot_stride_bytes, int64_t slot,
                             const Record& r) {
  int64_t* f = reinterpret_cast<int64_t*>(canary_buf + slot * slot_stride_bytes);
  f[kCanaryFieldToken] = r.token;
  f[kCanaryFieldPosition] = r.position;
  f[kCanaryFieldPrevHash] = r.prev_hash;
  f[kCanaryFieldRealKvHash] = r.real_kv_hash;
}

// link(record) = mix3(prev_hash, token, position): what a successor stores as prev_hash.
// real_kv_hash is deliberately not part of the link (docs/format.md §4).
KVC_DEVICE uint64_t link(const Record& r) {
  return mix3(static_cast<uint64_t>(r.prev_hash), static_cast<uint64_t>(r.token),
              static_cast<uint64_t>(r.position));
}

KVC_DEVICE bool slot_in_range(int64_t slot, int64_t num_slots) {
  return slot >= 0 && slot < num_slots;
}

// The violation ring (docs/format.md §10): claim a sequence number, write the row only when it
// fits (the ring never wraps), then fence so a host that sees the index sees the row.
struct Ring {
  int64_t* rows;
  int64_t capacity;
  int32_t* write_index;
};

// The index saturates at kViolationWriteIndexMax instead of wrapping to negative (which
// would make the log read clean and stop storing rows). Far from the top a plain atomicAdd
// claims; within the margin, which is larger than the threads a GPU runs at once (each adds
// 1 after its read), a compare-and-swap loop. -1: saturated, no sequence number, no row.
constexpr int32_t kWriteIndexCasMargin = 1 << 24;

KVC_DEVICE int32_t claim_sequence(int32_t* write_index) {
  constexpr int32_t kTop = static_cast<int32_t>(kViolationWriteIndexMax);
  int32_t seen = *reinterpret_cast<volatile int32_t*>(write_index);
  if (seen < kTop - kWriteIndexCasMargin) return atomicAdd(write_index, 1);
  while (seen != kTop) {
    const int32_t old = atomicCAS(write_index, seen, seen + 1);
    if (old == seen) return old;
    seen = old;
  }
  return -1;
}

KVC_DEVICE void append_violation(const Ring& ring, int64_t kernel_kind, int64_t slot,
                                 int64_t position, int64_t stored_token, int64_t expected_token,
                                 int64_t stored_chain_hash, int64_t expected_aux, int64_t bits) {
  const int32_t seq = claim_sequence(ring.write_index);
  if (seq >= 0 && static_cast<int64_t>(seq) < ring.capacity) {
    int64_t* row = ring.rows + static_cast<int64_t>(seq) * kViolationFields;
    row[kViolationFieldKernelKind] = kernel_kind;
    row[kViolationFieldSlotIdx] = slot;
    row[kViolationFieldPosition] = position;
    row[kViolationFieldStoredToken] = stored_token;
    row[kViolationFieldExpectedToken] = expected_token;
    row[kViolationFieldStoredChainHash] = stored_chain_hash;
    row[kViolationFieldExpectedAux] = expected_aux;
    row[kViolationFieldFailReasonBits] = bits;
  }
  __threadfence_system();
}

// 64-bit counters: CUDA's atomicAdd has an unsigned long long overload only; two's
// complement makes the signed sum the same bits.
KVC_DEVICE void add_counter(int64_t* counter, int64_t value) {
  atomicAdd(reinterpret_cast<unsigned long long*>(counter), static_cast<unsigned long long>(value));
}

KVC_DEVICE int64_t bit(FailReason reason) { return static_cast<int64_t>(reason); }

// Two's-complement arithmetic that wraps like numpy's int64 instead of being undefined.
KVC_DEVICE int64_t wrap_add(int64_t a, int64_t b) {
  return static_cast<int64_t>(static_cast<uint64_t>(a) + static_cast<uint64_t>(b));
}
KVC_DEVICE int64_t wrap_sub(int64_t a, int64_t b) {
  return static_cast<int64_t>(static_cast<uint64_t>(a) - static_cast<uint64_t>(b));
}

// Global thread id and grid stride of a 1-D launch.
KVC_DEVICE int64_t global_thread() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
KVC_DEVICE int64_t grid_threads() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

}  // namespace kvc
