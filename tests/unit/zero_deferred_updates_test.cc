// The optimizer stepper's deferred updates (src/zero/deferred_updates.h): each applied exactly
// once; and, through ZeroEngine, the deferred update lands at the next gather with the values an
// eager step gives.
#include "zero/deferred_updates.h"

#include <gtest/gtest.h>

#include "tiermem/error.h"

namespace tiermem::detail {
namespace {

AdamParams params(std::int64_t step, float lr) {
  AdamParams p;
  p.step = step;
  p.lr = lr;
  return p;
}

TEST(DeferredUpdates, EachIsTakenExactlyOnceWithItsStepsScalars) {
  DeferredUpdates d;
  d.resize(3);
  EXPECT_EQ(d.count(), 0u);
  EXPECT_FALSE(d.take(1).has_value());
  d.defer(0, params(5, 0.5f));
  d.defer(2, params(5, 0.5f));
  d.defer(2, params(5, 0.5f));  // one update per module
  EXPECT_EQ(d.count(), 2u);
  EXPECT_TRUE(d.pending(0));
  EXPECT_FALSE(d.pending(1));
  const auto a = d.take(2);
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->step, 5);
  EXPECT_EQ(a->lr, 0.5f);
  EXPECT_FALSE(d.take(2).has_value());  // applied: not again
  EXPECT_EQ(d.count(), 1u);
  EXPECT_TRUE(d.take(0).has_value());
  EXPECT_EQ(d.count(), 0u);
}

TEST(DeferredUpdates, DropAllLeavesNothingToApply) {
  DeferredUpdates d;
  d.resize(2);
  d.defer(0, params(1, 1.0f));
  d.defer(1, params(1, 1.0f));
  d.drop_all();
  EXPECT_EQ(d.count(), 0u);
  EXPECT_FALSE(d.take(0).has_value());
  EXPECT_FALSE(d.take(1).has_value());
  d.resize(3);  // registration grows it; the new module starts clear
  EXPECT_FALSE(d.pending(2));
}

TEST(DeferredUpdates, UnknownModuleIsAnError) {
  DeferredUpdates d;
  d.resize(2);
  EXPECT_THROW(d.defer(2, params(1, 1.0f)), Error);
  EXPECT_THROW(d.take(-1), Error);
  EXPECT_THROW((void)d.pending(7), Error);
}

}  // namespace
}  // namespace tiermem::detail
