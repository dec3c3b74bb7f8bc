// gpt/backend.h: the interface the training loop drives, through the CPU backend (which must be
// gpt::Model exactly), and the CUDA backend's buffer layout (pure host code: sizes, alignment,
// no overlap), so that what a GPU build allocates is checked without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "gpt/backend.h"
#include "gpt/backend_layout.h"
#include "tiermem/error.h"

#if TIERMEM_HAVE_CUDA
#include "gpt/cublas_loader.h"
#endif

namespace tiermem::gpt {
namespace {

std::vector<std::int32_t> ids(int n, int vocab, int mul) {
  std::vector<std::int32_t> v(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = (i * mul + 1) % vocab;
  return v;
}

TEST(GptBackend, CpuBackendIsTheModelBitForBit) {
  const GptConfig cfg = GptConfig::named("tiny");
  const int B = 2, T = 8;
  const auto params = init_params(cfg, 42);
  const auto tokens = ids(B * T, cfg.vocab_size, 7), targets = ids(B * T, cfg.vocab_size, 5);

  Model model(cfg, B, T);
  std::vector<std::vector<float>> g_ref(params.size());
  for (std::size_t m = 0; m < params.size(); ++m) g_ref[m].assign(params[m].size(), 0.0f);
  const float loss_ref = model.forward_backward(params, g_ref, tokens, targets);

  const auto backend = make_cpu_backend(cfg, B, T);
  EXPECT_EQ(backend->name(), "cpu");
  EXPECT_FALSE(backend->on_device());
  EXPECT_EQ(backend->activation_bytes(), model.activation_bytes());
  EXPECT_EQ(backend->batch_size(), B);
  EXPECT_EQ(backend->seq_len(), T);
  std::vector<std::vector<float>> g(params.size());
  for (std::size_t m = 0; m < params.size(); ++m) g[m].assign(params[m].size(), 0.0f);
  backend->set_batch(tokens, targets);
  for (const Step& s : forward_steps(cfg)) backend->forward(s, params[s.module]);
  EXPECT_EQ(backend->loss(), loss_ref);
  EXPECT_GT(backend->loss(), 0.0f);
  for (const Step& s : backward_steps(cfg)) {
    backend->backward(s, s.kind == StepKind::kEmbed ? ParamView() : ParamView(params[s.module]),
                      g[s.module]);
  }
  for (std::size_t m = 0; m < g.size(); ++m) EXPECT_EQ(g[m], g_ref[m]) << "module " << m;
}

TEST(GptBackend, CpuBackendRefusesStepsOutOfOrderAndWrongSizes) {
  const GptConfig cfg = GptConfig::named("tiny");
  const auto backend = make_cpu_backend(cfg, 1, 4);
  const auto params = init_params(cfg, 1);
  EXPECT_THROW(backend->set_batch(ids(3, 64, 1), ids(3, 64, 1)), Error);
  backend->set_batch(ids(4, 64, 3), ids(4, 64, 5));
  EXPECT_THROW(backend->forward(forward_steps(cfg)[2], params[2]), Error);  // not kEmbed first
  EXPECT_THROW(backend->forward(forward_steps(cfg)[0], params[1]), Error);  // block's size
}

TEST(GptBackend, CudaLayoutIsAlignedDisjointAndCounted) {
  const GptConfig cfg = GptConfig::named("mini");
  const int B = 3, T = 50;
  const CudaBackendLayout L(cfg, B, T, 0);
  std::vector<std::pair<std::uintptr_t, std::uint64_t>> bufs;  // (offset, bytes)
  const std::uint64_t N = B * T, C = cfg.d_model, V = cfg.vocab_size;
  const std::uint64_t att = static_cast<std::uint64_t>(B) * cfg.n_head * T * T;
  auto add = [&bufs](const void* p, std::uint64_t bytes) {
    bufs.emplace_back(reinterpret_cast<std::uintptr_t>(p), bytes);
  };
  for (float* r : L.resid) add(r, N * C * 4);
  for (const auto& a : L.layers) {
    for (const float* p : {a.ln1, a.atty, a.resid_mid, a.ln2}) add(p, N * C * 4);
    for (const float* p : {a.ln1_mean, a.ln1_rstd, a.ln2_mean, a.ln2_rstd}) add(p, N * 4);
    add(a.qkv, N * 3 * C * 4);
    add(a.fch, N * 4 * C * 4);
    add(a.fch_gelu, N * 4 * C * 4);
    add(a.att, att * 4);
  }
  add(L.lnf, N * C * 4);
  for (const float* p : {L.lnf_mean, L.lnf_rstd, L.losses}) add(p, N * 4);
  add(L.probs, N * V * 4);
  for (const float* p : {L.d_resid, L.d_resid_mid, L.d_ln, L.d_atty}) add(p, N * C * 4);
  add(L.d_qkv, N * 3 * C * 4);
  add(L.d_fch, N * 4 * C * 4);
  add(L.d_fch_gelu, N * 4 * C * 4);
  add(L.d_att, att * 4);
  for (int b = 0; b < 2; ++b) {
    add(L.params32[b], L.max_module_elems * 4);
    add(L.params16[b], L.max_module_elems * 2);
  }
  add(L.grads, L.max_module_elems * 4);
  add(L.in16, N * 4 * C * 2);
  add(L.out16, N * std::max(4 * C, V) * 2);
  add(L.tokens, N * 4);
  add(L.targets, N * 4);
  EXPECT_EQ(L.layers.size(), static_cast<std::size_t>(cfg.n_layer));
  EXPECT_EQ(L.resid.size(), static_cast<std::size_t>(cfg.n_layer) + 1);
  EXPECT_EQ(L.max_module_elems, static_cast<std::uint64_t>(module_layout(cfg, 1).numel));
  std::sort(bufs.begin(), bufs.end());
  for (std::size_t i = 0; i < bufs.size(); ++i) {
    EXPECT_EQ(bufs[i].first % 256, 0u) << i;
    const std::uint64_t end = bufs[i].first + bufs[i].second;
    EXPECT_LE(end, L.bytes) << i;
    if (i + 1 < bufs.size()) {
      EXPECT_LE(end, bufs[i + 1].first) << "buffers " << i << " overlap";
    }
  }
  // A base address moves every buffer by exactly that much.
  const CudaBackendLayout at(cfg, B, T, 1 << 20);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(at.probs), reinterpret_cast<std::uintptr_t>(L.probs) + (1 << 20));
  EXPECT_EQ(at.bytes, L.bytes);
  EXPECT_EQ(cuda_backend_bytes(cfg, B, T), L.bytes);
  EXPECT_LT(cuda_backend_bytes(cfg, 1, T), cuda_backend_bytes(cfg, 2, T));
  EXPECT_EQ(cuda_backend_bytes(cfg, 1, 0), cuda_backend_bytes(cfg, 1, cfg.seq_len));
}

TEST(GptBackend, BlockTensorsFollowTheModuleLayout) {
  const GptConfig cfg = GptConfig::named("mini");
  const ModuleLayout m = module_layout(cfg, 1);
  std::vector<float> buf(static_cast<std::size_t>(m.numel));
  const BlockTensors<float> b(buf.data(), cfg.d_model);
  const float* got[] = {b.ln1_w, b.ln1_b, b.qkv_w, b.qkv_b, b.proj_w, b.proj_b,
                        b.ln2_w, b.ln2_b, b.fc_w, b.fc_b, b.fc_proj_w, b.fc_proj_b};
  ASSERT_EQ(m.tensors.size(), std::size(got));
  for (std::size_t i = 0; i < m.tensors.size(); ++i)
    EXPECT_EQ(got[i] - buf.data(), m.tensors[i].offset) << m.tensors[i].name;
}

TEST(GptBackend, CudaBackendWithoutAGpuThrowsAnErrorNeverCrashes) {
  try {
    const auto b = make_cuda_backend(GptConfig::named("tiny"), 1, 4);
    EXPECT_TRUE(b->on_device());  // a GPU is here: tests/gpu/gpt_cuda_test.cc compares it
    GTEST_SKIP() << "a CUDA device is visible: the no-GPU error path is not reachable here";
  } catch (const Error& e) {
    EXPECT_FALSE(std::string(e.what()).empty());
  }
}

#if TIERMEM_HAVE_CUDA
// cuBLAS is loaded on first use, not linked (cublas_loader.h): the load and every entry point the
// model calls must resolve, GPU or not (dlopen needs no driver).
TEST(GptBackend, CublasLoadsOnFirstUseWithEveryEntryPoint) {
  const cuda::CublasApi& api = cuda::cublas_api();
  EXPECT_NE(api.create, nullptr);
  EXPECT_NE(api.destroy, nullptr);
  EXPECT_NE(api.set_stream, nullptr);
  EXPECT_NE(api.gemm_ex, nullptr);
  EXPECT_EQ(&cuda::cublas_api(), &api);  // loaded once
}
#endif

}  // namespace
}  // namespace tiermem::gpt
