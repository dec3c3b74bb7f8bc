// The gradient reducer's folded clipping norm (src/zero/norm_fold.h): folded in order, it is the
// sum the pre-pass adds; out of order it breaks; all-padding sub-groups keep their place.
#include "zero/norm_fold.h"

#include <gtest/gtest.h>

#include <random>
#include <vector>

namespace tiermem::detail {
namespace {

struct Module {
  std::vector<std::vector<float>> groups;  // each sub-group's real elements
  ModuleNormFold::ValidLen valid() const {
    return [this](std::size_t j) { return groups[j].size(); };
  }
  // The pre-pass's arithmetic: sub-group sums added in order, the first resetting the sum.
  ModuleNormFold::AddSubGroup add(std::size_t j) const {
    return [this, j](double running) {
      if (j == 0) running = 0;
      return running + sumsq_lanes(groups[j].data(), groups[j].size());
    };
  }
};

Module random_module(std::vector<std::size_t> sizes, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  Module m;
  for (std::size_t n : sizes) {
    m.groups.emplace_back(n);
    for (float& x : m.groups.back()) x = dist(rng);
  }
  return m;
}

TEST(NormFold, InOrderEqualsTheDirectSum) {
  const Module m = random_module({1000, 333, 4096, 7}, 11);
  ModuleNormFold f;
  double direct = 0, plain = 0;
  for (std::size_t j = 0; j < m.groups.size(); ++j) {
    EXPECT_FALSE(f.ready(m.groups.size(), m.valid()));
    f.complete(j, m.groups.size(), m.valid(), m.add(j));
    direct += sumsq_lanes(m.groups[j].data(), m.groups[j].size());
    for (float x : m.groups[j]) plain += static_cast<double>(x) * x;
  }
  ASSERT_TRUE(f.ready(m.groups.size(), m.valid()));
  EXPECT_EQ(f.sum(), direct);                // bit for bit: the same additions in the same order
  EXPECT_NEAR(f.sum(), plain, 1e-9 * plain);  // and the sum of squares it stands for
  // A second reduce call (next micro-batch) starts afresh at the first sub-group.
  for (std::size_t j = 0; j < m.groups.size(); ++j) f.complete(j, m.groups.size(), m.valid(), m.add(j));
  EXPECT_TRUE(f.ready(m.groups.size(), m.valid()));
  EXPECT_EQ(f.sum(), direct);
}

TEST(NormFold, OutOfOrderBreaksUntilTheNextCall) {
  const Module m = random_module({64, 64, 64}, 12);
  ModuleNormFold f;
  f.complete(0, 3, m.valid(), m.add(0));
  f.complete(2, 3, m.valid(), m.add(2));  // 1 skipped
  f.complete(1, 3, m.valid(), m.add(1));
  EXPECT_FALSE(f.ready(3, m.valid()));
  for (std::size_t j = 0; j < 3; ++j) f.complete(j, 3, m.valid(), m.add(j));
  EXPECT_TRUE(f.ready(3, m.valid()));
  f.clear();  // zero_grad: nothing folded for the next step yet
  EXPECT_FALSE(f.ready(3, m.valid()));
}

TEST(NormFold, AllPaddingSubGroupsKeepTheirPlace) {
  // The last rank's shard: real elements end inside sub-group 1; sub-group 2 is all padding and
  // never completes. Leading padding (sub-group 0 empty) resets the sum too.
  Module m = random_module({128, 50, 0}, 13);
  ModuleNormFold f;
  f.complete(0, 3, m.valid(), m.add(0));
  f.complete(1, 3, m.valid(), m.add(1));
  ASSERT_TRUE(f.ready(3, m.valid()));
  EXPECT_EQ(f.sum(), sumsq_lanes(m.groups[0].data(), 128) + sumsq_lanes(m.groups[1].data(), 50));
  const Module empty = random_module({0, 0}, 14);
  ModuleNormFold e;
  EXPECT_FALSE(has_real(2, empty.valid()));
  EXPECT_TRUE(e.ready(2, empty.valid()));  // adds nothing
}

}  // namespace
}  // namespace tiermem::detail
