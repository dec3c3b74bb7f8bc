// CudaDevice and TensorStore on a real GPU. Skips with "no CUDA device" when none is visible (or
// the build has no CUDA).
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <vector>

#include "tiermem/cuda_device.h"
#include "tiermem/device.h"
#include "tiermem/error.h"
#include "tiermem/tensor_store.h"

namespace tiermem {
namespace {

#define REQUIRE_GPU()                                          \
  do {                                                         \
    if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

TEST(CudaDevice, RoundTripAndEvents) {
  REQUIRE_GPU();
  auto dev = make_cuda_device(0, 256 << 20);
  EXPECT_EQ(dev->kind(), DeviceKind::kCuda);
  EXPECT_FALSE(dev->host_addressable());
  std::vector<std::uint8_t> src(5 << 20), dst(5 << 20, 0);
  std::iota(src.begin(), src.end(), 0);
  ASSERT_TRUE(dev->register_host(src.data(), src.size()));
  void* d = dev->allocate(src.size());
  void* d2 = dev->allocate(src.size());
  dev->copy_h2d_async(d, src.data(), src.size()).wait();
  dev->copy_d2d_async(d2, d, src.size()).wait();
  dev->copy_d2h(dst.data(), d2, dst.size());
  EXPECT_EQ(src, dst);
  dev->memset_async(d2, 0, 1000).wait();
  dev->copy_d2h(dst.data(), d2, 1000);
  EXPECT_EQ(dst[999], 0);
  dev->synchronize();
  dev->free(d);
  dev->free(d2);
  dev->unregister_host(src.data());
  // Caching: the same size again is served from the cache.
  void* again = dev->allocate(5 << 20);
  EXPECT_GE(dev->stats().cache_hits, 1u);
  dev->free(again);
}

TEST(CudaDevice, BudgetIsHard) {
  REQUIRE_GPU();
  auto dev = make_cuda_device(0, 64 << 20);
  void* a = dev->allocate(48 << 20);
  EXPECT_THROW(dev->allocate(32 << 20), OutOfMemoryError);
  dev->free(a);
  void* b = dev->allocate(64 << 20);
  dev->free(b);
  EXPECT_LE(dev->stats().peak_reserved_bytes, 64u << 20);
}

TEST(CudaDevice, TensorStoreHostHomeRoundTrip) {
  REQUIRE_GPU();
  std::shared_ptr<Device> dev = make_cuda_device(0, 64 << 20);
  TensorStoreOptions o;
  o.host_budget_bytes = 32 << 20;
  TensorStore store(o, dev);
  std::vector<std::byte> init(3'000'001);
  for (std::size_t i = 0; i < init.size(); ++i) init[i] = std::byte(static_cast<std::uint8_t>(i * 7));
  TensorId t = store.register_tensor({.name = "t", .dtype = DType::kU8, .shape = {}, .bytes = init.size(),
                                      .home = Tier::kHost, .initial = init});
  {
    TensorStore::Pin p = store.acquire(t, Tier::kDevice);
    dev->memset_async(p.data(), 0x5a, 1000).wait();
    p.mark_dirty();
  }
  ASSERT_TRUE(store.evict(t, Tier::kDevice));
  std::vector<std::byte> out(init.size());
  store.read(t, out);
  EXPECT_EQ(out[0], std::byte{0x5a});
  EXPECT_EQ(out[999], std::byte{0x5a});
  EXPECT_EQ(out[1000], init[1000]);
  EXPECT_EQ(out.back(), init.back());
}

}  // namespace
}  // namespace tiermem
