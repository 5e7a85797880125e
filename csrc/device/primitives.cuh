// The device-side spellings the step kernel uses: system-scope flags, L1-bypassing loads,
// clocks, the error claim. Compiled by nvcc for the GPU, and by the host compiler for the
// emulated device (emu/), where every access to memory is checked against the launch's
// buffers and every wait backs off so that oversubscribed cores keep moving.
//
// Flags are read with acquire and written with release at system scope: the peer that writes
// them may be another process on another GPU, and the host reads some of them too.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define PYCOLL_DEVICE __device__ __forceinline__
#define PYCOLL_UNROLL _Pragma("unroll")
#else
#include "common/half.h"
#include "emu/emu_checks.h"
#define PYCOLL_DEVICE inline
#define PYCOLL_UNROLL
#endif

namespace pycoll {
namespace cuda {

#if defined(__CUDACC__)

using DevHalf = __half;
using DevBFloat16 = __nv_bfloat16;
PYCOLL_DEVICE float widen(__half v) { return __half2float(v); }
PYCOLL_DEVICE float widen(__nv_bfloat16 v) { return __bfloat162float(v); }
template <class T>
PYCOLL_DEVICE T narrow(float v);
template <>
PYCOLL_DEVICE __half narrow<__half>(float v) {
  return __float2half_rn(v);
}
template <>
PYCOLL_DEVICE __nv_bfloat16 narrow<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
using Vec16 = uint4;

PYCOLL_DEVICE uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
PYCOLL_DEVICE void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
PYCOLL_DEVICE uint32_t ld_relaxed_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.relaxed.sys.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// Relaxed 64-bit loads and stores: no ordering of their own, so several are in flight at once
// (an acquire or release at system scope costs a round trip to memory each).
PYCOLL_DEVICE uint64_t ld_relaxed_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
PYCOLL_DEVICE void st_relaxed_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
PYCOLL_DEVICE void st_relaxed_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.relaxed.sys.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// A word of a message in the LL format (payload and flag in one store): relaxed, at system
// scope; the receiver polls the word itself, with relaxed loads.
PYCOLL_DEVICE void st_ll(uint64_t* p, uint64_t v) { st_relaxed_sys(p, v); }
// Nanoseconds since an arbitrary epoch, the same on every SM.
PYCOLL_DEVICE uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// The first caller gets true (device memory: atomics on mapped host memory are not
// available over every bus).
PYCOLL_DEVICE bool claim(uint32_t* p) { return atomicCAS(p, 0u, 1u) == 0u; }
// Orders the error details before the code, on the error path only.
PYCOLL_DEVICE void fence_system() { __threadfence_system(); }
// A block's writes, visible device-wide before what follows (the launch's end count).
PYCOLL_DEVICE void fence_device() { __threadfence(); }
// Counts one more (device memory); returns the count before.
PYCOLL_DEVICE uint32_t count_one(uint32_t* p) { return atomicAdd(p, 1u); }
// Between polls of a flag: nothing, the poll itself is the pause.
PYCOLL_DEVICE void poll_pause(const uint64_t*, uint64_t, uint64_t) {}
// Loads that bypass L1, which is not coherent with other GPUs or processes: staging slots are
// reused, and a stale line from an earlier message must never be read.
PYCOLL_DEVICE Vec16 load16(const void* p) { return __ldcg(static_cast<const uint4*>(p)); }
PYCOLL_DEVICE void store16(void* p, Vec16 v) { *static_cast<uint4*>(p) = v; }
template <class B>
PYCOLL_DEVICE B load_bits(const B* p) {
  return __ldcg(p);
}
template <class X>
PYCOLL_DEVICE void store_elem(X* p, const X& v) {
  *p = v;
}

#else  // the emulated device

using DevHalf = Half;
using DevBFloat16 = BFloat16;
inline float widen(Half v) { return to_float(v); }
inline float widen(BFloat16 v) { return to_float(v); }
template <class T>
inline T narrow(float v);
template <>
inline Half narrow<Half>(float v) {
  return to_half(v);
}
template <>
inline BFloat16 narrow<BFloat16>(float v) {
  return to_bfloat16(v);
}
struct alignas(16) Vec16 {
  uint32_t w[4];
};

inline uint64_t ld_acquire_sys(const uint64_t* p) {
  emu::check_access(p, sizeof(*p), false);
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
inline void st_release_sys(uint64_t* p, uint64_t v) {
  emu::check_access(p, sizeof(*p), true);
  emu::flush_stores();  // the release orders this thread's stores before it (weak visibility)
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
  emu::wake(p);  // blocks asleep in poll_pause on this flag
}
inline uint32_t ld_relaxed_sys(const uint32_t* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
inline uint64_t ld_relaxed_sys(const uint64_t* p) {
  emu::check_access(p, sizeof(*p), false);
  return __atomic_load_n(p, __ATOMIC_RELAXED);
}
inline void st_relaxed_sys(uint64_t* p, uint64_t v) {
  emu::check_access(p, sizeof(*p), true);
  __atomic_store_n(p, v, __ATOMIC_RELAXED);
}
inline void st_relaxed_sys(uint32_t* p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
inline void st_ll(uint64_t* p, uint64_t v) {
  st_relaxed_sys(p, v);
  emu::wake(p);  // a receiver asleep in poll_pause on this word
}
inline uint64_t global_timer_ns() { return emu::now_ns(); }
inline bool claim(uint32_t* p) {
  uint32_t expected = 0;
  return __atomic_compare_exchange_n(p, &expected, 1u, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}
inline void fence_system() {
  emu::flush_stores();
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
}
inline void fence_device() {
  emu::flush_stores();
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
}
inline uint32_t count_one(uint32_t* p) { return __atomic_fetch_add(p, 1u, __ATOMIC_ACQ_REL); }
inline void poll_pause(const uint64_t* flag, uint64_t seen, uint64_t spins) {
  emu::wait_change(flag, seen, spins);
}
inline Vec16 load16(const void* p) {
  emu::check_data(p, 16, false);
  emu::check_aligned16(p);
  Vec16 v;
  std::memcpy(&v, p, 16);
  emu::forward_load(p, &v, 16);
  return v;
}
inline void store16(void* p, Vec16 v) {
  emu::check_data(p, 16, true);
  emu::check_aligned16(p);
  if (!emu::buffer_store(p, &v, 16)) std::memcpy(p, &v, 16);
}
template <class B>
inline B load_bits(const B* p) {
  emu::check_data(p, sizeof(B), false);
  B v;
  std::memcpy(&v, p, sizeof(B));
  emu::forward_load(p, &v, sizeof(B));
  return v;
}
template <class X>
inline void store_elem(X* p, const X& v) {
  emu::check_data(p, sizeof(X), true);
  if (!emu::buffer_store(p, &v, sizeof(X))) std::memcpy(static_cast<void*>(p), &v, sizeof(X));
}

#endif

template <class To, class From>
PYCOLL_DEVICE To bit_cast(const From& f) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast sizes");
  To t;
  memcpy(static_cast<void*>(&t), &f, sizeof(To));
  return t;
}

template <int Bytes>
struct BitsOf;
template <>
struct BitsOf<1> {
  using type = unsigned char;
};
template <>
struct BitsOf<2> {
  using type = unsigned short;
};
template <>
struct BitsOf<4> {
  using type = unsigned int;
};
template <>
struct BitsOf<8> {
  using type = unsigned long long;
};

// v[0..E) = p[i..i+E). `vec`: p + i is 16-byte aligned, so whole 16-byte words move at once,
// all of them loaded before any is used (several loads in flight per thread).
template <class X, int E>
PYCOLL_DEVICE void load(X (&v)[E], const void* p, size_t i, bool vec) {
  const X* q = static_cast<const X*>(p) + i;
  if constexpr (sizeof(X) * E % 16 == 0) {
    if (vec) {
      constexpr int kWords = static_cast<int>(sizeof(X) * E / 16);
      Vec16 w[kWords];
      PYCOLL_UNROLL
      for (int k = 0; k < kWords; ++k) w[k] = load16(reinterpret_cast<const Vec16*>(q) + k);
      PYCOLL_UNROLL
      for (int k = 0; k < kWords; ++k)
        memcpy(static_cast<void*>(&v[k * 16 / sizeof(X)]), &w[k], 16);
      return;
    }
  }
  using B = typename BitsOf<sizeof(X)>::type;
  PYCOLL_UNROLL
  for (int k = 0; k < E; ++k) v[k] = bit_cast<X>(load_bits(reinterpret_cast<const B*>(q + k)));
}

template <class X, int E>
PYCOLL_DEVICE void store(void* p, size_t i, const X (&v)[E], bool vec) {
  if (p == nullptr) return;
  X* q = static_cast<X*>(p) + i;
  if constexpr (sizeof(X) * E % 16 == 0) {
    if (vec) {
      PYCOLL_UNROLL
      for (int k = 0; k < static_cast<int>(sizeof(X) * E / 16); ++k) {
        Vec16 w;
        memcpy(static_cast<void*>(&w), &v[k * 16 / sizeof(X)], 16);
        store16(reinterpret_cast<Vec16*>(q) + k, w);
      }
      return;
    }
  }
  PYCOLL_UNROLL
  for (int k = 0; k < E; ++k) store_elem(q + k, v[k]);
}

}  // namespace cuda
}  // namespace pycoll
