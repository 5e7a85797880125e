// The device-side spellings the kernels use: system-scope flags, L1-bypassing loads, clocks.
//
// Flags are read with acquire and written with release at system scope: the peer that writes
// them may be another process on another GPU, and the host reads some of them too.
#pragma once

#include <cstdint>
#include <cstring>

#define PYCOLL_DEVICE __device__ __forceinline__

namespace pycoll {
namespace cuda {

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

PYCOLL_DEVICE void st_relaxed_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.relaxed.sys.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Nanoseconds since an arbitrary epoch, the same on every SM.
PYCOLL_DEVICE uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

template <class To, class From>
PYCOLL_DEVICE To bit_cast(const From& f) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast sizes");
  To t;
  memcpy(&t, &f, sizeof(To));
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

// v[0..E) = p[i..i+E). Loads bypass L1, which is not coherent with other GPUs or processes:
// staging slots are reused, and a stale line from an earlier message must never be read.
// `vec`: p + i is 16-byte aligned, so whole 16-byte words move at once.
template <class X, int E>
PYCOLL_DEVICE void load(X (&v)[E], const void* p, size_t i, bool vec) {
  const X* q = static_cast<const X*>(p) + i;
  if constexpr (sizeof(X) * E % 16 == 0) {
    if (vec) {
      const uint4* u = reinterpret_cast<const uint4*>(q);
#pragma unroll
      for (int k = 0; k < static_cast<int>(sizeof(X) * E / 16); ++k) {
        const uint4 w = __ldcg(u + k);
        memcpy(&v[k * 16 / sizeof(X)], &w, 16);
      }
      return;
    }
  }
  using B = typename BitsOf<sizeof(X)>::type;
#pragma unroll
  for (int k = 0; k < E; ++k) v[k] = bit_cast<X>(__ldcg(reinterpret_cast<const B*>(q + k)));
}

template <class X, int E>
PYCOLL_DEVICE void store(void* p, size_t i, const X (&v)[E], bool vec) {
  if (p == nullptr) return;
  X* q = static_cast<X*>(p) + i;
  if constexpr (sizeof(X) * E % 16 == 0) {
    if (vec) {
      uint4* u = reinterpret_cast<uint4*>(q);
#pragma unroll
      for (int k = 0; k < static_cast<int>(sizeof(X) * E / 16); ++k) {
        uint4 w;
        memcpy(&w, &v[k * 16 / sizeof(X)], 16);
        u[k] = w;
      }
      return;
    }
  }
#pragma unroll
  for (int k = 0; k < E; ++k) q[k] = v[k];
}

}  // namespace cuda
}  // namespace pycoll
