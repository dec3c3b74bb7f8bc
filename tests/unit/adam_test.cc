// AdamW kernels (scalar / AVX2 / AVX-512) against a double-precision evaluation of the formula in
// include/tiermem/adam.h. Tolerance per step, for master, m and v: |x - ref| <= 1e-6 * scale + 1e-9,
// where scale is the sum of the magnitudes of the terms the value is computed from (m = b1*m + (1-b1)*g
// cancels, so |ref| alone would demand more than fp32 can give).
#include "tiermem/adam.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "tiermem/error.h"

namespace tiermem {
namespace {

struct State {
  std::vector<float> p, g, m, v;
  std::vector<double> sp, sm, sv;  // reference only: magnitude scales of the last step
};

State make_state(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  State s;
  s.p.resize(n); s.g.resize(n); s.m.resize(n); s.v.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    s.p[i] = d(rng);
    s.g[i] = d(rng) * 0.1f;
    s.m[i] = d(rng) * 0.01f;
    s.v[i] = std::abs(d(rng)) * 1e-3f;
  }
  return s;
}

// The formula of adam.h in double, from fp32 inputs; results rounded to fp32 for comparison.
void reference_step(const AdamParams& a, State& s) {
  double t = static_cast<double>(a.step);
  double bc1 = 1.0 - std::pow(static_cast<double>(a.beta1), t);
  double bc2 = 1.0 - std::pow(static_cast<double>(a.beta2), t);
  const std::size_t n = s.p.size();
  s.sp.resize(n); s.sm.resize(n); s.sv.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    double g = static_cast<double>(s.g[i]) * a.grad_scale;
    double m = a.beta1 * static_cast<double>(s.m[i]) + (1.0 - a.beta1) * g;
    double v = a.beta2 * static_cast<double>(s.v[i]) + (1.0 - a.beta2) * g * g;
    double p = static_cast<double>(s.p[i]) * (1.0 - static_cast<double>(a.lr) * a.weight_decay);
    double upd = (a.lr / bc1) * m / (std::sqrt(v) / std::sqrt(bc2) + a.eps);
    s.sm[i] = std::abs(a.beta1 * static_cast<double>(s.m[i])) + std::abs((1.0 - a.beta1) * g);
    s.sv[i] = std::abs(v);
    // the update's relative error follows m's (its only cancelling input)
    s.sp[i] = std::abs(p) + std::abs(upd) * (1.0 + s.sm[i] / std::max(std::abs(m), 1e-30));
    p -= upd;
    s.p[i] = static_cast<float>(p);
    s.m[i] = static_cast<float>(m);
    s.v[i] = static_cast<float>(v);
  }
}

bool close(float x, float ref, double scale = 0) {
  double s = std::max(std::abs(static_cast<double>(ref)), scale);
  return std::abs(static_cast<double>(x) - ref) <= 1e-6 * s + 1e-9;
}

std::vector<AdamIsa> isas() { return {AdamIsa::kScalar, AdamIsa::kAvx2, AdamIsa::kAvx512}; }

class AdamIsaTest : public ::testing::TestWithParam<AdamIsa> {
 protected:
  void SetUp() override {
    if (!adam_isa_supported(GetParam())) {
      GTEST_SKIP() << "this CPU has no " << adam_isa_name(GetParam()) << " (cpuid); kernel not tested here";
    }
  }
};

TEST_P(AdamIsaTest, MatchesDoubleReferenceForEveryLengthAndStep) {
  AdamParams a;
  a.lr = 1e-2f;
  a.weight_decay = 0.1f;
  a.grad_scale = 0.5f;
  for (std::size_t n : {0ul, 1ul, 3ul, 7ul, 8ul, 9ul, 15ul, 16ul, 17ul, 31ul, 33ul, 1000ul,
                        (1ul << 16) * 2 + 13}) {
    for (DType hd : {DType::kBF16, DType::kF16}) {
      State s = make_state(n, static_cast<unsigned>(n) + 7);
      State r = s;
      std::vector<std::uint16_t> half(n + 1, 0xdead);
      for (std::int64_t t = 1; t <= 3; ++t) {
        a.step = t;
        adam_step(a, s.p.data(), s.g.data(), s.m.data(), s.v.data(), n, half.data(), hd,
                  {GetParam(), 2});
        for (std::size_t i = 0; i < n; ++i) {
          std::uint16_t want = hd == DType::kBF16 ? f32_to_bf16(s.p[i]) : f32_to_f16(s.p[i]);
          ASSERT_EQ(half[i], want) << "half copy n=" << n << " i=" << i;
        }
        reference_step(a, r);
        for (std::size_t i = 0; i < n; ++i) {
          ASSERT_TRUE(close(s.p[i], r.p[i], r.sp[i])) << "n=" << n << " t=" << t << " i=" << i << " p=" << s.p[i] << " ref=" << r.p[i];
          ASSERT_TRUE(close(s.m[i], r.m[i], r.sm[i])) << "n=" << n << " i=" << i << " m=" << s.m[i] << " ref=" << r.m[i];
          ASSERT_TRUE(close(s.v[i], r.v[i], r.sv[i])) << "n=" << n << " i=" << i;
          // keep both sides on the same fp32 state so errors do not compound across steps
          s.p[i] = r.p[i]; s.m[i] = r.m[i]; s.v[i] = r.v[i];
        }
        ASSERT_EQ(half[n], 0xdead) << "wrote past the end of the half buffer, n=" << n;
      }
    }
  }
}

TEST_P(AdamIsaTest, NoHalfBufferLeavesStateSameAsWithOne) {
  const std::size_t n = 4099;
  State s1 = make_state(n, 3), s2 = s1;
  std::vector<std::uint16_t> half(n);
  AdamParams a;
  a.weight_decay = 0.01f;
  adam_step(a, s1.p.data(), s1.g.data(), s1.m.data(), s1.v.data(), n, nullptr, DType::kBF16, {GetParam(), 1});
  adam_step(a, s2.p.data(), s2.g.data(), s2.m.data(), s2.v.data(), n, half.data(), DType::kBF16, {GetParam(), 1});
  EXPECT_EQ(s1.p, s2.p);
  EXPECT_EQ(s1.m, s2.m);
  EXPECT_EQ(s1.v, s2.v);
}

// An fp32 copy (DType::kF32: fp32 working params) is the new master exactly, at every length
// (one chunk, several, a tail), and the state is the same as without it.
TEST_P(AdamIsaTest, Fp32CopyIsTheNewMasterAndChangesNothingElse) {
  for (std::size_t n : {0ul, 5ul, 4099ul, (1ul << 16) * 3 + 7}) {
    State s1 = make_state(n, 11), s2 = s1;
    std::vector<float> copy(n + 1, -7.0f);
    AdamParams a;
    a.weight_decay = 0.01f;
    a.step = 2;
    adam_step(a, s1.p.data(), s1.g.data(), s1.m.data(), s1.v.data(), n, nullptr, DType::kBF16, {GetParam(), 2});
    adam_step(a, s2.p.data(), s2.g.data(), s2.m.data(), s2.v.data(), n, copy.data(), DType::kF32, {GetParam(), 2});
    EXPECT_EQ(s1.p, s2.p) << "n=" << n;
    EXPECT_EQ(s1.m, s2.m) << "n=" << n;
    EXPECT_EQ(s1.v, s2.v) << "n=" << n;
    for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(copy[i], s2.p[i]) << "n=" << n << " i=" << i;
    EXPECT_EQ(copy[n], -7.0f) << "wrote past the end of the copy, n=" << n;
  }
}

// The vector kernels peel a head so that the copy can be streamed from an aligned address: the
// state and the copy must not depend on where the copy (or the state) starts.
TEST_P(AdamIsaTest, CopyAlignmentDoesNotChangeResults) {
  const std::size_t n = 1000;
  State ref = make_state(n + 40, 9);
  std::vector<std::uint16_t> ref_half(n + 40);
  AdamParams a;
  a.weight_decay = 0.01f;
  a.step = 3;
  {
    State s = ref;
    adam_step(a, s.p.data(), s.g.data(), s.m.data(), s.v.data(), n, ref_half.data(), DType::kBF16,
              {GetParam(), 1});
    ref = s;
  }
  State base = make_state(n + 40, 9);
  for (std::size_t half_off : {1u, 3u, 8u, 15u, 17u}) {
    for (std::size_t state_off : {0u, 5u}) {
      std::vector<std::uint16_t> half(n + 64, 0xdead);
      // The same n elements, starting state_off elements in, copied to half + half_off.
      State t = base;
      std::copy(base.p.begin(), base.p.begin() + n, t.p.begin() + state_off);
      std::copy(base.g.begin(), base.g.begin() + n, t.g.begin() + state_off);
      std::copy(base.m.begin(), base.m.begin() + n, t.m.begin() + state_off);
      std::copy(base.v.begin(), base.v.begin() + n, t.v.begin() + state_off);
      adam_step(a, t.p.data() + state_off, t.g.data() + state_off, t.m.data() + state_off,
                t.v.data() + state_off, n, half.data() + half_off, DType::kBF16, {GetParam(), 1});
      for (std::size_t i = 0; i < n; ++i) {
        ASSERT_EQ(f32_bits(t.p[state_off + i]), f32_bits(ref.p[i])) << "i=" << i << " half_off=" << half_off;
        ASSERT_EQ(f32_bits(t.m[state_off + i]), f32_bits(ref.m[i])) << "i=" << i;
        ASSERT_EQ(f32_bits(t.v[state_off + i]), f32_bits(ref.v[i])) << "i=" << i;
        ASSERT_EQ(half[half_off + i], ref_half[i]) << "i=" << i << " half_off=" << half_off;
      }
      ASSERT_EQ(half[half_off + n], 0xdead) << "wrote past the copy, half_off=" << half_off;
      ASSERT_EQ(half[half_off - 1], 0xdead) << "wrote before the copy, half_off=" << half_off;
    }
  }
}

TEST_P(AdamIsaTest, ThreadCountDoesNotChangeResults) {
  const std::size_t n = (1ul << 16) * 5 + 77;
  State s1 = make_state(n, 5), s2 = s1;
  AdamParams a;
  adam_step(a, s1.p.data(), s1.g.data(), s1.m.data(), s1.v.data(), n, nullptr, DType::kBF16, {GetParam(), 1});
  adam_step(a, s2.p.data(), s2.g.data(), s2.m.data(), s2.v.data(), n, nullptr, DType::kBF16, {GetParam(), 3});
  EXPECT_EQ(s1.p, s2.p);
  EXPECT_EQ(s1.v, s2.v);
}

TEST_P(AdamIsaTest, NonFiniteGradientPoisonsOnlyItsElement) {
  const std::size_t n = 37;
  State s = make_state(n, 11);
  State r = s;
  s.g[5] = std::numeric_limits<float>::quiet_NaN();
  s.g[20] = std::numeric_limits<float>::infinity();
  r.g[5] = r.g[20] = 0.0f;  // the reference for the untouched elements
  std::vector<std::uint16_t> half(n);
  AdamParams a;
  adam_step(a, s.p.data(), s.g.data(), s.m.data(), s.v.data(), n, half.data(), DType::kBF16, {GetParam(), 1});
  reference_step(a, r);
  EXPECT_TRUE(std::isnan(s.p[5]));
  EXPECT_TRUE(std::isnan(s.m[5]));
  EXPECT_TRUE(std::isnan(s.p[20]));
  EXPECT_TRUE(std::isinf(s.m[20]));
  EXPECT_TRUE(std::isinf(s.v[20]));
  EXPECT_TRUE(std::isnan(bf16_to_f32(half[5])));
  for (std::size_t i = 0; i < n; ++i) {
    if (i == 5 || i == 20) continue;
    EXPECT_TRUE(close(s.p[i], r.p[i], r.sp[i])) << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Isa, AdamIsaTest, ::testing::ValuesIn(isas()),
                         [](const auto& info) { return std::string(adam_isa_name(info.param)); });

TEST(Adam, VectorKernelsAgreeWithScalarTwin) {
  const std::size_t n = 10007;
  State base = make_state(n, 17);
  State sc = base;
  AdamParams a;
  a.weight_decay = 0.05f;
  adam_step(a, sc.p.data(), sc.g.data(), sc.m.data(), sc.v.data(), n, nullptr, DType::kBF16, {AdamIsa::kScalar, 1});
  int tested = 0;
  for (AdamIsa isa : {AdamIsa::kAvx2, AdamIsa::kAvx512}) {
    if (!adam_isa_supported(isa)) continue;
    State s = base;
    adam_step(a, s.p.data(), s.g.data(), s.m.data(), s.v.data(), n, nullptr, DType::kBF16, {isa, 1});
    for (std::size_t i = 0; i < n; ++i) ASSERT_TRUE(close(s.p[i], sc.p[i])) << adam_isa_name(isa) << " i=" << i;
    ++tested;
  }
  if (tested == 0) GTEST_SKIP() << "no vector ISA on this CPU";
}

TEST(Adam, BestIsaIsSupported) {
  EXPECT_NE(adam_best_isa(), AdamIsa::kAuto);
  EXPECT_TRUE(adam_isa_supported(adam_best_isa()));
}

TEST(Adam, RejectsBadHalfDtypeAndUnsupportedIsa) {
  State s = make_state(4, 1);
  std::vector<float> out(4);
  EXPECT_THROW(adam_step({}, s.p.data(), s.g.data(), s.m.data(), s.v.data(), 4, out.data(), DType::kI32),
               NotSupportedError);
  if (!adam_isa_supported(AdamIsa::kAvx512)) {
    EXPECT_THROW(adam_step({}, s.p.data(), s.g.data(), s.m.data(), s.v.data(), 4, nullptr, DType::kBF16,
                           {AdamIsa::kAvx512, 1}),
                 NotSupportedError);
  }
}

TEST(Adam, CountNonfinite) {
  std::vector<float> x(300000, 1.0f);
  EXPECT_EQ(count_nonfinite(x.data(), x.size()), 0u);
  x[0] = std::numeric_limits<float>::infinity();
  x[12345] = -std::numeric_limits<float>::infinity();
  x[299999] = std::numeric_limits<float>::quiet_NaN();
  x[7] = std::numeric_limits<float>::max();
  EXPECT_EQ(count_nonfinite(x.data(), x.size()), 3u);
  EXPECT_EQ(count_nonfinite(x.data(), 0), 0u);
}

}  // namespace
}  // namespace tiermem
