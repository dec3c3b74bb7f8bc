// When each module's optimizer update runs (src/zero/update_scheduler.h), against hooks that
// record the updates instead of running them: a deferred update runs once, at its module's gather
// (written where the gather reads) or when everything pending is applied; the update running
// ahead starts on the scheduler's thread only where nothing stands in its way, is joined (its
// error rethrown there) and counted; the updates in backward start at a backward gather for a
// complete module no more than twice the gathered module's size, never for one gathered again
// or still handing off, and a half-done step refuses the calls that would mix steps.
#include "zero/update_scheduler.h"

#include <gtest/gtest.h>

#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "tiermem/error.h"
#include "tiermem/zero_engine.h"
#include "unit/zero_parts_fakes.h"

namespace tiermem::detail {
namespace {

struct Run {
  int module;
  AdamParams ap;
  Phase phase;
  std::optional<Tier> publish;
  std::vector<bool> pending;  // the predicate's answers for every module, when the update ran
  bool on_driving_thread;
};

AdamParams params(std::int64_t step, float lr) {
  AdamParams p;
  p.step = step;
  p.lr = lr;
  return p;
}

struct Fixture {
  EngineShape shape;
  std::vector<ZeroModule> mods;
  std::vector<SubGroup> sub_groups;
  std::vector<Run> runs;
  std::mutex mu;  // runs, from the scheduler's thread
  std::vector<int> replayed;
  bool fits = true;
  bool fail = false;  // the next update throws
  std::uint64_t stall_ns = 0;  // the driving thread's waits: 10 ns more at every reading
  const std::thread::id driving = std::this_thread::get_id();
  std::unique_ptr<UpdateScheduler> s;

  // Modules of these sizes (elements), stored, on one rank at stage 3.
  explicit Fixture(std::vector<std::size_t> sizes, bool mean_over_micro_batches = false) {
    shape.stage = 3;
    for (std::size_t n : sizes) testing::add_module(mods, sub_groups, shape, n, 1 << 20);
    UpdateScheduler::Hooks h;
    h.run = [this](int m, const AdamParams& ap, Phase phase, std::optional<Tier> publish,
                   const std::function<bool(int)>& pending) {
      if (std::exchange(fail, false)) throw std::runtime_error("injected update failure");
      std::vector<bool> p;
      for (int q = 0; q < static_cast<int>(mods.size()); ++q) p.push_back(pending(q));
      const std::lock_guard<std::mutex> lock(mu);
      runs.push_back({m, ap, phase, publish, p, std::this_thread::get_id() == driving});
    };
    h.fits_now = [this](const ZeroModule&, Tier) { return fits; };
    h.gather_tier = [](const ZeroModule&) { return Tier::kDevice; };
    h.replay = [this](ZeroModule& m) {
      replayed.push_back(static_cast<int>(&m - mods.data()));
      m.replay.clear();
    };
    h.driving_stall_ns = [this] { return stall_ns += 10; };
    s = std::make_unique<UpdateScheduler>(shape, mods, mean_over_micro_batches, h);
    s->resize(mods.size());
  }
  ZeroStats stats() const {
    ZeroStats z;
    s->add_stats(z);
    return z;
  }
};

TEST(UpdateScheduler, DeferredUpdateRunsOnceAtItsGatherWhereTheGatherReads) {
  Fixture f({100, 100, 100});
  f.s->defer(0, params(7, 0.5f));
  f.s->defer(2, params(7, 0.5f));
  EXPECT_EQ(f.s->pending_count(), 2u);
  f.s->before_gather(0, Phase::kForward);
  ASSERT_EQ(f.runs.size(), 1u);
  EXPECT_EQ(f.runs[0].module, 0);
  EXPECT_EQ(f.runs[0].ap.step, 7);
  EXPECT_EQ(f.runs[0].phase, Phase::kOptimizer);
  EXPECT_EQ(f.runs[0].publish, std::optional<Tier>(Tier::kDevice));  // the gather's tier
  EXPECT_TRUE(f.runs[0].on_driving_thread);
  EXPECT_EQ(f.runs[0].pending, (std::vector<bool>{false, false, true}));  // read ahead: module 2's
  f.s->before_gather(0, Phase::kForward);  // applied: not again
  f.s->apply(0, Phase::kOptimizer);
  EXPECT_EQ(f.runs.size(), 1u);
  f.s->apply_all(Phase::kOutsideStep);
  ASSERT_EQ(f.runs.size(), 2u);
  EXPECT_EQ(f.runs[1].module, 2);
  EXPECT_EQ(f.runs[1].phase, Phase::kOutsideStep);
  EXPECT_EQ(f.runs[1].publish, std::nullopt);  // the engine's publish tier
  EXPECT_EQ(f.s->pending_count(), 0u);
  EXPECT_TRUE(f.s->first_deferring_step());
  EXPECT_FALSE(f.s->first_deferring_step());
}

TEST(UpdateScheduler, AGatherOutsideTheStepAppliesOutsideItAndReplaysOnlyInIt) {
  Fixture f({100, 100});
  f.shape.opaque = true;  // a device the CPU cannot address: the update writes at the publish tier
  f.s->defer(1, params(1, 1.0f));
  f.s->before_gather(1, Phase::kOutsideStep);
  ASSERT_EQ(f.runs.size(), 1u);
  EXPECT_EQ(f.runs[0].phase, Phase::kOutsideStep);
  EXPECT_EQ(f.runs[0].publish, std::nullopt);
  f.mods[0].replay.emplace_back(TensorId{3}, Tier::kHost);
  f.s->before_gather(0, Phase::kOutsideStep);  // an evaluation: nothing shown to the trace
  EXPECT_TRUE(f.replayed.empty());
  f.s->before_gather(0, Phase::kForward);
  EXPECT_EQ(f.replayed, (std::vector<int>{0}));
  f.s->before_gather(0, Phase::kForward);  // forgotten once shown
  EXPECT_EQ(f.replayed.size(), 1u);
}

TEST(UpdateScheduler, DropAllLeavesNothingToApplyOrReplay) {
  Fixture f({100, 100});
  f.s->defer(0, params(1, 1.0f));
  f.mods[1].replay.emplace_back(TensorId{1}, Tier::kHost);
  f.s->drop_all();
  f.s->apply_all(Phase::kOptimizer);
  f.s->before_gather(1, Phase::kForward);
  EXPECT_TRUE(f.runs.empty());
  EXPECT_TRUE(f.replayed.empty());
  EXPECT_THROW(f.s->defer(2, params(1, 1.0f)), Error);  // not one of the modules
}

TEST(UpdateScheduler, TheNextPendingUpdateRunsAheadOnItsThreadUntilJoined) {
  Fixture f({100, 100, 100, 100});
  for (int m : {1, 3}) f.s->defer(m, params(2, 0.25f));
  f.s->start_ahead(0);
  EXPECT_FALSE(f.s->pending(1));  // taken: the gather of 1 will not run it again
  f.s->start_ahead(1);            // one at a time: ignored while it runs
  f.s->join();
  ASSERT_EQ(f.runs.size(), 1u);
  EXPECT_EQ(f.runs[0].module, 1);
  EXPECT_FALSE(f.runs[0].on_driving_thread);
  EXPECT_EQ(f.runs[0].publish, std::optional<Tier>(Tier::kDevice));
  EXPECT_EQ(f.runs[0].pending, (std::vector<bool>{false, false, false, true}));  // as when it started
  EXPECT_EQ(f.stats().deferred_updates_ahead, 1u);
  EXPECT_EQ(f.stats().deferred_update_stall_ns, 10u);  // the driving thread's waits during the join
  f.s->before_gather(1, Phase::kForward);
  EXPECT_EQ(f.runs.size(), 1u);
}

TEST(UpdateScheduler, NothingRunsAheadWhereSomethingCouldStandInItsWay) {
  for (int c = 0; c < 3; ++c) {
    Fixture f({100, 100});
    if (c == 0) f.shape.world = 2;      // a collective
    if (c == 1) f.shape.opaque = true;  // staging buffers
    if (c == 2) f.fits = false;         // no room beside the pins held now
    f.s->defer(1, params(1, 1.0f));
    f.s->start_ahead(0);
    f.s->join();
    EXPECT_TRUE(f.runs.empty()) << c;
    EXPECT_TRUE(f.s->pending(1)) << c;  // left to its gather
  }
}

TEST(UpdateScheduler, AnUpdateAheadThatFailsThrowsAtTheJoin) {
  Fixture f({100, 100});
  f.s->defer(1, params(1, 1.0f));
  f.fail = true;
  f.s->start_ahead(0);
  EXPECT_THROW(f.s->join(), std::runtime_error);
  EXPECT_NO_THROW(f.s->join());  // reported once
}

TEST(UpdateScheduler, InBackwardACompleteModuleUpdatesAtTheNextBackwardGather) {
  Fixture f({100, 100, 100});
  AdamParams ap = params(4, 0.1f);
  f.s->arm_backward(ap);
  f.s->set_backward_lr(0.2f);  // before any update: taken
  f.s->note_gradient(2, /*complete=*/true);
  f.s->start_in_backward(1);
  f.s->join();
  ASSERT_EQ(f.runs.size(), 1u);
  EXPECT_EQ(f.runs[0].module, 2);
  EXPECT_FALSE(f.runs[0].on_driving_thread);
  EXPECT_EQ(f.runs[0].ap.lr, 0.2f);
  EXPECT_EQ(f.runs[0].ap.grad_scale, 1.0f);  // one rank, one micro-batch
  EXPECT_EQ(f.runs[0].pending, (std::vector<bool>{false, false, false}));
  EXPECT_TRUE(f.mods[2].stepped_in_backward);
  EXPECT_EQ(f.s->updated_in_backward(), 1);
  EXPECT_EQ(f.stats().updates_in_backward, 1u);
  f.s->set_backward_lr(0.3f);  // an update ran: kept
  EXPECT_EQ(f.s->backward_params().lr, 0.2f);
  EXPECT_THROW(f.s->refuse_half_step("gather"), Error);
  EXPECT_THROW(f.s->note_gradient(2, true), Error);  // a second gradient after its update
  f.s->disarm_backward();
  EXPECT_FALSE(f.mods[2].stepped_in_backward);
  EXPECT_EQ(f.s->updated_in_backward(), 0);
  EXPECT_NO_THROW(f.s->refuse_half_step("gather"));
  EXPECT_FALSE(f.s->first_step_with_backward_updates());  // none now
}

TEST(UpdateScheduler, InBackwardAHandOffCountsAtTheNextReduceAndAReGatherLeavesItToStep) {
  Fixture f({100, 100, 100, 100});
  f.s->arm_backward(params(1, 1.0f));
  f.s->note_gradient(3, /*complete=*/false);  // handing off
  f.s->start_in_backward(2);                  // not complete yet
  f.s->join();
  EXPECT_TRUE(f.runs.empty());
  f.s->note_gradient(2, false);  // waited for 3's hand-off first: 3 is complete
  f.s->start_in_backward(3);     // gathered again after its gradient came: left to step()
  f.s->join();
  EXPECT_TRUE(f.runs.empty());
  f.s->note_gradient(1, true);  // 2's hand-off waited for: complete
  f.s->start_in_backward(0);
  f.s->join();
  ASSERT_EQ(f.runs.size(), 1u);
  EXPECT_EQ(f.runs[0].module, 2);  // the oldest complete one
}

TEST(UpdateScheduler, InBackwardOnlyUpdatesNoMoreThanTwiceTheGatheredModule) {
  Fixture f({1000, 300000, 150000});
  f.s->arm_backward(params(1, 1.0f));
  f.s->note_gradient(1, true);
  f.s->start_in_backward(0);  // 300000 > 2 x 1000 + 65536
  f.s->join();
  EXPECT_TRUE(f.runs.empty());
  f.s->start_in_backward(2);  // 300000 <= 2 x 150000 + 65536
  f.s->join();
  ASSERT_EQ(f.runs.size(), 1u);
  EXPECT_EQ(f.runs[0].module, 1);
}

TEST(UpdateScheduler, InBackwardTheMeanDividesByTheMostMicroBatchesOfAnyModule) {
  Fixture f({100, 100, 100}, /*mean_over_micro_batches=*/true);
  f.s->arm_backward(params(1, 1.0f));
  f.mods[0].grad_calls = 4;
  f.mods[2].grad_calls = 4;
  f.s->note_gradient(2, true);
  f.s->start_in_backward(1);
  f.s->join();
  ASSERT_EQ(f.runs.size(), 1u);
  EXPECT_EQ(f.runs[0].ap.grad_scale, 0.25f);
  EXPECT_EQ(f.s->backward_micro_batches(), 4);
  f.mods[1].grad_calls = 5;  // a module got more: the rest wait for step()
  f.s->note_gradient(1, true);
  f.s->start_in_backward(0);
  f.s->join();
  EXPECT_EQ(f.runs.size(), 1u);
  EXPECT_TRUE(f.s->first_step_with_backward_updates());
  EXPECT_FALSE(f.s->first_step_with_backward_updates());
}

}  // namespace
}  // namespace tiermem::detail
