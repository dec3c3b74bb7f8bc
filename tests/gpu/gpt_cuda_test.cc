// The GPT model's CUDA kernels against its CPU kernels on the same random inputs. Row kernels run
// the same gpt/layer_math.h phases (split over a warp or a block, combined by shuffles: only the
// summation order and the device's expf differ), so they must agree to fp32 rounding (1e-5
// relative to the largest reference value), also at GPT-2's widths (C 1600, V 50257: there the
// softmax is held to a double-precision reference, see below); GEMMs take bf16 inputs, so the CPU reference is given the same
// bf16-rounded inputs and the bound is 1e-4 relative (fp32 accumulation order only).
// Skips with "no CUDA device" where there is no GPU; scripts/gpu-check.sh runs it on one.
#include <gtest/gtest.h>

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "gpt/kernels_cpu.h"
#include "gpt/backend.h"
#include "gpt/kernels_cuda.h"
#include "tiermem/dtype.h"

namespace tiermem::gpt {
namespace {

bool have_device() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

#define REQUIRE_DEVICE()                                  \
  do {                                                    \
    if (!have_device()) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

template <class T>
struct Dev {
  T* p = nullptr;
  std::size_t n = 0;
  explicit Dev(const std::vector<T>& h) : n(h.size()) {
    EXPECT_EQ(cudaMalloc(&p, n * sizeof(T)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(p, h.data(), n * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  ~Dev() { cudaFree(p); }
  std::vector<T> get() const {
    std::vector<T> h(n);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }
};

std::vector<float> filled(std::size_t n, float v = 0.0f) { return std::vector<float>(n, v); }
std::vector<std::uint16_t> filled_u16(std::size_t n) { return std::vector<std::uint16_t>(n, 0); }

std::vector<float> randn(std::size_t n, std::uint32_t seed, float scale = 1.0f) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

void expect_near_all(const std::vector<float>& gpu, const std::vector<float>& cpu, double rel,
                     const char* what) {
  ASSERT_EQ(gpu.size(), cpu.size()) << what;
  double maxref = 0, maxd = 0;
  for (std::size_t i = 0; i < cpu.size(); ++i) {
    maxref = std::max(maxref, std::abs(static_cast<double>(cpu[i])));
    maxd = std::max(maxd, std::abs(static_cast<double>(gpu[i]) - cpu[i]));
  }
  EXPECT_GT(maxref, 0.0) << what;
  EXPECT_LE(maxd, rel * std::max(maxref, 1e-3)) << what << " max |ref| " << maxref;
}

constexpr int B = 2, T = 33, C = 64, NH = 4, N = B * T, V = 97;

TEST(GptCuda, EncoderMatchesCpu) {
  REQUIRE_DEVICE();
  std::vector<std::int32_t> tok(N);
  for (int i = 0; i < N; ++i) tok[i] = (i * 7 + 3) % V;
  auto wte = randn(V * C, 1), wpe = randn(T * C, 2), dout = randn(N * C, 3);
  std::vector<float> out(N * C), dwte(V * C, 0.0f), dwpe(T * C, 0.0f);
  cpu::encoder_forward(out.data(), tok.data(), wte.data(), wpe.data(), B, T, C);
  cpu::encoder_backward(dwte.data(), dwpe.data(), dout.data(), tok.data(), B, T, C);
  Dev<std::int32_t> dtok(tok);
  Dev<float> dwte_p(wte), dwpe_p(wpe), ddout(dout), dout_g(filled(N * C)),
      gwte(filled(V * C, 0.0f)), gwpe(filled(T * C, 0.0f));
  cuda::encoder_forward(dout_g.p, dtok.p, dwte_p.p, dwpe_p.p, B, T, C, nullptr);
  cuda::encoder_backward(gwte.p, gwpe.p, ddout.p, dtok.p, B, T, C, nullptr);
  expect_near_all(dout_g.get(), out, 1e-6, "encoder out");
  expect_near_all(gwte.get(), dwte, 1e-5, "encoder dwte");
  expect_near_all(gwpe.get(), dwpe, 1e-5, "encoder dwpe");
}

TEST(GptCuda, LayerNormMatchesCpu) {
  REQUIRE_DEVICE();
  auto x = randn(N * C, 4, 2.0f), w = randn(C, 5), b = randn(C, 6), dout = randn(N * C, 7);
  std::vector<float> out(N * C), mean(N), rstd(N), dx(N * C, 0.5f), dw(C, 0.0f), db(C, 0.0f);
  cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
  cpu::layernorm_backward(dx.data(), dw.data(), db.data(), dout.data(), x.data(), w.data(),
                          mean.data(), rstd.data(), N, C);
  Dev<float> gx(x), gw(w), gb(b), gdout(dout), gout(filled(N * C)),
      gmean(filled(N)), grstd(filled(N)),
      gdx(filled(N * C, 0.5f)), gdw(filled(C, 0.0f)),
      gdb(filled(C, 0.0f));
  cuda::layernorm_forward(gout.p, gmean.p, grstd.p, gx.p, gw.p, gb.p, N, C, nullptr);
  cuda::layernorm_backward(gdx.p, gdw.p, gdb.p, gdout.p, gx.p, gw.p, gmean.p, grstd.p, N, C,
                           nullptr);
  expect_near_all(gout.get(), out, 1e-5, "layernorm out");
  expect_near_all(gdx.get(), dx, 1e-5, "layernorm dx");
  expect_near_all(gdw.get(), dw, 1e-5, "layernorm dw");
  expect_near_all(gdb.get(), db, 1e-5, "layernorm db");
}

TEST(GptCuda, AttentionMatchesCpu) {
  REQUIRE_DEVICE();
  auto qkv = randn(N * 3 * C, 8), dout = randn(N * C, 9);
  std::vector<float> out(N * C), att(B * NH * T * T), dqkv(N * 3 * C), dpre(B * NH * T * T);
  cpu::attention_forward(out.data(), att.data(), qkv.data(), B, T, C, NH);
  cpu::attention_backward(dqkv.data(), dpre.data(), dout.data(), qkv.data(), att.data(), B, T, C,
                          NH);
  Dev<float> gqkv(qkv), gdout(dout), gout(filled(N * C)),
      gatt(filled(att.size())), gdqkv(filled(dqkv.size())),
      gdpre(filled(dpre.size()));
  cuda::attention_forward(gout.p, gatt.p, gqkv.p, B, T, C, NH, nullptr);
  cuda::attention_backward(gdqkv.p, gdpre.p, gdout.p, gqkv.p, gatt.p, B, T, C, NH, nullptr);
  expect_near_all(gout.get(), out, 1e-5, "attention out");
  expect_near_all(gatt.get(), att, 1e-5, "attention probabilities");
  expect_near_all(gdqkv.get(), dqkv, 1e-5, "attention dqkv");
}

TEST(GptCuda, GeluResidualCrossEntropyMatchCpu) {
  REQUIRE_DEVICE();
  const std::int64_t n = N * 4 * C;
  auto x = randn(n, 10, 2.0f), y = randn(n, 11), dout = randn(n, 12);
  std::vector<float> g(n), dg(n), r(n);
  cpu::gelu_forward(g.data(), x.data(), n);
  cpu::gelu_backward(dg.data(), x.data(), dout.data(), n);
  cpu::residual_forward(r.data(), x.data(), y.data(), n);
  Dev<float> gx(x), gy(y), gdout(dout), gg(filled(n)), gdg(filled(n)),
      gr(filled(n));
  cuda::gelu_forward(gg.p, gx.p, n, nullptr);
  cuda::gelu_backward(gdg.p, gx.p, gdout.p, n, nullptr);
  cuda::residual_forward(gr.p, gx.p, gy.p, n, nullptr);
  expect_near_all(gg.get(), g, 1e-5, "gelu");
  expect_near_all(gdg.get(), dg, 1e-5, "gelu backward");
  expect_near_all(gr.get(), r, 1e-6, "residual");

  std::vector<std::int32_t> tgt(N);
  for (int i = 0; i < N; ++i) tgt[i] = (i * 13) % V;
  auto logits = randn(N * V, 13, 3.0f);
  std::vector<float> probs = logits;
  const float loss = cpu::crossentropy_forward(probs.data(), tgt.data(), N, V);
  Dev<float> glog(logits), glosses(filled(N));
  Dev<std::int32_t> gtgt(tgt);
  cuda::crossentropy_forward(glog.p, glosses.p, gtgt.p, N, V, nullptr);
  expect_near_all(glog.get(), probs, 1e-5, "softmax probabilities");
  double sum = 0;
  for (float l : glosses.get()) sum += l;
  EXPECT_NEAR(sum / N, loss, 1e-5 * std::abs(loss));
  cpu::crossentropy_backward(probs.data(), tgt.data(), N, V, 1.0f / N);
  cuda::crossentropy_backward(glog.p, gtgt.p, N, V, 1.0f / N, nullptr);
  expect_near_all(glog.get(), probs, 1e-5, "dlogits");
}

// The warp- and block-per-row kernels where each lane owns many elements: LayerNorm over 1600
// columns (gpt2-xl), cross-entropy over 50257 logits (GPT-2's vocabulary); and the bf16 -> fp32
// cast (exact).
TEST(GptCuda, RowKernelsAtGpt2WidthsMatchCpu) {
  REQUIRE_DEVICE();
  const int Nw = 6, Cw = 1600, Vw = 50257;
  auto x = randn(static_cast<std::size_t>(Nw) * Cw, 21, 2.0f), w = randn(Cw, 22), b = randn(Cw, 23);
  std::vector<float> out(Nw * Cw), mean(Nw), rstd(Nw);
  cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), Nw, Cw);
  Dev<float> gx(x), gw(w), gb(b), gout(filled(Nw * Cw)), gmean(filled(Nw)), grstd(filled(Nw));
  cuda::layernorm_forward(gout.p, gmean.p, grstd.p, gx.p, gw.p, gb.p, Nw, Cw, nullptr);
  expect_near_all(gout.get(), out, 1e-5, "layernorm out, C 1600");
  expect_near_all(grstd.get(), rstd, 1e-5, "layernorm rstd, C 1600");

  std::vector<std::int32_t> tgt = {0, 1, 50256, 777, 31337, 4};
  auto logits = randn(static_cast<std::size_t>(Nw) * Vw, 24, 3.0f);
  std::vector<float> probs = logits;
  const float loss = cpu::crossentropy_forward(probs.data(), tgt.data(), Nw, Vw);
  Dev<float> glog(logits), glosses(filled(Nw));
  Dev<std::int32_t> gtgt(tgt);
  cuda::crossentropy_forward(glog.p, glosses.p, gtgt.p, Nw, Vw, nullptr);
  // Over 50257 terms the CPU kernel's left-to-right fp32 sum of the exponentials is itself off by
  // up to ~V·2^-24 relative (4.7e-5 was seen against the GPU's tree sum on an H200), so both are
  // held to the softmax computed in double: the GPU's tree sum to fp32 rounding (1e-5 relative),
  // the CPU's sequential one to its own bound (3e-4).
  std::vector<float> exact(probs.size());
  for (int n = 0; n < Nw; ++n) {
    const float* l = logits.data() + static_cast<std::size_t>(n) * Vw;
    double mx = l[0], sum = 0;
    for (int v = 1; v < Vw; ++v) mx = std::max(mx, static_cast<double>(l[v]));
    for (int v = 0; v < Vw; ++v) sum += std::exp(l[v] - mx);
    for (int v = 0; v < Vw; ++v) exact[static_cast<std::size_t>(n) * Vw + v] = static_cast<float>(std::exp(l[v] - mx) / sum);
  }
  expect_near_all(probs, exact, 3e-4, "CPU softmax probabilities against double, V 50257");
  expect_near_all(glog.get(), exact, 1e-5, "GPU softmax probabilities against double, V 50257");
  double sum = 0;
  for (float l : glosses.get()) sum += l;
  EXPECT_NEAR(sum / Nw, loss, 1e-5 * std::abs(loss));

  std::vector<std::uint16_t> bits(4096);
  std::vector<float> want(bits.size());
  for (std::size_t i = 0; i < bits.size(); ++i) {
    bits[i] = static_cast<std::uint16_t>((i * 40503u) & 0xff7fu);  // finite (exponent < 0xff), both signs
    want[i] = bf16_to_f32(bits[i]);
  }
  Dev<std::uint16_t> gbits(bits);
  Dev<float> gf(filled(bits.size()));
  cuda::cast_bf16_to_f32(gf.p, gbits.p, static_cast<std::int64_t>(bits.size()), nullptr);
  EXPECT_EQ(gf.get(), want);
}

TEST(GptCuda, Bf16MatmulMatchesCpuOnRoundedInputs) {
  REQUIRE_DEVICE();
  const int OC = 3 * C;
  auto round_bf16 = [](std::vector<float> v, std::vector<std::uint16_t>* bits) {
    bits->resize(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) {
      (*bits)[i] = f32_to_bf16(v[i]);
      v[i] = bf16_to_f32((*bits)[i]);
    }
    return v;
  };
  std::vector<std::uint16_t> xb, wb, db16;
  auto x = round_bf16(randn(N * C, 14), &xb);
  auto w = round_bf16(randn(OC * C, 15, 0.1f), &wb);
  auto dout = round_bf16(randn(N * OC, 16), &db16);
  auto bias = randn(OC, 17);
  std::vector<float> out(N * OC), dx(N * C), dw(OC * C, 0.25f), dbias(OC, 0.0f);
  cpu::matmul_forward(out.data(), x.data(), w.data(), bias.data(), N, C, OC);
  cpu::matmul_backward(dx.data(), dw.data(), dbias.data(), dout.data(), x.data(), w.data(), N, C,
                       OC);

  // The device side also checks the cast kernel: upload fp32, cast to bf16 on the GPU.
  Dev<float> gx32(x), gw32(w), gd32(dout), gbias(bias), gout(filled(N * OC)),
      gdx(filled(N * C)), gdw(filled(OC * C, 0.25f)),
      gdbias(filled(OC, 0.0f));
  Dev<std::uint16_t> gx(filled_u16(N * C)), gw(filled_u16(OC * C)),
      gd(filled_u16(N * OC));
  cuda::cast_f32_to_bf16(gx.p, gx32.p, N * C, nullptr);
  cuda::cast_f32_to_bf16(gw.p, gw32.p, OC * C, nullptr);
  cuda::cast_f32_to_bf16(gd.p, gd32.p, N * OC, nullptr);
  EXPECT_EQ(gx.get(), xb);  // the device cast rounds exactly as tiermem/dtype.h does
  cublasHandle_t h;
  ASSERT_EQ(cublasCreate(&h), CUBLAS_STATUS_SUCCESS);
  cuda::matmul_forward(h, gout.p, gx.p, gw.p, gbias.p, N, C, OC, nullptr);
  cuda::matmul_backward(h, gdx.p, gdw.p, gdbias.p, gd.p, gd32.p, gx.p, gw.p, N, C, OC, nullptr);
  expect_near_all(gout.get(), out, 1e-4, "matmul out");
  expect_near_all(gdx.get(), dx, 1e-4, "matmul dinp");
  expect_near_all(gdw.get(), dw, 1e-4, "matmul dw");
  expect_near_all(gdbias.get(), dbias, 1e-4, "matmul dbias");
  cublasDestroy(h);
}

// The whole model through the CUDA backend against the CPU backend (backend.h), parameters
// given from host memory: the loss within 1% (bf16 GEMM inputs) and every module's gradient
// within 3% of its largest magnitude; then the same with parameters already in device memory.
TEST(GptCuda, CudaBackendMatchesCpuBackend) {
  REQUIRE_DEVICE();
  const GptConfig cfg = GptConfig::named("tiny");
  const int Bm = 2, Tm = 16;
  const auto params = init_params(cfg, 7);
  std::vector<std::int32_t> tok(Bm * Tm), tgt(Bm * Tm);
  for (int i = 0; i < Bm * Tm; ++i) tok[i] = (i * 5 + 1) % cfg.vocab_size, tgt[i] = (i * 3 + 2) % cfg.vocab_size;
  auto run = [&](ModelBackend& b, bool device_params, std::vector<std::vector<float>>* grads) {
    std::vector<Dev<float>*> dev;
    for (const auto& p : params) dev.push_back(device_params ? new Dev<float>(p) : nullptr);
    auto view = [&](int m) {
      return device_params ? ParamView(std::span<const float>(dev[m]->p, dev[m]->n))
                           : ParamView(params[m]);
    };
    b.set_batch(tok, tgt);
    for (const Step& s : forward_steps(cfg)) b.forward(s, view(s.module));
    const float loss = b.loss();
    grads->assign(params.size(), {});
    for (std::size_t m = 0; m < params.size(); ++m) (*grads)[m].assign(params[m].size(), 0.0f);
    for (const Step& s : backward_steps(cfg)) b.backward(s, view(s.module), (*grads)[s.module]);
    for (auto* d : dev) delete d;
    return loss;
  };
  auto cpu = make_cpu_backend(cfg, Bm, Tm);
  auto gpu = make_cuda_backend(cfg, Bm, Tm);
  EXPECT_TRUE(gpu->on_device());
  std::vector<std::vector<float>> g_cpu, g_gpu;
  const float l_cpu = run(*cpu, false, &g_cpu);
  for (bool device_params : {false, true}) {
    SCOPED_TRACE(device_params ? "params in device memory" : "params in host memory");
    const float l_gpu = run(*gpu, device_params, &g_gpu);
    EXPECT_NEAR(l_gpu, l_cpu, 0.01 * l_cpu);
    for (std::size_t m = 0; m < g_cpu.size(); ++m) expect_near_all(g_gpu[m], g_cpu[m], 3e-2, "module gradient");
  }
}

}  // namespace
}  // namespace tiermem::gpt
