// SPDX-License-Identifier: Apache-2.0
// Real-KV fingerprint (docs/format.md §5), the same rules as kvcanary/reference/realkv.py:
//   fold_source(src, s)  fold each 8-byte little-endian word of the slot's bytes
//   real_kv_hash(s)      fold the per-source results in source order
//   outside a source     kvcanary extension: a slot whose page lies past a source's rows has
//                        no bytes to fold; it hashes to 0 and is never read
// The descriptors are a fixed array sized by the compile-time bound, passed by value.
#pragma once

#include "kvc_common.cuh"

#ifndef KVC_MAX_REAL_KV_SOURCES
#error "KVC_MAX_REAL_KV_SOURCES must be defined (-DKVC_MAX_REAL_KV_SOURCES=N, 1 <= N <= 64)"
#endif

static_assert(1 <= KVC_MAX_REAL_KV_SOURCES && KVC_MAX_REAL_KV_SOURCES <= 64,
              "KVC_MAX_REAL_KV_SOURCES must be in [1, 64]");

namespace kvc {

constexpr int kMaxSources = KVC_MAX_REAL_KV_SOURCES;

// One source; every field is 8 bytes so the host packs it without padding rules.
struct RealKvSource {
  const uint8_t* ptr;
  int64_t row_stride_bytes;
  int64_t page_size;
  int64_t num_bytes_per_token;
  int64_t read_bytes;
  int64_t num_rows;  // slots past num_rows * page_size lie outside the source
};

// num_sources is 0 when the launch does not hash (mode NONE or no sources): the
// descriptors are then never dereferenced.
struct RealKvSources {
  RealKvSource src[kMaxSources];
  int32_t num_sources;
  int32_t mode;
};

// Whether every source holds slot `slot` (>= 0): true without hashing, where no source is read.
KVC_DEVICE bool slot_in_sources(const RealKvSources& sources, int64_t slot) {
  const int n = sources.num_sources < kMaxSources ? sources.num_sources : kMaxSources;
  for (int i = 0; i < n; ++i) {
    if (slot / sources.src[i].page_size >= sources.src[i].num_rows) return false;
  }
  return true;
}

// Leading bytes of slot `slot` in `source`; callers check slot_in_sources first.
KVC_DEVICE const uint8_t* slot_bytes(const RealKvSource& source, int64_t slot) {
  return source.ptr + (slot / source.page_size) * source.row_stride_bytes +
         (slot % source.page_size) * source.num_bytes_per_token;
}

KVC_DEVICE uint64_t load_word(const uint8_t* p) {
  uint64_t w = 0;
  for (int b = 7; b >= 0; --b) w = (w << 8) | p[b];
  return w;
}

// 16-byte chunks: aligned sources take one 128-bit load; a misaligned base pointer
// falls back to byte loads (same words, little-endian).
KVC_DEVICE uint64_t fold_source(const RealKvSource& source, int64_t slot, int64_t num_bytes) {
  const uint8_t* p = slot_bytes(source, slot);
  const bool aligned = (reinterpret_cast<uintptr_t>(p) & (kRealKvAlignBytes - 1)) == 0;
  uint64_t acc = 0;
  for (int64_t off = 0; off < num_bytes; off += kRealKvAlignBytes) {
    uint64_t lo, hi;
    if (aligned) {
      const ulonglong2 v = __ldg(reinterpret_cast<const ulonglong2*>(p + off));
      lo = v.x;
      hi = v.y;
    } else {
      lo = load_word(p + off);
      hi = load_word(p + off + 8);
    }
    acc = splitmix64(acc ^ lo);
    acc = splitmix64(acc ^ hi);
  }
  return acc;
}

KVC_DEVICE int64_t effective_read_bytes(const RealKvSource& source, int32_t mode) {
  if (mode == static_cast<int32_t>(RealKvHashMode::kPartial)) return kRealKvPartialReadBytes;
  return source.read_bytes;
}

// 0 when nothing is hashed or the slot lies outside a source; otherwise
// acc = splitmix64(acc ^ fold_source) per source.
KVC_DEVICE uint64_t real_kv_hash(const RealKvSources& sources, int64_t slot) {
  if (sources.mode == static_cast<int32_t>(RealKvHashMode::kNone)) return 0;
  if (!slot_in_sources(sources, slot)) return 0;
  uint64_t acc = 0;
  const int n = sources.num_sources < kMaxSources ? sources.num_sources : kMaxSources;
  for (int i = 0; i < n; ++i) {
    const RealKvSource& source = sources.src[i];
    acc = splitmix64(acc ^ fold_source(source, slot, effective_read_bytes(source, sources.mode)));
  }
  return acc;
}

}  // namespace kvc
