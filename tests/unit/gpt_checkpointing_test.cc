// Activation checkpointing of the GPT model (ModelOptions::checkpoint_blocks): the recompute is
// the same kernels on the same values, so losses and gradients equal the plain model's BITWISE
// (fp32 and bf16 parameters), across gradient accumulation and an evaluation pass in between; and
// the activation memory drops by n_layer - 1 blocks' intermediates.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "gpt/model.h"
#include "tiermem/dtype.h"

namespace tiermem::gpt {
namespace {

using Params = std::vector<std::vector<float>>;

std::vector<std::int32_t> ids(std::size_t n, int vocab, std::uint32_t seed) {
  std::mt19937 g(seed);
  std::uniform_int_distribution<int> d(0, vocab - 1);
  std::vector<std::int32_t> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

Params zeros_like(const Params& p) {
  Params g(p.size());
  for (std::size_t i = 0; i < p.size(); ++i) g[i].assign(p[i].size(), 0.0f);
  return g;
}

// A model with weights moved off their init so every path carries signal.
Params perturbed(const GptConfig& cfg, std::uint32_t seed) {
  Params p = init_params(cfg, seed);
  std::mt19937 g(seed + 1);
  std::normal_distribution<float> d(0.0f, 0.2f);
  for (auto& m : p)
    for (auto& x : m) x += d(g);
  return p;
}

bool bitwise_equal(const Params& a, const Params& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t m = 0; m < a.size(); ++m) {
    if (a[m].size() != b[m].size() ||
        std::memcmp(a[m].data(), b[m].data(), a[m].size() * sizeof(float)) != 0)
      return false;
  }
  return true;
}

const GptConfig kCfg{3, 2, 16, 8, 40};  // 3 blocks, so the shared buffers are reused

TEST(GptCheckpointing, LossesAndGradientsAreBitwiseTheSame) {
  const int B = 3;
  const Params p = perturbed(kCfg, 21);
  Model plain(kCfg, B), ckpt(kCfg, B, 0, ModelOptions{.checkpoint_blocks = true});
  ASSERT_TRUE(ckpt.checkpoints_blocks());
  Params g_plain = zeros_like(p), g_ckpt = zeros_like(p);
  // Two accumulated micro-batches with an evaluation pass between them: the evaluation
  // overwrites the shared block buffers, which the next backward must not read stale.
  for (std::uint32_t micro = 0; micro < 2; ++micro) {
    const auto tok = ids(B * kCfg.seq_len, kCfg.vocab_size, 100 + micro);
    const auto tgt = ids(B * kCfg.seq_len, kCfg.vocab_size, 200 + micro);
    const float a = plain.forward_backward(p, g_plain, tok, tgt);
    const float b = ckpt.forward_backward(p, g_ckpt, tok, tgt);
    EXPECT_EQ(a, b) << "micro-batch " << micro;  // bitwise: the recompute is deterministic
    const auto etok = ids(B * kCfg.seq_len, kCfg.vocab_size, 300 + micro);
    EXPECT_EQ(plain.forward_all(p, etok, tgt), ckpt.forward_all(p, etok, tgt));
  }
  EXPECT_TRUE(bitwise_equal(g_plain, g_ckpt));
  double norm = 0;  // not a vacuous comparison of zeros
  for (const auto& m : g_plain)
    for (float x : m) norm += static_cast<double>(x) * x;
  EXPECT_GT(norm, 1e-6);
}

TEST(GptCheckpointing, Bf16ParametersAreRecomputedFromTheSameBits) {
  const int B = 2;
  const Params p = perturbed(kCfg, 31);
  std::vector<std::vector<std::uint16_t>> half(p.size());
  for (std::size_t m = 0; m < p.size(); ++m)
    for (float x : p[m]) half[m].push_back(f32_to_bf16(x));
  const auto tok = ids(B * kCfg.seq_len, kCfg.vocab_size, 7);
  const auto tgt = ids(B * kCfg.seq_len, kCfg.vocab_size, 8);
  auto run = [&](bool checkpoint, Params* grads) {
    Model model(kCfg, B, 0, ModelOptions{.checkpoint_blocks = checkpoint});
    model.set_batch(tok, tgt);
    for (const Step& s : forward_steps(kCfg)) model.forward(s, ParamView::bf16(half[s.module]));
    for (const Step& s : backward_steps(kCfg)) {
      const ParamView v = s.kind == StepKind::kEmbed ? ParamView() : ParamView::bf16(half[s.module]);
      model.backward(s, v, (*grads)[s.module]);
    }
    return model.loss();
  };
  Params ga = zeros_like(p), gb = zeros_like(p);
  EXPECT_EQ(run(false, &ga), run(true, &gb));
  EXPECT_TRUE(bitwise_equal(ga, gb));
}

TEST(GptCheckpointing, KeepsBlockInputsAndOneBlocksIntermediates) {
  const int B = 2, T = kCfg.seq_len;
  const Model plain(kCfg, B), ckpt(kCfg, B, 0, ModelOptions{.checkpoint_blocks = true});
  const std::size_t N = static_cast<std::size_t>(B) * T, C = kCfg.d_model;
  const std::size_t att = static_cast<std::size_t>(B) * kCfg.n_head * T * T;
  // One block's intermediates: ln1, atty, resid_mid, ln2 (N·C each), qkv (3·N·C), fch and
  // fch_gelu (4·N·C each), att (B·heads·T²), four LayerNorm mean/rstd vectors (N each).
  const std::size_t block = (4 * N * C + 3 * N * C + 8 * N * C + att + 4 * N) * sizeof(float);
  EXPECT_EQ(plain.activation_bytes() - ckpt.activation_bytes(), (kCfg.n_layer - 1) * block);
  EXPECT_EQ(ckpt.block_input_bytes(), (kCfg.n_layer + 1) * N * C * sizeof(float));
  EXPECT_EQ(plain.block_input_bytes(), ckpt.block_input_bytes());  // kept either way
}

}  // namespace
}  // namespace tiermem::gpt
