// src/zero/zero_step.cc — ZeroEngine's optimizer step (AdamW streamed over sub-groups through the
// TensorStore), in phases, and the arming of the updates in backward (step_in_backward). Each
// sub-group's update is the OptimizerStepper's (optimizer_stepper.h); when a module's update runs
// (now, deferred, ahead, in backward) the UpdateScheduler's (update_scheduler.h); the clipping norm
// is the NormTracker's (norm_tracker.h), the stage 0-1 reductions the GradientReducer's. The
// state's export/import (checkpoints, export_master, set_module_params) is in zero_state.cc.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fmt/format.h>

#include "tiermem/adam.h"
#include "tiermem/log.h"
#include "zero/zero_impl.h"

namespace tiermem {

ZeroEngine::StepResult ZeroEngine::Impl::step() {
  finalize();
  sync();
  updates.apply_all(Phase::kOptimizer);  // a module not gathered since the last step
  int micro = reducer.finish_step();  // stages 0-1: the collective they deferred

  StepResult res;
  const bool pre_pass = scaler != nullptr || cfg.gradient_clipping > 0;
  detail::NormTracker::Sum sum;
  const bool folded = norm.folded_sumsq(sum.total);
  if (pre_pass && !norm_pre_pass(folded, sum, res)) return res;  // fp16 overflow: step skipped
  // In fp32 as tiermem-train's loop computes it for its other engines (bitwise-equal runs).
  if (!opts.mean_over_micro_batches) micro = 1;  // the caller scaled each micro-batch's loss
  double grad_scale = static_cast<float>(1.0 / (static_cast<double>(shape.world) * micro * (scaler ? res.loss_scale : 1.0)));
  if (pre_pass) {
    res.grad_norm = std::sqrt(sum.total) * grad_scale;
    if (cfg.gradient_clipping > 0 && res.grad_norm > cfg.gradient_clipping) {
      grad_scale = static_cast<float>(grad_scale * cfg.gradient_clipping / (res.grad_norm + 1e-6));
    }
  }
  AdamParams ap = stepper.params(grad_scale, st.steps + 1);
  const int in_backward = updates.updated_in_backward();
  if (in_backward > 0) {  // updates ran in backward (update_scheduler.h): the rest take their scalars
    const AdamParams& bap = updates.backward_params();
    if (ap.lr != bap.lr) {
      TM_LOG_WARN("ZERO",
                  "step {}: the learning rate changed from {} to {} between the backward pass and step(); {} modules "
                  "were updated in backward with {}, so the whole step uses it (set the learning rate before the "
                  "accumulation boundary's backward, or tiermem.update_in_backward false)",
                  ap.step, bap.lr, ap.lr, in_backward, bap.lr);
    }
    if (ap.grad_scale != bap.grad_scale) {
      TM_LOG_WARN("ZERO",
                  "step {}: {} micro-batches were counted when {} modules were updated in backward, {} at step(): a "
                  "module got gradients from more micro-batches than the others; the whole step divides by {} (set "
                  "tiermem.update_in_backward false for such a model)",
                  ap.step, updates.backward_micro_batches(), in_backward, micro, updates.backward_micro_batches());
    }
    ap = bap;
  }

  // Overlapped with the next forward (tiermem.overlap_optimizer_step): with the norm known
  // without reading a gradient (folded into accumulation; no fp16 overflow check), each stored
  // stage-3 module's update waits for its next gather (UpdateScheduler::apply), so its sub-groups' NVMe
  // reads and write-backs run beside the forward pass instead of before it. Bit for bit the same
  // update, with this step's scalars.
  // "auto": on when the optimizer state streams from NVMe and a deferred update writes the module's
  // shard where its gather reads it (published on the device, or a host-addressable device: the
  // update at a gather writes at the gather's tier), so the updates do not pass the parameters
  // through the host pool. Measured on a host-addressable SimDevice, 4 December 2026: GPT-2 124 M at
  // 256 MiB budgets 2.16 s a step against 2.37 s eager (medians of 3 interleaved pairs, each
  // faster); Llama 4 x 2048 at 256 MiB 5.7-6.4 s against 8.9-10.3 s; gpt2-xl at 1 GiB device /
  // 2 GiB host, step 3 read 25.7 GB against 35.6 GB eager. Before the updates wrote at the gather's
  // tier they went through the host pool and lost there (gpt2-xl step 2: 55 GB, 39.8 s against 35
  // GB, 25.8 s), which still holds for a device the CPU cannot address.
  const bool defer =
      defers_optimizer_step(plan, cfg, shape.publish_tier == Tier::kDevice || !shape.opaque, folded && !scaler);
  const bool hook = !pre_pass && !folded;  // the norm is summed as the update reads each gradient
  stream_update(ap, defer, hook ? &sum : nullptr);
  if (!pre_pass) res.grad_norm = std::sqrt(norm.sum_over_ranks(sum.total)) * grad_scale;
  gatherer.publish_whole_modules(-1);  // the modules kept whole: all-gather their new working params
  end_step(defer);
  res.step = st.steps;
  if (scaler) res.loss_scale = scaler->scale();
  return res;
}

// The overflow check (fp16) and the global norm before anything is updated (the norm summed from
// the gradients unless `folded` has it in sum.total already). False when an fp16 overflow skips
// the step: `res` is then the step's result, gradients dropped.
bool ZeroEngine::Impl::norm_pre_pass(bool folded, detail::NormTracker::Sum& sum, StepResult& res) {
  float bad = 0;
  for (std::size_t k = 0; k < sub_groups.size() && !folded; ++k) {
    stepper.prefetch_after(k, false);
    TensorStore::Pin pin;
    const float* g = stepper.grad(sub_groups[k], pin, Phase::kOptimizer);
    if (scaler) bad += static_cast<float>(count_nonfinite(g, sub_groups[k].size()));
    norm.add(sum, k, g);
  }
  if (scaler) {
    if (shape.stage > 0 && shape.world > 1) comm.all_reduce(&bad, &bad, 1, DType::kF32, ReduceOp::kSum);
    const double used_scale = scaler->scale();
    if (scaler->update(bad > 0)) {
      ++st.skipped_steps;
      TM_LOG_WARN("ZERO", "fp16 gradient overflow: step skipped, loss scale {} -> {}", used_scale, scaler->scale());
      zero_grad();
      store->end_step();
      store->begin_step();
      res.skipped = true;
      res.loss_scale = scaler->scale();
      res.step = st.steps;
      return false;
    }
    res.loss_scale = used_scale;
  }
  sum.total = norm.sum_over_ranks(sum.total);
  return true;
}

// AdamW over the sub-groups in order, each module's working shard written whole; with `defer`,
// a stored module's update is left pending with `ap` instead (UpdateScheduler::apply at its next
// gather). `sum`: when given, each gradient's squares are added as the update reads it (the norm
// summed inside the update: no pre-pass reads the gradients).
void ZeroEngine::Impl::stream_update(const AdamParams& ap, bool defer, detail::NormTracker::Sum* sum) {
  detail::WorkingShardOut working = stepper.working_out();
  detail::OptimizerStepper::OnGrad norm_hook;
  if (sum != nullptr) norm_hook = [this, sum](std::size_t k, const float* g) { norm.add(*sum, k, g); };
  for (std::size_t k = 0; k < sub_groups.size(); ++k) {
    detail::ZeroModule& m = mods[static_cast<std::size_t>(sub_groups[k].module)];
    if (m.stepped_in_backward) continue;  // updated in backward already (update_scheduler.h)
    if (defer && m.stored) {
      updates.defer(sub_groups[k].module, ap);
      continue;
    }
    stepper.prefetch_after(k, true);
    stepper.update(k, ap, working, Phase::kOptimizer, norm_hook);
  }
  working.finish();
}

// The step's end: the store's trace, the Prefetcher (re-recording after the first deferred
// step), the step count, and the gradients cleared.
void ZeroEngine::Impl::end_step(bool defer) {
  store->end_step();  // the step's trace ends here (the Prefetcher records the first, replays later)
  // The trace recorded so far has no updates inside the forward pass (the first deferring step),
  // or none inside backward (the first step with updates in backward); from now on every step
  // has them: record the next step afresh instead of diverging on it, reading ahead meanwhile
  // along the old order's forward and backward accesses, which do not move (Prefetcher::rerecord).
  const bool first_deferring = defer && updates.first_deferring_step();
  const bool first_in_backward = updates.first_step_with_backward_updates();
  if (first_deferring || first_in_backward) store->rerecord();
  store->begin_step();
  ++st.steps;
  updates.disarm_backward();
  reducer.hold_pins(false);  // hand-offs let go of their pins again when done
  zero_grad();
}

// --------------------------------------------------------------------------------- in backward

// The updates in backward (update_scheduler.h): armed here for this step, when they apply.
bool ZeroEngine::step_in_backward(double lr) {
  Impl& I = *impl_;
  I.finalize();
  if (!std::isfinite(lr) || lr < 0) {
    throw ConfigError("optimizer.params.lr", fmt::format("{}", lr),
                      fmt::format("learning rate {} must be finite and >= 0", lr));
  }
  if (I.updates.backward_armed()) {
    I.updates.set_backward_lr(static_cast<float>(lr));
    return true;
  }
  if (!I.cfg.tiermem.update_in_backward || I.shape.world != 1 || I.shape.stage != 3 || I.shape.opaque || I.scaler ||
      I.cfg.gradient_clipping > 0 || I.plan.optimizer_on_device || !I.store) {
    return false;
  }
  // step()'s scalars for this step; the gradient's scale is set at the first update (with
  // mean_over_micro_batches it divides by the micro-batches, known once a gradient is complete).
  AdamParams ap = I.stepper.params(1.0, I.st.steps + 1);
  ap.lr = static_cast<float>(lr);
  I.updates.arm_backward(ap);
  I.reducer.hold_pins(true);  // the room checks see pins that change only on this thread
  return true;
}

int ZeroEngine::updated_in_backward() const { return impl_->updates.updated_in_backward(); }

}  // namespace tiermem
