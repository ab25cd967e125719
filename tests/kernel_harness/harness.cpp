// CPU launcher for the kernels in kernels/: each launch takes its arguments the way
// cuLaunchKernel does (an array of pointers to the argument values) and runs the grid
// as a sequential loop. Built per (KVC_MAX_REAL_KV_SOURCES, KVC_CHECK_VERIFY_EXPECTED_TOKEN).
#include "cuda_shim.h"

#include <cstring>
#include <type_traits>
#include <utility>

#include "kvc_plan.cu"
#include "kvc_verify.cu"
#include "kvc_write.cu"

namespace {

template <class... Args, std::size_t... I>
void call_kernel(void (*kernel)(Args...), void** args, std::index_sequence<I...>) {
  kernel(*static_cast<std::remove_cv_t<std::remove_reference_t<Args>>*>(args[I])...);
}

template <class... Args>
void run_grid(void (*kernel)(Args...), unsigned grid, unsigned block, void** args) {
  gridDim = {grid, 1, 1};
  blockDim = {block, 1, 1};
  for (unsigned b = 0; b < grid; ++b) {
    for (unsigned t = 0; t < block; ++t) {
      blockIdx = {b, 0, 0};
      threadIdx = {t, 0, 0};
      call_kernel(kernel, args, std::index_sequence_for<Args...>{});
    }
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
                              int nargs) {
  kvc_shim_misaligned_loads = 0;
#define KVC_DISPATCH(kernel)                                      \
  if (std::strcmp(name, #kernel) == 0) {                          \
    if (nargs != arity(&kernel)) return -2;                       \
    run_grid(&kernel, grid, block, args);                         \
    return kvc_shim_misaligned_loads == 0 ? 0 : -3;               \
  }
  KVC_DISPATCH(kvc_verify)
  KVC_DISPATCH(kvc_write)
  KVC_DISPATCH(kvc_plan_rows)
  KVC_DISPATCH(kvc_plan_offsets)
  KVC_DISPATCH(kvc_plan_entries)
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
