#include "tiermem/dtype.h"

#include <cmath>
#include <limits>
#include <random>

#include <gtest/gtest.h>

namespace tiermem {
namespace {

TEST(DType, Bf16RoundTripAndRounding) {
  for (float f : {0.0f, 1.0f, -2.5f, 3.140625f, 0x1p-100f, 0x1p100f}) {
    EXPECT_EQ(bf16_to_f32(f32_to_bf16(f)), f) << f;  // exactly representable
  }
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even -> 1.
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + 1.0f / 256)), 1.0f);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isinf(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::infinity()))));
}

TEST(DType, F16MatchesReferenceRounding) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> d(-70000.0f, 70000.0f);
  for (int i = 0; i < 100000; ++i) {
    float f = d(rng) * (i % 3 == 0 ? 1e-6f : 1.0f);
    float back = f16_to_f32(f32_to_f16(f));
    if (std::fabs(f) >= 65520.0f) {
      EXPECT_TRUE(std::isinf(back)) << f;
    } else {
      // relative error of round-to-nearest fp16 is at most 2^-11 for normals.
      float tol = std::max(std::fabs(f) * (1.0f / 2048.0f), 2.98e-8f);
      EXPECT_LE(std::fabs(back - f), tol) << f;
    }
  }
  EXPECT_EQ(f16_to_f32(f32_to_f16(65504.0f)), 65504.0f);
  EXPECT_EQ(f32_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(f32_to_f16(-2.0f), 0xc000);
  EXPECT_EQ(f16_to_f32(0x0001), std::ldexp(1.0f, -24));
}

}  // namespace
}  // namespace tiermem
