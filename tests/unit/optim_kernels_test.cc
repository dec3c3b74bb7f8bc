// Lion and Adagrad kernels (include/tiermem/optim_kernels.h).
//  - Every ISA kernel the CPU has (AVX2, AVX-512) against the scalar twin: bit for bit (NaN: both
//    NaN), master, state and the bf16/fp16/fp32 copy, at lengths 0, 1, 15, 16, 17, 31, 33, 1003
//    and 2 chunks + 13 (threads), with grad_scale != 1 and weight decay, 3 steps.
//  - The scalar twin against the formulas in double over 10 steps, each step from the kernel's own
//    fp32 state (errors do not compound). Tolerance |x - ref| <= kRelTol * scale, scale the sum of
//    the magnitudes of the terms x is computed from (a difference can cancel, so |ref| alone would
//    ask more than fp32 gives). Measured on this data (x86-64, glibc): Lion master 1.1e-7,
//    m 1.2e-7; Adagrad master 7.7e-8, sum 7.7e-8 (the test prints them); kRelTol = 5e-7 (~4 ulp).
//    Lion elements whose direction c is within kRelTol of zero have no fp32-knowable sign and are
//    skipped (counted; none on this data).
#include "tiermem/optim_kernels.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "tiermem/error.h"

namespace tiermem {
namespace {

constexpr double kRelTol = 5e-7;

struct State {
  std::vector<float> p, g, s;  // master, gradient, optimizer state (m or sum)
};

// Random state with a few exact zeros (Lion's sign(0); Adagrad's zero gradients). sum >= 0.
State make_state(std::size_t n, unsigned seed, bool nonneg_state) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  State st;
  st.p.resize(n); st.g.resize(n); st.s.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    st.p[i] = d(rng);
    st.g[i] = i % 97 == 5 ? 0.0f : d(rng) * 0.1f;
    float s = d(rng) * 0.01f;
    st.s[i] = i % 89 == 3 ? 0.0f : nonneg_state ? std::abs(s) : s;
  }
  return st;
}

bool same(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || f32_bits(a) == f32_bits(b);
}

std::vector<AdamIsa> vector_isas() { return {AdamIsa::kAvx2, AdamIsa::kAvx512}; }

const std::size_t kLengths[] = {0, 1, 15, 16, 17, 31, 33, 1003, (1u << 16) * 2 + 13};
const DType kCopies[] = {DType::kBF16, DType::kF16, DType::kF32};

// Runs `step(state, isa, threads, half, dtype)` three times on the scalar twin and on `isa` from
// the same data, with each copy kind (and none), and requires bit-identical results.
template <class Step>
void expect_equal_to_scalar_twin(AdamIsa isa, bool nonneg_state, Step step) {
  for (std::size_t n : kLengths) {
    for (int copy = -1; copy < 3; ++copy) {
      const bool has_copy = copy >= 0;
      const DType dt = has_copy ? kCopies[copy] : DType::kBF16;
      const std::size_t elem = dtype_size(dt);
      State a = make_state(n, static_cast<unsigned>(n) * 7 + 1, nonneg_state), b = a;
      // one spare element past the end (a sentinel) in each copy buffer
      std::vector<unsigned char> ha((n + 1) * elem, 0xab), hb((n + 1) * elem, 0xab);
      for (int t = 1; t <= 3; ++t) {
        step(a, t, AdamIsa::kScalar, 1, has_copy ? ha.data() : nullptr, dt);
        step(b, t, isa, 3, has_copy ? hb.data() : nullptr, dt);
        const std::string where = "n=" + std::to_string(n) + " copy=" + std::to_string(copy) +
                                  " t=" + std::to_string(t);
        for (std::size_t i = 0; i < n; ++i) {
          ASSERT_TRUE(same(a.p[i], b.p[i])) << where << " i=" << i << " master " << a.p[i] << " vs " << b.p[i];
          ASSERT_TRUE(same(a.s[i], b.s[i])) << where << " i=" << i << " state " << a.s[i] << " vs " << b.s[i];
        }
        ASSERT_EQ(ha, hb) << where << ": copies differ";
        if (!has_copy) continue;
        // the copy is the new master, rounded as the scalar casts of tiermem/dtype.h round it
        for (std::size_t i = 0; i < n; ++i) {
          if (dt == DType::kF32) {
            float x;
            std::memcpy(&x, ha.data() + i * 4, 4);
            ASSERT_EQ(f32_bits(x), f32_bits(a.p[i])) << where << " i=" << i;
          } else {
            std::uint16_t h;
            std::memcpy(&h, ha.data() + i * 2, 2);
            ASSERT_EQ(h, dt == DType::kBF16 ? f32_to_bf16(a.p[i]) : f32_to_f16(a.p[i])) << where << " i=" << i;
          }
        }
        for (std::size_t k = n * elem; k < (n + 1) * elem; ++k) ASSERT_EQ(hb[k], 0xab) << where << ": wrote past the copy";
      }
    }
  }
}

class OptimIsaTest : public ::testing::TestWithParam<AdamIsa> {
 protected:
  void SetUp() override {
    if (!adam_isa_supported(GetParam())) {
      GTEST_SKIP() << "this CPU has no " << adam_isa_name(GetParam()) << " (cpuid); kernel not tested here";
    }
  }
};

TEST_P(OptimIsaTest, LionEqualsScalarTwinBitForBit) {
  LionParams lp;
  lp.lr = 1e-3;
  lp.weight_decay = 0.1;
  lp.grad_scale = 0.5f;
  expect_equal_to_scalar_twin(GetParam(), false, [&](State& st, int, AdamIsa isa, int threads, void* h, DType dt) {
    lion_step(lp, st.p.data(), st.g.data(), st.s.data(), st.p.size(), h, dt, {isa, threads});
  });
}

TEST_P(OptimIsaTest, AdagradEqualsScalarTwinBitForBit) {
  for (double wd : {0.0, 0.05}) {
    AdagradParams ap;
    ap.lr = 0.05;
    ap.lr_decay = 0.01;
    ap.weight_decay = wd;
    ap.grad_scale = 0.25f;
    expect_equal_to_scalar_twin(GetParam(), true, [&](State& st, int t, AdamIsa isa, int threads, void* h, DType dt) {
      ap.step = t;
      adagrad_step(ap, st.p.data(), st.g.data(), st.s.data(), st.p.size(), h, dt, {isa, threads});
    });
  }
}

// Non-finite inputs take the same path in every kernel (and stay in their element).
TEST_P(OptimIsaTest, NonFiniteInputsEqualScalarTwin) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  State base = make_state(37, 3, true);
  base.g[2] = nan; base.g[9] = inf; base.g[20] = -inf; base.p[30] = inf; base.p[31] = nan;
  State a = base, b = base;
  lion_step({}, a.p.data(), a.g.data(), a.s.data(), 37, nullptr, DType::kBF16, {AdamIsa::kScalar, 1});
  lion_step({}, b.p.data(), b.g.data(), b.s.data(), 37, nullptr, DType::kBF16, {GetParam(), 1});
  for (std::size_t i = 0; i < 37; ++i) ASSERT_TRUE(same(a.p[i], b.p[i]) && same(a.s[i], b.s[i])) << "lion i=" << i;
  EXPECT_TRUE(std::isnan(b.s[2]));            // m = NaN
  EXPECT_EQ(b.p[2], base.p[2]);               // sign(NaN) = 0, no weight decay: unchanged
  EXPECT_EQ(b.p[9], base.p[9] - 1e-4f);       // +Inf gradient: a full +lr step
  a = base; b = base;
  adagrad_step({}, a.p.data(), a.g.data(), a.s.data(), 37, nullptr, DType::kBF16, {AdamIsa::kScalar, 1});
  adagrad_step({}, b.p.data(), b.g.data(), b.s.data(), 37, nullptr, DType::kBF16, {GetParam(), 1});
  for (std::size_t i = 0; i < 37; ++i) ASSERT_TRUE(same(a.p[i], b.p[i]) && same(a.s[i], b.s[i])) << "adagrad i=" << i;
  EXPECT_TRUE(std::isnan(b.p[9]));            // Inf / Inf
  EXPECT_TRUE(std::isinf(b.s[9]));
  EXPECT_TRUE(std::isinf(b.p[30]));           // no weight decay: an Inf master is not mixed in
  EXPECT_FALSE(std::isnan(b.s[30]));
  EXPECT_TRUE(std::isfinite(b.p[3]));         // neighbours untouched by their neighbours
}

INSTANTIATE_TEST_SUITE_P(Isa, OptimIsaTest, ::testing::Values(AdamIsa::kScalar, AdamIsa::kAvx2, AdamIsa::kAvx512),
                         [](const auto& info) { return std::string(adam_isa_name(info.param)); });

// The largest |x - ref| / scale seen, for the report (kept per test).
struct ErrMax {
  double v = 0;
  void add(float x, double ref, double scale) {
    v = std::max(v, std::abs(static_cast<double>(x) - ref) / std::max(scale, 1e-30));
  }
};

TEST(Lion, ScalarMatchesDoubleFormulaOver10Steps) {
  const std::size_t n = 4099;
  LionParams lp;
  lp.lr = 3e-3;
  lp.beta1 = 0.9;
  lp.beta2 = 0.99;
  lp.weight_decay = 0.1;
  lp.grad_scale = 0.5f;
  State st = make_state(n, 21, false);
  std::mt19937 rng(5);
  std::normal_distribution<float> d(0.0f, 0.1f);
  ErrMax ep, em;
  std::size_t near_zero = 0;
  for (int t = 1; t <= 10; ++t) {
    for (std::size_t i = 0; i < n; ++i) st.g[i] = i % 97 == 5 ? 0.0f : d(rng);
    State before = st;
    lion_step(lp, st.p.data(), st.g.data(), st.s.data(), n, nullptr, DType::kBF16, {AdamIsa::kScalar, 1});
    for (std::size_t i = 0; i < n; ++i) {
      const double g = static_cast<double>(before.g[i]) * lp.grad_scale;
      const double m = before.s[i];
      const double c = lp.beta1 * m + (1 - lp.beta1) * g;
      const double c_scale = std::abs(lp.beta1 * m) + std::abs((1 - lp.beta1) * g);
      if (c != 0 && std::abs(c) <= kRelTol * c_scale) {  // fp32 cannot know this sign
        ++near_zero;
        continue;
      }
      const double sign = c > 0 ? 1.0 : c < 0 ? -1.0 : 0.0;
      const double pd = before.p[i] * (1 - lp.lr * lp.weight_decay);
      const double p = pd - lp.lr * sign;
      const double m_new = lp.beta2 * m + (1 - lp.beta2) * g;
      ep.add(st.p[i], p, std::abs(pd) + lp.lr);
      em.add(st.s[i], m_new, std::abs(lp.beta2 * m) + std::abs((1 - lp.beta2) * g));
    }
  }
  std::printf("Lion scalar vs double over 10 steps: max rel err master %.2e, m %.2e (%zu near-zero c skipped)\n",
              ep.v, em.v, near_zero);
  EXPECT_LE(ep.v, kRelTol);
  EXPECT_LE(em.v, kRelTol);
  EXPECT_LE(near_zero, n / 1000);
}

TEST(Adagrad, ScalarMatchesDoubleFormulaOver10Steps) {
  const std::size_t n = 4099;
  AdagradParams ap;
  ap.lr = 0.05;
  ap.lr_decay = 0.01;
  ap.weight_decay = 0.05;
  ap.eps = 1e-10;
  ap.grad_scale = 0.5f;
  State st = make_state(n, 33, true);
  std::fill(st.s.begin(), st.s.end(), 0.1f);  // initial_accumulator_value
  std::mt19937 rng(6);
  std::normal_distribution<float> d(0.0f, 0.1f);
  ErrMax ep, es;
  for (int t = 1; t <= 10; ++t) {
    for (std::size_t i = 0; i < n; ++i) st.g[i] = i % 97 == 5 ? 0.0f : d(rng);
    State before = st;
    ap.step = t;
    adagrad_step(ap, st.p.data(), st.g.data(), st.s.data(), n, nullptr, DType::kBF16, {AdamIsa::kScalar, 1});
    const double clr = ap.lr / (1 + (t - 1) * ap.lr_decay);
    for (std::size_t i = 0; i < n; ++i) {
      const double gs = static_cast<double>(before.g[i]) * ap.grad_scale;
      const double wdp = ap.weight_decay * before.p[i];
      const double g = gs + wdp;
      const double s = before.s[i] + g * g;
      const double upd = clr * g / (std::sqrt(s) + ap.eps);
      const double p = before.p[i] - upd;
      // upd's relative error follows g's (its one cancelling input)
      const double g_scale = std::abs(gs) + std::abs(wdp);
      ep.add(st.p[i], p, std::abs(before.p[i]) + std::abs(upd) * (1 + g_scale / std::max(std::abs(g), 1e-30)));
      es.add(st.s[i], s, std::abs(s));
    }
  }
  std::printf("Adagrad scalar vs double over 10 steps: max rel err master %.2e, sum %.2e\n", ep.v, es.v);
  EXPECT_LE(ep.v, kRelTol);
  EXPECT_LE(es.v, kRelTol);
}

TEST(Adagrad, LrDecayAndStepClamp) {
  AdagradParams ap;
  ap.lr = 0.1;
  ap.lr_decay = 0.5;
  ap.step = 3;
  EXPECT_EQ(detail::adagrad_coeffs(ap).neg_clr, static_cast<float>(-(0.1 / 2.0)));
  ap.step = 0;  // taken as 1: no decay
  EXPECT_EQ(detail::adagrad_coeffs(ap).neg_clr, -0.1f);
}

TEST(Lion, ZeroDirectionOnlyDecays) {
  LionParams lp;
  lp.lr = 0.01;
  lp.weight_decay = 0.5;
  float p = 2.0f, g = 0.0f, m = 0.0f;
  lion_step(lp, &p, &g, &m, 1);
  EXPECT_EQ(p, 2.0f * static_cast<float>(1.0 - 0.01 * 0.5));
  EXPECT_EQ(m, 0.0f);
}

TEST(OptimKernels, RejectsBadArgumentsWithoutWriting) {
  State st = make_state(8, 1, true);
  const State orig = st;
  std::vector<std::uint32_t> out(8, 7);
  EXPECT_THROW(lion_step({}, nullptr, st.g.data(), st.s.data(), 8), Error);
  EXPECT_THROW(lion_step({}, st.p.data(), nullptr, st.s.data(), 8), Error);
  EXPECT_THROW(lion_step({}, st.p.data(), st.g.data(), nullptr, 8), Error);
  EXPECT_THROW(adagrad_step({}, st.p.data(), st.g.data(), nullptr, 8), Error);
  EXPECT_THROW(adagrad_step({}, nullptr, st.g.data(), st.s.data(), 8), Error);
  EXPECT_THROW(lion_step({}, st.p.data(), st.g.data(), st.s.data(), 8, out.data(), DType::kI32), NotSupportedError);
  EXPECT_THROW(adagrad_step({}, st.p.data(), st.g.data(), st.s.data(), 8, out.data(), DType::kU16), NotSupportedError);
  EXPECT_EQ(st.p, orig.p);
  EXPECT_EQ(st.s, orig.s);
  EXPECT_EQ(out, std::vector<std::uint32_t>(8, 7));
  // n == 0: nothing to read, null buffers are fine
  EXPECT_NO_THROW(lion_step({}, nullptr, nullptr, nullptr, 0));
  EXPECT_NO_THROW(adagrad_step({}, nullptr, nullptr, nullptr, 0, nullptr, DType::kF16));
  for (AdamIsa isa : vector_isas()) {
    if (adam_isa_supported(isa)) continue;
    EXPECT_THROW(lion_step({}, st.p.data(), st.g.data(), st.s.data(), 8, nullptr, DType::kBF16, {isa, 1}), NotSupportedError);
    EXPECT_THROW(adagrad_step({}, st.p.data(), st.g.data(), st.s.data(), 8, nullptr, DType::kBF16, {isa, 1}), NotSupportedError);
  }
}

}  // namespace
}  // namespace tiermem
