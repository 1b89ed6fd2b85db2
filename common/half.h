// 16-bit float storage types: bfloat16 (the KV and weight format) and IEEE fp16 (accepted from
// checkpoints). Conversions to float are exact; float -> bf16 rounds to nearest even, as PyTorch
// does, so weights we round here match weights rounded there bit for bit.
#ifndef FLUXION_COMMON_HALF_H_
#define FLUXION_COMMON_HALF_H_

#include <cstdint>
#include <cstring>

namespace fluxion {

struct bf16 {
  uint16_t bits;
};
struct fp16 {
  uint16_t bits;
};

inline float Bf16ToFloat(bf16 h) {
  uint32_t u = static_cast<uint32_t>(h.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline bf16 FloatToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{static_cast<uint16_t>((u >> 16) | 0x40)};  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return bf16{static_cast<uint16_t>(u >> 16)};
}

// Rounds a float to the nearest bf16 value and back.
inline float RoundToBf16(float f) { return Bf16ToFloat(FloatToBf16(f)); }

inline float Fp16ToFloat(fp16 h) {
  const uint32_t sign = static_cast<uint32_t>(h.bits & 0x8000u) << 16;
  uint32_t exp = (h.bits >> 10) & 0x1fu;
  uint32_t mant = h.bits & 0x3ffu;
  uint32_t u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (mant << 13);  // inf / NaN
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    u = sign;  // +-0
  } else {
    // Subnormal: normalise the mantissa.
    exp = 113;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --exp;
    }
    u = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline fp16 FloatToFp16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return fp16{static_cast<uint16_t>(sign | 0x7e00u)};  // NaN
  if (abs >= 0x477ff000u) return fp16{static_cast<uint16_t>(sign | 0x7c00u)};  // overflow -> inf
  if (abs < 0x38800000u) {
    // Subnormal or zero in fp16: scale into integer mantissa with round-to-nearest-even.
    if (abs < 0x33000000u) return fp16{sign};
    const uint32_t e = abs >> 23;
    const uint32_t m = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e;
    uint32_t half_m = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (half_m & 1u))) ++half_m;
    return fp16{static_cast<uint16_t>(sign | half_m)};
  }
  uint32_t r = abs + 0xfffu + ((abs >> 13) & 1u) - (112u << 23);
  return fp16{static_cast<uint16_t>(sign | (r >> 13))};
}

}  // namespace fluxion

#endif  // FLUXION_COMMON_HALF_H_
