// fp16 dynamic loss scaling (include/tiermem/loss_scaler.h): DeepSpeed's rules.
#include "tiermem/loss_scaler.h"

#include <gtest/gtest.h>

#include <iterator>

#include "tiermem/error.h"

namespace tiermem {
namespace {

Fp16Config fp16(int power, int window, int hysteresis, double min_scale = 1) {
  Fp16Config c;
  c.enabled = true;
  c.initial_scale_power = power;
  c.loss_scale_window = window;
  c.hysteresis = hysteresis;
  c.min_loss_scale = min_scale;
  return c;
}

TEST(LossScaler, OverflowHalvesWhenHysteresisIsOne) {
  DynamicLossScaler s(fp16(16, 1000, 1));
  EXPECT_EQ(s.scale(), 65536.0);
  EXPECT_TRUE(s.update(true));
  EXPECT_EQ(s.scale(), 32768.0);
  EXPECT_TRUE(s.update(true));
  EXPECT_EQ(s.scale(), 16384.0);
  EXPECT_FALSE(s.update(false));
  EXPECT_EQ(s.scale(), 16384.0);
}

TEST(LossScaler, HysteresisToleratesOverflowsBeforeLowering) {
  DynamicLossScaler s(fp16(10, 1000, 3));
  s.update(true);
  EXPECT_EQ(s.scale(), 1024.0);
  EXPECT_EQ(s.hysteresis_left(), 2);
  s.update(true);
  EXPECT_EQ(s.scale(), 1024.0);
  s.update(true);
  EXPECT_EQ(s.scale(), 512.0);
}

TEST(LossScaler, GrowsAfterWindowAndRestoresHysteresis) {
  DynamicLossScaler s(fp16(4, 3, 2));
  s.update(true);  // iter 0: hysteresis 2 -> 1, scale stays 16
  EXPECT_EQ(s.scale(), 16.0);
  s.update(false);  // iter 1: 1 step since overflow
  s.update(false);  // iter 2
  EXPECT_EQ(s.scale(), 16.0);
  s.update(false);  // iter 3: 3 steps since the overflow at 0 -> doubles
  EXPECT_EQ(s.scale(), 32.0);
  EXPECT_EQ(s.hysteresis_left(), 2);
}

TEST(LossScaler, NeverBelowMinimum) {
  DynamicLossScaler s(fp16(2, 1000, 1, 2.0));
  s.update(true);
  s.update(true);
  s.update(true);
  EXPECT_EQ(s.scale(), 2.0);
}

TEST(LossScaler, StaticScaleNeverChanges) {
  Fp16Config c = fp16(16, 1, 1);
  c.loss_scale = 128;
  DynamicLossScaler s(c);
  EXPECT_TRUE(s.update(true));
  EXPECT_FALSE(s.update(false));
  EXPECT_EQ(s.scale(), 128.0);
}

// A scaler restored from another's state() makes the same decisions from then on (the window
// counts from the restored iteration, not from 0); impossible states are refused.
TEST(LossScaler, RestoredStateContinuesIdentically) {
  const Fp16Config c = fp16(6, 3, 2);
  const bool pattern[] = {false, true, false, false, true, true, false, false, false, false, false, true, false};
  DynamicLossScaler a(c);
  for (int i = 0; i < 5; ++i) a.update(pattern[i]);
  DynamicLossScaler b(c);
  b.restore(a.state());
  EXPECT_EQ(b.scale(), a.scale());
  EXPECT_EQ(b.hysteresis_left(), a.hysteresis_left());
  DynamicLossScaler fresh(c);  // what a resume without the state would do
  bool fresh_differs = false;
  for (std::size_t i = 5; i < std::size(pattern); ++i) {
    a.update(pattern[i]);
    b.update(pattern[i]);
    fresh.update(pattern[i]);
    ASSERT_EQ(b.scale(), a.scale()) << "update " << i;
    ASSERT_EQ(b.hysteresis_left(), a.hysteresis_left()) << "update " << i;
    fresh_differs |= fresh.scale() != a.scale();
  }
  EXPECT_TRUE(fresh_differs);
  EXPECT_EQ(b.state().iter, a.state().iter);
  EXPECT_EQ(b.state().last_overflow_iter, a.state().last_overflow_iter);

  DynamicLossScaler d(c);
  const LossScalerState ok = a.state();
  LossScalerState bad = ok;
  bad.scale = 0;
  EXPECT_THROW(d.restore(bad), Error);
  bad = ok;
  bad.hysteresis_left = 3;  // above fp16.hysteresis = 2
  EXPECT_THROW(d.restore(bad), Error);
  bad = ok;
  bad.last_overflow_iter = bad.iter;
  EXPECT_THROW(d.restore(bad), Error);
  bad = ok;
  bad.iter = -1;
  EXPECT_THROW(d.restore(bad), Error);
  EXPECT_EQ(d.state().iter, 0);  // unchanged by the refused restores
  EXPECT_EQ(d.scale(), 64.0);
}

}  // namespace
}  // namespace tiermem
