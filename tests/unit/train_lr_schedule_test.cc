// tiermem-train's learning rate schedules (include/tiermem/lr_schedule.h) against reference curves:
// values computed by hand from DeepSpeed's formulas (deepspeed/runtime/lr_schedules.py:
// WarmupLR, WarmupDecayLR, WarmupCosineLR) at last_batch_iteration = step - 1, and the trainer's
// own warm-up + cosine schedule.
#include "tiermem/lr_schedule.h"

#include <gtest/gtest.h>

#include <cmath>
#include <tuple>
#include <utility>
#include <vector>

#include "train/train_loop.h"

namespace tiermem::train {
namespace {

// Each pair: (1-based optimizer step, expected lr).
void expect_curve(const LrSchedule& s, const std::vector<std::pair<long long, double>>& curve) {
  for (const auto& [t, lr] : curve) EXPECT_NEAR(lr_at(s, t), lr, 1e-12) << "step " << t;
}

SchedulerConfig sched(const char* type) {
  SchedulerConfig c;
  c.type = type;
  return c;
}

TEST(LrSchedule, TrainerOwnWarmupThenCosineToATenth) {
  const LrSchedule s = make_lr_schedule(SchedulerConfig{}, 1e-3, 10, 110);
  EXPECT_EQ(s.kind, LrSchedule::Kind::kTrainer);
  expect_curve(s, {{1, 1e-4}, {5, 5e-4}, {10, 1e-3}, {60, 5.5e-4}, {110, 1e-4}, {200, 1e-4}});
}

// Without a scheduler section, lr_at is the trainer's learning_rate (train_loop.cc) to the bit, so
// train_loop can call it for every run.
TEST(LrSchedule, TrainerKindIsTheTrainLoopsLearningRate) {
  for (const auto& [lr, warmup, steps] : {std::tuple{2e-3, 10, 150}, std::tuple{3e-3, 2, 20},
                                          std::tuple{3e-4, 0, 3}, std::tuple{1e-3, 7, 7}}) {
    TrainPlan plan;
    plan.lr = lr;
    plan.warmup = warmup;
    plan.steps = steps;
    const LrSchedule s = make_lr_schedule(plan.config.scheduler, plan.lr, plan.warmup, plan.steps);
    for (int t = 1; t <= steps + 3; ++t) EXPECT_EQ(lr_at(s, t), learning_rate(plan, t)) << t;
  }
}

TEST(LrSchedule, WarmupLRLogAndLinear) {
  SchedulerConfig c = sched("WarmupLR");
  c.warmup_min_lr = 0.0;
  c.warmup_max_lr = 0.01;
  c.warmup_num_steps = 10;
  // log: lr = max * ln(it + 1) / ln(10); then flat at max.
  expect_curve(make_lr_schedule(c, 123.0, 999, 999), {{1, 0.0},
                                                      {2, 0.0030102999566398118},
                                                      {6, 0.007781512503836436},
                                                      {10, 0.01},
                                                      {11, 0.01},
                                                      {5000, 0.01}});
  c.warmup_type = "linear";
  c.warmup_min_lr = 1e-3;
  c.warmup_num_steps = 4;
  expect_curve(make_lr_schedule(c, 123.0, 999, 999),
               {{1, 1e-3}, {3, 5.5e-3}, {5, 1e-2}, {9, 1e-2}});
}

TEST(LrSchedule, WarmupDecayLRDecaysLinearlyToTheMinimum) {
  SchedulerConfig c = sched("WarmupDecayLR");
  c.warmup_min_lr = 0.0;
  c.warmup_max_lr = 1e-2;
  c.warmup_num_steps = 10;
  c.total_num_steps = 100;
  c.warmup_type = "linear";
  expect_curve(make_lr_schedule(c, 123.0, 999, 999),
               {{1, 0.0}, {6, 5e-3}, {11, 1e-2}, {56, 5e-3}, {101, 0.0}, {151, 0.0}});
}

TEST(LrSchedule, WarmupCosineLRScalesTheOptimizerLr) {
  SchedulerConfig c = sched("WarmupCosineLR");
  c.warmup_num_steps = 10;
  c.total_num_steps = 110;
  c.warmup_type = "linear";
  c.warmup_min_ratio = 0.1;
  c.cos_min_ratio = 0.01;
  expect_curve(make_lr_schedule(c, 1e-3, 999, 999), {{1, 1e-4},
                                                     {6, 5.5e-4},
                                                     {11, 0.0009997557473810372},
                                                     {60, 5.05e-4},
                                                     {110, 1e-5},
                                                     {500, 1e-5}});
}

// tiermem-train runs a DeepSpeed scheduler section as DeepSpeed's engine does (and tiermem.torch):
// optimizer steps 1 and 2 at the warm-up's start, step t at iteration t - 2. It ran one step ahead
// (1e-5, 1.09e-4, 2.08e-4 here) while tiermem.torch and DeepSpeed 0.19.8's WarmupLR gave 1e-5,
// 1e-5, 1.09e-4 (found by a helper trying the README as a new user).
TEST(LrSchedule, TheTrainerStepsADeepSpeedSchedulerAsDeepSpeedsEngineDoes) {
  TrainPlan plan;
  plan.lr = 1e-3;
  plan.warmup = 5;
  plan.steps = 30;
  plan.config.scheduler = sched("WarmupLR");
  plan.config.scheduler.warmup_min_lr = 1e-5;
  plan.config.scheduler.warmup_max_lr = 1e-3;
  plan.config.scheduler.warmup_num_steps = 10;
  plan.config.scheduler.warmup_type = "linear";
  const std::vector<std::pair<int, double>> want = {{1, 1e-5}, {2, 1e-5}, {3, 1.09e-4}, {4, 2.08e-4}, {12, 1e-3}};
  for (const auto& [t, lr] : want) EXPECT_NEAR(learning_rate(plan, t), lr, 1e-12) << "step " << t;
  const LrSchedule s = make_lr_schedule(plan.config.scheduler, plan.lr, plan.warmup, plan.steps);
  for (int t = 1; t <= 20; ++t) EXPECT_EQ(learning_rate(plan, t), lr_at_optimizer_step(s, t)) << t;
}

TEST(LrSchedule, UnsetParametersComeFromTheTrainer) {
  // Nothing but the type: peak = the trainer's lr, warm-up = its warm-up, total = its steps.
  const LrSchedule s = make_lr_schedule(sched("WarmupDecayLR"), 2e-3, 20, 200);
  EXPECT_DOUBLE_EQ(s.peak_lr, 2e-3);
  EXPECT_DOUBLE_EQ(s.min_lr, 0.0);
  EXPECT_EQ(s.warmup_steps, 20);
  EXPECT_EQ(s.total_steps, 200);
  EXPECT_TRUE(s.log_warmup);
  // DeepSpeed keeps at least two warm-up steps (its log warm-up divides by ln(warmup steps)).
  EXPECT_EQ(make_lr_schedule(sched("WarmupLR"), 1e-3, 0, 10).warmup_steps, 2);
  EXPECT_TRUE(std::isfinite(lr_at(make_lr_schedule(sched("WarmupLR"), 1e-3, 0, 10), 1)));
}

}  // namespace
}  // namespace tiermem::train
