#include "common/half.h"

#include <cmath>
#include <cstring>
#include <limits>

#include "gtest/gtest.h"

namespace fluxion {
namespace {

TEST(HalfTest, Bf16RoundTripIsExactForEveryBf16Value) {
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    bf16 h{static_cast<uint16_t>(bits)};
    float f = Bf16ToFloat(h);
    if (std::isnan(f)) continue;
    EXPECT_EQ(FloatToBf16(f).bits, h.bits) << bits;
  }
}

TEST(HalfTest, Bf16RoundsToNearestEven) {
  // 1 + 2^-8 lies exactly between two bf16 values (1 and 1 + 2^-7): ties go to the even one (1).
  EXPECT_EQ(RoundToBf16(1.0f + std::ldexp(1.0f, -8)), 1.0f);
  // Just above the tie rounds up.
  EXPECT_EQ(RoundToBf16(1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20)),
            1.0f + std::ldexp(1.0f, -7));
}

TEST(HalfTest, Fp16RoundTripIsExactForEveryFiniteFp16Value) {
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    fp16 h{static_cast<uint16_t>(bits)};
    float f = Fp16ToFloat(h);
    if (std::isnan(f)) continue;
    EXPECT_EQ(FloatToFp16(f).bits, h.bits) << bits;
  }
}

TEST(HalfTest, Fp16DecodesKnownValues) {
  EXPECT_EQ(Fp16ToFloat(fp16{0x3c00}), 1.0f);
  EXPECT_EQ(Fp16ToFloat(fp16{0xc000}), -2.0f);
  EXPECT_EQ(Fp16ToFloat(fp16{0x7bff}), 65504.0f);
  EXPECT_EQ(Fp16ToFloat(fp16{0x0001}), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_TRUE(std::isinf(Fp16ToFloat(fp16{0x7c00})));
}

}  // namespace
}  // namespace fluxion
