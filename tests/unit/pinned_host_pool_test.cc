// PinnedHostPool: alignment, budget, no fragmentation (issue 32), memory and registration that
// follow use, backpressure, the memlock error.
#include "tiermem/pinned_host_pool.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/resource.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <random>
#include <thread>
#include <vector>

#include "tiermem/error.h"

namespace tiermem {
namespace {

PinnedHostPoolOptions small(std::uint64_t budget) {
  PinnedHostPoolOptions o;
  o.budget_bytes = budget;
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

TEST(PinnedHostPool, HugePagesGiveAlignedSlotsAndAnHonestLayout) {
  constexpr std::uint64_t k2M = PinnedHostPool::kHugePageBytes;
  PinnedHostPoolOptions o = small(8 * k2M);
  o.verify_huge_pages = true;
  PinnedHostPool pool(o);
  EXPECT_TRUE(pool.regions().empty()) << "nothing is committed before it is used";
  char* a = static_cast<char*>(pool.allocate(8 * k2M));
  ASSERT_EQ(pool.regions().size(), 1u);
  const HostRegion r = pool.regions().front();
  EXPECT_EQ(r.base, a);
  EXPECT_EQ(r.bytes, 8 * k2M);
  EXPECT_LE(pool.huge_bytes(), r.bytes);
  // The layout claimed is never better than what the kernel reported.
  if (r.contiguous_bytes == k2M) {
    EXPECT_EQ(pool.huge_bytes(), r.bytes);
  } else {
    EXPECT_EQ(r.contiguous_bytes, 4096u);
    EXPECT_LT(pool.huge_bytes(), r.bytes);
  }
  std::memset(a, 0x5a, 8 * k2M);
  EXPECT_EQ(a[3 * k2M], 0x5a);
  pool.free(a);
  const std::string thp = thp_mode();
  if (pool.page_kind() == HostPageKind::kSmall) {
    EXPECT_TRUE(thp != "always" && thp != "madvise") << "THP is '" << thp << "' but 4 KiB pages";
    EXPECT_EQ(pool.huge_bytes(), 0u);
    GTEST_SKIP() << "no huge pages here (THP '" << thp << "'): fallback checked";
  }
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(r.base) % k2M, 0u);
}

TEST(PinnedHostPool, HugePagesOffIsSmallPagesAndClaimsNothing) {
  PinnedHostPoolOptions o = small(4 << 20);
  o.huge_pages = false;
  PinnedHostPool pool(o);
  EXPECT_EQ(pool.page_kind(), HostPageKind::kSmall);
  void* p = pool.allocate(2 << 20);
  std::memset(p, 1, 2 << 20);
  EXPECT_EQ(pool.huge_bytes(), 0u);
  ASSERT_EQ(pool.regions().size(), 1u);
  EXPECT_EQ(pool.regions().front().contiguous_bytes, 4096u);
  pool.free(p);
}

// The pattern that failed before (issue 32): blocks of many sizes freed in an order that left the
// free bytes of a best-fit pool in pieces, then a block as large as all of them. Here any block
// fits while allocated + its size <= budget, whatever came before.
TEST(PinnedHostPool, AnyBlockFitsWhileTheBudgetHoldsItsBytes) {
  constexpr std::uint64_t kBudget = 4 << 20;
  PinnedHostPool pool(small(kBudget));
  std::mt19937 rng(32);
  std::vector<std::pair<void*, std::uint64_t>> live;
  for (int round = 0; round < 200; ++round) {
    // Fill with random sizes, free every other one: the classic checkerboard.
    while (true) {
      const std::uint64_t n = PinnedHostPool::allocation_size(1 + rng() % (700 << 10));
      void* p = pool.try_allocate(n);
      if (p == nullptr) {
        ASSERT_GT(pool.allocated_bytes() + n, kBudget) << "refused with room in the budget";
        break;
      }
      live.push_back({p, n});
    }
    for (std::size_t i = round % 2; i < live.size(); i += 2) {
      pool.free(live[i].first);
      live[i].first = nullptr;
    }
    std::erase_if(live, [](const auto& b) { return b.first == nullptr; });
    // A block of all the free bytes fits.
    const std::uint64_t room = kBudget - pool.allocated_bytes();
    void* big = pool.try_allocate(room);
    ASSERT_NE(big, nullptr) << "round " << round << ": " << room << " bytes free but no block of them";
    EXPECT_EQ(pool.allocated_bytes(), kBudget);
    std::memset(big, 0x3c, room);
    pool.free(big);
    EXPECT_LE(pool.mapped_bytes(), kBudget) << "committed memory stays within the budget";
  }
  for (auto& [p, n] : live) pool.free(p);
  EXPECT_EQ(pool.allocated_bytes(), 0u);
}

// Memory follows use: nothing committed at start, a freed block stays warm for the next of its
// size (no system call), and warm blocks are released when a commit would pass the budget.
TEST(PinnedHostPool, CommitsWhatIsUsedAndReleasesWarmSlotsForRoom) {
  constexpr std::uint64_t kMiB = 1 << 20;
  PinnedHostPool pool(small(64 * kMiB));
  EXPECT_EQ(pool.mapped_bytes(), 0u);
  void* a = pool.allocate(3 * kMiB);
  EXPECT_EQ(pool.mapped_bytes(), 3 * kMiB);
  pool.free(a);
  EXPECT_EQ(pool.mapped_bytes(), 3 * kMiB) << "a freed slot stays warm";
  void* b = pool.allocate(3 * kMiB);
  EXPECT_EQ(b, a) << "the warm slot of the same size is reused";
  EXPECT_EQ(pool.mapped_bytes(), 3 * kMiB);
  pool.free(b);
  // 61 MiB and the warm 3 MiB slot reused fill the budget; then 64 MiB needs both released.
  void* c = pool.allocate(61 * kMiB);
  void* d = pool.allocate(3 * kMiB);
  EXPECT_EQ(pool.mapped_bytes(), 64 * kMiB);
  EXPECT_EQ(pool.peak_mapped_bytes(), 64 * kMiB);
  pool.free(c);
  pool.free(d);
  void* e = pool.allocate(64 * kMiB);
  EXPECT_LE(pool.mapped_bytes(), 64 * kMiB);
  std::memset(e, 1, 64 * kMiB);
  pool.free(e);
}

// Past the budget, a commit takes a warm slot's pages over (mremap) instead of releasing them and
// faulting zeroed ones in: the new block holds the old bytes (nothing zeroed), nothing is faulted,
// the budget holds, and the blocks stay disjoint.
TEST(PinnedHostPool, WarmSlotsPagesMoveToTheCommitThatNeedsThemInsteadOfBeingZeroedAgain) {
  constexpr std::uint64_t kMiB = 1 << 20;
  PinnedHostPool pool(small(16 * kMiB));
  auto* a = static_cast<unsigned char*>(pool.allocate(12 * kMiB));
  std::memset(a, 0xAB, 12 * kMiB);
  auto* b = static_cast<unsigned char*>(pool.allocate(4 * kMiB));
  std::memset(b, 0xCD, 4 * kMiB);
  pool.free(a);
  EXPECT_EQ(pool.faulted_bytes(), 16 * kMiB);
  EXPECT_EQ(pool.moved_bytes(), 0u);
  // 6 MiB is another size class: the budget is committed in full, so 6 MiB of the warm 12 move.
  auto* c = static_cast<unsigned char*>(pool.allocate(6 * kMiB));
  EXPECT_EQ(pool.faulted_bytes(), 16 * kMiB) << "nothing faulted in afresh";
  EXPECT_EQ(pool.moved_bytes(), 6 * kMiB);
  EXPECT_EQ(pool.mapped_bytes(), 16 * kMiB);
  EXPECT_EQ(c[0], 0xAB) << "the warm slot's pages, not zeroed ones";
  EXPECT_EQ(c[6 * kMiB - 1], 0xAB);
  std::memset(c, 0x11, 6 * kMiB);
  EXPECT_EQ(b[0], 0xCD);
  EXPECT_EQ(b[4 * kMiB - 1], 0xCD);
  pool.free(b);
  pool.free(c);
  // The 12 MiB slot kept 6 MiB; growing it back takes the other warm slots' pages.
  auto* d = static_cast<unsigned char*>(pool.allocate(12 * kMiB));
  EXPECT_LE(pool.mapped_bytes(), 16 * kMiB);
  EXPECT_EQ(pool.faulted_bytes(), 16 * kMiB);
  std::memset(d, 0x22, 12 * kMiB);
  auto* e = static_cast<unsigned char*>(pool.allocate(4 * kMiB));
  std::memset(e, 0x33, 4 * kMiB);
  EXPECT_EQ(d[0], 0x22);
  EXPECT_EQ(d[12 * kMiB - 1], 0x22);
  EXPECT_LE(pool.mapped_bytes(), 16 * kMiB);
  pool.free(d);
  pool.free(e);
}

// A move leaves no moment where the warm slot's range is unmapped: another thread's mmap could
// land in such a hole and be overwritten when the pool reserved the range again (glibc's large
// mallocs, a sanitizer's own mappings). One thread makes the pool move pages back and forth
// between two size classes while another maps blocks of the moved size, fills them and checks
// them: every block keeps its bytes.
TEST(PinnedHostPool, MovingPagesNeverUnmapsAWarmSlotsRangeUnderAnotherThread) {
  constexpr std::uint64_t kMiB = 1 << 20;
  PinnedHostPool pool(small(16 * kMiB));
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> bad{0}, checked{0};
  std::thread mapper([&] {
    std::uint64_t round = 0;
    while (!stop.load()) {
      const std::uint64_t len = (round % 2 ? 6 : 2) * kMiB;
      auto* p = static_cast<unsigned char*>(
          mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
      if (p == MAP_FAILED) continue;
      const auto v = static_cast<unsigned char>(round % 251 + 1);
      std::memset(p, v, len);
      std::this_thread::yield();
      for (std::uint64_t o = 0; o < len; o += 4096) {
        if (p[o] != v) {
          ++bad;
          break;
        }
      }
      ++checked;
      munmap(p, len);
      ++round;
    }
  });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  std::uint64_t moves = 0;
  while (std::chrono::steady_clock::now() < deadline) {
    void* a = pool.allocate(12 * kMiB);
    void* b = pool.allocate(4 * kMiB);
    pool.free(a);
    void* c = pool.allocate(6 * kMiB);  // 6 MiB of the warm 12 move
    pool.free(c);
    pool.free(b);
    void* d = pool.allocate(2 * kMiB);
    pool.free(d);
    ++moves;
  }
  stop = true;
  mapper.join();
  EXPECT_GT(pool.moved_bytes(), 0u);
  EXPECT_GT(checked.load(), 0u);
  EXPECT_EQ(bad.load(), 0u) << "another thread's mapping was overwritten by the pool (" << moves << " rounds, "
                            << checked.load() << " blocks checked)";
}

// Registration follows the slots: the listener sees each committed slot mapped, and unmapped
// before its pages go; every block handed out lies inside a region mapped at that time.
TEST(PinnedHostPool, RegionListenerFollowsCommittedSlots) {
  constexpr std::uint64_t kMiB = 1 << 20;
  PinnedHostPool pool(small(8 * kMiB));
  void* early = pool.allocate(kMiB);
  std::map<char*, std::uint64_t> mapped;
  pool.set_region_listener([&](const HostRegion& r) { mapped[static_cast<char*>(r.base)] = r.bytes; },
                           [&](void* base) { ASSERT_EQ(mapped.erase(static_cast<char*>(base)), 1u); });
  EXPECT_EQ(mapped.size(), 1u) << "setting the listener replays what is committed";
  auto inside = [&](void* p, std::uint64_t n) {
    auto it = mapped.upper_bound(static_cast<char*>(p));
    if (it == mapped.begin()) return false;
    --it;
    return static_cast<char*>(p) + n <= it->first + it->second;
  };
  std::mt19937 rng(5);
  std::vector<std::pair<void*, std::uint64_t>> live;
  for (int i = 0; i < 2000; ++i) {
    if (!live.empty() && rng() % 2 == 0) {
      const std::size_t k = rng() % live.size();
      pool.free(live[k].first);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
    } else {
      const std::uint64_t n = 1 + rng() % (3 * kMiB);
      void* p = pool.try_allocate(n);
      if (p == nullptr) continue;
      ASSERT_TRUE(inside(p, n)) << "a block outside every mapped region";
      live.push_back({p, n});
    }
    std::uint64_t total = 0;
    for (auto& [b, n] : mapped) total += n;
    ASSERT_EQ(total, pool.mapped_bytes());
  }
  for (auto& [p, n] : live) pool.free(p);
  pool.free(early);
  pool.clear_region_listener();
  EXPECT_TRUE(mapped.empty()) << "clearing unmaps every region";
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

TEST(PinnedHostPool, BudgetIsHardAndErrorHasNumbers) {
  PinnedHostPool pool(small(1 << 20));
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
  PinnedHostPool pool(small(64 << 10));
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
  PinnedHostPool pool(small(8 << 20));
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
  PinnedHostPool pool(small(1 << 20));
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
  PinnedHostPoolOptions o = small(rl.rlim_cur * 4 + (64 << 20));
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
  PinnedHostPoolOptions o = small(1 << 20);
  o.pin_memory = true;
  PinnedHostPool pool(o);
  void* p = pool.allocate(1 << 20);
  EXPECT_TRUE(pool.pinned());
  ASSERT_EQ(pool.regions().size(), 1u);
  EXPECT_EQ(pool.regions()[0].bytes, 1u << 20);
  pool.free(p);
}

// A tiermem.numa_node the machine has not was taken silently (the mbind failed, the memory went
// wherever the kernel put it): said once, naming the key, the value and the nodes there are.
TEST(PinnedHostPool, ANumaNodeTheMachineHasNotIsWarnedAbout) {
  PinnedHostPoolOptions o = small(2 * PinnedHostPool::kHugePageBytes);
  o.numa_node = 4000;
  testing::internal::CaptureStderr();
  {
    PinnedHostPool pool(o);
    void* p = pool.allocate(4096);
    ASSERT_NE(p, nullptr);
    pool.free(p);
  }
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_NE(log.find("tiermem.numa_node = 4000: this machine has"), std::string::npos) << log;
}

}  // namespace
}  // namespace tiermem
