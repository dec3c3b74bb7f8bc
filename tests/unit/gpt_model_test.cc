// The whole GPT model: parameter layout, init, step order, gradients of the assembled model
// against finite differences, bf16 parameters, loss at init, and overfitting a small text.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "gpt/model.h"
#include "tiermem/error.h"

namespace tiermem::gpt {
namespace {

using Params = std::vector<std::vector<float>>;

Params zeros_like(const Params& p) {
  Params g(p.size());
  for (std::size_t i = 0; i < p.size(); ++i) g[i].assign(p[i].size(), 0.0f);
  return g;
}

std::vector<std::int32_t> random_ids(std::size_t n, int vocab, std::uint32_t seed) {
  std::mt19937 g(seed);
  std::uniform_int_distribution<int> d(0, vocab - 1);
  std::vector<std::int32_t> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

TEST(GptConfig, NamedConfigsAndParameterCounts) {
  // The published GPT-2 sizes (HuggingFace counts, tied head, vocab 50257, 1024 positions).
  EXPECT_EQ(num_params(GptConfig::named("gpt2")), 124439808);
  EXPECT_EQ(num_params(GptConfig::named("gpt2-medium")), 354823168);
  EXPECT_EQ(num_params(GptConfig::named("gpt2-large")), 774030080);
  EXPECT_EQ(num_params(GptConfig::named("gpt2-xl")), 1557611200);
  const auto mini = num_params(GptConfig::named("mini"));
  EXPECT_GT(mini, 2'000'000);
  EXPECT_LT(mini, 6'000'000);
  EXPECT_THROW(GptConfig::named("gpt5"), ConfigError);
  GptConfig bad{2, 3, 32, 16, 64};  // 32 % 3 != 0
  EXPECT_THROW(bad.validate(), ConfigError);
  GptConfig zero{0, 2, 32, 16, 64};
  try {
    zero.validate();
    FAIL() << "n_layer 0 accepted";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.key_path(), "gpt.n_layer");
  }
}

TEST(GptConfig, ModuleLayoutIsContiguousAndTiesTheHeadToModuleZero) {
  const GptConfig cfg = GptConfig::named("tiny");
  auto mods = module_layouts(cfg);
  ASSERT_EQ(static_cast<int>(mods.size()), cfg.n_layer + 2);
  EXPECT_EQ(mods[0].name, "embed");
  EXPECT_EQ(mods[1].name, "block.0");
  EXPECT_EQ(mods.back().name, "ln_f");
  std::int64_t total = 0;
  for (const auto& m : mods) {
    std::int64_t off = 0;
    for (const auto& t : m.tensors) {
      EXPECT_EQ(t.offset, off) << m.name << "." << t.name;
      off += t.numel;
    }
    EXPECT_EQ(off, m.numel);
    total += m.numel;
  }
  EXPECT_EQ(total, num_params(cfg));
  const auto fwd = forward_steps(cfg), bwd = backward_steps(cfg);
  ASSERT_EQ(fwd.size(), static_cast<std::size_t>(cfg.n_layer + 3));
  EXPECT_EQ(fwd.front().kind, StepKind::kEmbed);
  EXPECT_EQ(fwd.back().kind, StepKind::kHead);
  EXPECT_EQ(fwd.back().module, 0);  // the tied head reads module 0 again
  EXPECT_EQ(bwd.front().kind, StepKind::kHead);
  EXPECT_EQ(bwd.back().kind, StepKind::kEmbed);
  EXPECT_THROW(module_layout(cfg, cfg.n_layer + 2), Error);
}

TEST(GptConfig, FlopsPerTokenMatchesSixNPlusAttention) {
  for (const char* name : {"mini", "gpt2", "gpt2-xl"}) {
    const GptConfig c = GptConfig::named(name);
    const double L = c.n_layer, d = c.d_model, T = c.seq_len, V = c.vocab_size;
    const double n_matmul = 12 * L * d * d + V * d;
    EXPECT_DOUBLE_EQ(flops_per_token(c), 6 * n_matmul + 12 * L * T * d) << name;
    // The usual shortcut uses all parameters N: within 1% for GPT-2 sizes (wpe, biases and
    // LayerNorms are the difference).
    const double approx = 6 * static_cast<double>(num_params(c)) + 12 * L * T * d;
    if (std::string(name) != "mini") {
      EXPECT_NEAR(flops_per_token(c) / approx, 1.0, 0.01) << name;
    }
    EXPECT_DOUBLE_EQ(flops_per_token(c), 3 * forward_flops_per_token(c));
  }
  const GptConfig g = GptConfig::named("gpt2");
  EXPECT_LT(flops_per_token(g, 128), flops_per_token(g));  // shorter context, less attention
}

TEST(GptInit, DeterministicPerModuleWithGpt2Scales) {
  const GptConfig cfg = GptConfig::named("mini");
  const Params a = init_params(cfg, 42), b = init_params(cfg, 42), c = init_params(cfg, 43);
  EXPECT_EQ(a, b);
  EXPECT_NE(a[1], c[1]);
  // A module can be initialised alone and matches.
  std::vector<float> m2(module_layout(cfg, 2).numel);
  init_module(cfg, 2, 42, m2);
  EXPECT_EQ(m2, a[2]);
  auto stddev = [](const float* p, std::int64_t n) {
    double s = 0, s2 = 0;
    for (std::int64_t i = 0; i < n; ++i) s += p[i], s2 += double(p[i]) * p[i];
    return std::sqrt(s2 / n - (s / n) * (s / n));
  };
  const ModuleLayout blk = module_layout(cfg, 1);
  for (const auto& t : blk.tensors) {
    const float* p = a[1].data() + t.offset;
    if (t.name == "qkv_w" || t.name == "fc_w") {
      EXPECT_NEAR(stddev(p, t.numel), 0.02, 0.001) << t.name;
    } else if (t.name == "proj_w" || t.name == "fc_proj_w") {
      EXPECT_NEAR(stddev(p, t.numel), 0.02 / std::sqrt(2.0 * cfg.n_layer), 0.0005) << t.name;
    } else if (t.name == "ln1_w" || t.name == "ln2_w") {
      for (std::int64_t i = 0; i < t.numel; ++i) ASSERT_EQ(p[i], 1.0f) << t.name;
    } else {
      for (std::int64_t i = 0; i < t.numel; ++i) ASSERT_EQ(p[i], 0.0f) << t.name;
    }
  }
  EXPECT_NEAR(stddev(a[0].data(), a[0].size()), 0.02, 0.001);
}

TEST(GptModel, LossAtInitIsLogVocab) {
  const GptConfig cfg = GptConfig::named("tiny");
  Model model(cfg, 4);
  const auto p = init_params(cfg, 1);
  const auto tok = random_ids(4 * cfg.seq_len, cfg.vocab_size, 2);
  const auto tgt = random_ids(4 * cfg.seq_len, cfg.vocab_size, 3);
  const float loss = model.forward_all(p, tok, tgt);
  EXPECT_NEAR(loss, std::log(static_cast<double>(cfg.vocab_size)), 0.05);
  // Probabilities are a distribution per row.
  double s = 0;
  for (int i = 0; i < cfg.vocab_size; ++i) s += model.probs()[i];
  EXPECT_NEAR(s, 1.0, 1e-5);
}

// The assembled model (all steps, residual stream, tied head) against central differences in
// fp32 with h = 1e-3 on random O(0.3) parameters. fp32 rounding of the loss (~1e-6) divided by 2h
// makes each numeric derivative good to ~1e-3 absolute, so the bound is norm-wise per module
// over 48 sampled parameters: ‖a − n‖₂ ≤ 2e-2·‖n‖₂. (Each layer's exact check is in double in
// gpt_layers_test.cc.)
TEST(GptModel, WholeModelGradientMatchesFiniteDifferences) {
  const GptConfig cfg{2, 2, 8, 4, 11};
  const int B = 2;
  Params p = init_params(cfg, 5);
  std::mt19937 g(6);
  std::normal_distribution<float> d(0.0f, 0.3f);
  for (auto& m : p) {
    for (auto& x : m) x += d(g);
  }
  const auto tok = random_ids(B * cfg.seq_len, cfg.vocab_size, 7);
  const auto tgt = random_ids(B * cfg.seq_len, cfg.vocab_size, 8);
  Model model(cfg, B);
  Params grads = zeros_like(p);
  model.forward_backward(p, grads, tok, tgt);
  for (int m = 0; m < num_modules(cfg); ++m) {
    std::uniform_int_distribution<std::size_t> pick(0, p[m].size() - 1);
    double num2 = 0, diff2 = 0;
    for (int k = 0; k < 48; ++k) {
      const std::size_t i = pick(g);
      const float x0 = p[m][i];
      const float h = 1e-3f;
      p[m][i] = x0 + h;
      const double fp = model.forward_all(p, tok, tgt);
      p[m][i] = x0 - h;
      const double fm = model.forward_all(p, tok, tgt);
      p[m][i] = x0;
      const double num = (fp - fm) / (2.0 * h);
      num2 += num * num;
      diff2 += (num - grads[m][i]) * (num - grads[m][i]);
    }
    EXPECT_GT(num2, 1e-8) << "module " << m << ": vacuous check";
    EXPECT_LE(std::sqrt(diff2), 2e-2 * std::sqrt(num2)) << "module " << m;
  }
}

TEST(GptModel, GradientsAccumulateAndStepsAreChecked) {
  const GptConfig cfg = GptConfig::named("tiny");
  const int B = 2;
  const auto p = init_params(cfg, 9);
  const auto tok = random_ids(B * cfg.seq_len, cfg.vocab_size, 10);
  const auto tgt = random_ids(B * cfg.seq_len, cfg.vocab_size, 11);
  Model model(cfg, B);
  Params g1 = zeros_like(p), g2 = zeros_like(p);
  model.forward_backward(p, g1, tok, tgt);
  model.forward_backward(p, g2, tok, tgt);
  model.forward_backward(p, g2, tok, tgt);
  for (std::size_t m = 0; m < p.size(); ++m) {
    for (std::size_t i = 0; i < p[m].size(); ++i) {
      ASSERT_NEAR(g2[m][i], 2 * g1[m][i], 1e-6f + 1e-5f * std::abs(g1[m][i])) << m << " " << i;
    }
  }
  // Out-of-order steps and wrong sizes throw with context.
  Model fresh(cfg, B);
  const auto fwd = forward_steps(cfg);
  const auto bwd = backward_steps(cfg);
  EXPECT_THROW(fresh.forward(fwd[1], p[1]), Error);  // before set_batch / kEmbed
  fresh.set_batch(tok, tgt);
  EXPECT_THROW(fresh.backward(bwd[0], p[0], g1[0]), Error);  // before a forward pass
  fresh.forward(fwd[0], p[0]);
  EXPECT_THROW(fresh.forward(fwd[2], p[2]), Error);  // skipped block.0
  std::vector<float> short_params(p[1].size() - 1);
  EXPECT_THROW(fresh.forward(fwd[1], short_params), Error);
  std::vector<std::int32_t> bad = tok;
  bad[3] = cfg.vocab_size;
  EXPECT_THROW(fresh.set_batch(bad, tgt), Error);
  EXPECT_THROW(Model(cfg, B, cfg.seq_len + 1), ConfigError);
}

TEST(GptModel, Bf16ParametersEqualTheirFp32Rounding) {
  const GptConfig cfg = GptConfig::named("tiny");
  const int B = 2;
  Params p = init_params(cfg, 12);
  std::vector<std::vector<std::uint16_t>> bits(p.size());
  for (std::size_t m = 0; m < p.size(); ++m) {
    for (auto& x : p[m]) {
      bits[m].push_back(f32_to_bf16(x));
      x = bf16_to_f32(bits[m].back());
    }
  }
  const auto tok = random_ids(B * cfg.seq_len, cfg.vocab_size, 13);
  const auto tgt = random_ids(B * cfg.seq_len, cfg.vocab_size, 14);
  Model a(cfg, B), b(cfg, B);
  Params ga = zeros_like(p), gb = zeros_like(p);
  const float la = a.forward_backward(p, ga, tok, tgt);
  b.set_batch(tok, tgt);
  for (const Step& s : forward_steps(cfg)) b.forward(s, ParamView::bf16(bits[s.module]));
  EXPECT_EQ(b.loss(), la);
  for (const Step& s : backward_steps(cfg)) {
    // kEmbed's backward needs no parameters: the engine can skip gathering module 0 again.
    ParamView v = s.kind == StepKind::kEmbed ? ParamView() : ParamView::bf16(bits[s.module]);
    b.backward(s, v, gb[s.module]);
  }
  EXPECT_EQ(ga, gb);
}

// Reference AdamW (Loshchilov & Hutter 2019), decoupled weight decay, bias-corrected moments.
struct AdamW {
  float lr = 1e-2f, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, wd = 0.0f;
  int t = 0;
  Params m, v;
  void step(Params& p, const Params& g) {
    if (m.empty()) m = zeros_like(p), v = zeros_like(p);
    ++t;
    const float bc1 = 1 - std::pow(beta1, t), bc2 = 1 - std::pow(beta2, t);
    for (std::size_t k = 0; k < p.size(); ++k) {
      for (std::size_t i = 0; i < p[k].size(); ++i) {
        m[k][i] = beta1 * m[k][i] + (1 - beta1) * g[k][i];
        v[k][i] = beta2 * v[k][i] + (1 - beta2) * g[k][i] * g[k][i];
        const float mh = m[k][i] / bc1, vh = v[k][i] / bc2;
        p[k][i] -= lr * (mh / (std::sqrt(vh) + eps) + wd * p[k][i]);
      }
    }
  }
};

// 300 AdamW steps on a fixed batch of a short text: the tiny model memorises it. Loss starts at
// ≈ ln 64 = 4.16 and must fall below 0.25 nats/token.
TEST(GptModel, OverfitsASmallText) {
  const std::string text =
      "the quick brown fox jumps over the lazy dog. pack my box with five dozen liquor jugs. "
      "how vexingly quick daft zebras jump! sphinx of black quartz, judge my vow.";
  const GptConfig cfg = GptConfig::named("tiny");
  const int B = 4, T = cfg.seq_len;
  std::vector<std::int32_t> tok(B * T), tgt(B * T);
  for (int b = 0; b < B; ++b) {
    for (int t = 0; t < T; ++t) {
      const std::size_t i = b * 37 + t;
      tok[b * T + t] = static_cast<unsigned char>(text[i]) % cfg.vocab_size;
      tgt[b * T + t] = static_cast<unsigned char>(text[i + 1]) % cfg.vocab_size;
    }
  }
  Params p = init_params(cfg, 2024);
  Model model(cfg, B);
  AdamW opt;
  float first = 0, last = 0;
  for (int step = 0; step < 300; ++step) {
    Params g = zeros_like(p);
    last = model.forward_backward(p, g, tok, tgt);
    if (step == 0) first = last;
    opt.step(p, g);
  }
  EXPECT_NEAR(first, std::log(64.0), 0.1);
  EXPECT_LT(last, 0.25f) << "first loss " << first;
}

}  // namespace
// Activations beyond the machine's memory are a ConfigError naming the batch before anything is
// allocated (a --d-model 1048576 run used to grow until the OOM killer ended it, or die on a bare
// std::bad_alloc under a memory limit).
TEST(GptModel, ActivationsBeyondMemoryAreAConfigErrorNotAnAllocation) {
  GptConfig cfg;
  cfg.n_layer = 2;
  cfg.n_head = 1;
  cfg.d_model = 1 << 20;
  cfg.seq_len = 128;
  try {
    Model m(cfg, 1024, 128);  // 25 TB of activations
    FAIL() << "built a model whose activations exceed memory";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("--batch"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("GiB"), std::string::npos) << e.what();
  }
  cfg.d_model = 64;
  EXPECT_THROW(Model(cfg, 100000000, 128), ConfigError);  // the batch alone
  EXPECT_NO_THROW(Model(cfg, 2, 16));
}

}  // namespace tiermem::gpt
