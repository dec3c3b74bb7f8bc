// StepIoMeter (src/zero/step_io_meter.h) with made-up counters and times: the window opens once,
// the last closed window's deltas, compute = wall - stall, the bound at the rates and 0 without
// them, a step() with nothing before it.
#include "zero/step_io_meter.h"

#include <gtest/gtest.h>

#include "tiermem/zero_engine.h"

namespace tiermem::detail {
namespace {

TEST(StepIoMeter, LastWindowsDeltasAndTheBoundAtTheRates) {
  StepIoMeter m(2.0, 4.0);  // GB/s: 2 bytes/ns read, 4 bytes/ns written
  ZeroStats s;
  m.add_stats(s);
  EXPECT_EQ(s.last_step_wall_ns, 0u);  // before the first step
  EXPECT_EQ(s.last_step_io_bound_ns, 0u);
  EXPECT_EQ(s.nvme_read_gbps, 2.0);

  EXPECT_FALSE(m.is_open());
  m.open(1000, {100, 50, 10});
  EXPECT_TRUE(m.is_open());
  m.open(5000, {999, 999, 999});  // already open: ignored
  m.close(11000, {100 + 4000, 50 + 8000, 10 + 3000});
  EXPECT_FALSE(m.is_open());
  m.add_stats(s);
  EXPECT_EQ(s.last_step_nvme_read_bytes, 4000u);
  EXPECT_EQ(s.last_step_nvme_written_bytes, 8000u);
  EXPECT_EQ(s.last_step_stall_ns, 3000u);
  EXPECT_EQ(s.last_step_wall_ns, 10000u);
  EXPECT_EQ(s.last_step_compute_ns, 7000u);
  EXPECT_EQ(s.last_step_io_bound_ns, 4000u);  // 4000 / 2 + 8000 / 4

  // The next step replaces the figures; a stall summed over threads above the wall: compute 0.
  m.open(20000, {5000, 9000, 4000});
  m.close(21000, {5000, 9000, 9000});
  m.add_stats(s);
  EXPECT_EQ(s.last_step_nvme_read_bytes, 0u);
  EXPECT_EQ(s.last_step_wall_ns, 1000u);
  EXPECT_EQ(s.last_step_stall_ns, 5000u);
  EXPECT_EQ(s.last_step_compute_ns, 0u);
  EXPECT_EQ(s.last_step_io_bound_ns, 0u);
}

TEST(StepIoMeter, NoBoundWithoutBothRatesAndAStepAloneIsAnEmptyWindow) {
  StepIoMeter m(2.0, 0.0);  // write rate unknown
  m.open(0, {});
  m.close(100, {1000, 1000, 0});
  ZeroStats s;
  m.add_stats(s);
  EXPECT_EQ(s.last_step_nvme_read_bytes, 1000u);
  EXPECT_EQ(s.last_step_io_bound_ns, 0u);
  m.close(500, {3000, 1000, 0});  // close without open: a window of no time, nothing moved
  m.add_stats(s);
  EXPECT_EQ(s.last_step_wall_ns, 0u);
  EXPECT_EQ(s.last_step_nvme_read_bytes, 0u);
}

}  // namespace
}  // namespace tiermem::detail
