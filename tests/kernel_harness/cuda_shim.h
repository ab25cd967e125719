// SPDX-License-Identifier: Apache-2.0
// Just enough of CUDA's built-ins to compile the kernels in kernels/ with a host C++
// compiler. The test harness runs a launch as a sequential loop over blocks and threads,
// setting blockIdx/threadIdx before each call. Kernels use no shared memory and no warp
// intrinsics, so that loop is a faithful execution of the grid (in one legal order).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __grid_constant__

struct kvc_shim_dim3 {
  unsigned int x = 1, y = 1, z = 1;
};

inline thread_local kvc_shim_dim3 threadIdx, blockIdx, blockDim, gridDim;

struct alignas(16) ulonglong2 {  // CUDA's vector type: 16-byte aligned
  unsigned long long x, y;
};

// Loads a GPU would fault on (an address off the type's alignment), counted so the
// launcher can fail the launch: on the CPU any address loads.
inline thread_local unsigned long long kvc_shim_misaligned_loads = 0;

// atomicAdd returns the old value; signed overflow wraps (atomics are two's complement).
template <class T>
inline T atomicAdd(T* address, T value) {
  return __atomic_fetch_add(address, value, __ATOMIC_SEQ_CST);
}

// atomicCAS returns the old value; ``value`` is stored only when the old one was ``compare``.
template <class T>
inline T atomicCAS(T* address, T compare, T value) {
  __atomic_compare_exchange_n(address, &compare, value, false, __ATOMIC_SEQ_CST,
                              __ATOMIC_SEQ_CST);
  return compare;
}

// atomicMax returns the old value.
template <class T>
inline T atomicMax(T* address, T value) {
  T old = __atomic_load_n(address, __ATOMIC_SEQ_CST);
  while (old < value &&
         !__atomic_compare_exchange_n(address, &old, value, false, __ATOMIC_SEQ_CST,
                                      __ATOMIC_SEQ_CST)) {
  }
  return old;
}

// Read-only cached load: a plain copy on the host, after counting a misaligned address.
template <class T>
inline T __ldg(const T* address) {
  if (reinterpret_cast<std::uintptr_t>(address) % alignof(T) != 0) ++kvc_shim_misaligned_loads;
  T value;
  std::memcpy(&value, address, sizeof(T));
  return value;
}

inline void __threadfence_system() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
