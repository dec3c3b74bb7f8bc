// ZeroEngine on a device whose memory the CPU cannot address: SimDevice with
// tiermem.sim_host_addressable false, the CPU twin of CudaDevice (device pointers lie in a
// PROT_NONE mapping, so any host read or write of them by the engine faults). One rank: every
// stage and offload gives, bit for bit, the masters and working params of the same run on the
// default (host-addressable) SimDevice; gathers of stage-3 modules land in device memory;
// gradients handed over from device memory (reduce_gradients_from_device) equal host ones; new
// working params reach the device through the copy engines, sub-group by sub-group; the device
// peak stays within the budget; checkpoint import republishes through the same path.
// The 2-4 rank version runs under mpirun in tests/mpi/zero_mpi_test.cc.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <random>

#include "mpi/zero_mlp.h"
#include "tiermem/device.h"
#include "tiermem/error.h"
#include "tiermem/zero_engine.h"

namespace tiermem {
namespace {

using testing::mlp_config;
using testing::on_opaque_device;
using testing::synthetic_grad;

std::string nvme_dir() {
  auto d =
      std::filesystem::temp_directory_path() / ("tiermem-zero-device-" + std::to_string(getpid()));
  std::filesystem::create_directories(d);
  return d.string();
}

// The config with its NVMe paths moved to `sub` inside them: two engines alive at once need a
// swap directory each.
Config in_subdir(Config cfg, const std::string& sub) {
  for (OffloadConfig* o : {&cfg.zero.offload_param, &cfg.zero.offload_optimizer}) {
    for (std::string& p : o->nvme_path) p += "/" + sub;
  }
  return cfg;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

struct Case {
  int stage;
  const char* offload;         // offload_optimizer.device
  const char* param = "none";  // offload_param.device (stage 3)
  bool bf16 = false;
};

class ZeroOpaqueDevice : public ::testing::TestWithParam<Case> {};

// Ten MLP steps (two micro-batches) on the opaque device equal, bit for bit, the same run on the
// host-addressable SimDevice, with gradients handed over from host or from device memory.
TEST_P(ZeroOpaqueDevice, TrainsBitForBitAsOnTheAddressableDevice) {
  auto comm = make_single_communicator();
  const std::string dir = nvme_dir();
  const Case c = GetParam();
  Config cfg = testing::with_param_offload(mlp_config(c.stage, c.offload, dir, 2), c.param, dir);
  cfg.tiermem.device = "sim";
  cfg.bf16 = c.bf16;
  ZeroEngine ref(in_subdir(cfg, "ref"), *comm);
  const auto want = testing::mlp_train_engine(ref, *comm, 10, 2);
  for (bool device_grads : {false, true}) {
    SCOPED_TRACE(device_grads ? "gradients from device memory" : "gradients from host memory");
    ZeroEngine eng(on_opaque_device(in_subdir(cfg, "opaque")), *comm);
    const auto got = testing::mlp_train_engine(eng, *comm, 10, 2, device_grads);
    ASSERT_EQ(got.size(), want.size());
    for (std::size_t m = 0; m < want.size(); ++m)
      EXPECT_TRUE(same_bits(got[m], want[m])) << "master of module " << m;
    EXPECT_EQ(eng.stats().steps, 10);
    for (int m = 0; m < 2; ++m) {  // the working params as a model would read them
      auto a = ref.gather(m);
      auto b = eng.gather(m);
      EXPECT_TRUE(same_bits(testing::to_f32_host(ref, a), testing::to_f32_host(eng, b)))
          << "working params " << m;
    }
    const ZeroStats s = eng.stats();
    if (c.stage == 3) {
      ASSERT_NE(eng.device(), nullptr);
      EXPECT_FALSE(eng.device()->host_addressable());
      EXPECT_EQ(s.param_home, std::string(c.param) == "none"  ? Tier::kDevice
                              : std::string(c.param) == "cpu" ? Tier::kHost
                                                              : Tier::kNvme);
      EXPECT_LE(s.device_peak_bytes, s.device_budget_bytes);
      // Module 0 (144 elements) is stored; its gathers were device memory.
      auto g = eng.gather(0);
      EXPECT_TRUE(g.on_device());
      // New working params went up through the copy engines (publication or the store's loads).
      EXPECT_GT(eng.device()->stats().h2d_bytes, 0u);
      EXPECT_GT(s.host_to_device_bytes, 0u);  // the engine's own copies are counted
      if (device_grads) {
        EXPECT_GT(eng.device()->stats().d2h_bytes, 0u);
        EXPECT_GE(s.device_to_host_bytes, 10u * 2 * 4 * (144 + 68));  // every gradient came down
      }
    } else {
      EXPECT_EQ(eng.device(), nullptr);
    }
  }
  std::filesystem::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(StageOffload, ZeroOpaqueDevice,
                         ::testing::Values(Case{0, "none"}, Case{1, "cpu"}, Case{2, "none"},
                                           Case{2, "nvme"}, Case{3, "none"}, Case{3, "cpu"},
                                           Case{3, "nvme"}, Case{3, "none", "cpu"},
                                           Case{3, "none", "nvme"}, Case{3, "nvme", "nvme"},
                                           Case{3, "none", "none", true},
                                           Case{3, "nvme", "nvme", true}),
                         [](const auto& info) {
                           const Case& c = info.param;
                           std::string p = c.param;
                           return "stage" + std::to_string(c.stage) + "_" + c.offload +
                                  (p == "none" ? "" : "_param_" + p) + (c.bf16 ? "_bf16" : "");
                         });

// Stage 3, six modules of 10000 elements in sub-groups of 4096 (three per module, the last one
// padded, some straddling nothing but their module): each sub-group's new working params are
// published through the two alternating host staging buffers. Every gather of every step, and
// the masters, equal the addressable device's bit for bit, for params homed on the device, in
// host memory and on NVMe, in fp32 and bf16; gathers on the opaque device are device memory, the
// device peak stays within its budget and the engine's host staging is counted.
TEST(ZeroOpaqueDevice, SubGroupPublicationMatchesAcrossHomesAndDtypes) {
  auto comm = make_single_communicator();
  const std::string dir = nvme_dir();
  constexpr std::size_t kModules = 6, kNumel = 10000;
  for (const char* param : {"none", "cpu", "nvme"}) {
    for (bool bf16 : {false, true}) {
      SCOPED_TRACE(std::string(param) + (bf16 ? " bf16" : " fp32"));
      Config cfg = testing::with_param_offload(mlp_config(3, "cpu", dir, 1), param, dir);
      cfg.zero.stage3_param_persistence_threshold_elems = 0;
      cfg.zero.sub_group_size_elems = 4096;
      cfg.tiermem.device = "sim";
      cfg.tiermem.device_budget_bytes = 1 << 20;
      cfg.bf16 = bf16;
      ZeroEngine ref(in_subdir(cfg, "ref"), *comm),
          eng(on_opaque_device(in_subdir(cfg, "opaque")), *comm);
      std::mt19937 rng(5);
      std::normal_distribution<float> d(0.0f, 0.2f);
      for (std::size_t m = 0; m < kModules; ++m) {
        std::vector<float> init(kNumel);
        for (float& x : init) x = d(rng);
        ref.register_module("m" + std::to_string(m), init);
        eng.register_module("m" + std::to_string(m), init);
      }
      std::vector<float> grad(kNumel);
      for (int step = 0; step < 3; ++step) {
        for (std::size_t m = 0; m < kModules; ++m) {
          auto a = ref.gather(static_cast<int>(m));
          auto b = eng.gather(static_cast<int>(m));
          ASSERT_TRUE(b.on_device());
          ASSERT_TRUE(same_bits(testing::to_f32_host(ref, a), testing::to_f32_host(eng, b)))
              << "step " << step << " module " << m;
        }
        for (std::size_t m = kModules; m-- > 0;) {
          for (std::size_t i = 0; i < kNumel; ++i) grad[i] = synthetic_grad(m, step, i);
          ref.reduce_gradients(static_cast<int>(m), grad);
          testing::reduce_from_device(eng, static_cast<int>(m), grad);
        }
        ref.step();
        eng.step();
      }
      for (int m = 0; m < static_cast<int>(kModules); ++m) {
        ASSERT_TRUE(same_bits(ref.export_master(m), eng.export_master(m))) << "master " << m;
        auto a = ref.gather(m);
        auto b = eng.gather(m);
        ASSERT_TRUE(same_bits(testing::to_f32_host(ref, a), testing::to_f32_host(eng, b)))
            << "final params " << m;
      }
      const ZeroStats s = eng.stats();
      EXPECT_EQ(s.sub_groups, kModules * 3);
      EXPECT_LE(s.device_peak_bytes, s.device_budget_bytes);
      // Staging: two publication sub-groups (device homes only) and one module's gradient.
      const std::uint64_t wsize = bf16 ? 2 : 4;
      const std::uint64_t publish = std::string(param) == "none" ? 2 * 4096 * wsize : 0;
      EXPECT_GE(s.host_engine_peak_bytes, publish + 4 * kNumel);
      EXPECT_GE(eng.plan().host_engine_bytes, publish + 4 * kNumel);
    }
  }
  std::filesystem::remove_all(dir);
}

// A checkpoint taken on the opaque device and imported into a fresh engine on it republishes the
// working params through the staging path: training then continues exactly as an uninterrupted
// run (on either device).
TEST(ZeroOpaqueDevice, ImportRepublishesIntoDeviceMemory) {
  auto comm = make_single_communicator();
  const std::string dir = nvme_dir();
  Config cfg =
      on_opaque_device(testing::with_param_offload(mlp_config(3, "nvme", dir, 1), "none", dir));
  ZeroEngine straight(in_subdir(cfg, "straight"), *comm);
  const auto want = testing::mlp_train_engine(straight, *comm, 8, 1);

  ZeroOptimizerState saved;
  {
    ZeroEngine first(cfg, *comm);
    testing::mlp_train_engine(first, *comm, 4, 1);
    saved = first.export_optimizer_state();
  }
  ZeroEngine resumed(cfg, *comm);
  auto init = testing::mlp_init();
  for (auto& v : init) std::fill(v.begin(), v.end(), 0.0f);  // must be overwritten by the import
  resumed.register_module("fc1", init[0]);
  resumed.register_module("fc2", init[1]);
  resumed.import_optimizer_state(saved);
  testing::mlp_train_steps(resumed, *comm, 4, 1, /*device_grads=*/true);
  for (int m = 0; m < 2; ++m) {
    EXPECT_TRUE(same_bits(resumed.export_master(m), want[static_cast<std::size_t>(m)]))
        << "module " << m;
    auto a = straight.gather(m);
    auto b = resumed.gather(m);
    EXPECT_TRUE(same_bits(testing::to_f32_host(straight, a), testing::to_f32_host(resumed, b)))
        << "params " << m;
  }
  std::filesystem::remove_all(dir);
}

TEST(ZeroOpaqueDevice, DeviceGradientErrors) {
  auto comm = make_single_communicator();
  const std::string dir = nvme_dir();
  {  // stage 2: no device tier
    ZeroEngine eng(on_opaque_device(mlp_config(2, "none", dir, 1)), *comm);
    auto init = testing::mlp_init();
    eng.register_module("fc1", init[0]);
    eng.register_module("fc2", init[1]);
    EXPECT_EQ(eng.device(), nullptr);
    std::vector<float> g(init[0].size());
    EXPECT_THROW(eng.reduce_gradients_from_device(0, g.data(), g.size()), Error);
  }
  ZeroEngine eng(on_opaque_device(mlp_config(3, "none", dir, 1)), *comm);
  auto init = testing::mlp_init();
  eng.register_module("fc1", init[0]);
  eng.register_module("fc2", init[1]);
  EXPECT_EQ(eng.device(), nullptr);  // made with the plan: at the first training call here
  eng.shard_numel();                 // finalizes the registration
  Device* dev = eng.device();
  ASSERT_NE(dev, nullptr);
  void* d = dev->allocate(init[0].size() * 4);
  const float* p = static_cast<const float*>(d);
  EXPECT_THROW(eng.reduce_gradients_from_device(5, p, init[0].size()), Error);  // unknown module
  EXPECT_THROW(eng.reduce_gradients_from_device(0, p, init[0].size() - 1), Error);    // wrong numel
  EXPECT_THROW(eng.reduce_gradients_from_device(0, nullptr, init[0].size()), Error);  // null
  // A host pointer is not device memory: the copy refuses it (as cudaMemcpy would fail).
  std::vector<float> host(init[0].size());
  EXPECT_THROW(eng.reduce_gradients_from_device(0, host.data(), host.size()), Error);
  dev->free(d);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace tiermem
