// The CUDA row kernels' decomposition, tested on the CPU: each row layer of gpt/layer_math.h run
// as the GPU runs it — every phase over 32 lanes, the lanes' partials combined by the same xor
// butterfly as the kernels' __shfl_xor_sync warp reductions (kernels_cuda.cu) — against the
// whole-row function the CPU kernels use (lane 0 of 1). Shapes are chosen so that lanes own
// several elements (C, T, V > 32), none (hs < 32), and uneven tails.
// Tolerances: double 1e-12 relative (only the summation order differs); float 2e-6 relative to
// the largest value of the row (a few ulps of reordering over <= 1000 terms).
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <functional>
#include <random>
#include <vector>

#include "gpt/layer_math.h"

namespace tiermem::gpt::math {
namespace {

constexpr int kLanes = 32;

// The lanes' partials combined as warp_sum / warp_max do: v[l] op= v[l ^ o], o = 16, 8, 4, 2, 1.
template <class R>
R butterfly(std::array<R, kLanes> v, bool max) {
  for (int o = kLanes / 2; o > 0; o >>= 1) {
    std::array<R, kLanes> next{};
    for (int l = 0; l < kLanes; ++l) next[l] = max ? std::max(v[l], v[l ^ o]) : v[l] + v[l ^ o];
    v = next;
  }
  return v[0];
}
template <class R>
R lanes_sum(const std::function<R(int)>& phase) {
  std::array<R, kLanes> v{};
  for (int l = 0; l < kLanes; ++l) v[l] = phase(l);
  return butterfly(v, false);
}
template <class R>
R lanes_max(const std::function<R(int)>& phase) {
  std::array<R, kLanes> v{};
  for (int l = 0; l < kLanes; ++l) v[l] = phase(l);
  return butterfly(v, true);
}
void for_lanes(const std::function<void(int)>& phase) {
  for (int l = 0; l < kLanes; ++l) phase(l);
}

template <class R>
std::vector<R> randn(std::size_t n, std::uint32_t seed, double scale = 1.0) {
  std::mt19937 g(seed);
  std::normal_distribution<double> d(0.0, scale);
  std::vector<R> v(n);
  for (auto& x : v) x = static_cast<R>(d(g));
  return v;
}

template <class R>
double tol() {
  return sizeof(R) == 8 ? 1e-12 : 2e-6;
}

template <class R>
void expect_near_all(const std::vector<R>& got, const std::vector<R>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double maxref = 0, maxd = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    maxref = std::max(maxref, std::abs(static_cast<double>(want[i])));
    maxd = std::max(maxd, std::abs(static_cast<double>(got[i]) - static_cast<double>(want[i])));
  }
  EXPECT_GT(maxref, 0.0) << what << ": all zero, the comparison is vacuous";
  EXPECT_LE(maxd, tol<R>() * std::max(maxref, 1.0)) << what << " max |ref| " << maxref;
}

template <class R>
class RowMath : public ::testing::Test {};
using Reals = ::testing::Types<float, double>;
TYPED_TEST_SUITE(RowMath, Reals);

TYPED_TEST(RowMath, LayerNormInLanesMatchesTheWholeRow) {
  using R = TypeParam;
  for (int C : {7, 32, 33, 100, 768}) {
    SCOPED_TRACE(C);
    const auto x = randn<R>(C, 1 + C, 2.0), w = randn<R>(C, 2 + C), b = randn<R>(C, 3 + C);
    const auto dout = randn<R>(C, 4 + C);
    std::vector<R> out_ref(C), out(C);
    R mean_ref, rstd_ref;
    layernorm_row_forward(x.data(), w.data(), b.data(), out_ref.data(), &mean_ref, &rstd_ref, C);
    const R m = lanes_sum<R>([&](int l) { return layernorm_row_sum(x.data(), C, l, kLanes); }) / R(C);
    const R rs = layernorm_rstd(
        lanes_sum<R>([&](int l) { return layernorm_row_sq_dev(x.data(), m, C, l, kLanes); }), C);
    for_lanes([&](int l) { layernorm_row_apply(x.data(), w.data(), b.data(), out.data(), m, rs, C, l, kLanes); });
    expect_near_all(out, out_ref, "layernorm out");
    EXPECT_NEAR(m, mean_ref, tol<R>() * 4);
    EXPECT_NEAR(rs, rstd_ref, tol<R>() * std::abs(rstd_ref) * 4);

    std::vector<R> dx_ref(C, R(0.5)), dx(C, R(0.5));  // += into a non-zero buffer
    layernorm_row_backward_dx(dout.data(), x.data(), w.data(), mean_ref, rstd_ref, dx_ref.data(), C);
    std::array<R, kLanes> sg{}, sgx{};
    for (int l = 0; l < kLanes; ++l)
      layernorm_row_dx_sums(dout.data(), x.data(), w.data(), mean_ref, rstd_ref, C, l, kLanes,
                            &sg[l], &sgx[l]);
    const R mg = butterfly(sg, false) / R(C), mgx = butterfly(sgx, false) / R(C);
    for_lanes([&](int l) {
      layernorm_row_dx_apply(dout.data(), x.data(), w.data(), mean_ref, rstd_ref, mg, mgx,
                             dx.data(), C, l, kLanes);
    });
    expect_near_all(dx, dx_ref, "layernorm dx");
  }
}

TYPED_TEST(RowMath, AttentionInLanesMatchesTheWholeRow) {
  using R = TypeParam;
  for (int C : {16, 96}) {  // heads of 8 (< 32 lanes) and 48 dims (> 32: two per lane, a tail)
    const int B = 2, T = 37, NH = 2;
    SCOPED_TRACE(C);
    const auto qkv = randn<R>(static_cast<std::size_t>(B) * T * 3 * C, 7 + C);
    const auto dout = randn<R>(static_cast<std::size_t>(B) * T * C, 8 + C);
    const std::size_t att_n = static_cast<std::size_t>(B) * NH * T * T;
    std::vector<R> att_ref(att_n, R(9)), out_ref(B * T * C), att(att_n, R(9)), out(B * T * C);
    std::vector<R> dpre_ref(att_n), dpre(att_n), dqkv_ref(qkv.size()), dqkv(qkv.size());
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < NH; ++h)
        for (int t = 0; t < T; ++t) {
          attention_row_forward(qkv.data(), att_ref.data(), out_ref.data(), T, C, NH, b, t, h);
          const R mx = lanes_max<R>([&](int l) {
            return attention_row_scores(qkv.data(), att.data(), T, C, NH, b, t, h, l, kLanes);
          });
          const R sum = lanes_sum<R>([&](int l) {
            return attention_row_exp(att.data(), mx, T, NH, b, t, h, l, kLanes);
          });
          for_lanes([&](int l) { attention_row_normalize(att.data(), R(1) / sum, T, NH, b, t, h, l, kLanes); });
          for_lanes([&](int l) { attention_row_out(qkv.data(), att.data(), out.data(), T, C, NH, b, t, h, l, kLanes); });
        }
    expect_near_all(att, att_ref, "attention probabilities (zeros after t)");
    expect_near_all(out, out_ref, "attention out");
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < NH; ++h)
        for (int t = 0; t < T; ++t) {
          attention_row_dpre(qkv.data(), att_ref.data(), dout.data(), dpre_ref.data(), T, C, NH, b, t, h);
          const R dot = lanes_sum<R>([&](int l) {
            return attention_row_dpre_dots(qkv.data(), att_ref.data(), dout.data(), dpre.data(), T,
                                           C, NH, b, t, h, l, kLanes);
          });
          for_lanes([&](int l) { attention_row_dpre_apply(att_ref.data(), dpre.data(), dot, T, NH, b, t, h, l, kLanes); });
        }
    expect_near_all(dpre, dpre_ref, "attention dpre");
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < NH; ++h)
        for (int t = 0; t < T; ++t) {
          attention_row_dq(qkv.data(), dpre_ref.data(), dqkv_ref.data(), T, C, NH, b, t, h);
          attention_row_dkv(qkv.data(), att_ref.data(), dpre_ref.data(), dout.data(), dqkv_ref.data(), T, C, NH, b, t, h);
          for_lanes([&](int l) {
            attention_row_dq(qkv.data(), dpre_ref.data(), dqkv.data(), T, C, NH, b, t, h, l, kLanes);
            attention_row_dkv(qkv.data(), att_ref.data(), dpre_ref.data(), dout.data(), dqkv.data(), T, C, NH, b, t, h, l, kLanes);
          });
        }
    expect_near_all(dqkv, dqkv_ref, "attention dqkv");
  }
}

TYPED_TEST(RowMath, CrossEntropyInLanesMatchesTheWholeRow) {
  using R = TypeParam;
  for (int V : {5, 97, 1000}) {
    SCOPED_TRACE(V);
    auto ref = randn<R>(V, 11 + V, 3.0);
    auto got = ref;
    const int target = V / 3;
    const R loss_ref = softmax_xent_row_forward(ref.data(), V, target);
    const R target_logit = got[target];  // the kernel reads it before the apply phase
    const R mx = lanes_max<R>([&](int l) { return xent_row_max(got.data(), V, l, kLanes); });
    const R sum = lanes_sum<R>([&](int l) { return xent_row_sumexp(got.data(), mx, V, l, kLanes); });
    const R loss = xent_row_loss(target_logit, mx, sum);
    for_lanes([&](int l) { xent_row_apply(got.data(), mx, R(1) / sum, V, l, kLanes); });
    EXPECT_NEAR(loss, loss_ref, tol<R>() * std::max<double>(1.0, std::abs(loss_ref)) * 4);
    expect_near_all(got, ref, "softmax probabilities");
    double total = 0;
    for (R p : got) total += p;
    EXPECT_NEAR(total, 1.0, 1e-5);
    const R dloss = R(0.25);
    softmax_xent_row_backward(ref.data(), V, target, dloss);
    for_lanes([&](int l) { softmax_xent_row_backward(got.data(), V, target, dloss, l, kLanes); });
    expect_near_all(got, ref, "dlogits");
  }
}

}  // namespace
}  // namespace tiermem::gpt::math
