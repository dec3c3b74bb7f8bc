// SimDevice: budgets, asynchronous copies in order, events, throttle, make_device, AdamW on its
// memory (adam_step_async) in both addressing modes.
#include "tiermem/sim_device.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "tiermem/adam.h"
#include "tiermem/config.h"
#include "tiermem/error.h"

namespace tiermem {
namespace {

TEST(SimDevice, RoundTripThroughDevice) {
  SimDevice dev({.budget_bytes = 8 << 20});
  EXPECT_TRUE(dev.host_addressable());
  std::vector<std::uint8_t> src(3 << 20), dst(3 << 20, 0);
  std::iota(src.begin(), src.end(), 0);
  void* d = dev.allocate(src.size());
  DeviceEvent e = dev.copy_h2d_async(d, src.data(), src.size());
  e.wait();
  EXPECT_TRUE(e.ready());
  EXPECT_EQ(std::memcmp(d, src.data(), src.size()), 0);  // host-addressable
  dev.copy_d2h(dst.data(), d, dst.size());
  EXPECT_EQ(src, dst);
  void* d2 = dev.allocate(src.size());
  dev.copy_d2d_async(d2, d, src.size()).wait();
  dev.memset_async(d, 0, 1000).wait();
  EXPECT_EQ(static_cast<std::uint8_t*>(d)[999], 0);
  EXPECT_EQ(std::memcmp(d2, src.data(), src.size()), 0);
  dev.free(d);
  dev.free(d2);
  DeviceStats s = dev.stats();
  EXPECT_EQ(s.h2d_bytes, src.size());
  EXPECT_EQ(s.d2h_bytes, src.size());
  EXPECT_EQ(s.allocated_bytes, 0u);
}

// A block freed to make room is not unmapped: its pages become the next allocation's (moved, not
// faulted in and zeroed anew), which shows as its bytes at the new block's start; the rest of the
// new block is mapped and writable, and empty_cache() lets the kept pages go.
// The names of this process's threads (/proc/self/task/*/comm).
std::multiset<std::string> thread_names() {
  std::multiset<std::string> names;
  for (const auto& t : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream f(t.path() / "comm");
    std::string name;
    if (std::getline(f, name)) names.insert(name);
  }
  return names;
}

// Each copy engine's thread says what it is (top -H, perf, /proc), and is gone with the device.
TEST(SimDevice, CopyEngineThreadsAreNamed) {
  const auto before = thread_names();
  ASSERT_EQ(before.count("tm-sim-h2d"), 0u);
  {
    SimDevice dev({.budget_bytes = 1 << 20});
    // The names are set by the threads themselves, as they start.
    std::multiset<std::string> now;
    for (int i = 0; i < 200; ++i) {
      now = thread_names();
      if (now.count("tm-sim-h2d") == 1 && now.count("tm-sim-d2h") == 1) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    EXPECT_EQ(now.count("tm-sim-h2d"), 1u);
    EXPECT_EQ(now.count("tm-sim-d2h"), 1u);
  }
  EXPECT_EQ(thread_names().count("tm-sim-h2d"), 0u);
}

TEST(SimDevice, FreedPagesBecomeTheNextAllocationsInsteadOfFreshOnes) {
  SimDevice dev({.budget_bytes = 8 << 20});
  auto* a = static_cast<std::uint8_t*>(dev.allocate(4 << 20));
  std::memset(a, 0xAB, 4 << 20);
  dev.free(a);  // cached by the allocator: 4 + 6 MiB would pass the budget, so it is freed below
  auto* b = static_cast<std::uint8_t*>(dev.allocate(6 << 20));
  EXPECT_EQ(b[0], 0xAB);
  EXPECT_EQ(b[(4 << 20) - 1], 0xAB);  // all of a's pages, in order
  EXPECT_EQ(b[4 << 20], 0);            // then fresh ones
  std::memset(b, 0x11, 6 << 20);
  EXPECT_EQ(b[(6 << 20) - 1], 0x11);
  dev.free(b);
  dev.empty_cache();
  EXPECT_EQ(dev.stats().allocated_bytes, 0u);
  auto* c = static_cast<std::uint8_t*>(dev.allocate(2 << 20));  // after empty_cache: nothing kept
  EXPECT_EQ(c[0], 0);
  dev.free(c);
}

TEST(SimDevice, OverBudgetThrowsOutOfMemoryOnDeviceTier) {
  SimDevice dev({.budget_bytes = 1 << 20});
  void* a = dev.allocate(768 << 10);
  try {
    dev.allocate(512 << 10);
    FAIL() << "expected OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    EXPECT_EQ(e.tier(), Tier::kDevice);
    EXPECT_EQ(e.requested(), 512u << 10);
    EXPECT_EQ(e.available(), 256u << 10);
  }
  EXPECT_EQ(dev.try_allocate(512 << 10), nullptr);
  dev.free(a);
  void* b = dev.allocate(1 << 20);  // the cached block is released to make room
  dev.free(b);
  EXPECT_LE(dev.stats().peak_reserved_bytes, 1u << 20);
}

TEST(SimDevice, CopyOutsideAllocationIsRejected) {
  SimDevice dev({.budget_bytes = 1 << 20});
  std::vector<char> host(8192);
  void* d = dev.allocate(4096);
  EXPECT_THROW(dev.copy_h2d_async(d, host.data(), 8192), Error);
  EXPECT_THROW(dev.copy_d2h_async(host.data(), host.data(), 16), Error);
  dev.free(d);
  EXPECT_THROW(dev.copy_h2d_async(d, host.data(), 16), Error);  // use after free
}

TEST(SimDevice, CopiesOfOneDirectionCompleteInOrder) {
  SimDevice dev({.budget_bytes = 64 << 20});
  void* d = dev.allocate(1 << 20);
  std::vector<std::vector<std::uint8_t>> srcs;
  for (int i = 0; i < 32; ++i) srcs.emplace_back(1 << 20, static_cast<std::uint8_t>(i));
  std::vector<DeviceEvent> evs;
  for (auto& s : srcs) evs.push_back(dev.copy_h2d_async(d, s.data(), s.size()));
  evs.back().wait();
  for (auto& e : evs) EXPECT_TRUE(e.ready());  // FIFO: earlier ones are done too
  EXPECT_EQ(static_cast<std::uint8_t*>(d)[12345], 31);
  dev.synchronize();
  dev.free(d);
}

TEST(SimDevice, ThrottleMakesCopiesTakeAtLeastBytesOverBandwidth) {
  // 4 MiB at 1 GB/s must take >= ~4.2 ms; this is a lower bound from the implementation's sleep,
  // not a timing assertion about machine speed.
  SimDevice dev({.budget_bytes = 8 << 20, .h2d_gbps = 1.0, .d2h_gbps = 0});
  std::vector<char> host(4 << 20);
  void* d = dev.allocate(host.size());
  auto t0 = std::chrono::steady_clock::now();
  dev.copy_h2d(d, host.data(), host.size());
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GE(s, 4.0e-3);
  dev.free(d);
}

TEST(SimDevice, ConcurrentAllocCopyFromManyThreads) {
  SimDevice dev({.budget_bytes = 16 << 20});
  std::vector<std::thread> threads;
  std::atomic<int> ooms{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::vector<std::uint8_t> src(300000, static_cast<std::uint8_t>(t + 1)), dst(300000);
      for (int i = 0; i < 200; ++i) {
        void* d = dev.try_allocate(src.size());
        if (d == nullptr) {
          ++ooms;
          continue;
        }
        dev.copy_h2d_async(d, src.data(), src.size()).wait();
        dev.copy_d2h(dst.data(), d, dst.size());
        ASSERT_EQ(dst, src);
        dev.free(d);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_LE(dev.stats().peak_reserved_bytes, 16u << 20);
  EXPECT_EQ(dev.stats().allocated_bytes, 0u);
}

TEST(MakeDevice, SimAndAutoWithoutGpuAndBadValue) {
  Config c;
  c.tiermem.device = "sim";
  c.tiermem.device_budget_bytes = 4 << 20;
  auto d = make_device(c);
  EXPECT_EQ(d->kind(), DeviceKind::kSim);
  EXPECT_EQ(d->budget_bytes(), 4u << 20);
  c.tiermem.device = "auto";
  auto a = make_device(c);
  EXPECT_EQ(a->kind(), cuda_device_available() ? DeviceKind::kCuda : DeviceKind::kSim);
  c.tiermem.device = "tpu";
  EXPECT_THROW(make_device(c), ConfigError);
  c.tiermem.device = "cuda";
  if (!cuda_device_available()) {
    EXPECT_THROW(make_device(c), NotSupportedError);
  }
}

// The CPU twin of CudaDevice: memory the CPU may not address. Copies, memset, budgets and
// events work as in the default mode; the bytes are only reachable through copies.
TEST(SimDeviceOpaque, CopiesWorkAndTheDeviceIsNotHostAddressable) {
  SimDevice dev({.budget_bytes = 8 << 20, .host_addressable = false});
  EXPECT_FALSE(dev.host_addressable());
  EXPECT_EQ(dev.kind(), DeviceKind::kSim);
  std::vector<std::uint8_t> src(3 << 20), dst(3 << 20, 1);
  std::iota(src.begin(), src.end(), 0);
  void* d = dev.allocate(src.size());
  void* d2 = dev.allocate(src.size());
  dev.copy_h2d(d, src.data(), src.size());
  dev.copy_d2d_async(d2, d, src.size()).wait();
  dev.memset_async(d, 7, 1000).wait();
  dev.copy_d2h(dst.data(), d2, dst.size());
  EXPECT_EQ(src, dst);
  dev.copy_d2h(dst.data(), d, 2000);
  EXPECT_EQ(dst[999], 7);
  EXPECT_EQ(dst[1000], src[1000]);
  // Offsets inside a block, and copies at the ends of it.
  dev.copy_h2d(static_cast<char*>(d) + 12345, src.data(), 100);
  dev.copy_d2h(dst.data(), static_cast<char*>(d) + 12345, 100);
  EXPECT_EQ(std::memcmp(dst.data(), src.data(), 100), 0);
  EXPECT_THROW(dev.copy_h2d(static_cast<char*>(d) + src.size() - 10, src.data(), 100), Error);
  // Freed blocks are cached and reused, and their contents survive only through copies.
  dev.free(d);
  void* d3 = dev.allocate(src.size());
  EXPECT_EQ(d3, d);
  dev.free(d2);
  dev.free(d3);
  dev.empty_cache();
  const DeviceStats s = dev.stats();
  EXPECT_EQ(s.allocated_bytes, 0u);
  EXPECT_EQ(s.cached_bytes, 0u);
  EXPECT_LE(s.peak_reserved_bytes, 8u << 20);
  EXPECT_THROW(dev.allocate(9 << 20), OutOfMemoryError);
}

// A host read of device memory — the mistake this mode exists to catch — faults at once.
TEST(SimDeviceOpaqueDeathTest, HostDereferenceOfDeviceMemoryFaults) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  SimDevice dev({.budget_bytes = 1 << 20, .host_addressable = false});
  void* d = dev.allocate(4096);
  dev.memset_async(d, 1, 4096).wait();
  volatile const std::uint8_t* p = static_cast<const std::uint8_t*>(d);
  EXPECT_DEATH({ [[maybe_unused]] std::uint8_t x = p[100]; }, "");
  dev.free(d);
}

TEST(MakeDevice, SimHostAddressableFromConfig) {
  Config c;
  c.tiermem.device = "sim";
  EXPECT_TRUE(make_device(c)->host_addressable());
  c.tiermem.sim_host_addressable = false;
  auto d = make_device(c);
  EXPECT_FALSE(d->host_addressable());
  EXPECT_EQ(d->name(), "sim (not host-addressable)");
  const Config parsed = parse_config(R"({"tiermem": {"device": "sim", "sim_host_addressable": false}})");
  EXPECT_FALSE(parsed.tiermem.sim_host_addressable);
  EXPECT_FALSE(make_device(parsed)->host_addressable());
}


void cpu_adam(const AdamParams& p, float* master, const float* grad, float* m, float* v, std::size_t n, void* half,
              DType half_dtype) {
  adam_step(p, master, grad, m, v, n, half, half_dtype);
}

// Three tensors (one with a bf16 copy-out, one empty) stepped twice in device memory equal, bit
// for bit, tiermem::adam_step on host copies of the same values — on addressable memory and on
// the PROT_NONE twin, where only the device's own view may touch the bytes.
TEST(SimDeviceAdam, StepsDeviceMemoryAsTheCpuKernelInBothModes) {
  for (bool addressable : {true, false}) {
    SCOPED_TRACE(addressable ? "host-addressable" : "not host-addressable");
    SimDevice dev({.budget_bytes = 8 << 20, .host_addressable = addressable, .adam_kernel = &cpu_adam});
    const std::size_t ns[3] = {1000, 37, 0};
    std::vector<std::vector<float>> host[4];  // master, grad, m, v per tensor
    std::vector<std::vector<std::uint16_t>> half_want(3);
    std::vector<DeviceAdamTensor> t(3);
    std::vector<void*> bufs;
    for (std::size_t i = 0; i < 3; ++i) {
      for (int k = 0; k < 4; ++k) {
        host[k].emplace_back(ns[i]);
        for (std::size_t e = 0; e < ns[i]; ++e) {
          host[k][i][e] = k == 3 ? 0.01f * static_cast<float>(e % 7) : std::sin(0.1f * e + k + i);
        }
      }
      auto up = [&](const std::vector<float>& v) {
        void* d = dev.allocate(4 * v.size());
        dev.copy_h2d(d, v.data(), 4 * v.size());
        bufs.push_back(d);
        return static_cast<float*>(d);
      };
      t[i].master = up(host[0][i]);
      t[i].grad = up(host[1][i]);
      t[i].m = up(host[2][i]);
      t[i].v = up(host[3][i]);
      t[i].n = ns[i];
      half_want[i].resize(ns[i]);
    }
    void* half_dev = dev.allocate(2 * ns[0]);
    t[0].half = static_cast<std::uint16_t*>(half_dev);
    AdamParams p;
    p.lr = 0.01f;
    p.weight_decay = 0.1f;
    p.grad_scale = 0.5f;
    for (std::int64_t step = 1; step <= 2; ++step) {
      p.step = step;
      dev.adam_step_async(p, t.data(), t.size(), DType::kBF16).wait();
      for (std::size_t i = 0; i < 3; ++i) {
        adam_step(p, host[0][i].data(), host[1][i].data(), host[2][i].data(), host[3][i].data(), ns[i],
                  i == 0 ? half_want[0].data() : nullptr, DType::kBF16);
      }
    }
    for (std::size_t i = 0; i < 2; ++i) {  // (the third is empty: nothing to compare)
      float* dptr[4] = {t[i].master, const_cast<float*>(t[i].grad), t[i].m, t[i].v};
      for (int k = 0; k < 4; ++k) {
        std::vector<float> got(ns[i]);
        dev.copy_d2h(got.data(), dptr[k], 4 * ns[i]);
        EXPECT_EQ(std::memcmp(got.data(), host[k][i].data(), 4 * ns[i]), 0) << "tensor " << i << " part " << k;
      }
    }
    std::vector<std::uint16_t> half_got(ns[0]);
    dev.copy_d2h(half_got.data(), half_dev, 2 * ns[0]);
    EXPECT_EQ(half_got, half_want[0]);
    EXPECT_NE(half_got[5], 0);
    // A pointer outside the device's allocations, or a bad half dtype: refused at once.
    DeviceAdamTensor bad = t[0];
    bad.grad = host[1][0].data();
    EXPECT_THROW(dev.adam_step_async(p, &bad, 1, DType::kBF16), Error);
    EXPECT_THROW(dev.adam_step_async(p, t.data(), 1, DType::kF32), NotSupportedError);
    for (void* b : bufs) dev.free(b);
    dev.free(half_dev);
  }
  SimDevice plain({.budget_bytes = 1 << 20});  // made without a kernel
  DeviceAdamTensor none;
  EXPECT_THROW(plain.adam_step_async(AdamParams{}, &none, 1, DType::kBF16), NotSupportedError);
}

}  // namespace
}  // namespace tiermem
