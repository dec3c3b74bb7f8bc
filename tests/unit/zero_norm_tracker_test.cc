// The engine's clipping norm (src/zero/norm_tracker.h): folded sub-group by sub-group in order it is the
// direct sum of squares over the sub-groups, bit for bit the sum step() adds when it reads them; out
// of order, or with fp16, it is not used; padding never counts; the sum over ranks.
#include "zero/norm_tracker.h"

#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "unit/zero_parts_fakes.h"

namespace tiermem::detail {
namespace {

struct Fixture {
  EngineShape shape;
  std::vector<ZeroModule> mods;
  std::vector<SubGroup> sub_groups;
  std::vector<std::vector<float>> grads;  // one a sub-group (its whole partition; padding zero)
  testing::FakeComm comm{0, 1};
  NormTracker norm{comm, shape, mods, sub_groups};

  explicit Fixture(int stage = 2) { shape.stage = stage; }
  void add(std::size_t numel, std::size_t sub_group_elems, unsigned seed) {
    testing::add_module(mods, sub_groups, shape, numel, sub_group_elems);
    norm.resize(mods.size());
    std::mt19937 rng(seed);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    for (std::size_t k = grads.size(); k < sub_groups.size(); ++k) {
      grads.emplace_back(sub_groups[k].size());
      for (std::size_t i = 0; i < norm.valid_len(k); ++i) grads.back()[i] = dist(rng);
      sub_groups[k].grad_fresh = false;  // a gradient arrived
    }
  }
  double direct() const {  // the pre-pass's sum: add() over every sub-group in order
    NormTracker::Sum s;
    for (std::size_t k = 0; k < sub_groups.size(); ++k) norm.add(s, k, grads[k].data());
    return s.total;
  }
};

TEST(NormTracker, FoldedInOrderEqualsTheDirectSum) {
  Fixture f;
  f.add(1000, 256, 1);  // four sub-groups
  f.add(300, 512, 2);   // one sub-group: the plain sum
  f.add(77, 32, 3);
  for (std::size_t k = 0; k < f.sub_groups.size(); ++k) f.norm.fold(static_cast<int>(k), f.grads[k].data());
  double folded = 0;
  ASSERT_TRUE(f.norm.folded_sumsq(folded));
  EXPECT_EQ(folded, f.direct());  // bit for bit
  double plain = 0;
  for (const auto& g : f.grads)
    for (float x : g) plain += static_cast<double>(x) * x;
  EXPECT_NEAR(folded, plain, 1e-9 * plain);
  // `partial` (a fused copy's sum) stands for the sub-group's own lane sum.
  Fixture h;
  h.add(1000, 256, 1);
  for (std::size_t k = 0; k < h.sub_groups.size(); ++k) {
    h.norm.fold(static_cast<int>(k), h.grads[k].data(), sumsq_lanes(h.grads[k].data(), h.norm.valid_len(k)));
  }
  double with_partial = 0;
  ASSERT_TRUE(h.norm.folded_sumsq(with_partial));
  EXPECT_EQ(with_partial, h.direct());
}

TEST(NormTracker, OutOfOrderIsNotUsedUntilCleared) {
  Fixture f;
  f.add(1000, 256, 4);
  f.norm.fold(0, f.grads[0].data());
  f.norm.fold(2, f.grads[2].data());  // sub-group 1 skipped
  f.norm.fold(1, f.grads[1].data());
  f.norm.fold(3, f.grads[3].data());
  double s = 0;
  EXPECT_FALSE(f.norm.folded_sumsq(s));
  f.norm.clear();
  for (std::size_t k = 0; k < f.sub_groups.size(); ++k) f.norm.fold(static_cast<int>(k), f.grads[k].data());
  EXPECT_TRUE(f.norm.folded_sumsq(s));
  EXPECT_EQ(s, f.direct());
}

TEST(NormTracker, ModulesWithoutAGradientAddNothing) {
  Fixture f;
  f.add(100, 64, 5);
  f.add(100, 64, 6);
  for (std::size_t k : {f.mods[1].sub_groups[0], f.mods[1].sub_groups[1]}) f.sub_groups[k].grad_fresh = true;
  for (int k : f.mods[0].sub_groups) f.norm.fold(k, f.grads[static_cast<std::size_t>(k)].data());
  double s = 0;
  ASSERT_TRUE(f.norm.folded_sumsq(s));
  NormTracker::Sum d;
  for (int k : f.mods[0].sub_groups) f.norm.add(d, static_cast<std::size_t>(k), f.grads[static_cast<std::size_t>(k)].data());
  EXPECT_EQ(s, d.total);
}

TEST(NormTracker, OnlyStagesTwoAndThreeWithoutFp16Fold) {
  for (int stage : {0, 1}) {
    Fixture f(stage);
    f.add(64, 64, 7);
    EXPECT_FALSE(f.norm.folds());
    double s = 0;
    EXPECT_FALSE(f.norm.folded_sumsq(s));
  }
  Fixture f;
  f.shape.loss_scaled = true;
  EXPECT_FALSE(f.norm.folds());
  f.shape.loss_scaled = false;
  EXPECT_TRUE(f.norm.folds());
}

TEST(NormTracker, PaddingIsNotCounted) {
  // 10 elements over 4 ranks (shards of 3): rank 3 holds one real element, rank 3 of 5 elements
  // none (its sub-groups never complete, and its modules add nothing).
  Fixture f;
  f.shape.world = f.shape.opt_world = 4;
  f.shape.rank = f.shape.opt_rank = 3;
  f.add(10, 2, 8);
  ASSERT_EQ(f.sub_groups.size(), 2u);
  EXPECT_EQ(f.norm.valid_len(0), 1u);
  EXPECT_EQ(f.norm.valid_len(1), 0u);
  EXPECT_TRUE(f.norm.module_has_real(0));
  f.add(5, 2, 9);
  EXPECT_FALSE(f.norm.module_has_real(1));
  f.norm.fold(0, f.grads[0].data());
  double s = 0;
  ASSERT_TRUE(f.norm.folded_sumsq(s));
  EXPECT_EQ(s, static_cast<double>(f.grads[0][0]) * f.grads[0][0]);
}

TEST(NormTracker, SumOverRanks) {
  Fixture f;
  testing::FakeComm two(1, 2);
  NormTracker n2(two, f.shape, f.mods, f.sub_groups);
  f.shape.world = 2;
  EXPECT_EQ(n2.sum_over_ranks(1.5), 3.0);  // the other rank's equal share added (fp32)
  f.shape.stage = 0;
  EXPECT_EQ(n2.sum_over_ranks(1.5), 1.5);  // stage 0: every rank has the whole gradient
}

}  // namespace
}  // namespace tiermem::detail
