#include "tiermem/access_trace.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace tiermem {
namespace {

Access acc(TensorId id, std::uint64_t bytes = 16, Phase p = Phase::kForward) {
  return Access{id, bytes, p, Tier::kDevice};
}

void run_step(AccessTrace& t, const std::vector<TensorId>& ids) {
  t.begin_step();
  for (TensorId id : ids) t.on_access(acc(id));
  t.end_step();
}

TEST(AccessTrace, RecordsFirstStepThenReplays) {
  AccessTrace t;
  EXPECT_FALSE(t.has_trace());
  t.begin_step();
  EXPECT_EQ(t.state(), AccessTrace::State::kRecording);
  EXPECT_FALSE(t.on_access(acc(3)));
  EXPECT_FALSE(t.on_access(acc(1)));
  EXPECT_FALSE(t.on_access(acc(3)));
  EXPECT_FALSE(t.has_trace());  // not complete until end_step
  t.end_step();
  ASSERT_TRUE(t.has_trace());
  ASSERT_EQ(t.accesses().size(), 3u);
  EXPECT_EQ(t.accesses()[1].id, 1u);
  const auto gen = t.generation();

  for (int step = 0; step < 3; ++step) {
    t.begin_step();
    EXPECT_TRUE(t.replaying());
    EXPECT_TRUE(t.on_access(acc(3)));
    EXPECT_EQ(t.position(), 1u);
    EXPECT_TRUE(t.on_access(acc(1)));
    EXPECT_TRUE(t.on_access(acc(3)));
    t.end_step();
  }
  EXPECT_EQ(t.replayed_steps(), 3u);
  EXPECT_EQ(t.invalidations(), 0u);
  EXPECT_EQ(t.generation(), gen);
}

TEST(AccessTrace, DifferentTensorInvalidatesWithOneLogLineAndReRecords) {
  AccessTrace t;
  run_step(t, {0, 1, 2, 3});
  const auto gen = t.generation();
  t.begin_step();
  EXPECT_TRUE(t.on_access(acc(0)));
  EXPECT_TRUE(t.on_access(acc(1)));
  testing::internal::CaptureStderr();
  EXPECT_FALSE(t.on_access(acc(7)));  // expected 2
  EXPECT_FALSE(t.on_access(acc(3)));  // the rest of the step is ignored, no more log lines
  EXPECT_FALSE(t.on_access(acc(9)));
  t.end_step();
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_EQ(t.invalidations(), 1u);
  EXPECT_FALSE(t.has_trace());
  EXPECT_TRUE(t.accesses().empty());
  EXPECT_NE(t.generation(), gen);
  // One line, naming the position and both tensors.
  EXPECT_EQ(std::count(log.begin(), log.end(), '\n'), 1) << log;
  EXPECT_NE(log.find("PREFETCH"), std::string::npos) << log;
  EXPECT_NE(log.find("position 2"), std::string::npos) << log;
  EXPECT_NE(log.find("expected tensor 2"), std::string::npos) << log;
  EXPECT_NE(log.find("got tensor 7"), std::string::npos) << log;

  // The next step records the new order, the one after replays it.
  run_step(t, {0, 1, 7, 3});
  ASSERT_TRUE(t.has_trace());
  t.begin_step();
  EXPECT_TRUE(t.replaying());
  for (TensorId id : {0u, 1u, 7u, 3u}) EXPECT_TRUE(t.on_access(acc(id)));
  t.end_step();
  EXPECT_EQ(t.invalidations(), 1u);
}

// forget(): the caller changed this step's order on purpose (a checkpoint's state loaded between
// steps): the trace goes without a divergence or a log line, the rest of the step in progress is
// not recorded (it is the unusual one), the next step records and the one after replays.
TEST(AccessTrace, ForgetDropsTheTraceQuietlyAndTheNextStepRecords) {
  AccessTrace t;
  run_step(t, {0, 1, 2, 3});
  const auto gen = t.generation();
  t.begin_step();  // between steps, as the engine keeps a step open
  testing::internal::CaptureStderr();
  t.forget();
  EXPECT_FALSE(t.has_trace());
  EXPECT_NE(t.generation(), gen);
  for (TensorId id : {2u, 3u}) EXPECT_FALSE(t.on_access(acc(id)));  // the unusual step: ignored
  t.end_step();
  EXPECT_FALSE(t.has_trace());
  run_step(t, {0, 1, 2, 3});  // the usual order again, recorded
  ASSERT_TRUE(t.has_trace());
  t.begin_step();
  EXPECT_TRUE(t.replaying());
  for (TensorId id : {0u, 1u, 2u, 3u}) EXPECT_TRUE(t.on_access(acc(id)));
  t.end_step();
  EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
  EXPECT_EQ(t.invalidations(), 0u);
  EXPECT_EQ(t.replayed_steps(), 1u);
  t.forget();  // outside a step: the trace goes, nothing else
  EXPECT_EQ(t.state(), AccessTrace::State::kIdle);
  EXPECT_FALSE(t.has_trace());
  EXPECT_EQ(t.invalidations(), 0u);
}

TEST(AccessTrace, PastTheEndAndEarlyEndAreDivergences) {
  AccessTrace t;
  run_step(t, {0, 1});
  t.begin_step();
  EXPECT_TRUE(t.on_access(acc(0)));
  EXPECT_TRUE(t.on_access(acc(1)));
  EXPECT_FALSE(t.on_access(acc(0)));  // past the end
  t.end_step();
  EXPECT_EQ(t.invalidations(), 1u);

  run_step(t, {0, 1});  // re-record
  t.begin_step();
  EXPECT_TRUE(t.on_access(acc(0)));
  t.end_step();  // ended after 1 of 2
  EXPECT_EQ(t.invalidations(), 2u);
  EXPECT_FALSE(t.has_trace());
}

TEST(AccessTrace, SameTensorWithOtherBytesOrPhaseDiverges) {
  AccessTrace t;
  run_step(t, {0, 1});
  t.begin_step();
  EXPECT_TRUE(t.on_access(acc(0)));
  EXPECT_FALSE(t.on_access(acc(1, 32)));
  t.end_step();
  EXPECT_EQ(t.invalidations(), 1u);
  run_step(t, {0, 1});
  t.begin_step();
  EXPECT_FALSE(t.on_access(acc(0, 16, Phase::kBackward)));
  t.end_step();
  EXPECT_EQ(t.invalidations(), 2u);
}

TEST(AccessTrace, AccessesOutsideAStepAreIgnored) {
  AccessTrace t;
  EXPECT_FALSE(t.on_access(acc(5)));
  run_step(t, {1, 2});
  EXPECT_FALSE(t.on_access(acc(9)));  // between steps: neither recorded nor a divergence
  EXPECT_EQ(t.invalidations(), 0u);
  EXPECT_EQ(t.accesses().size(), 2u);
  t.begin_step();
  EXPECT_TRUE(t.on_access(acc(1)));
  // begin_step inside a step ends it first (here: early end -> divergence).
  t.begin_step();
  EXPECT_EQ(t.invalidations(), 1u);
  EXPECT_EQ(t.state(), AccessTrace::State::kRecording);
}

// An evaluation pass between training steps falls inside a step's window (the window ends at
// the optimizer step) but is no part of the repeating order: its accesses are neither recorded
// nor checked, so replay goes on without a divergence, and recording keeps only the step.
TEST(AccessTrace, EvalAccessesAreLeftOutOfTheTrace) {
  AccessTrace t;
  t.begin_step();
  EXPECT_FALSE(t.on_access(acc(4, 16, Phase::kOutsideStep)));  // while recording: not recorded
  t.on_access(acc(1));
  t.on_access(acc(2, 16, Phase::kBackward));
  t.end_step();
  ASSERT_EQ(t.accesses().size(), 2u);
  for (int step = 0; step < 3; ++step) {
    t.begin_step();
    for (TensorId id : {1u, 2u}) EXPECT_FALSE(t.on_access(acc(id, 16, Phase::kOutsideStep)));  // eval
    EXPECT_TRUE(t.on_access(acc(1)));
    EXPECT_TRUE(t.on_access(acc(2, 16, Phase::kBackward)));
    t.end_step();
  }
  EXPECT_EQ(t.invalidations(), 0u);
  EXPECT_EQ(t.replayed_steps(), 3u);
  EXPECT_EQ(phase_name(Phase::kOutsideStep), "outside-step");
}

// A module used twice in one step — e.g. activation checkpointing that gathers a block again to
// recompute it before its backward — is just a longer trace: it replays without divergence.
TEST(AccessTrace, AModuleAccessedTwiceInAStepReplays) {
  AccessTrace t;
  const std::vector<Access> step = {acc(0), acc(1), acc(2), acc(2, 16, Phase::kBackward),
                                    acc(2), acc(2, 16, Phase::kBackward), acc(1, 16, Phase::kBackward)};
  for (int i = 0; i < 4; ++i) {
    t.begin_step();
    for (const Access& a : step) EXPECT_EQ(t.on_access(a), i > 0);
    t.end_step();
  }
  EXPECT_EQ(t.invalidations(), 0u);
  EXPECT_EQ(t.replayed_steps(), 3u);
}

}  // namespace
}  // namespace tiermem
