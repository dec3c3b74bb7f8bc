// LruPolicy: the least recently accessed candidate is the victim.
#include "tiermem/lru_policy.h"

#include <gtest/gtest.h>

namespace tiermem {
namespace {

TEST(LruPolicy, EvictsLeastRecentlyUsedAndNeverAccessedFirst) {
  LruPolicy p;
  ResidencyView v;
  EXPECT_TRUE(p.on_access(3, 10, Tier::kDevice, Phase::kForward, v).empty());
  p.on_access(1, 10, Tier::kDevice, Phase::kForward, v);
  p.on_access(2, 10, Tier::kDevice, Phase::kForward, v);
  p.on_access(3, 10, Tier::kDevice, Phase::kForward, v);
  std::vector<TensorId> c = {1, 2, 3};
  EXPECT_EQ(p.choose_victim(Tier::kDevice, c), 1u);
  p.on_access(1, 10, Tier::kDevice, Phase::kForward, v);
  EXPECT_EQ(p.choose_victim(Tier::kDevice, c), 2u);
  std::vector<TensorId> c2 = {3, 7, 1};
  EXPECT_EQ(p.choose_victim(Tier::kDevice, c2), 7u);  // never accessed
  EXPECT_TRUE(p.keep_on_release(1, Tier::kDevice, v));
}

}  // namespace
}  // namespace tiermem
