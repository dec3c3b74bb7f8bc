// GPU AdamW (src/gpu/adam.cu) against the CPU scalar kernel. Skips without a CUDA device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "tiermem/gpu_adam.h"

namespace tiermem {
namespace {

TEST(GpuAdam, MatchesCpuScalarKernel) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(1);
  std::normal_distribution<float> d(0.0f, 1.0f);
  const std::vector<std::size_t> sizes = {1, 31, 1000, 70001};
  std::vector<std::vector<float>> p, g, m, v;
  for (std::size_t n : sizes) {
    std::vector<float> a(n), b(n), c(n), e(n);
    for (std::size_t i = 0; i < n; ++i) {
      a[i] = d(rng); b[i] = 0.1f * d(rng); c[i] = 0.01f * d(rng); e[i] = 1e-3f * std::abs(d(rng));
    }
    p.push_back(a); g.push_back(b); m.push_back(c); v.push_back(e);
  }
  AdamParams ap;
  ap.lr = 1e-2f;
  ap.weight_decay = 0.1f;
  ap.step = 3;
  std::vector<GpuAdamTensor> ts;
  std::vector<void*> allocs;
  auto dev = [&](const std::vector<float>& h) {
    void* ptr = nullptr;
    EXPECT_EQ(cudaMalloc(&ptr, h.size() * 4), cudaSuccess);
    cudaMemcpy(ptr, h.data(), h.size() * 4, cudaMemcpyHostToDevice);
    allocs.push_back(ptr);
    return static_cast<float*>(ptr);
  };
  for (std::size_t k = 0; k < sizes.size(); ++k) {
    GpuAdamTensor t;
    t.master = dev(p[k]); t.grad = dev(g[k]); t.m = dev(m[k]); t.v = dev(v[k]); t.n = sizes[k];
    void* h = nullptr;
    cudaMalloc(&h, sizes[k] * 2);
    allocs.push_back(h);
    t.half = static_cast<std::uint16_t*>(h);
    ts.push_back(t);
  }
  gpu_adam_step(ap, ts.data(), ts.size(), DType::kBF16, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (std::size_t k = 0; k < sizes.size(); ++k) {
    const std::size_t n = sizes[k];
    adam_step(ap, p[k].data(), g[k].data(), m[k].data(), v[k].data(), n, nullptr, DType::kBF16, {AdamIsa::kScalar, 1});
    std::vector<float> out(n);
    std::vector<std::uint16_t> half(n);
    cudaMemcpy(out.data(), ts[k].master, n * 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(half.data(), ts[k].half, n * 2, cudaMemcpyDeviceToHost);
    for (std::size_t i = 0; i < n; ++i) {
      ASSERT_NEAR(out[i], p[k][i], 1e-6 * std::max(1.0f, std::abs(p[k][i])) + 1e-7) << k << " " << i;
      ASSERT_EQ(half[i], f32_to_bf16(out[i]));
    }
  }
  for (void* a : allocs) cudaFree(a);
}

}  // namespace
}  // namespace tiermem
