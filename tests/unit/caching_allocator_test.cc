// CachingAllocator: budget on allocated + cached, cache reuse, cache release under pressure.
#include "gpu/caching_allocator.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <set>
#include <vector>

namespace tiermem::detail {
namespace {

struct Backend {
  std::set<void*> live;
  int allocs = 0, frees = 0;
  std::vector<std::uint64_t> freed_sizes;
  CachingAllocator make(std::uint64_t budget) {
    return CachingAllocator(
        budget,
        [this](std::uint64_t n) {
          void* p = std::malloc(n);
          live.insert(p);
          ++allocs;
          return p;
        },
        [this](void* p, std::uint64_t n) {
          live.erase(p);
          freed_sizes.push_back(n);
          ++frees;
          std::free(p);
        });
  }
};

TEST(CachingAllocator, Rounding) {
  EXPECT_EQ(CachingAllocator::round(0), 256u);
  EXPECT_EQ(CachingAllocator::round(1), 256u);
  EXPECT_EQ(CachingAllocator::round(257), 512u);
  EXPECT_EQ(CachingAllocator::round(4096), 4096u);
  EXPECT_EQ(CachingAllocator::round(4097), 8192u);
}

TEST(CachingAllocator, ReusesFreedBlocksWithoutBackendCalls) {
  Backend b;
  {
    CachingAllocator a = b.make(1 << 20);
    void* p = a.try_allocate(10000);
    ASSERT_NE(p, nullptr);
    EXPECT_TRUE(a.free(p));
    for (int i = 0; i < 100; ++i) {
      void* q = a.try_allocate(10000);
      EXPECT_EQ(q, p);
      a.free(q);
    }
    EXPECT_EQ(b.allocs, 1);
    DeviceStats s;
    a.fill_stats(s);
    EXPECT_EQ(s.cache_hits, 100u);
    EXPECT_EQ(s.cached_bytes, 12288u);
  }
  EXPECT_TRUE(b.live.empty());  // destructor released everything
}

TEST(CachingAllocator, ReleasesCacheBeforeFailingAndNeverExceedsBudget) {
  Backend b;
  CachingAllocator a = b.make(64 << 10);
  void* x = a.try_allocate(32 << 10);
  void* y = a.try_allocate(32 << 10);
  ASSERT_NE(y, nullptr);
  EXPECT_EQ(a.try_allocate(1), nullptr);  // budget full
  a.free(x);
  a.free(y);
  void* z = a.try_allocate(64 << 10);  // needs the cache released
  ASSERT_NE(z, nullptr);
  EXPECT_EQ(b.frees, 2);
  DeviceStats s;
  a.fill_stats(s);
  EXPECT_LE(s.peak_reserved_bytes, 64u << 10);
  EXPECT_FALSE(a.free(reinterpret_cast<void*>(0x1234)));
  EXPECT_TRUE(a.contains(static_cast<char*>(z) + 100, 1000));
  EXPECT_FALSE(a.contains(static_cast<char*>(z) + 100, 64 << 10));
  a.free(z);
}

// A request that does not fit releases cached blocks largest first, only as many as it needs:
// the small blocks stay cached and are reused without a backend call.
TEST(CachingAllocator, ReleasesOnlyWhatARequestNeedsLargestFirst) {
  Backend b;
  CachingAllocator a = b.make(256 << 10);
  void* big = a.try_allocate(128 << 10);
  void* mid = a.try_allocate(64 << 10);
  void* small = a.try_allocate(16 << 10);
  ASSERT_NE(small, nullptr);
  a.free(big);
  a.free(mid);
  a.free(small);  // 208 KiB cached, 48 KiB free in the budget
  void* want = a.try_allocate(96 << 10);  // needs 48 KiB more: the 128 KiB block goes
  ASSERT_NE(want, nullptr);
  EXPECT_EQ(b.freed_sizes, std::vector<std::uint64_t>{128u << 10});
  const int allocs = b.allocs;
  EXPECT_EQ(a.try_allocate(16 << 10), small);  // still cached
  EXPECT_EQ(a.try_allocate(64 << 10), mid);
  EXPECT_EQ(b.allocs, allocs);
  DeviceStats s;
  a.fill_stats(s);
  EXPECT_LE(s.peak_reserved_bytes, 256u << 10);
}

}  // namespace
}  // namespace tiermem::detail
