// PinnedHostPool: alignment, budget, coalescing, backpressure, the memlock error.
#include "tiermem/pinned_host_pool.h"

#include <gtest/gtest.h>
#include <sys/resource.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <random>
#include <thread>
#include <vector>

#include "tiermem/error.h"

namespace tiermem {
namespace {

PinnedHostPoolOptions small(std::uint64_t budget, std::uint64_t mapping = 1 << 20) {
  PinnedHostPoolOptions o;
  o.budget_bytes = budget;
  o.mapping_bytes = mapping;
  o.pin_memory = false;
  return o;
}

// The bracketed THP mode, "" without THP.
std::string thp_mode() {
  std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string line;
  std::getline(f, line);
  auto a = line.find('['), b = line.find(']');
  return a == std::string::npos || b == std::string::npos ? "" : line.substr(a + 1, b - a - 1);
}

TEST(PinnedHostPool, HugePagesGiveAlignedMappingsAndAnHonestLayout) {
  constexpr std::uint64_t k2M = PinnedHostPool::kHugePageBytes;
  PinnedHostPoolOptions o = small(8 * k2M, 8 * k2M);
  o.populate = true;
  o.map_now = true;
  PinnedHostPool pool(o);
  ASSERT_EQ(pool.regions().size(), 1u);
  const HostRegion r = pool.regions().front();
  EXPECT_EQ(r.bytes, 8 * k2M);
  EXPECT_LE(pool.huge_bytes(), r.bytes);
  // The layout claimed is never better than what the kernel reported.
  if (r.contiguous_bytes == k2M) {
    EXPECT_EQ(pool.huge_bytes(), r.bytes);
  } else {
    EXPECT_EQ(r.contiguous_bytes, 4096u);
    EXPECT_LT(pool.huge_bytes(), r.bytes);
  }
  const std::string thp = thp_mode();
  if (pool.page_kind() == HostPageKind::kSmall) {
    EXPECT_TRUE(thp != "always" && thp != "madvise") << "THP is '" << thp << "' but 4 KiB pages";
    EXPECT_EQ(pool.huge_bytes(), 0u);
    GTEST_SKIP() << "no huge pages here (THP '" << thp << "', no hugetlbfs pages): fallback checked";
  }
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(r.base) % k2M, 0u);
  // Blocks are still 4096-aligned pieces of it, writable end to end.
  char* a = static_cast<char*>(pool.allocate(3 * k2M + 4096));
  std::memset(a, 0x5a, 3 * k2M + 4096);
  EXPECT_EQ(a[3 * k2M], 0x5a);
  pool.free(a);
}

TEST(PinnedHostPool, HugePagesOffIsSmallPagesAndClaimsNothing) {
  PinnedHostPoolOptions o = small(4 << 20, 4 << 20);
  o.huge_pages = false;
  o.populate = true;
  o.map_now = true;
  PinnedHostPool pool(o);
  EXPECT_EQ(pool.page_kind(), HostPageKind::kSmall);
  EXPECT_EQ(pool.huge_bytes(), 0u);
  ASSERT_EQ(pool.regions().size(), 1u);
  EXPECT_EQ(pool.regions().front().contiguous_bytes, 4096u);
  void* p = pool.allocate(1 << 20);
  std::memset(p, 1, 1 << 20);
  pool.free(p);
}

TEST(PinnedHostPool, UnpopulatedMappingClaimsNoHugeLayout) {
  // Not faulted in yet: the kernel has not decided the pages, so nothing is claimed.
  PinnedHostPoolOptions o = small(4 << 20, 4 << 20);
  o.map_now = true;
  PinnedHostPool pool(o);
  ASSERT_EQ(pool.regions().size(), 1u);
  EXPECT_EQ(pool.regions().front().contiguous_bytes, 4096u);
  EXPECT_EQ(pool.huge_bytes(), 0u);
}

TEST(PinnedHostPool, AlignedAndWritable) {
  PinnedHostPool pool(small(4 << 20));
  void* a = pool.allocate(1);
  void* b = pool.allocate(5000);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(a) % 4096, 0u);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(b) % 4096, 0u);
  EXPECT_NE(a, b);
  std::memset(b, 0xab, 5000);
  EXPECT_EQ(pool.allocated_bytes(), 4096u + 8192u);
  pool.free(a);
  pool.free(b);
  EXPECT_EQ(pool.allocated_bytes(), 0u);
  EXPECT_EQ(pool.peak_allocated_bytes(), 4096u + 8192u);
}

// Long-lived blocks from try_allocate_high pack at the top of the mapping, interleaved with
// short-lived ones, so the short-lived ones' space stays one contiguous run once they are freed
// (the fragmentation a TensorStore's host homes caused between its caches).
TEST(PinnedHostPool, HighAllocationsKeepTheLowSpaceContiguous) {
  constexpr std::uint64_t kMiB = 1 << 20;
  PinnedHostPoolOptions o = small(16 * kMiB, 16 * kMiB);
  o.map_now = true;
  PinnedHostPool pool(o);
  std::vector<void*> homes, caches;
  for (int i = 0; i < 7; ++i) {
    caches.push_back(pool.allocate(kMiB + 4096 * i));
    homes.push_back(pool.try_allocate_high(128 << 10));
    ASSERT_NE(homes.back(), nullptr);
  }
  for (std::size_t i = 1; i < homes.size(); ++i) {
    EXPECT_LT(homes[i], homes[i - 1]) << "homes grow down from the top";
    EXPECT_GT(homes[i], caches.back()) << "homes stay above every short-lived block";
  }
  for (void* c : caches) pool.free(c);
  // Everything but the 7 x 128 KiB homes is one free run: a block of all of it fits.
  void* big = pool.try_allocate(16 * kMiB - 7 * (128 << 10));
  EXPECT_NE(big, nullptr);
  pool.free(big);
  for (void* h : homes) pool.free(h);
  EXPECT_EQ(pool.allocated_bytes(), 0u);
  EXPECT_EQ(pool.try_allocate_high(17 * kMiB), nullptr);  // over the budget
}

TEST(PinnedHostPool, BudgetIsHardAndErrorHasNumbers) {
  PinnedHostPool pool(small(1 << 20, 1 << 20));
  void* a = pool.allocate(768 << 10);
  try {
    pool.allocate(512 << 10);
    FAIL() << "expected OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    EXPECT_EQ(e.tier(), Tier::kHost);
    EXPECT_EQ(e.requested(), 512u << 10);
    EXPECT_EQ(e.available(), 256u << 10);
  }
  EXPECT_EQ(pool.try_allocate(512 << 10), nullptr);
  pool.free(a);
  void* b = pool.allocate(1 << 20);  // whole budget after coalescing
  EXPECT_NE(b, nullptr);
  pool.free(b);
  EXPECT_LE(pool.mapped_bytes(), 1u << 20);
}

TEST(PinnedHostPool, FreeCoalescesNeighbours) {
  PinnedHostPool pool(small(64 << 10, 64 << 10));
  std::vector<void*> blocks;
  for (int i = 0; i < 16; ++i) blocks.push_back(pool.allocate(4096));
  EXPECT_EQ(pool.try_allocate(1), nullptr);
  // Free in an interleaved order; all pieces must merge back into one 64 KiB extent.
  for (int i = 0; i < 16; i += 2) pool.free(blocks[i]);
  for (int i = 1; i < 16; i += 2) pool.free(blocks[i]);
  void* all = pool.try_allocate(64 << 10);
  EXPECT_NE(all, nullptr);
  pool.free(all);
}

TEST(PinnedHostPool, RandomAllocFreeKeepsBlocksDisjoint) {
  PinnedHostPool pool(small(8 << 20, 2 << 20));
  std::mt19937 rng(7);
  std::vector<std::pair<unsigned char*, std::uint64_t>> live;
  for (int it = 0; it < 3000; ++it) {
    if (!live.empty() && (rng() % 3 == 0 || pool.allocated_bytes() > (6u << 20))) {
      std::size_t k = rng() % live.size();
      auto [p, n] = live[k];
      unsigned char tag = static_cast<unsigned char>(reinterpret_cast<std::uintptr_t>(p) >> 12);
      for (std::uint64_t i = 0; i < n; i += 509) ASSERT_EQ(p[i], tag) << "block overwritten";
      pool.free(p);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
    } else {
      std::uint64_t n = 1 + rng() % (300 << 10);
      auto* p = static_cast<unsigned char*>(pool.try_allocate(n));
      if (p == nullptr) continue;
      std::memset(p, static_cast<unsigned char>(reinterpret_cast<std::uintptr_t>(p) >> 12), n);
      live.push_back({p, n});
    }
    ASSERT_LE(pool.allocated_bytes(), pool.budget_bytes());
  }
  for (auto& [p, n] : live) pool.free(p);
  EXPECT_EQ(pool.allocated_bytes(), 0u);
}

TEST(PinnedHostPool, AllocateWaitGetsBlockFreedByAnotherThread) {
  PinnedHostPool pool(small(1 << 20, 1 << 20));
  void* a = pool.allocate(1 << 20);
  std::thread t([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    pool.free(a);
  });
  void* b = pool.allocate_wait(512 << 10, std::chrono::seconds(10));
  EXPECT_NE(b, nullptr);
  t.join();
  pool.free(b);
  void* c = pool.allocate(1 << 20);
  EXPECT_THROW(pool.allocate_wait(4096, std::chrono::milliseconds(10)), OutOfMemoryError);
  pool.free(c);
}

TEST(PinnedHostPool, PinMemoryOverMemlockLimitSaysHowToRaiseIt) {
  struct rlimit rl {};
  ASSERT_EQ(getrlimit(RLIMIT_MEMLOCK, &rl), 0);
  if (rl.rlim_cur == RLIM_INFINITY || rl.rlim_cur >= (1ull << 40)) {
    GTEST_SKIP() << "RLIMIT_MEMLOCK is unlimited here; the error path cannot be provoked";
  }
  PinnedHostPoolOptions o = small(rl.rlim_cur * 4 + (64 << 20), rl.rlim_cur * 4 + (64 << 20));
  o.pin_memory = true;
  try {
    PinnedHostPool pool(o);
    // Root with CAP_IPC_LOCK may lock past the limit: then it must really be pinned.
    EXPECT_TRUE(pool.pinned());
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("ulimit -l"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("pin_memory: false"), std::string::npos) << e.what();
  }
}

TEST(PinnedHostPool, SmallPinnedPoolWithinLimitIsLocked) {
  struct rlimit rl {};
  ASSERT_EQ(getrlimit(RLIMIT_MEMLOCK, &rl), 0);
  if (rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < (2 << 20)) {
    GTEST_SKIP() << "RLIMIT_MEMLOCK below 2 MiB";
  }
  PinnedHostPoolOptions o = small(1 << 20, 1 << 20);
  o.pin_memory = true;
  PinnedHostPool pool(o);
  EXPECT_TRUE(pool.pinned());
  ASSERT_EQ(pool.regions().size(), 1u);
  EXPECT_EQ(pool.regions()[0].bytes, 1u << 20);
}

}  // namespace
}  // namespace tiermem
