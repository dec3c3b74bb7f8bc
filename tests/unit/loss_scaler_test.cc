// fp16 dynamic loss scaling (include/tiermem/loss_scaler.h): DeepSpeed's rules.
#include "tiermem/loss_scaler.h"

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace tiermem
