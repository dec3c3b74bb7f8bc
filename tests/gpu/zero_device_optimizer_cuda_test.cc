// The device-resident optimizer on a real GPU: CudaDevice::adam_step_async (gpu_adam_step on the
// compute stream) against the CPU kernel, and ZeroEngine with offload_optimizer none and
// tiermem.device_optimizer auto on a CudaDevice (its state homed in GPU memory, stepped there)
// against the same run on SimDevice's CPU twin (device_optimizer on), within the CUDA kernel's
// tolerance (adam.h: the CUDA and CPU kernels round differently by a few ulp). Each step moves no
// optimizer state between device and host: only each sub-group's gradient goes up.
// The CPU twin's bit-for-bit tests: tests/unit/zero_device_optimizer_test.cc.
// Skips with "no CUDA device" when none is visible (or the build has no CUDA).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>

#include "mpi/zero_mlp.h"
#include "tiermem/adam.h"
#include "tiermem/device.h"
#include "tiermem/error.h"
#include "tiermem/zero_engine.h"

namespace tiermem {
namespace {

// |a - b| <= rel x max(|a|, |b|) + abs for every element; returns the first offender or -1.
long first_mismatch(const std::vector<float>& a, const std::vector<float>& b, double rel = 1e-5,
                    double abs = 1e-7) {
  if (a.size() != b.size()) return 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double tol = rel * std::max(std::fabs(a[i]), std::fabs(b[i])) + abs;
    if (!(std::fabs(static_cast<double>(a[i]) - b[i]) <= tol)) return static_cast<long>(i);
  }
  return -1;
}

TEST(DeviceOptimizerCuda, AdamStepAsyncMatchesTheCpuKernel) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  DeviceOptions o;
  o.choice = DeviceChoice::kCuda;
  o.budget_bytes = 64 << 20;
  auto dev = make_device(o);
  constexpr std::size_t n = 100003;
  std::vector<float> w(n), g(n), m(n, 0.0f), v(n, 0.0f);
  for (std::size_t i = 0; i < n; ++i) {
    w[i] = std::sin(0.001f * i);
    g[i] = std::cos(0.003f * i) * 0.1f;
  }
  auto up = [&](const std::vector<float>& x) {
    void* d = dev->allocate(4 * n);
    dev->copy_h2d(d, x.data(), 4 * n);
    return static_cast<float*>(d);
  };
  DeviceAdamTensor t;
  t.master = up(w);
  t.grad = up(g);
  t.m = up(m);
  t.v = up(v);
  t.half = static_cast<std::uint16_t*>(dev->allocate(2 * n));
  t.n = n;
  AdamParams p;
  p.lr = 1e-3f;
  p.weight_decay = 0.01f;
  std::vector<std::uint16_t> half_want(n);
  for (std::int64_t s = 1; s <= 3; ++s) {
    p.step = s;
    dev->adam_step_async(p, &t, 1, DType::kBF16).wait();
    adam_step(p, w.data(), g.data(), m.data(), v.data(), n, half_want.data(), DType::kBF16);
  }
  std::vector<float> got(n);
  dev->copy_d2h(got.data(), t.master, 4 * n);
  EXPECT_EQ(first_mismatch(got, w), -1);
  dev->copy_d2h(got.data(), t.v, 4 * n);
  EXPECT_EQ(first_mismatch(got, v), -1);
  std::vector<std::uint16_t> half_got(n);
  dev->copy_d2h(half_got.data(), t.half, 2 * n);
  std::size_t off_by_more = 0;  // bf16 of values a few ulp apart: at most one bf16 ulp
  for (std::size_t i = 0; i < n; ++i)
    off_by_more += std::abs(int(half_got[i]) - int(half_want[i])) > 1;
  EXPECT_EQ(off_by_more, 0u);
  for (void* b : {static_cast<void*>(t.master), const_cast<void*>(static_cast<const void*>(t.grad)),
                  static_cast<void*>(t.m), static_cast<void*>(t.v), static_cast<void*>(t.half)}) {
    dev->free(b);
  }
}

TEST(DeviceOptimizerCuda, ZeroEngineOnTheGpuMatchesTheCpuTwin) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  auto comm = make_single_communicator();
  const auto dir =
      std::filesystem::temp_directory_path() / ("tiermem-devopt-cuda-" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  for (int stage : {1, 2, 3}) {
    for (bool bf16 : {false, true}) {
      SCOPED_TRACE("stage " + std::to_string(stage) + (bf16 ? " bf16" : " fp32"));
      auto make = [&](const char* device, const char* mode) {
        Config cfg = testing::mlp_config(stage, "none", dir.string(), 2);
        cfg.tiermem.device = device;
        cfg.tiermem.device_budget_bytes = 64 << 20;
        cfg.tiermem.device_optimizer = mode;
        cfg.tiermem.sim_host_addressable = false;
        cfg.bf16 = bf16;
        return cfg;
      };
      ZeroEngine sim(make("sim", "on"), *comm), gpu(make("cuda", "auto"), *comm);
      const auto want = testing::mlp_train_engine(sim, *comm, 10, 2);
      const auto got = testing::mlp_train_engine(gpu, *comm, 10, 2, /*device_grads=*/true);
      ASSERT_NE(gpu.device(), nullptr);
      EXPECT_EQ(gpu.device()->kind(), DeviceKind::kCuda);
      EXPECT_EQ(gpu.stats().optimizer_home, Tier::kDevice);
      // fp32: the kernels' few-ulp differences stay tiny over 10 steps. bf16: one of them may flip
      // a working param's rounding, and the forward pass then differs by a bf16 ulp: 2e-3 absolute
      // (each step moves a master by up to lr = 0.01, so a missing or wrong update still fails).
      for (int m = 0; m < 2; ++m) {
        EXPECT_EQ(first_mismatch(got[m], want[m], bf16 ? 0.0 : 1e-5, bf16 ? 2e-3 : 1e-6), -1)
            << "master " << m;
      }
      // One more step: the step itself moves no optimizer state; only gradients go up.
      testing::MlpData D = testing::mlp_data();
      std::vector<float> p0, p1, g0, g1;
      {
        auto a = gpu.gather(0);
        auto b = gpu.gather(1);
        p0 = testing::to_f32_host(gpu, a);
        p1 = testing::to_f32_host(gpu, b);
      }
      testing::mlp_forward_backward(D, p0.data(), p1.data(), 0, testing::kSamples, g0, g1);
      gpu.reduce_gradients(1, g1);
      gpu.reduce_gradients(0, g0);
      const ZeroStats before = gpu.stats();
      gpu.step();
      const ZeroStats after = gpu.stats();
      const std::uint64_t R = gpu.shard_numel();
      EXPECT_EQ(after.host_to_device_bytes - before.host_to_device_bytes, 4 * R);
      const std::uint64_t working =
          stage == 3 ? 0 : R * (bf16 ? 2 : 4);  // stages 1-2: params to host
      EXPECT_EQ(after.device_to_host_bytes - before.device_to_host_bytes, working);
    }
  }
  std::filesystem::remove_all(dir);
}

// auto on a GPU whose budget cannot hold the state: the engine still starts, with the state in
// the host pool (one warning), and trains as the host optimizer does.
TEST(DeviceOptimizerCuda, AutoFallsBackToTheHostWhenTheStateDoesNotFit) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  auto comm = make_single_communicator();
  const auto dir =
      std::filesystem::temp_directory_path() / ("tiermem-devopt-fit-" + std::to_string(getpid()));
  Config cfg = testing::mlp_config(2, "none", dir.string(), 1);
  cfg.tiermem.device = "cuda";
  cfg.tiermem.device_budget_bytes = 16 << 10;  // below 2 sub-groups of state + scratch
  ZeroEngine eng(cfg, *comm);
  testing::mlp_train_engine(eng, *comm, 2, 1);
  EXPECT_EQ(eng.stats().optimizer_home, Tier::kHost);
  EXPECT_FALSE(eng.plan().optimizer_on_device);
  cfg.tiermem.device_optimizer = "on";  // asked for explicitly: refused, naming the budget key
  EXPECT_THROW(
      {
        ZeroEngine e(cfg, *comm);
        testing::mlp_train_engine(e, *comm, 1, 1);
      },
      ConfigError);
}

}  // namespace
}  // namespace tiermem
