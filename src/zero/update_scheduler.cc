// src/zero/update_scheduler.cc — see update_scheduler.h.
#include "zero/update_scheduler.h"

#include <algorithm>
#include <fmt/format.h>

#include "tiermem/error.h"
#include "tiermem/trace.h"
#include "tiermem/zero_engine.h"

namespace tiermem::detail {

// --------------------------------------------------------------------------------- deferred

void UpdateScheduler::apply(int mi, Phase phase, std::optional<Tier> publish) {
  const std::optional<AdamParams> ap = deferred_.take(mi);  // at most once per deferral
  if (!ap) return;
  hooks_.run(mi, *ap, phase, publish, [this](int q) { return deferred_.pending(q); });
}

void UpdateScheduler::apply_all(Phase phase) {
  for (int i = 0; i < static_cast<int>(mods_.size()) && deferred_.count() > 0; ++i) apply(i, phase);
}

void UpdateScheduler::drop_all() {
  deferred_.drop_all();
  for (auto& m : mods_) m.replay.clear();
}

void UpdateScheduler::before_gather(int mi, Phase phase) {
  ZeroModule& m = module(mi);
  if (deferred_.pending(mi)) {  // the overlapped optimizer step: this module's update, now that it is needed
    // The new shard written where the gather is about to read it, when the CPU can write there
    // (a host-addressable device: the master is read from NVMe into device memory and updated in
    // place, with no host copy to make room for and none to copy up; GPT-2 124 M at 256 MiB
    // budgets: 8 % fewer bytes read a step, 5 % fewer written).
    std::optional<Tier> at;
    if (!shape_.opaque && m.stored) at = hooks_.gather_tier(m);
    const std::uint64_t t0 = Trace::now_ns(), stall0 = hooks_.driving_stall_ns();
    apply(mi, phase == Phase::kOutsideStep ? Phase::kOutsideStep : Phase::kOptimizer, at);
    update_ns_ += Trace::now_ns() - t0;
    update_stall_ns_ += hooks_.driving_stall_ns() - stall0;
  } else if (!m.replay.empty() && phase != Phase::kOutsideStep) {
    hooks_.replay(m);
  }
}

// --------------------------------------------------------------------------------- ahead

void UpdateScheduler::start(int next, const AdamParams& ap, Tier at, std::vector<bool> still) {
  task_.start([this, next, ap, at, still = std::move(still)] {
    hooks_.run(next, ap, Phase::kOptimizer, std::optional<Tier>(at),
               [&still](int q) { return !still.empty() && still[static_cast<std::size_t>(q)]; });
  });
}

void UpdateScheduler::start_ahead(int after) {
  if (task_.running() || deferred_.count() == 0 || shape_.world != 1 || shape_.opaque) return;
  int next = -1;
  for (int q = after + 1; q < static_cast<int>(mods_.size()); ++q) {
    if (deferred_.pending(q)) {
      next = q;
      break;
    }
  }
  if (next < 0) return;
  const ZeroModule& m = module(next);
  const Tier at = hooks_.gather_tier(m);  // where its gather reads the shard: the update writes it there
  if (!hooks_.fits_now(m, at)) return;    // applied at its gather, as without this
  const std::optional<AdamParams> ap = deferred_.take(next);
  std::vector<bool> still(mods_.size());
  for (std::size_t q = 0; q < mods_.size(); ++q) still[q] = deferred_.pending(static_cast<int>(q));
  ++ahead_;
  start(next, *ap, at, std::move(still));
}

void UpdateScheduler::join() {
  if (!task_.running()) return;
  const std::uint64_t stall0 = hooks_.driving_stall_ns();
  // The time the driving thread waited for it: the part of the update the forward did not hide.
  update_ns_ += task_.join();
  update_stall_ns_ += hooks_.driving_stall_ns() - stall0;
}

// --------------------------------------------------------------------------------- in backward

void UpdateScheduler::arm_backward(const AdamParams& ap) {
  bwd_.ap = ap;
  bwd_.micro = 0;
  bwd_.state.assign(mods_.size(), BackwardStep::kNone);
  bwd_.armed = true;
}

void UpdateScheduler::disarm_backward() {
  for (int q : bwd_.stepped) module(q).stepped_in_backward = false;
  bwd_.stepped.clear();
  bwd_.ready.clear();
  bwd_.handing = -1;
  bwd_.armed = false;
}

void UpdateScheduler::refuse_half_step(const char* call) const {
  if (updated_in_backward() == 0) return;
  throw Error(fmt::format(
      "ZeroEngine::{}: {} modules were already updated in this backward pass (tiermem.update_in_backward) and step() "
      "has not run: their parameters and state are this step's, the others' the last step's. Call step() first; to "
      "read or change the model between backward and step, set tiermem.update_in_backward to false",
      call, updated_in_backward()));
}

void UpdateScheduler::note_gradient(int mi, bool complete) {
  if (!bwd_.armed) return;
  const ZeroModule& m = module(mi);
  if (m.stepped_in_backward) {
    throw Error(fmt::format(
        "ZeroEngine::reduce_gradients: module {} (\"{}\") got another gradient in the backward pass after its update "
        "ran (step_in_backward: its gradient was taken as complete at its last hand-off). The model reduces a module "
        "twice in one backward; set tiermem.update_in_backward to false for it",
        mi, m.name));
  }
  if (bwd_.handing >= 0 && bwd_.handing != mi) bwd_.ready.push_back(bwd_.handing);  // its hand-off was waited for
  bwd_.handing = -1;
  auto& state = bwd_.state[static_cast<std::size_t>(mi)];
  if (state == BackwardStep::kNone) state = BackwardStep::kReduced;
  // A module reduced again is not complete until this reduce is.
  bwd_.ready.erase(std::remove(bwd_.ready.begin(), bwd_.ready.end(), mi), bwd_.ready.end());
  if (complete) bwd_.ready.push_back(mi);
  else bwd_.handing = mi;
}

void UpdateScheduler::start_in_backward(int gathered) {
  if (!bwd_.armed) return;
  // Gathered again after a gradient of it came: its working params are read now, so its update
  // waits for step().
  auto& state = bwd_.state[static_cast<std::size_t>(gathered)];
  if (state == BackwardStep::kReduced) {
    state = BackwardStep::kLeftToStep;
    bwd_.ready.erase(std::remove(bwd_.ready.begin(), bwd_.ready.end(), gathered), bwd_.ready.end());
  }
  // The hand-off in flight (bwd_.handing) counts as complete only at the next reduce_gradients,
  // which waits for it: not when it happens to finish, so every step takes the same decisions
  // and the store's recorded trace holds.
  if (task_.running()) return;
  bwd_.ready.erase(std::remove_if(bwd_.ready.begin(), bwd_.ready.end(),
                                  [&](int q) {  // left to step()
                                    return bwd_.state[static_cast<std::size_t>(q)] == BackwardStep::kLeftToStep ||
                                           deferred_.pending(q) || !module(q).stored;
                                  }),
                   bwd_.ready.end());
  // The update is joined at the next call, so it hides behind this module's backward compute
  // only: the oldest update no more than twice this module's size (a layer norm's short backward
  // takes a layer norm's update, a projection's a projection's).
  const std::size_t limit = 2 * module(gathered).numel + (std::size_t{1} << 16);
  auto pick = std::find_if(bwd_.ready.begin(), bwd_.ready.end(), [&](int q) { return module(q).numel <= limit; });
  if (pick == bwd_.ready.end()) return;
  const int next = *pick;
  ZeroModule& m = module(next);
  // The micro-batches step() will divide by (mean_over_micro_batches): the most reduce calls of
  // any module so far, the same for every update of the step (else the rest wait for step()).
  int micro = 1;
  if (mean_over_micro_batches_) {
    for (const auto& q : mods_) micro = std::max(micro, q.grad_calls);
  }
  if (updated_in_backward() > 0 && micro != bwd_.micro) return;
  const Tier at = hooks_.gather_tier(m);  // where its next gather reads the shard
  if (!hooks_.fits_now(m, at)) return;    // tried again at the next backward gather, else in step()
  bwd_.micro = micro;
  bwd_.ap.grad_scale = static_cast<float>(1.0 / (static_cast<double>(shape_.world) * micro));
  bwd_.ready.erase(pick);
  m.stepped_in_backward = true;
  bwd_.stepped.push_back(next);
  ++in_backward_;
  start(next, bwd_.ap, at, {});  // nothing read ahead past it
}

// --------------------------------------------------------------------------------- stats

void UpdateScheduler::add_stats(ZeroStats& s) const {
  s.deferred_update_ns += update_ns_;
  s.deferred_update_stall_ns += update_stall_ns_;
  s.deferred_updates_ahead += ahead_;
  s.updates_in_backward += in_backward_;
}

}  // namespace tiermem::detail
