// SPDX-License-Identifier: Apache-2.0
// CPU launcher for the kernels in kernels/: each launch takes its arguments the way
// cuLaunchKernel does (an array of pointers to the argument values) and runs the grid
// as a sequential loop over (block, thread) in the order asked for: forward, reverse, or
// shuffled by a seed. A GPU runs threads in no fixed order, so a kernel must give the
// same bytes in all three. Built per (KVC_MAX_REAL_KV_SOURCES, KVC_CHECK_VERIFY_EXPECTED_TOKEN).
#include "cuda_shim.h"

#include <algorithm>
#include <cstring>
#include <random>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvc_plan.cu"
#include "kvc_verify.cu"
#include "kvc_write.cu"

namespace {

template <class... Args, std::size_t... I>
void call_kernel(void (*kernel)(Args...), void** args, std::index_sequence<I...>) {
  kernel(*static_cast<std::remove_cv_t<std::remove_reference_t<Args>>*>(args[I])...);
}

enum Order { kForward = 0, kReverse = 1, kShuffled = 2 };

template <class... Args>
void run_grid(void (*kernel)(Args...), unsigned grid, unsigned block, void** args, int order,
              unsigned seed) {
  gridDim = {grid, 1, 1};
  blockDim = {block, 1, 1};
  std::vector<unsigned long long> threads(static_cast<std::size_t>(grid) * block);
  for (std::size_t k = 0; k < threads.size(); ++k) threads[k] = k;
  if (order == kReverse) std::reverse(threads.begin(), threads.end());
  if (order == kShuffled) std::shuffle(threads.begin(), threads.end(), std::mt19937_64(seed));
  for (const unsigned long long k : threads) {
    blockIdx = {static_cast<unsigned>(k / block), 0, 0};
    threadIdx = {static_cast<unsigned>(k % block), 0, 0};
    call_kernel(kernel, args, std::index_sequence_for<Args...>{});
  }
}

template <class... Args>
constexpr int arity(void (*)(Args...)) {
  return sizeof...(Args);
}

}  // namespace

// Returns 0, or -1 for an unknown kernel name, -2 when nargs does not match, -3 when the
// kernel made a load a GPU would fault on (misaligned for its type).
extern "C" int kvc_cpu_launch(const char* name, unsigned grid, unsigned block, void** args,
                              int nargs, int order, unsigned seed) {
  kvc_shim_misaligned_loads = 0;
#define KVC_DISPATCH(kernel)                                      \
  if (std::strcmp(name, #kernel) == 0) {                          \
    if (nargs != arity(&kernel)) return -2;                       \
    run_grid(&kernel, grid, block, args, order, seed);            \
    return kvc_shim_misaligned_loads == 0 ? 0 : -3;               \
  }
  KVC_DISPATCH(kvc_verify)
  KVC_DISPATCH(kvc_write_seeds)
  KVC_DISPATCH(kvc_write_claims)
  KVC_DISPATCH(kvc_write)
  KVC_DISPATCH(kvc_write_real_kv)
  KVC_DISPATCH(kvc_plan_rows_i32)
  KVC_DISPATCH(kvc_plan_rows_i64)
  KVC_DISPATCH(kvc_plan_offsets)
  KVC_DISPATCH(kvc_plan_entries_i32_i32)
  KVC_DISPATCH(kvc_plan_entries_i32_i64)
  KVC_DISPATCH(kvc_plan_entries_i64_i32)
  KVC_DISPATCH(kvc_plan_entries_i64_i64)
#undef KVC_DISPATCH
  return -1;
}

// Layout facts the Python packer must agree with.
extern "C" long kvc_cpu_sources_size() { return sizeof(kvc::RealKvSources); }
extern "C" long kvc_cpu_sources_offset(int field) {
  switch (field) {
    case 0: return offsetof(kvc::RealKvSources, src);
    case 1: return offsetof(kvc::RealKvSources, num_sources);
    case 2: return offsetof(kvc::RealKvSources, mode);
    case 3: return sizeof(kvc::RealKvSource);
    default: return -1;
  }
}
extern "C" int kvc_cpu_max_sources() { return kvc::kMaxSources; }

// kvc_write's parameter struct: the offset of field `name`, -1 for a name it lacks, and
// its size (kvcanary/cuda/write_args.py must agree on both).
extern "C" long kvc_cpu_write_args_size() { return sizeof(kvc::WriteArgs); }
extern "C" long kvc_cpu_write_args_offset(const char* name) {
#define KVC_FIELD(field) \
  if (std::strcmp(name, #field) == 0) return offsetof(kvc::WriteArgs, field);
  KVC_FIELD(canary_buf)
  KVC_FIELD(num_slots)
  KVC_FIELD(slot_stride_bytes)
  KVC_FIELD(write_offsets)
  KVC_FIELD(write_seed_slot_indices)
  KVC_FIELD(write_num_valid_reqs)
  KVC_FIELD(write_req_capacity)
  KVC_FIELD(input_ids)
  KVC_FIELD(positions)
  KVC_FIELD(out_cache_loc)
  KVC_FIELD(num_tokens)
  KVC_FIELD(expected_input_tokens)
  KVC_FIELD(expected_input_positions)
  KVC_FIELD(kernel_kind)
  KVC_FIELD(violation_ring)
  KVC_FIELD(ring_capacity)
  KVC_FIELD(violation_write_index)
  KVC_FIELD(slot_run_counter)
  KVC_FIELD(kernel_run_counter)
  KVC_FIELD(enable_chain_position_assert)
  KVC_FIELD(report_conflicts)
  KVC_FIELD(seed_links)
  KVC_FIELD(seed_positions)
  KVC_FIELD(sources)
#undef KVC_FIELD
  return -1;
}
