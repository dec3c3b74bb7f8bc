// IoBusyClock (src/runtime/io_busy_clock.h) with made-up times: busy wall time per phase,
// overlapping transfers of one phase counted once, two phases' transfers in flight at once counted
// to both, idle gaps and out-of-order times.
#include "runtime/io_busy_clock.h"

#include <gtest/gtest.h>

namespace tiermem::store_detail {
namespace {

constexpr Phase kF = Phase::kForward, kB = Phase::kBackward, kO = Phase::kOptimizer;

TEST(IoBusyClock, IdleTimeCountsNothing) {
  IoBusyClock c;
  for (int p = 0; p < kNumPhases; ++p) EXPECT_EQ(c.busy_ns(static_cast<Phase>(p), 1000), 0u) << p;
  c.end(kF, 600);  // an end without a begin is ignored
  EXPECT_EQ(c.in_flight(), 0);
  EXPECT_EQ(c.busy_ns(kF, 2000), 0u);
}

TEST(IoBusyClock, OverlappingTransfersOfAPhaseCountOnceAndGapsNotAtAll) {
  IoBusyClock c;
  c.begin(kF, 10);
  c.begin(kF, 20);  // overlaps the first
  c.end(kF, 30);
  EXPECT_EQ(c.busy_ns(kF, 35), 25u);  // still one in flight: counted to `now`
  c.end(kF, 40);
  c.begin(kF, 100);  // after an idle gap of 60
  c.end(kF, 110);
  EXPECT_EQ(c.busy_ns(kF, 1000), 40u);
  EXPECT_EQ(c.in_flight(), 0);
}

TEST(IoBusyClock, TwoPhasesInFlightAtOnceCountToBoth) {
  // The update thread's optimizer reads (100..400) while forward loads a parameter (200..300),
  // then backward's write (350..500).
  IoBusyClock c;
  c.begin(kO, 100);
  c.begin(kF, 200);
  EXPECT_EQ(c.in_flight(), 2);
  c.end(kF, 300);
  c.begin(kB, 350);
  c.end(kO, 400);
  c.end(kB, 500);
  EXPECT_EQ(c.busy_ns(kO, 1000), 300u);
  EXPECT_EQ(c.busy_ns(kF, 1000), 100u);
  EXPECT_EQ(c.busy_ns(kB, 1000), 150u);
  EXPECT_EQ(c.busy_ns(Phase::kOther, 1000), 0u);
  c.end(kB, 600);  // one end too many for its phase: ignored
  EXPECT_EQ(c.busy_ns(kB, 1000), 150u);
  EXPECT_EQ(c.in_flight(), 0);
}

TEST(IoBusyClock, EarlierTimesAreTakenAsTheLastOne) {
  IoBusyClock c;
  c.begin(Phase::kOther, 100);
  c.begin(kF, 200);
  c.end(Phase::kOther, 150);  // before the last settle: taken as 200
  EXPECT_EQ(c.busy_ns(Phase::kOther, 300), 100u);
  EXPECT_EQ(c.busy_ns(kF, 300), 100u);
  EXPECT_EQ(c.busy_ns(kF, 50), 0u);  // a `now` before the interval: nothing negative
}

}  // namespace
}  // namespace tiermem::store_detail
