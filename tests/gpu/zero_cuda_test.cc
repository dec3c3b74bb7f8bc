// ZeroEngine on a real GPU (CudaDevice, whose memory the CPU cannot address): the MLP of
// tests/mpi/zero_mlp.h trained through stage 3 with its gathers in GPU memory, new working params
// published through host staging and gradients handed over from GPU memory equals, bit for bit,
// the same run on SimDevice (AdamW runs on the CPU in both; copies are exact). The same path runs
// without a GPU on SimDevice with sim_host_addressable false (tests/unit/zero_device_test.cc).
// Skips with "no CUDA device" when none is visible (or the build has no CUDA).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>

#include "mpi/zero_mlp.h"
#include "tiermem/device.h"
#include "tiermem/zero_engine.h"

namespace tiermem {
namespace {

TEST(ZeroCuda, Stage3OnTheGpuEqualsSimDeviceBitForBit) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  auto comm = make_single_communicator();
  const auto dir =
      std::filesystem::temp_directory_path() / ("tiermem-zero-cuda-" + std::to_string(getpid()));
  for (const char* param : {"none", "nvme"}) {
    for (bool bf16 : {false, true}) {
      SCOPED_TRACE(std::string(param) + (bf16 ? " bf16" : " fp32"));
      auto make = [&](const char* device) {
        const std::string d = (dir / device).string();
        std::filesystem::create_directories(d);
        Config cfg = testing::with_param_offload(testing::mlp_config(3, "cpu", d, 2), param, d);
        cfg.tiermem.device = device;
        cfg.tiermem.device_budget_bytes = 64 << 20;
        cfg.bf16 = bf16;
        return cfg;
      };
      ZeroEngine sim(make("sim"), *comm), gpu(make("cuda"), *comm);
      const auto want = testing::mlp_train_engine(sim, *comm, 10, 2);
      const auto got = testing::mlp_train_engine(gpu, *comm, 10, 2, /*device_grads=*/true);
      ASSERT_NE(gpu.device(), nullptr);
      EXPECT_EQ(gpu.device()->kind(), DeviceKind::kCuda);
      for (int m = 0; m < 2; ++m) {
        ASSERT_EQ(got[m].size(), want[m].size());
        EXPECT_EQ(std::memcmp(got[m].data(), want[m].data(), want[m].size() * 4), 0)
            << "master " << m;
        auto a = sim.gather(m);
        auto b = gpu.gather(m);
        EXPECT_TRUE(b.on_device());
        EXPECT_EQ(testing::to_f32_host(sim, a), testing::to_f32_host(gpu, b))
            << "working params " << m;
      }
      const ZeroStats s = gpu.stats();
      EXPECT_LE(s.device_peak_bytes, s.device_budget_bytes);
      EXPECT_GT(s.host_to_device_bytes, 0u);
    }
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace tiermem
