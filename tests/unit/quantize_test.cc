// tests/unit/quantize_test.cc — frozen values at rest (tiermem/quantize.h): int8 per-group absmax
// round trip within its stated bound (half a group's absmax/127, plus one fp32 rounding), the
// AVX-512 dequantize equal to its scalar twin bit for bit (odd lengths, tails, every code), the
// shard layout's byte counts, bf16 at rest equal to the bf16 cast, the conversion into each
// working dtype, and the errors (a non-finite value, a write not at a group start).
#include "tiermem/quantize.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "tiermem/error.h"

namespace tiermem {
namespace {

constexpr std::size_t G = kInt8GroupElems;

std::vector<float> random_values(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 0.02f);
  std::vector<float> x(n);
  for (auto& v : x) v = d(rng);
  // Groups of different scales, an all-zero group and one outlier, as real weights have.
  for (std::size_t i = 0; i < std::min<std::size_t>(n, G); ++i) x[i] *= 100.0f;
  if (n >= 3 * G) std::fill(x.begin() + 2 * G, x.begin() + 3 * G, 0.0f);
  if (n > 5 * G) x[5 * G - 1] = 3.0f;
  return x;
}

TEST(Quantize, AtRestBytes) {
  EXPECT_EQ(at_rest_bytes(FrozenDtype::kWorking, 1024, 4), 4096u);
  EXPECT_EQ(at_rest_bytes(FrozenDtype::kWorking, 1024, 2), 2048u);
  EXPECT_EQ(at_rest_bytes(FrozenDtype::kBF16, 1024, 4), 2048u);
  EXPECT_EQ(at_rest_bytes(FrozenDtype::kInt8, 1024, 4), 1024u + 4u * 8u);
  EXPECT_EQ(at_rest_bytes(FrozenDtype::kInt8, 129, 4), 129u + 8u);  // a partial last group has a scale
  EXPECT_EQ(frozen_dtype_of("auto", DType::kF32), FrozenDtype::kWorking);
  EXPECT_EQ(frozen_dtype_of("bf16", DType::kF32), FrozenDtype::kBF16);
  EXPECT_EQ(frozen_dtype_of("bf16", DType::kBF16), FrozenDtype::kWorking);  // already bf16
  EXPECT_EQ(frozen_dtype_of("int8", DType::kBF16), FrozenDtype::kInt8);
}

TEST(Quantize, Int8RoundTripWithinHalfAStep) {
  for (std::size_t n : {std::size_t{1}, std::size_t{127}, G, G + 1, 7 * G + 33, std::size_t{8192}}) {
    const std::vector<float> x = random_values(n, static_cast<unsigned>(n));
    std::vector<std::int8_t> q(n);
    std::vector<float> s((n + G - 1) / G), y(n);
    quantize_int8_n(x.data(), n, q.data(), s.data());
    dequantize_int8_n(q.data(), s.data(), n, y.data(), CastIsa::kScalar);
    for (std::size_t g = 0; g < s.size(); ++g) {
      float amax = 0;
      for (std::size_t i = g * G; i < std::min(n, g * G + G); ++i) amax = std::max(amax, std::fabs(x[i]));
      ASSERT_EQ(s[g], amax / 127.0f) << "group " << g;
      for (std::size_t i = g * G; i < std::min(n, g * G + G); ++i) {
        const float bound = s[g] / 2 + std::fabs(x[i]) * std::numeric_limits<float>::epsilon();
        ASSERT_LE(std::fabs(y[i] - x[i]), bound) << "n " << n << " element " << i;
        ASSERT_GE(q[i], -127);
      }
    }
    if (n >= 3 * G) {  // the all-zero group reads back zeros, its scale 0
      EXPECT_EQ(s[2], 0.0f);
      EXPECT_EQ(y[2 * G], 0.0f);
    }
  }
}

TEST(Quantize, Avx512DequantizeIsItsScalarTwin) {
  if (!cast_isa_supported(CastIsa::kAvx512)) GTEST_SKIP() << "no AVX-512 on this CPU: the scalar kernel only";
  for (std::size_t n : {std::size_t{1}, std::size_t{15}, std::size_t{17}, G - 1, G, 3 * G + 5, std::size_t{4096}}) {
    std::vector<std::int8_t> q(n);
    for (std::size_t i = 0; i < n; ++i) q[i] = static_cast<std::int8_t>(static_cast<int>(i * 37 % 255) - 127);
    std::vector<float> s((n + G - 1) / G);
    for (std::size_t g = 0; g < s.size(); ++g) s[g] = 0.001f * static_cast<float>(g + 1) / 3.0f;
    std::vector<float> a(n + 1, -1.0f), b(n + 1, -1.0f);  // one guard element each
    dequantize_int8_n(q.data(), s.data(), n, a.data(), CastIsa::kScalar);
    dequantize_int8_n(q.data(), s.data(), n, b.data(), CastIsa::kAvx512);
    ASSERT_EQ(std::memcmp(a.data(), b.data(), (n + 1) * sizeof(float)), 0) << "n " << n;
    EXPECT_EQ(b[n], -1.0f);  // the masked tail wrote nothing past n
  }
}

TEST(Quantize, ShardIntoEachWorkingDtype) {
  const std::size_t n = 4 * 1024;
  const std::vector<float> x = random_values(n, 7);
  for (FrozenDtype d : {FrozenDtype::kBF16, FrozenDtype::kInt8}) {
    std::vector<std::byte> rest(at_rest_bytes(d, n, 4));
    // Written in two pieces, the second starting at a group boundary, as the engine's chunks are.
    write_at_rest(d, x.data(), 0, 1024, n, rest.data());
    write_at_rest(d, x.data() + 1024, 1024, n, n, rest.data());
    std::vector<float> f(n);
    read_at_rest(d, rest.data(), n, DType::kF32, f.data());
    if (d == FrozenDtype::kBF16) {  // the bf16 cast exactly
      for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(f[i], bf16_to_f32(f32_to_bf16(x[i]))) << i;
    }
    for (DType w : {DType::kBF16, DType::kF16}) {  // the f32 values, narrowed
      std::vector<std::uint16_t> h(n);
      read_at_rest(d, rest.data(), n, w, h.data());
      for (std::size_t i = 0; i < n; ++i) {
        ASSERT_EQ(h[i], w == DType::kBF16 ? f32_to_bf16(f[i]) : f32_to_f16(f[i])) << i;
      }
    }
  }
}

TEST(Quantize, RefusesWhatInt8CannotHold) {
  std::vector<float> x(2 * G, 0.5f);
  std::vector<std::int8_t> q(x.size());
  std::vector<float> s(2);
  x[G + 3] = std::numeric_limits<float>::quiet_NaN();
  try {
    quantize_int8_n(x.data(), x.size(), q.data(), s.data());
    FAIL() << "a NaN was quantized";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("element 131"), std::string::npos) << e.what();
  }
  x[G + 3] = std::numeric_limits<float>::infinity();
  EXPECT_THROW(quantize_int8_n(x.data(), x.size(), q.data(), s.data()), Error);
  std::vector<std::byte> rest(at_rest_bytes(FrozenDtype::kInt8, 4 * G, 4));
  EXPECT_THROW(write_at_rest(FrozenDtype::kInt8, x.data(), 3, 10, 4 * G, rest.data()), Error);  // not a group start
}

}  // namespace
}  // namespace tiermem
