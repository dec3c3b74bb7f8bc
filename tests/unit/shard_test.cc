// Shard arithmetic (include/tiermem/shard.h), checked exhaustively over small sizes.
#include "tiermem/shard.h"

#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "tiermem/error.h"

namespace tiermem {
namespace {

TEST(Shard, ModuleShardCoversPaddedBufferExactlyOnce) {
  for (int world = 1; world <= 8; ++world) {
    for (std::size_t align : {1ul, 2ul, 3ul, 4ul, 8ul, 64ul, 1024ul}) {
      for (std::size_t numel = 0; numel <= 300; ++numel) {
        ModuleShard s = make_module_shard(numel, world, align);
        ASSERT_EQ(s.padded % (static_cast<std::size_t>(world) * align), 0u);
        ASSERT_GE(s.padded, numel);
        ASSERT_LT(s.padded - numel, static_cast<std::size_t>(world) * align) << "over-padded";
        ASSERT_EQ(s.shard * static_cast<std::size_t>(world), s.padded);
        ASSERT_EQ(s.shard % align, 0u);
        std::vector<int> owner(s.padded, -1);
        std::size_t valid_total = 0;
        for (int r = 0; r < world; ++r) {
          ElemRange rg = s.range(r);
          ASSERT_EQ(rg.size(), s.shard);
          for (std::size_t i = rg.begin; i < rg.end; ++i) {
            ASSERT_EQ(owner[i], -1) << "element " << i << " owned twice";
            owner[i] = r;
          }
          ElemRange v = s.valid(r);
          ASSERT_LE(v.begin, v.end);
          ASSERT_GE(v.begin, rg.begin);
          ASSERT_LE(v.end, rg.end);
          if (v.size() > 0) {
            ASSERT_LE(v.end, numel);
          }
          if (rg.end <= numel) {
            ASSERT_EQ(v, rg);
          }
          valid_total += v.size();
        }
        for (int o : owner) ASSERT_NE(o, -1);
        ASSERT_EQ(valid_total, numel);
      }
    }
  }
}

TEST(Shard, LayoutPlacesShardsBackToBack) {
  std::mt19937 rng(42);
  for (int trial = 0; trial < 200; ++trial) {
    int world = 1 + static_cast<int>(rng() % 8);
    std::size_t align = std::size_t{1} << (rng() % 11);
    std::vector<std::size_t> numels(1 + rng() % 6);
    for (auto& n : numels) n = rng() % 5000;
    ShardLayout l = make_shard_layout(numels, world, align);
    ASSERT_EQ(l.modules.size(), numels.size());
    std::size_t off = 0, full = 0;
    for (std::size_t i = 0; i < numels.size(); ++i) {
      ASSERT_EQ(l.flat_offset[i], off);
      ASSERT_EQ(l.flat_offset[i] % align, 0u);
      ASSERT_EQ(l.modules[i].numel, numels[i]);
      off += l.modules[i].shard;
      full += l.modules[i].padded;
    }
    ASSERT_EQ(l.rank_flat, off);
    ASSERT_EQ(l.full_flat, full);
    ASSERT_EQ(l.rank_flat * static_cast<std::size_t>(world), l.full_flat);
  }
}

TEST(Shard, SubGroupsAreAlignedAndCover) {
  for (std::size_t align : {1ul, 4ul, 1024ul}) {
    for (std::size_t total = 0; total <= 5000; total += 37) {
      for (std::size_t maxe : {1ul, 5ul, 1000ul, 1024ul, 3000ul, 100000ul}) {
        auto g = make_sub_groups(total, maxe, align);
        std::size_t at = 0;
        std::size_t cap = std::max(maxe, align) / align * align;
        for (std::size_t k = 0; k < g.size(); ++k) {
          ASSERT_EQ(g[k].begin, at);
          ASSERT_GT(g[k].size(), 0u);
          ASSERT_LE(g[k].size(), cap);
          if (k + 1 < g.size()) {
            ASSERT_EQ(g[k].end % align, 0u);
          }
          at = g[k].end;
        }
        ASSERT_EQ(at, total);
      }
    }
  }
}

TEST(Shard, ReduceChunksRespectBucketSize) {
  auto c = make_reduce_chunks(4096, 4, 4096, 256);  // 1024 per rank per bucket
  ASSERT_EQ(c.size(), 4u);
  EXPECT_EQ(c[1], (ElemRange{1024, 2048}));
  auto one = make_reduce_chunks(4096, 4, 1ul << 30, 256);
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(one[0], (ElemRange{0, 4096}));
  auto tiny = make_reduce_chunks(1024, 8, 8, 256);  // bucket smaller than world*align
  ASSERT_EQ(tiny.size(), 4u);
  EXPECT_EQ(tiny[0].size(), 256u);
  EXPECT_TRUE(make_reduce_chunks(0, 2, 100, 4).empty());
}

TEST(Shard, RejectsBadArguments) {
  EXPECT_THROW(make_module_shard(10, 0, 4), Error);
  EXPECT_THROW(make_module_shard(10, 2, 0), Error);
}

}  // namespace
}  // namespace tiermem
