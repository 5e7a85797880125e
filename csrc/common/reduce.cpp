#include "common/reduce.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "common/half.h"

namespace pycoll {
namespace {

// How an element type is accumulated.
template <class T>
struct Acc {
  using type = T;
  static T load(T v) { return v; }
  static T store(T v) { return v; }
};
template <>
struct Acc<Half> {
  using type = float;
  static float load(Half v) { return to_float(v); }
  static Half store(float v) { return to_half(v); }
};
template <>
struct Acc<BFloat16> {
  using type = float;
  static float load(BFloat16 v) { return to_float(v); }
  static BFloat16 store(float v) { return to_bfloat16(v); }
};

// Signed overflow wraps (as numpy's does) by computing in the unsigned type.
template <class A>
A wrap_add(A a, A b) {
  if constexpr (std::is_integral_v<A>) {
    using U = std::make_unsigned_t<A>;
    return static_cast<A>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
  } else {
    return a + b;
  }
}
template <class A>
A wrap_mul(A a, A b) {
  if constexpr (std::is_integral_v<A>) {
    // Promote to a wide unsigned type so no intermediate is signed.
    using W = std::conditional_t<(sizeof(A) < sizeof(unsigned)), unsigned, std::make_unsigned_t<A>>;
    return static_cast<A>(static_cast<W>(static_cast<W>(a) * static_cast<W>(b)));
  } else {
    return a * b;
  }
}

struct OpSum {
  template <class A>
  static A apply(A a, A b) {
    return wrap_add(a, b);
  }
};
struct OpProd {
  template <class A>
  static A apply(A a, A b) {
    return wrap_mul(a, b);
  }
};
// min and max propagate NaN like numpy.minimum / numpy.maximum.
struct OpMin {
  template <class A>
  static A apply(A a, A b) {
    return (a < b || a != a) ? a : b;
  }
};
struct OpMax {
  template <class A>
  static A apply(A a, A b) {
    return (a > b || a != a) ? a : b;
  }
};

// Writes the 64 bytes at `tile` to d (16-byte aligned) with non-temporal stores.
inline void stream_tile(void* d, const void* tile) {
#if defined(__SSE2__)
  auto* out = static_cast<__m128i*>(d);
  const auto* in = static_cast<const __m128i*>(tile);
  for (int j = 0; j < 4; ++j) _mm_stream_si128(out + j, _mm_load_si128(in + j));
#else
  std::memcpy(d, tile, 64);
#endif
}

template <class T, class Op, bool kAvg>
struct Kernels {
  using A = typename Acc<T>::type;

  static void load(void* dst, const void* src, size_t n) {
    if constexpr (std::is_same_v<A, T>) {
      copy_bytes(dst, src, n * sizeof(T));
    } else {
      A* __restrict d = static_cast<A*>(dst);
      const T* __restrict s = static_cast<const T*>(src);
      for (size_t i = 0; i < n; ++i) d[i] = Acc<T>::load(s[i]);
    }
  }

  static void reduce(void* dst, const void* a, const void* b, size_t n) {
    A* d = static_cast<A*>(dst);
    const A* pa = static_cast<const A*>(a);
    const T* __restrict pb = static_cast<const T*>(b);
    for (size_t i = 0; i < n; ++i) d[i] = Op::apply(pa[i], Acc<T>::load(pb[i]));
  }

  static void combine(void* dst, const void* a, const void* b, size_t n) {
    A* d = static_cast<A*>(dst);
    const A* pa = static_cast<const A*>(a);
    const A* __restrict pb = static_cast<const A*>(b);
    for (size_t i = 0; i < n; ++i) d[i] = Op::apply(pa[i], pb[i]);
  }

  // Calls body(fin), fin being what turns an accumulated value into the result: v / divisor
  // for avg, v otherwise. Dividing by a power of two and multiplying by its (exact) reciprocal
  // round the same real number, so there the product is bit for bit the quotient, and several
  // times cheaper (dividing made the 2-rank all-reduce over shared buffers 20% slower in place).
  template <class Body>
  static void finishing(int divisor, Body&& body) {
    if constexpr (!kAvg) {
      body([](A v) { return v; });
    } else {
      if constexpr (std::is_floating_point_v<A>) {
        if (divisor > 0 && (divisor & (divisor - 1)) == 0) {
          const A inv = static_cast<A>(1) / static_cast<A>(divisor);
          body([inv](A v) { return v * inv; });
          return;
        }
      }
      const A div = static_cast<A>(divisor);
      body([div](A v) { return v / div; });
    }
  }

  static void finalize(void* dst, void* dst2, const void* a, size_t n, int divisor) {
    T* __restrict d = static_cast<T*>(dst);
    T* d2 = static_cast<T*>(dst2);
    const A* __restrict pa = static_cast<const A*>(a);
    finishing(divisor, [&](auto fin) {
      for (size_t i = 0; i < n; ++i) {
        const T v = Acc<T>::store(fin(pa[i]));
        d[i] = v;
        if (d2 != nullptr) d2[i] = v;
      }
    });
  }

  // dst may alias b (in-place output), never a.
  static void reduce_final(void* dst, void* dst2, const void* a, const void* b, size_t n,
                           int divisor) {
    T* d = static_cast<T*>(dst);
    const A* __restrict pa = static_cast<const A*>(a);
    const T* pb = static_cast<const T*>(b);
    finishing(divisor, [&](auto fin) {
      if (dst2 == nullptr) {
        for (size_t i = 0; i < n; ++i)
          d[i] = Acc<T>::store(fin(Op::apply(pa[i], Acc<T>::load(pb[i]))));
      } else {
        T* __restrict d2 = static_cast<T*>(dst2);
        for (size_t i = 0; i < n; ++i) {
          const T v = Acc<T>::store(fin(Op::apply(pa[i], Acc<T>::load(pb[i]))));
          d[i] = v;
          d2[i] = v;
        }
      }
    });
  }

  // A 64-byte tile at a time, computed into registers and written to dst and, when not null,
  // dst2: each with non-temporal stores when its flag says so (that one 16-byte aligned), or
  // with ordinary ones, staying in cache for the core that reads it next. No __restrict: an
  // output may be an input (in place), each tile read before it is written.
  template <bool kStreamDst, bool kStreamDst2>
  static void final_tiles(void* dst, void* dst2, const void* a, const void* b, size_t n,
                          int divisor) {
    constexpr size_t kTile = 64 / sizeof(T);
    alignas(64) T tile[kTile];
    T* d = static_cast<T*>(dst);
    T* d2 = static_cast<T*>(dst2);
    const A* pa = static_cast<const A*>(a);
    const T* pb = static_cast<const T*>(b);
    auto put = [&](T* p, bool stream) {
      if (stream)
        stream_tile(p, tile);
      else
        std::memcpy(p, tile, sizeof tile);
    };
    finishing(divisor, [&](auto fin) {
      for (size_t i = 0; i < n; i += kTile) {
        const size_t m = std::min(kTile, n - i);
        for (size_t j = 0; j < m; ++j)
          tile[j] = Acc<T>::store(fin(Op::apply(pa[i + j], Acc<T>::load(pb[i + j]))));
        if (m == kTile) {
          put(d + i, kStreamDst);
          if (d2 != nullptr) put(d2 + i, kStreamDst2);
        } else {
          std::memcpy(d + i, tile, m * sizeof(T));
          if (d2 != nullptr) std::memcpy(d2 + i, tile, m * sizeof(T));
        }
      }
    });
  }

  static constexpr ReduceKernels table{&load,
                                       &reduce,
                                       &combine,
                                       &finalize,
                                       &reduce_final,
                                       &final_tiles<true, true>,
                                       &final_tiles<true, false>,
                                       &final_tiles<false, true>};
};

template <class T>
constexpr ReduceKernels kernels_for(RedOp op) {
  switch (op) {
    case RedOp::Sum:
      return Kernels<T, OpSum, false>::table;
    case RedOp::Prod:
      return Kernels<T, OpProd, false>::table;
    case RedOp::Min:
      return Kernels<T, OpMin, false>::table;
    case RedOp::Max:
      return Kernels<T, OpMax, false>::table;
    case RedOp::Avg:
      return Kernels<T, OpSum, true>::table;
  }
  return Kernels<T, OpSum, false>::table;
}

template <class T>
struct Row {
  ReduceKernels k[kNumRedOps] = {kernels_for<T>(RedOp::Sum), kernels_for<T>(RedOp::Prod),
                                 kernels_for<T>(RedOp::Min), kernels_for<T>(RedOp::Max),
                                 kernels_for<T>(RedOp::Avg)};
};

}  // namespace

const ReduceKernels& reduce_kernels(DType t, RedOp op) {
  static const Row<int8_t> i8;
  static const Row<uint8_t> u8;
  static const Row<int32_t> i32;
  static const Row<int64_t> i64;
  static const Row<Half> f16;
  static const Row<BFloat16> bf16;
  static const Row<float> f32;
  static const Row<double> f64;
  const int o = static_cast<int>(op);
  switch (t) {
    case DType::Int8:
      return i8.k[o];
    case DType::UInt8:
      return u8.k[o];
    case DType::Int32:
      return i32.k[o];
    case DType::Int64:
      return i64.k[o];
    case DType::Float16:
      return f16.k[o];
    case DType::BFloat16:
      return bf16.k[o];
    case DType::Float32:
      return f32.k[o];
    case DType::Float64:
      return f64.k[o];
  }
  return f32.k[o];
}

namespace {

// glibc before 2.39 copies from about 2 KiB up with `rep movsb`, which on AMD Zen runs at
// 1.6-2.6 GB/s instead of about 40 when the destination lies 1-31 bytes after the source
// modulo the page size (glibc bug 30994): a numpy array at page + 16 filled from a
// page-aligned staging slot, or an input copied into an output 16 bytes further into its page.
bool short_distance(const void* dst, const void* src) {
  const uintptr_t gap =
      (reinterpret_cast<uintptr_t>(dst) - reinterpret_cast<uintptr_t>(src)) & 4095;
  return gap != 0 && gap < 64;
}

#if defined(__SSE2__)
// Copies the whole 64-byte runs of [s, s + bytes) to d with 16-byte vector loads and stores
// (streaming stores, which need d 16-byte aligned, when kStream); returns the bytes copied.
template <bool kStream>
size_t copy_runs(uint8_t* d, const uint8_t* s, size_t bytes) {
  auto store = [](uint8_t* p, __m128i v) {
    if constexpr (kStream)
      _mm_stream_si128(reinterpret_cast<__m128i*>(p), v);
    else
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p), v);
  };
  size_t i = 0;
  for (; i + 64 <= bytes; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
    store(d + i, a);
    store(d + i + 16, b);
    store(d + i + 32, c);
    store(d + i + 48, e);
  }
  return i;
}
#endif

// Forward copy without string instructions; the ranges do not overlap.
void vector_copy(uint8_t* d, const uint8_t* s, size_t bytes) {
#if defined(__SSE2__)
  const size_t i = copy_runs<false>(d, s, bytes);
  std::memcpy(d + i, s + i, bytes - i);  // under 64 bytes: no string instruction either
#else
  std::memcpy(d, s, bytes);
#endif
}

}  // namespace

void copy_bytes(void* dst, const void* src, size_t bytes) {
  if (dst == src || bytes == 0) return;
  auto* d = static_cast<uint8_t*>(dst);
  const auto* s = static_cast<const uint8_t*>(src);
  const bool overlap = d < s + bytes && s < d + bytes;
  if (!overlap && bytes >= 1024 && short_distance(d, s))
    vector_copy(d, s, bytes);
  else
    std::memmove(d, s, bytes);
}

void stream_copy(void* dst, const void* src, size_t bytes) {
#if defined(__SSE2__)
  auto* d = static_cast<uint8_t*>(dst);
  const auto* s = static_cast<const uint8_t*>(src);
  // Head up to 16-byte alignment of the destination.
  const size_t head = std::min(bytes, (16 - (reinterpret_cast<uintptr_t>(d) & 15)) & 15);
  std::memcpy(d, s, head);
  d += head;
  s += head;
  bytes -= head;
  size_t i = copy_runs<true>(d, s, bytes);
  for (; i + 16 <= bytes; i += 16)
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i),
                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
  std::memcpy(d + i, s + i, bytes - i);
#else
  std::memcpy(dst, src, bytes);
#endif
}

void stream_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

void fold_rows(DType t, RedOp op, const void* rows, size_t nrows, size_t count, void* out,
               int divisor) {
  if (nrows == 0) return;
  const ReduceKernels& k = reduce_kernels(t, op);
  const size_t row_bytes = count * dtype_size(t);
  std::vector<uint8_t> acc(count * acc_size(t));
  for (size_t q = 0; q < nrows; ++q)
    fold_rank(k, acc_size(t), acc.data(), static_cast<int>(q), /*elems=*/true,
              static_cast<const uint8_t*>(rows) + q * row_bytes, count);
  k.finalize(out, nullptr, acc.data(), count, divisor);
}

}  // namespace pycoll
