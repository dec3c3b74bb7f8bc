// Every CPU layer's backward against central finite differences of its forward, in double
// precision, on tiny shapes. The check: scalar loss f = Σ out·r with fixed random r, analytic
// gradient = backward(dout = r), numeric gradient = (f(x+h) − f(x−h)) / 2h with h = 1e-5.
// Bound: ‖analytic − numeric‖∞ ≤ 1e-6 · max(‖numeric‖∞, 1e-3) (FD truncation is O(h²) ≈ 1e-10,
// rounding ≈ 1e-16/h ≈ 1e-11, so a wrong term in a backward shows up many orders above it).
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <random>
#include <vector>

#include "gpt/kernels_cpu.h"
#include "gpt/layer_math.h"

namespace tiermem::gpt {
namespace {

using Vec = std::vector<double>;

Vec randn(std::size_t n, std::uint32_t seed, double scale = 1.0) {
  std::mt19937 g(seed);
  std::normal_distribution<double> d(0.0, scale);
  Vec v(n);
  for (auto& x : v) x = d(g);
  return v;
}

double dot(const Vec& a, const Vec& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// Numeric gradient of f() with respect to every element of x (x is perturbed in place).
Vec numeric_grad(Vec& x, const std::function<double()>& f, double h = 1e-5) {
  Vec g(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double x0 = x[i];
    x[i] = x0 + h;
    const double fp = f();
    x[i] = x0 - h;
    const double fm = f();
    x[i] = x0;
    g[i] = (fp - fm) / (2 * h);
  }
  return g;
}

void expect_close(const Vec& analytic, const Vec& numeric, const char* what) {
  ASSERT_EQ(analytic.size(), numeric.size()) << what;
  double maxn = 0, maxd = 0;
  for (std::size_t i = 0; i < numeric.size(); ++i) {
    maxn = std::max(maxn, std::abs(numeric[i]));
    maxd = std::max(maxd, std::abs(analytic[i] - numeric[i]));
  }
  EXPECT_GT(maxn, 0.0) << what << ": gradient is identically zero, the check is vacuous";
  EXPECT_LE(maxd, 1e-6 * std::max(maxn, 1e-3)) << what << ": max |numeric| " << maxn;
}

constexpr int B = 2, T = 5, C = 8, NH = 2, N = B * T;

TEST(GptLayers, GeluMatchesReferenceAndGradient) {
  // gelu(0) = 0, gelu(x) − gelu(−x) = x (odd part), and the tanh formula at x = 1.
  EXPECT_DOUBLE_EQ(math::gelu(0.0), 0.0);
  EXPECT_NEAR(math::gelu(1.7) - math::gelu(-1.7), 1.7, 1e-12);
  EXPECT_NEAR(math::gelu(1.0), 0.5 * (1 + std::tanh(std::sqrt(2 / M_PI) * 1.044715)), 1e-15);
  Vec x = randn(64, 1, 2.0), r = randn(64, 2), out(64), dx(64);
  cpu::gelu_forward(out.data(), x.data(), 64);
  cpu::gelu_backward(dx.data(), x.data(), r.data(), 64);
  Vec num = numeric_grad(x, [&] {
    Vec o(64);
    cpu::gelu_forward(o.data(), x.data(), 64);
    return dot(o, r);
  });
  expect_close(dx, num, "gelu dx");
}

TEST(GptLayers, LayerNormGradients) {
  Vec x = randn(N * C, 3, 1.5), w = randn(C, 4), b = randn(C, 5), r = randn(N * C, 6);
  auto f = [&] {
    Vec out(N * C), mean(N), rstd(N);
    cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
    return dot(out, r);
  };
  Vec out(N * C), mean(N), rstd(N), dx(N * C, 0.0), dw(C, 0.0), db(C, 0.0);
  cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
  // Forward: each output row normalised then affine; check row 0 mean/var of (out − b)/w.
  double m = 0, v = 0;
  for (int c = 0; c < C; ++c) m += (out[c] - b[c]) / w[c];
  for (int c = 0; c < C; ++c) v += std::pow((out[c] - b[c]) / w[c] - m / C, 2);
  EXPECT_NEAR(m / C, 0.0, 1e-12);
  EXPECT_NEAR(v / C, 1.0, 1e-4);  // 1 − eps/var
  cpu::layernorm_backward(dx.data(), dw.data(), db.data(), r.data(), x.data(), w.data(),
                          mean.data(), rstd.data(), N, C);
  expect_close(dx, numeric_grad(x, f), "layernorm dx");
  expect_close(dw, numeric_grad(w, f), "layernorm dw");
  expect_close(db, numeric_grad(b, f), "layernorm db");
}

TEST(GptLayers, MatmulGradients) {
  const int OC = 6;
  Vec x = randn(N * C, 7), w = randn(OC * C, 8), bias = randn(OC, 9), r = randn(N * OC, 10);
  auto f = [&] {
    Vec out(N * OC);
    cpu::matmul_forward(out.data(), x.data(), w.data(), bias.data(), N, C, OC);
    return dot(out, r);
  };
  // Forward against the definition for one element.
  Vec out(N * OC);
  cpu::matmul_forward(out.data(), x.data(), w.data(), bias.data(), N, C, OC);
  double ref = bias[4];
  for (int c = 0; c < C; ++c) ref += x[3 * C + c] * w[4 * C + c];
  EXPECT_NEAR(out[3 * OC + 4], ref, 1e-12);
  Vec dx(N * C, 0.0), dw(OC * C, 0.0), db(OC, 0.0);
  cpu::matmul_backward(dx.data(), dw.data(), db.data(), r.data(), x.data(), w.data(), N, C, OC);
  expect_close(dx, numeric_grad(x, f), "matmul dinp");
  expect_close(dw, numeric_grad(w, f), "matmul dw");
  expect_close(db, numeric_grad(bias, f), "matmul dbias");
  // dw and dbias accumulate, dinp is overwritten.
  Vec dx2(N * C, 123.0), dw2 = dw, db2 = db;
  cpu::matmul_backward(dx2.data(), dw2.data(), db2.data(), r.data(), x.data(), w.data(), N, C, OC);
  for (std::size_t i = 0; i < dw.size(); ++i) EXPECT_NEAR(dw2[i], 2 * dw[i], 1e-12);
  for (std::size_t i = 0; i < db.size(); ++i) EXPECT_NEAR(db2[i], 2 * db[i], 1e-12);
  for (std::size_t i = 0; i < dx.size(); ++i) EXPECT_NEAR(dx2[i], dx[i], 1e-12);
}

TEST(GptLayers, AttentionIsCausalAndGradientsMatch) {
  Vec qkv = randn(N * 3 * C, 11), r = randn(N * C, 12);
  auto f = [&] {
    Vec out(N * C), att(B * NH * T * T);
    cpu::attention_forward(out.data(), att.data(), qkv.data(), B, T, C, NH);
    return dot(out, r);
  };
  Vec out(N * C), att(B * NH * T * T);
  cpu::attention_forward(out.data(), att.data(), qkv.data(), B, T, C, NH);
  for (int row = 0; row < B * NH * T; ++row) {
    const int t = row % T;
    double s = 0;
    for (int j = 0; j < T; ++j) {
      if (j > t) {
        EXPECT_EQ(att[row * T + j], 0.0) << "future key " << j << " of query " << t;
      }
      s += att[row * T + j];
    }
    EXPECT_NEAR(s, 1.0, 1e-12);
  }
  // Changing a later token's k/v leaves earlier outputs unchanged (causality).
  Vec qkv2 = qkv;
  for (int c = C; c < 3 * C; ++c) qkv2[(0 * T + 4) * 3 * C + c] += 1.0;
  Vec out2(N * C), att2(B * NH * T * T);
  cpu::attention_forward(out2.data(), att2.data(), qkv2.data(), B, T, C, NH);
  for (int t = 0; t < 4; ++t) {
    for (int c = 0; c < C; ++c) EXPECT_EQ(out2[t * C + c], out[t * C + c]);
  }
  Vec dqkv(N * 3 * C, 7.0), dpre(B * NH * T * T);
  cpu::attention_backward(dqkv.data(), dpre.data(), r.data(), qkv.data(), att.data(), B, T, C, NH);
  expect_close(dqkv, numeric_grad(qkv, f), "attention dqkv");
}

TEST(GptLayers, EncoderGradients) {
  const int V = 7;
  std::vector<std::int32_t> tok = {1, 3, 3, 0, 6, 2, 3, 1, 5, 6};
  Vec wte = randn(V * C, 13), wpe = randn(T * C, 14), r = randn(N * C, 15);
  auto f = [&] {
    Vec out(N * C);
    cpu::encoder_forward(out.data(), tok.data(), wte.data(), wpe.data(), B, T, C);
    return dot(out, r);
  };
  Vec dwte(V * C, 0.0), dwpe(T * C, 0.0);
  cpu::encoder_backward(dwte.data(), dwpe.data(), r.data(), tok.data(), B, T, C);
  expect_close(dwte, numeric_grad(wte, f), "encoder dwte");
  expect_close(dwpe, numeric_grad(wpe, f), "encoder dwpe");
  // Token 4 never occurs: its rows get no gradient.
  for (int c = 0; c < C; ++c) EXPECT_EQ(dwte[4 * C + c], 0.0);
}

TEST(GptLayers, CrossEntropyGradientsAndValue) {
  const int V = 9;
  std::vector<std::int32_t> tgt = {0, 8, 3, 3, 1, 2, 7, 5, 4, 6};
  Vec logits = randn(N * V, 16, 3.0);
  auto f = [&] {
    Vec l = logits;
    return cpu::crossentropy_forward(l.data(), tgt.data(), N, V);
  };
  Vec p = logits;
  const double loss = cpu::crossentropy_forward(p.data(), tgt.data(), N, V);
  double ref = 0;
  for (int n = 0; n < N; ++n) {
    double z = 0;
    for (int i = 0; i < V; ++i) z += std::exp(logits[n * V + i]);
    ref += std::log(z) - logits[n * V + tgt[n]];
  }
  EXPECT_NEAR(loss, ref / N, 1e-12);
  // Large logits stay finite.
  Vec big(V, 0.0);
  big[2] = 1000.0;
  std::int32_t t2 = 2;
  EXPECT_NEAR(cpu::crossentropy_forward(big.data(), &t2, 1, V), 0.0, 1e-12);
  cpu::crossentropy_backward(p.data(), tgt.data(), N, V, 1.0 / N);
  expect_close(p, numeric_grad(logits, f), "cross-entropy dlogits");
}

TEST(GptLayers, ResidualAdds) {
  Vec a = randn(10, 17), b = randn(10, 18), out(10);
  cpu::residual_forward(out.data(), a.data(), b.data(), 10);
  for (int i = 0; i < 10; ++i) EXPECT_EQ(out[i], a[i] + b[i]);
}

}  // namespace
}  // namespace tiermem::gpt
