// float16 and bfloat16 <-> float32, round to nearest even (as numpy and ml_dtypes do).
#pragma once

#include <cstdint>
#include <cstring>

namespace pycoll {

struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float f32_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float to_float(Half h) {
  // Scale the exponent by magic multiplication; handles subnormals, inf and nan.
  const uint32_t shifted_exp = 0x7c00u << 13;
  uint32_t o = (h.bits & 0x7fffu) << 13;
  uint32_t exp = shifted_exp & o;
  o += (127 - 15) << 23;
  if (exp == shifted_exp) {
    o += (128 - 16) << 23;  // inf / nan
  } else if (exp == 0) {
    o += 1 << 23;  // zero / subnormal: renormalise
    o = f32_bits(f32_from_bits(o) - f32_from_bits(113u << 23));
  }
  o |= (h.bits & 0x8000u) << 16;
  return f32_from_bits(o);
}

inline Half to_half(float f) {
  const uint32_t f32_inf = 255u << 23;
  const uint32_t f16_max = (127u + 16u) << 23;
  const uint32_t denorm_magic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
  uint32_t u = f32_bits(f);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  uint16_t o;
  if (u >= f16_max) {
    o = (u > f32_inf) ? 0x7e00 : 0x7c00;
  } else if (u < (113u << 23)) {
    // Subnormal result: let the FPU round by adding a magic number.
    o = static_cast<uint16_t>(f32_bits(f32_from_bits(u) + f32_from_bits(denorm_magic)) -
                              denorm_magic);
  } else {
    uint32_t mant_odd = (u >> 13) & 1;
    u += (static_cast<uint32_t>(15 - 127) << 23) + 0xfff;
    u += mant_odd;
    o = static_cast<uint16_t>(u >> 13);
  }
  return Half{static_cast<uint16_t>(o | (sign >> 16))};
}

inline float to_float(BFloat16 b) { return f32_from_bits(static_cast<uint32_t>(b.bits) << 16); }

inline BFloat16 to_bfloat16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return BFloat16{static_cast<uint16_t>((u >> 16) | 0x40)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return BFloat16{static_cast<uint16_t>(u >> 16)};
}

}  // namespace pycoll
