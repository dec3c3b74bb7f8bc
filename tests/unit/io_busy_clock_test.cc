// IoBusyClock (src/runtime/io_busy_clock.h) with made-up times: busy wall time per phase,
// overlapping transfers counted once, a phase change splitting an open interval, idle gaps and
// out-of-order times.
#include "runtime/io_busy_clock.h"

#include <gtest/gtest.h>

namespace tiermem::store_detail {
namespace {

constexpr Phase kF = Phase::kForward, kB = Phase::kBackward, kO = Phase::kOptimizer;

TEST(IoBusyClock, IdleTimeAndPhaseChangesWithoutTransfersCountNothing) {
  IoBusyClock c;
  EXPECT_EQ(c.phase(), Phase::kOther);
  c.set_phase(kF, 100);
  c.set_phase(kB, 500);
  for (int p = 0; p < kNumPhases; ++p) EXPECT_EQ(c.busy_ns(static_cast<Phase>(p), 1000), 0u) << p;
  c.end(600);  // an end without a begin is ignored
  EXPECT_EQ(c.in_flight(), 0);
}

TEST(IoBusyClock, OverlappingTransfersCountOnceAndGapsNotAtAll) {
  IoBusyClock c;
  c.set_phase(kF, 0);
  c.begin(10);
  c.begin(20);  // overlaps the first
  c.end(30);
  EXPECT_EQ(c.busy_ns(kF, 35), 25u);  // still one in flight: counted to `now`
  c.end(40);
  c.begin(100);  // after an idle gap of 60
  c.end(110);
  EXPECT_EQ(c.busy_ns(kF, 1000), 40u);
  EXPECT_EQ(c.in_flight(), 0);
}

TEST(IoBusyClock, PhaseChangeSplitsAnOpenInterval) {
  IoBusyClock c;
  c.set_phase(kF, 0);
  c.begin(100);
  c.set_phase(kB, 150);  // 50 to forward, the rest to backward
  c.set_phase(kB, 160);  // unchanged: nothing happens
  c.end(200);
  c.set_phase(kO, 300);
  c.begin(300);
  EXPECT_EQ(c.busy_ns(kF, 400), 50u);
  EXPECT_EQ(c.busy_ns(kB, 400), 50u);
  EXPECT_EQ(c.busy_ns(kO, 400), 100u);
  c.end(450);
  EXPECT_EQ(c.busy_ns(kO, 9999), 150u);
}

TEST(IoBusyClock, EarlierTimesAreTakenAsTheLastOne) {
  IoBusyClock c;
  c.begin(100);
  c.set_phase(kF, 200);  // 100 to kOther
  c.end(150);            // before the last settle: taken as 200, nothing more counted
  EXPECT_EQ(c.busy_ns(Phase::kOther, 300), 100u);
  EXPECT_EQ(c.busy_ns(kF, 300), 0u);
  EXPECT_EQ(c.busy_ns(kF, 50), 0u);  // a `now` before the interval: nothing negative
}

}  // namespace
}  // namespace tiermem::store_detail
