// ExtentAllocator against a bitmap reference model: random allocate/free/grow sequences; after
// every step, no overlap, alignment, the free runs equal the model's maximal free runs
// (i.e. coalescing is complete), and the stats agree.
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <vector>

#include "nvme/extent_allocator.h"

namespace tiermem::detail {
namespace {

// The obvious twin: one bool per alignment unit.
struct Model {
  std::vector<bool> used;
  std::uint64_t align;
  std::map<std::uint64_t, std::uint64_t> runs() const {  // maximal free runs, in bytes
    std::map<std::uint64_t, std::uint64_t> r;
    std::size_t i = 0;
    while (i < used.size()) {
      if (used[i]) {
        ++i;
        continue;
      }
      std::size_t j = i;
      while (j < used.size() && !used[j]) ++j;
      r[i * align] = (j - i) * align;
      i = j;
    }
    return r;
  }
  bool can_fit(std::uint64_t units) const {
    for (auto& [o, l] : runs())
      if (l >= units * align) return true;
    return false;
  }
};

TEST(ExtentAllocator, RandomSequencesMatchBitmapModel) {
  for (std::uint64_t align : {1ull, 4096ull, 65536ull}) {
    std::mt19937_64 rng(1234 + align);
    const std::uint64_t units0 = 257;
    ExtentAllocator a(units0 * align, align);
    Model m{std::vector<bool>(units0, false), align};
    struct Live { std::uint64_t off, bytes; };
    std::vector<Live> live;
    for (int step = 0; step < 4000; ++step) {
      int action = static_cast<int>(rng() % 10);
      if (action < 5) {
        std::uint64_t bytes = 1 + rng() % (align * (rng() % 4 == 0 ? 40 : 6));
        std::uint64_t units = (bytes + align - 1) / align;
        auto off = a.allocate(bytes);
        ASSERT_EQ(off.has_value(), m.can_fit(units)) << "step " << step << " bytes " << bytes;
        if (off) {
          ASSERT_EQ(*off % align, 0u);
          for (std::uint64_t u = *off / align; u < *off / align + units; ++u) {
            ASSERT_LT(u, m.used.size());
            ASSERT_FALSE(m.used[u]) << "overlap at unit " << u;
            m.used[u] = true;
          }
          live.push_back({*off, bytes});
        }
      } else if (action < 9 && !live.empty()) {
        std::size_t i = rng() % live.size();
        a.free(live[i].off, live[i].bytes);
        std::uint64_t units = (live[i].bytes + align - 1) / align;
        for (std::uint64_t u = live[i].off / align; u < live[i].off / align + units; ++u)
          m.used[u] = false;
        live.erase(live.begin() + static_cast<long>(i));
      } else if (action == 9 && m.used.size() < 2000) {
        std::uint64_t extra = 1 + rng() % 16;
        a.grow((m.used.size() + extra) * align);
        m.used.resize(m.used.size() + extra, false);
      }
      auto runs = m.runs();
      ASSERT_EQ(a.free_map(), runs) << "step " << step;
      std::uint64_t free = 0, largest = 0;
      for (auto& [o, l] : runs) {
        free += l;
        largest = std::max(largest, l);
      }
      ASSERT_EQ(a.free_bytes(), free);
      ASSERT_EQ(a.largest_free_bytes(), largest);
      ASSERT_EQ(a.free_runs(), runs.size());
      ASSERT_EQ(a.capacity_bytes(), m.used.size() * align);
    }
  }
}

TEST(ExtentAllocator, BestFitKeepsLargeRunsWhole) {
  ExtentAllocator a(100 * 4096, 4096);
  auto x = a.allocate(10 * 4096), y = a.allocate(4096), z = a.allocate(50 * 4096);
  ASSERT_TRUE(x && y && z);
  a.free(*x, 10 * 4096);  // holes: 10 units at 0, 39 units at the end
  auto small = a.allocate(8 * 4096);
  ASSERT_TRUE(small);
  EXPECT_EQ(*small, 0u);  // took the 10-unit hole, not the 39-unit tail
  EXPECT_EQ(a.largest_free_bytes(), 39u * 4096);
}

TEST(ExtentAllocator, RejectsDoubleFreeAndBadRanges) {
  ExtentAllocator a(16 * 4096, 4096);
  auto x = a.allocate(4096);
  ASSERT_TRUE(x);
  a.free(*x, 4096);
  EXPECT_THROW(a.free(*x, 4096), std::invalid_argument);
  EXPECT_THROW(a.free(1, 4096), std::invalid_argument);
  EXPECT_THROW(a.free(16 * 4096, 4096), std::invalid_argument);
  EXPECT_THROW(ExtentAllocator(4096, 3000), std::invalid_argument);
  EXPECT_FALSE(a.allocate(0).has_value());
  EXPECT_FALSE(a.allocate(17 * 4096).has_value());
}

}  // namespace
}  // namespace tiermem::detail
