// Tests of the re-partitioning of a saved ZeRO optimizer state (include/tiermem/checkpoint_reshard.h):
// synthetic checkpoints written at one world size, read back at another, every element checked.
// Module sizes are odd (not multiples of world × alignment), so every layout has padding, and
// some ranks' shards of the small modules are all padding.
#include "tiermem/checkpoint_reshard.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace tiermem::train {
namespace {
namespace fs = std::filesystem;

const std::vector<std::size_t> kNumels = {1, 37, 5, 1000, 2049, 3};
constexpr std::size_t kAlign = 8;
const OptimizerStateNames kNames{"zero.master", "zero.exp_avg", "zero.exp_avg_sq"};

// The value of element e of module m in each tensor (exact in fp32: below 2^24).
float value(int tensor, std::size_t m, std::size_t e) {
  const float v = static_cast<float>(m * 10000 + e) + 0.25f;
  return tensor == 0 ? v : tensor == 1 ? -v : 2 * v;
}

// Writes dir/rank<k>/ for every rank of a `world`-rank layout: each rank's flat shard with the
// module elements it owns and zeros for padding, as ZeroEngine exports it.
void save_state(const fs::path& dir, int world) {
  const ShardLayout l = make_shard_layout(kNumels, world, kAlign);
  for (int k = 0; k < world; ++k) {
    std::vector<float> t[3];
    for (auto& v : t) v.assign(l.rank_flat, 0.0f);
    for (std::size_t m = 0; m < kNumels.size(); ++m) {
      const ElemRange valid = l.modules[m].valid(k);
      for (std::size_t e = valid.begin; e < valid.end; ++e) {
        const std::size_t at = l.flat_offset[m] + (e - l.modules[m].range(k).begin);
        for (int i = 0; i < 3; ++i) t[i][at] = value(i, m, e);
      }
    }
    CheckpointWriter w(dir.string(), k, world, 4);
    const std::int64_t n = static_cast<std::int64_t>(l.rank_flat);
    w.add_tensor(kNames.master, Tier::kHost, t[0].data(), l.rank_flat * 4, "f32", {n});
    w.add_tensor(kNames.exp_avg, Tier::kHost, t[1].data(), l.rank_flat * 4, "f32", {n});
    w.add_tensor(kNames.exp_avg_sq, Tier::kHost, t[2].data(), l.rank_flat * 4, "f32", {n});
    w.commit(nlohmann::json::object());
  }
}

class ReshardTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("tiermem_reshard_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

// The copies of a range cover exactly its real (non-padding) elements, once each, in order, and
// each comes from the old rank that held that element.
TEST(ReshardCopies, CoverEveryRealElementOnceFromItsOwner) {
  for (int from_world : {1, 2, 3, 4}) {
    for (int to_world : {1, 2, 3, 5}) {
      const ShardLayout from = make_shard_layout(kNumels, from_world, kAlign);
      const ShardLayout to = make_shard_layout(kNumels, to_world, kAlign);
      for (int r = 0; r < to_world; ++r) {
        SCOPED_TRACE(testing::Message() << from_world << " -> " << to_world << " rank " << r);
        std::vector<int> seen(to.rank_flat, 0);
        std::size_t last_end = 0;
        for (const ReshardCopy& c : reshard_copies(from, to, r, {0, to.rank_flat})) {
          EXPECT_GE(c.dst, last_end);
          last_end = c.dst + c.n;
          for (std::size_t i = 0; i < c.n; ++i) ++seen[c.dst + i];
          ASSERT_LT(c.old_rank, from_world);
        }
        for (std::size_t m = 0; m < kNumels.size(); ++m) {
          for (std::size_t s = 0; s < to.modules[m].shard; ++s) {
            const std::size_t e = to.modules[m].range(r).begin + s;
            EXPECT_EQ(seen[to.flat_offset[m] + s], e < kNumels[m] ? 1 : 0) << "module " << m << " element " << e;
          }
        }
      }
    }
  }
}

TEST(ReshardCopies, SameWorldIsTheRankItself) {
  const ShardLayout l = make_shard_layout(kNumels, 3, kAlign);
  for (int r = 0; r < 3; ++r) {
    for (const ReshardCopy& c : reshard_copies(l, l, r, {0, l.rank_flat})) {
      EXPECT_EQ(c.old_rank, r);
      EXPECT_EQ(c.old_offset, c.dst);
    }
  }
}

TEST(ReshardCopies, RejectsLayoutsOfOtherModulesAndRangesPastTheShard) {
  const ShardLayout a = make_shard_layout(kNumels, 2, kAlign);
  std::vector<std::size_t> other = kNumels;
  other[1] += 1;
  const ShardLayout b = make_shard_layout(other, 3, kAlign);
  EXPECT_THROW(reshard_copies(a, b, 0, {0, 1}), Error);
  const ShardLayout c = make_shard_layout(kNumels, 3, kAlign);
  EXPECT_THROW(reshard_copies(a, c, 0, {0, c.rank_flat + 1}), Error);
  EXPECT_THROW(reshard_copies(a, c, 3, {0, 1}), Error);
}

// Saved at `from` ranks, every new rank of `to` fills its shard in sub-groups of 13 elements (not
// aligned to anything): every element is the saved value of its module element, padding is 0.
TEST_F(ReshardTest, EveryElementLandsWhereItShould) {
  const std::pair<int, int> cases[] = {{2, 3}, {2, 1}, {3, 2}, {1, 4}, {4, 3}, {3, 3}};
  for (const auto& [from, to] : cases) {
    SCOPED_TRACE(testing::Message() << from << " -> " << to);
    fs::remove_all(dir_);
    save_state(dir_, from);
    const ShardLayout l = make_shard_layout(kNumels, to, kAlign);
    for (int r = 0; r < to; ++r) {
      OptimizerStateReshard src(dir_.string(), from, kNames, kNumels, kAlign, to, r);
      ASSERT_EQ(src.shard_numel(), l.rank_flat);
      std::vector<float> got[3];
      for (auto& v : got) v.assign(l.rank_flat, -7.0f);  // every element must be written
      for (std::size_t off = 0; off < l.rank_flat; off += 13) {
        const std::size_t n = std::min<std::size_t>(13, l.rank_flat - off);
        src.fill(off, n, got[0].data() + off, got[1].data() + off, got[2].data() + off);
      }
      for (std::size_t m = 0; m < kNumels.size(); ++m) {
        for (std::size_t s = 0; s < l.modules[m].shard; ++s) {
          const std::size_t e = l.modules[m].range(r).begin + s;
          for (int i = 0; i < 3; ++i) {
            const float want = e < kNumels[m] ? value(i, m, e) : 0.0f;
            ASSERT_EQ(got[i][l.flat_offset[m] + s], want)
                << "rank " << r << " tensor " << i << " module " << m << " element " << e;
          }
        }
      }
    }
  }
}

// A rank opens (and verifies) only the old ranks that hold part of its shard: one module of 16
// elements, alignment 8. Saved at 4 ranks the module is padded to 32, shards of 8: old ranks 0
// and 1 hold it all, 2 and 3 only padding. At 2 ranks (padded to 16) new rank r needs old rank r
// alone, so the resharding works with old ranks 2 and 3 deleted.
TEST_F(ReshardTest, ReadsOnlyTheOldRanksItNeeds) {
  const std::vector<std::size_t> one = {16};
  for (int k = 0; k < 4; ++k) {
    std::vector<float> t(8);
    for (std::size_t i = 0; i < 8; ++i) t[i] = k < 2 ? static_cast<float>(8 * k + i) : 0.0f;
    CheckpointWriter w(dir_.string(), k, 4, 1);
    for (const std::string* name : {&kNames.master, &kNames.exp_avg, &kNames.exp_avg_sq})
      w.add_tensor(*name, Tier::kHost, t.data(), 32, "f32", {8});
    w.commit(nlohmann::json::object());
  }
  fs::remove_all(dir_ / "rank2");
  fs::remove_all(dir_ / "rank3");
  for (int r = 0; r < 2; ++r) {
    OptimizerStateReshard src(dir_.string(), 4, kNames, one, kAlign, 2, r);
    EXPECT_EQ(src.source_ranks(), (std::vector<int>{r}));
    std::vector<float> a(8), b(8), c(8);
    src.fill(0, 8, a.data(), b.data(), c.data());
    for (std::size_t i = 0; i < 8; ++i) EXPECT_EQ(a[i], static_cast<float>(8 * r + i));
  }
}

TEST_F(ReshardTest, AMissingOldRankOrACorruptFileIsACheckpointErrorNamingIt) {
  save_state(dir_, 3);
  fs::remove_all(dir_ / "rank2");
  try {
    OptimizerStateReshard src(dir_.string(), 3, kNames, kNumels, kAlign, 1, 0);
    FAIL() << "a missing old rank must be refused";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("rank2"), std::string::npos) << e.what();
  }
  fs::remove_all(dir_);
  save_state(dir_, 2);
  for (const auto& f : fs::directory_iterator(dir_ / "rank1")) {
    if (f.path().filename().string().rfind("state-", 0) != 0) continue;
    std::fstream s(f.path(), std::ios::in | std::ios::out | std::ios::binary);
    s.seekp(8);
    s.put('\x7f');  // inside zero.master, the first tensor
  }
  try {
    OptimizerStateReshard src(dir_.string(), 2, kNames, kNumels, kAlign, 3, 1);
    FAIL() << "a checksum mismatch must be refused before anything is read";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("checksum mismatch"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("zero.master"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tiermem::train
