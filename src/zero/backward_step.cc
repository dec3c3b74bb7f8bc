// src/zero/backward_step.cc — ZeroEngine's updates in backward (step_in_backward,
// tiermem.update_in_backward): at the accumulation boundary, without gradient clipping or an fp16
// overflow check, nothing a module's update reads depends on another module's gradient. So each
// module's AdamW update can run as soon as its own gradient is complete, during the backward
// pass, rather than in step() or at its next gather (the overlapped step). Its gradient
// partitions are consumed while still in host memory (never written to NVMe), and its state's
// reads and write-backs overlap backward's compute, where the drive is otherwise idle. It is
// the first half of SuperOffload's speculation-then-validation (SuperOffload, 2025: the update
// runs before the global norm is known, and is redone when a clip turns out to apply): with no
// clip there is nothing to validate, and nothing is ever redone.
//
// The update runs on the engine's update thread (`ahead`, helper_task.h) under the rule of the
// update running ahead in forward (start_update_ahead, zero_step.cc): started by a gather, one
// module at a time, only with room for its pins beside every pin held now, and joined by the
// next engine call, so the store's recorded order of accesses is the same on every step.
#include <algorithm>
#include <cmath>
#include <fmt/format.h>

#include "tiermem/log.h"
#include "zero/zero_impl.h"

namespace tiermem {

bool ZeroEngine::step_in_backward(double lr) {
  Impl& I = *impl_;
  I.finalize();
  if (!std::isfinite(lr) || lr < 0) {
    throw ConfigError("optimizer.params.lr", fmt::format("{}", lr),
                      fmt::format("learning rate {} must be finite and >= 0", lr));
  }
  if (I.bwd.armed) {
    if (I.bwd.updated() == 0) I.bwd.ap.lr = static_cast<float>(lr);
    return true;
  }
  if (!I.cfg.tiermem.update_in_backward || I.shape.world != 1 || I.shape.stage != 3 || I.shape.opaque || I.scaler ||
      I.cfg.gradient_clipping > 0 || I.plan.optimizer_on_device || !I.store) {
    return false;
  }
  // step()'s scalars for this step (zero_step.cc); the gradient's scale is set at the first update
  // (with mean_over_micro_batches it divides by the micro-batches, known once a gradient is complete).
  I.bwd.ap = I.step_params(1.0);
  I.bwd.ap.lr = static_cast<float>(lr);
  I.bwd.micro = 0;
  I.bwd.state.assign(I.mods.size(), Impl::BackwardStep::kNone);
  I.bwd.armed = true;
  I.reducer.hold_pins(true);  // the room checks see pins that change only on this thread
  return true;
}

void ZeroEngine::Impl::disarm_backward_step() {
  for (int q : bwd.stepped) mods[static_cast<std::size_t>(q)].stepped_in_backward = false;
  bwd.stepped.clear();
  bwd.ready.clear();
  bwd.handing = -1;
  bwd.armed = false;
  reducer.hold_pins(false);
}

int ZeroEngine::updated_in_backward() const { return impl_->bwd.updated(); }

void ZeroEngine::Impl::refuse_half_step(const char* call) const {
  if (bwd.updated() == 0) return;
  throw Error(fmt::format(
      "ZeroEngine::{}: {} modules were already updated in this backward pass (tiermem.update_in_backward) and step() "
      "has not run: their parameters and state are this step's, the others' the last step's. Call step() first; to "
      "read or change the model between backward and step, set tiermem.update_in_backward to false",
      call, bwd.updated()));
}

void ZeroEngine::Impl::note_gradient(int module, bool complete) {
  if (!bwd.armed) return;
  detail::ZeroModule& m = mods[static_cast<std::size_t>(module)];
  if (m.stepped_in_backward) {
    throw Error(fmt::format(
        "ZeroEngine::reduce_gradients: module {} (\"{}\") got another gradient in the backward pass after its update "
        "ran (step_in_backward: its gradient was taken as complete at its last hand-off). The model reduces a module "
        "twice in one backward; set tiermem.update_in_backward to false for it",
        module, m.name));
  }
  if (bwd.handing >= 0 && bwd.handing != module) bwd.ready.push_back(bwd.handing);  // its hand-off was waited for
  bwd.handing = -1;
  auto& state = bwd.state[static_cast<std::size_t>(module)];
  if (state == BackwardStep::kNone) state = BackwardStep::kReduced;
  // A module reduced again is not complete until this reduce is.
  bwd.ready.erase(std::remove(bwd.ready.begin(), bwd.ready.end(), module), bwd.ready.end());
  if (complete) bwd.ready.push_back(module);
  else bwd.handing = module;
}

void ZeroEngine::Impl::start_update_in_backward(int gathered) {
  if (!bwd.armed) return;
  // Gathered again after a gradient of it came: its working params are read now, so its update
  // waits for step().
  auto& state = bwd.state[static_cast<std::size_t>(gathered)];
  if (state == BackwardStep::kReduced) {
    state = BackwardStep::kLeftToStep;
    bwd.ready.erase(std::remove(bwd.ready.begin(), bwd.ready.end(), gathered), bwd.ready.end());
  }
  // The hand-off in flight (bwd.handing) counts as complete only at the next reduce_gradients,
  // which waits for it: not when it happens to finish, so every step takes the same decisions
  // and the store's recorded trace holds.
  if (ahead.running()) return;
  bwd.ready.erase(std::remove_if(bwd.ready.begin(), bwd.ready.end(),
                                 [&](int q) {  // left to step()
                                   return bwd.state[static_cast<std::size_t>(q)] == BackwardStep::kLeftToStep ||
                                          deferred.pending(q) || !mods[static_cast<std::size_t>(q)].stored;
                                 }),
                  bwd.ready.end());
  // The update is joined at the next call, so it hides behind this module's backward compute
  // only: the oldest update no more than twice this module's size (a layer norm's short backward
  // takes a layer norm's update, a projection's a projection's).
  const std::size_t limit = 2 * mods[static_cast<std::size_t>(gathered)].numel + (std::size_t{1} << 16);
  auto pick = std::find_if(bwd.ready.begin(), bwd.ready.end(),
                           [&](int q) { return mods[static_cast<std::size_t>(q)].numel <= limit; });
  if (pick == bwd.ready.end()) return;
  const int next = *pick;
  detail::ZeroModule& m = mods[static_cast<std::size_t>(next)];
  // The micro-batches step() will divide by (mean_over_micro_batches): the most reduce calls of
  // any module so far, the same for every update of the step (else the rest wait for step()).
  int micro = 1;
  if (opts.mean_over_micro_batches) {
    for (const auto& q : mods) micro = std::max(micro, q.grad_calls);
  }
  if (bwd.updated() > 0 && micro != bwd.micro) return;
  const Tier at = staging.gather_tier(m);  // where its next gather reads the shard
  if (!update_fits_now(m, at)) return;     // tried again at the next backward gather, else in step()
  bwd.micro = micro;
  bwd.ap.grad_scale = static_cast<float>(1.0 / (static_cast<double>(shape.world) * micro));
  bwd.ready.erase(pick);
  m.stepped_in_backward = true;
  bwd.stepped.push_back(next);
  ++st.updates_in_backward;
  ahead.start([this, next, ap = bwd.ap, at] {
    run_update(next, ap, Phase::kOptimizer, std::optional<Tier>(at), [](int) { return false; });
  });
}

}  // namespace tiermem
