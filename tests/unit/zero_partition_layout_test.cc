// ZeroEngine's partition layout (src/zero/partition_layout.h): module offsets in the rank-flat
// space, kept-whole and stored modules, and sub-groups, for several world sizes.
#include "zero/partition_layout.h"

#include <gtest/gtest.h>

#include <vector>

namespace tiermem::detail {
namespace {

PartitionOptions options(int stage, int world, std::size_t align, std::size_t threshold = 0) {
  PartitionOptions o;
  o.stage = stage;
  o.world = world;
  o.opt_world = stage == 0 ? 1 : world;
  o.alignment_elems = align;
  o.persistence_threshold_elems = threshold;
  return o;
}

// Modules laid out one after the other, as ZeroEngine registers them.
std::vector<ModuleLayout> lay_out(const std::vector<std::size_t>& numels, const PartitionOptions& o) {
  std::vector<ModuleLayout> out;
  std::size_t flat = 0;
  for (std::size_t n : numels) {
    out.push_back(layout_module(n, flat, o));
    flat += out.back().shard.shard;
  }
  return out;
}

TEST(PartitionLayout, ModuleOffsetsForSeveralWorldSizes) {
  const std::vector<std::size_t> numels = {1000, 7, 0, 4096};
  // Expected shard sizes: numel padded to world x 64, divided by world.
  struct Case {
    int world;
    std::vector<std::size_t> shards;
  };
  for (const Case& c : {Case{1, {1024, 64, 0, 4096}}, Case{2, {512, 64, 0, 2048}}, Case{3, {384, 64, 0, 1408}},
                        Case{4, {256, 64, 0, 1024}}}) {
    const auto mods = lay_out(numels, options(3, c.world, 64));
    std::size_t flat = 0;
    for (std::size_t i = 0; i < mods.size(); ++i) {
      EXPECT_EQ(mods[i].shard.shard, c.shards[i]) << "world " << c.world << " module " << i;
      EXPECT_EQ(mods[i].shard.padded, c.shards[i] * static_cast<std::size_t>(c.world));
      EXPECT_EQ(mods[i].flat, flat) << "world " << c.world << " module " << i;
      EXPECT_EQ(mods[i].flat % 64, 0u);
      flat += c.shards[i];
    }
  }
}

TEST(PartitionLayout, StageZeroKeepsTheWholeModuleOnEveryRank) {
  const auto mods = lay_out({1000, 10}, options(0, 4, 8));
  EXPECT_EQ(mods[0].shard.shard, 1000u);  // opt_world 1: no split
  EXPECT_EQ(mods[1].flat, 1000u);
  EXPECT_FALSE(mods[0].stored);
  EXPECT_FALSE(mods[0].persistent);
}

TEST(PartitionLayout, PersistentAndStoredModulesAtStageThree) {
  // Several ranks: a module under the threshold is kept whole, not stored; an empty one neither.
  auto mods = lay_out({99, 100, 0}, options(3, 2, 4, /*threshold=*/100));
  EXPECT_TRUE(mods[0].persistent);
  EXPECT_FALSE(mods[0].stored);
  EXPECT_FALSE(mods[1].persistent);
  EXPECT_TRUE(mods[1].stored);
  EXPECT_FALSE(mods[2].stored);
  // One rank: a persistent module is stored like any other (homed on the device).
  mods = lay_out({99}, options(3, 1, 4, 100));
  EXPECT_TRUE(mods[0].persistent);
  EXPECT_TRUE(mods[0].stored);
  // Stages 1-2 never store working shards.
  mods = lay_out({99, 1000}, options(2, 2, 4, 100));
  EXPECT_FALSE(mods[0].persistent);
  EXPECT_FALSE(mods[1].stored);
}

TEST(PartitionLayout, SubGroupsTileTheShardAndPlaceTheDeviceShare) {
  const auto mods = lay_out({1000, 3000}, options(3, 2, 16));  // shards 512 and 1504 elements
  ASSERT_EQ(mods[1].flat, 512u);
  // Module 1 in sub-groups of at most 600: 592 (aligned down), 592, 320.
  const auto groups = layout_sub_groups(mods[1], 600, 16, /*all_on_device=*/false, /*device_from=*/512 + 1184);
  ASSERT_EQ(groups.size(), 3u);
  std::size_t next = 0;
  for (const SubGroupLayout& g : groups) {
    EXPECT_EQ(g.range.begin, next);
    EXPECT_EQ(g.flat, mods[1].flat + g.range.begin);
    next = g.range.end;
  }
  EXPECT_EQ(next, mods[1].shard.shard);
  EXPECT_EQ(groups[0].range.size(), 592u);
  EXPECT_EQ(groups[2].range.size(), 320u);
  EXPECT_FALSE(groups[0].on_device);
  EXPECT_FALSE(groups[1].on_device);
  EXPECT_TRUE(groups[2].on_device);  // flat 1696 >= device_from
  for (const SubGroupLayout& g : layout_sub_groups(mods[0], 600, 16, /*all_on_device=*/true, ~std::size_t{0})) {
    EXPECT_TRUE(g.on_device);
  }
  EXPECT_TRUE(layout_sub_groups(lay_out({0}, options(3, 2, 16))[0], 600, 16, false, 0).empty());
}

}  // namespace
}  // namespace tiermem::detail
