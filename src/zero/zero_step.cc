// src/zero/zero_step.cc — ZeroEngine's optimizer step (AdamW streamed over sub-groups through the
// TensorStore), in phases, and the overlapped step's deferred updates; the clipping norm is the
// NormTracker's (norm_tracker.h), the stage 0-1 reductions the GradientReducer's. The
// state's export/import (checkpoints, export_master, set_module_params) is in zero_state.cc.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fmt/format.h>

#include "tiermem/adam.h"
#include "tiermem/log.h"
#include "tiermem/prefetcher.h"
#include "tiermem/optim_kernels.h"
#include "zero/zero_impl.h"

namespace tiermem {

ZeroEngine::StepResult ZeroEngine::Impl::step() {
  finalize();
  sync();
  apply_all_pending(Phase::kOptimizer);  // a module not gathered since the last step
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
  AdamParams ap = step_params(grad_scale);
  if (bwd.updated() > 0) {  // updates ran in backward (backward_step.cc): the rest take their scalars
    if (ap.lr != bwd.ap.lr) {
      TM_LOG_WARN("ZERO",
                  "step {}: the learning rate changed from {} to {} between the backward pass and step(); {} modules "
                  "were updated in backward with {}, so the whole step uses it (set the learning rate before the "
                  "accumulation boundary's backward, or tiermem.update_in_backward false)",
                  ap.step, bwd.ap.lr, ap.lr, bwd.updated(), bwd.ap.lr);
    }
    if (ap.grad_scale != bwd.ap.grad_scale) {
      TM_LOG_WARN("ZERO",
                  "step {}: {} micro-batches were counted when {} modules were updated in backward, {} at step(): a "
                  "module got gradients from more micro-batches than the others; the whole step divides by {} (set "
                  "tiermem.update_in_backward false for such a model)",
                  ap.step, bwd.micro, bwd.updated(), micro, bwd.micro);
    }
    ap = bwd.ap;
  }

  // Overlapped with the next forward (tiermem.overlap_optimizer_step): with the norm known
  // without reading a gradient (folded into accumulation; no fp16 overflow check), each stored
  // stage-3 module's update waits for its next gather (apply_pending), so its sub-groups' NVMe
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
  publish_whole_modules(-1);
  end_step(defer);
  res.step = st.steps;
  if (scaler) res.loss_scale = scaler->scale();
  return res;
}

// Sub-groups k+1 .. k+buffer_count-1 on their way to the host tier (their gradient partitions;
// with `with_state`, their optimizer state too), skipping those stepped on the device.
void ZeroEngine::Impl::prefetch_after(std::size_t k, bool with_state) {
  const int B = std::max(1, cfg.zero.offload_optimizer.buffer_count);
  std::vector<TensorId> ids;
  std::vector<TensorId> masters;  // the working shards that hold the master (shared_master)
  for (std::size_t j = k + 1; j < sub_groups.size() && j < k + static_cast<std::size_t>(B); ++j) {
    if (sub_groups[j].on_device) continue;  // state (and gradient) already where it is used
    if (with_state) ids.push_back(sub_groups[j].optim);
    if (shape.stage >= 2 && !sub_groups[j].grad_fresh) ids.push_back(sub_groups[j].grad);
    const detail::ZeroModule& m = mods[static_cast<std::size_t>(sub_groups[j].module)];
    if (with_state && m.shared_master && sub_groups[j].module != sub_groups[k].module &&
        std::find(masters.begin(), masters.end(), m.param) == masters.end()) {
      masters.push_back(m.param);
    }
  }
  if (!ids.empty()) store->prefetch(ids, Tier::kHost);
  if (!masters.empty()) store->prefetch(masters, shape.publish_tier);
}

// The overflow check (fp16) and the global norm before anything is updated (the norm summed from
// the gradients unless `folded` has it in sum.total already). False when an fp16 overflow skips
// the step: `res` is then the step's result, gradients dropped.
bool ZeroEngine::Impl::norm_pre_pass(bool folded, detail::NormTracker::Sum& sum, StepResult& res) {
  float bad = 0;
  for (std::size_t k = 0; k < sub_groups.size() && !folded; ++k) {
    prefetch_after(k, false);
    TensorStore::Pin pin;
    const float* g = sub_group_grad(sub_groups[k], pin, Phase::kOptimizer);
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

AdamParams ZeroEngine::Impl::step_params(double grad_scale) const {
  AdamParams ap;
  ap.lr = static_cast<float>(cfg.optimizer.lr);
  ap.beta1 = cfg.optimizer.beta1;  // double: 1 - beta computed from the configured value
  ap.beta2 = cfg.optimizer.beta2;
  ap.eps = static_cast<float>(cfg.optimizer.eps);
  ap.weight_decay = static_cast<float>(cfg.optimizer.weight_decay);
  ap.step = st.steps + 1;
  ap.grad_scale = static_cast<float>(grad_scale);
  return ap;
}

// AdamW over the sub-groups in order, each module's working shard written whole; with `defer`,
// a stored module's update is left pending with `ap` instead (apply_pending at its next gather).
// `norm`: when given, each gradient's squares are added as the update reads it.
void ZeroEngine::Impl::stream_update(const AdamParams& ap, bool defer, detail::NormTracker::Sum* sum) {
  detail::WorkingShardOut working = working_out();
  std::function<void(std::size_t, const float*)> norm_hook;
  if (sum != nullptr) norm_hook = [this, sum](std::size_t k, const float* g) { norm.add(*sum, k, g); };
  for (std::size_t k = 0; k < sub_groups.size(); ++k) {
    detail::ZeroModule& m = mods[static_cast<std::size_t>(sub_groups[k].module)];
    if (m.stepped_in_backward) continue;  // updated in backward already (backward_step.cc)
    if (defer && m.stored) {
      deferred.defer(sub_groups[k].module, ap);
      continue;
    }
    prefetch_after(k, true);
    update_sub_group(k, ap, working, Phase::kOptimizer, norm_hook);
  }
  working.finish();
}

// The step's end: the store's trace, the Prefetcher (re-recording after the first deferred
// step), the step count, and the gradients cleared.
void ZeroEngine::Impl::end_step(bool defer) {
  store->end_step();  // the step's trace ends here (the Prefetcher records the first, replays later)
  // The trace recorded so far has no updates inside the forward pass (the first deferring step),
  // or none inside backward (the first step with updates in backward); from now on every step
  // has them: record the next step afresh (a new Prefetcher), instead of diverging on it.
  const bool first_deferring = defer && deferred.first_deferring_step();
  const bool first_in_backward = bwd.updated() > 0 && !std::exchange(bwd.seen, true);
  if (first_deferring || first_in_backward) {
    store->set_policy(std::make_unique<Prefetcher>(PrefetcherOptions::from_config(cfg, shape.wdtype)));
  }
  store->begin_step();
  ++st.steps;
  disarm_backward_step();
  zero_grad();
}

const float* ZeroEngine::Impl::sub_group_grad(detail::SubGroup& p, TensorStore::Pin& pin, Phase phase) {
  detail::ZeroModule& m = mods[static_cast<std::size_t>(p.module)];
  if (shape.stage == 0) return m.full_grad.data() + p.begin;
  if (shape.stage == 1) return m.shard_grad.data() + p.begin;
  if (p.grad_fresh) {  // no gradient since the last step: zero
    pin = store->acquire_for_overwrite(p.grad, p.gtier);
    std::memset(pin.data(), 0, pin.bytes());
    p.grad_fresh = false;
  } else {
    pin = store->acquire(p.grad, p.gtier, phase);
    if (phase == Phase::kOutsideStep) m.replay.emplace_back(p.grad, p.gtier);
  }
  return pin.as<const float>();
}

void ZeroEngine::Impl::update_sub_group(std::size_t k, const AdamParams& ap, detail::WorkingShardOut& working, Phase phase,
                                    const std::function<void(std::size_t, const float*)>& on_grad) {
  detail::SubGroup& p = sub_groups[k];
  if (p.on_device) return update_sub_group_on_device(k, ap, working, phase, on_grad);  // zero_device_step.cc
  working.begin(p);  // a new module: the last one's shard released first
  TensorStore::Pin state = store->acquire(p.optim, Tier::kHost, phase);
  if (phase == Phase::kOutsideStep) mods[static_cast<std::size_t>(p.module)].replay.emplace_back(p.optim, Tier::kHost);
  TensorStore::Pin gpin;
  const float* g = sub_group_grad(p, gpin, phase);
  if (on_grad) on_grad(k, g);
  std::byte* out = working.dest(p);
  float* s = state.as<float>();
  const std::size_t n = p.size();
  // The master: slot 0 of the state, or (shared_master) the fp32 working params themselves,
  // updated in place, with no copy to write. Else the new working params are written by the same
  // pass (bf16/fp16 rounded, or an fp32 copy).
  const bool shared = mods[static_cast<std::size_t>(p.module)].shared_master;
  float* master = shared ? reinterpret_cast<float*>(out) : s;
  float* m1 = shared ? s : s + n;  // slot 1 (exp_avg), then slot 2 (exp_avg_sq) at m1 + n
  void* copy = shared ? nullptr : out;
  switch (shape.optimizer) {
    case detail::OptimizerKind::kAdamW:
      adam_step(ap, master, g, m1, m1 + n, n, copy, shape.wdtype);
      break;
    case detail::OptimizerKind::kLion:
      // lr as the step was given it (a deferred update keeps its step's); the rest as configured.
      lion_step(LionParams{ap.lr, ap.beta1, ap.beta2, cfg.optimizer.weight_decay, ap.grad_scale}, master, g, m1, n,
                copy, shape.wdtype);
      break;
    case detail::OptimizerKind::kAdagrad:
      adagrad_step(AdagradParams{ap.lr, cfg.optimizer.lr_decay, cfg.optimizer.weight_decay, cfg.optimizer.eps,
                                 ap.step, ap.grad_scale},
                   master, g, m1 + n, n, copy, shape.wdtype);
      break;
  }
  state.mark_dirty();
  state.release();
  gpin.release();
  if (shape.stage >= 2) {  // consumed: the next accumulation overwrites it, so it is never written down
    store->discard(p.grad);
    p.grad_fresh = true;
  }
}

void ZeroEngine::Impl::apply_pending(int mi, Phase phase, std::optional<Tier> publish) {
  const std::optional<AdamParams> ap = deferred.take(mi);  // at most once per deferral
  if (!ap) return;
  run_update(mi, *ap, phase, publish, [this](int q) { return deferred.pending(q); });
}

void ZeroEngine::Impl::run_update(int mi, const AdamParams& ap, Phase phase, std::optional<Tier> publish,
                                  const std::function<bool(int)>& pending) {
  detail::ZeroModule& m = mods[static_cast<std::size_t>(mi)];
  const std::size_t B = static_cast<std::size_t>(std::max(1, cfg.zero.offload_optimizer.buffer_count));
  detail::WorkingShardOut working = working_out(phase, publish);
  for (std::size_t j = 0; j < m.sub_groups.size(); ++j) {
    // The next B - 1 sub-groups to be stepped on their way while this one steps: this module's,
    // then those of the modules still pending after it (in the order the forward pass gathers
    // them, as registered), so the next module's state is read during this module's compute
    // rather than at its gather (GPT-2 124 M at 256 MiB budgets: step 3.19 -> 3.06 s, median of 4
    // interleaved pairs, each faster). The Prefetcher's trace-driven look-ahead does not reach it:
    // the plan's room is spent on the parameters ahead. The scan stops after a few modules' worth.
    std::vector<TensorId> ids;
    const std::size_t k = static_cast<std::size_t>(m.sub_groups[j]);
    std::size_t ahead = 0;
    for (std::size_t q = k + 1; q < sub_groups.size() && ahead + 1 < B && q < k + 8 * B; ++q) {
      const detail::SubGroup& nxt = sub_groups[q];
      if (nxt.on_device || (nxt.module != mi && !pending(nxt.module))) continue;
      ++ahead;
      ids.push_back(nxt.optim);
      if (!nxt.grad_fresh) ids.push_back(nxt.grad);
    }
    if (!ids.empty()) store->prefetch(ids, Tier::kHost);
    update_sub_group(static_cast<std::size_t>(m.sub_groups[j]), ap, working, phase, nullptr);
  }
  working.finish();
}

// The update runs ahead only where nothing but its own pins can stand in its way: one rank (no
// collective), memory the CPU addresses (no staging buffers, which are the driving thread's), the
// host optimizer, a forward pass (the store's recorded order of accesses is kept: the update's
// acquires come between this gather and the next, as they did at the next gather), and room for
// its working shard and `buffer_count` sub-groups beside every pin held now (the driving thread
// pins nothing more before it joins, so the update never waits for a pin of the driving thread).
void ZeroEngine::Impl::start_update_ahead(int after) {
  if (ahead.running() || deferred.count() == 0 || shape.world != 1 || shape.opaque) return;
  int next = -1;
  for (int q = after + 1; q < static_cast<int>(mods.size()); ++q) {
    if (deferred.pending(q)) {
      next = q;
      break;
    }
  }
  if (next < 0) return;
  const detail::ZeroModule& m = mods[static_cast<std::size_t>(next)];
  const Tier at = staging.gather_tier(m);  // where its gather reads the shard: the update writes it there
  if (!update_fits_now(m, at)) return;  // applied at its gather, as without this
  const std::optional<AdamParams> ap = deferred.take(next);
  std::vector<bool> still(mods.size());
  for (std::size_t q = 0; q < mods.size(); ++q) still[q] = deferred.pending(static_cast<int>(q));
  ++st.deferred_updates_ahead;
  ahead.start([this, next, ap = *ap, at, still = std::move(still)] {
    run_update(next, ap, Phase::kOptimizer, std::optional<Tier>(at),
               [&still](int q) { return still[static_cast<std::size_t>(q)]; });
  });
}

bool ZeroEngine::Impl::update_fits_now(const detail::ZeroModule& m, Tier at) const {
  if (!m.stored) return false;
  const std::size_t B = static_cast<std::size_t>(std::max(1, cfg.zero.offload_optimizer.buffer_count));
  std::uint64_t host_need = 0;
  for (std::size_t j = 0; j < m.sub_groups.size(); ++j) {
    const detail::SubGroup& p = sub_groups[static_cast<std::size_t>(m.sub_groups[j])];
    if (p.on_device || p.gtier != Tier::kHost) return false;  // the device optimizer, device gradients
    if (j < B) host_need += 4ull * p.size() * (m.shared_master ? 3 : 4);  // moments (and master), gradient
  }
  const TensorStoreStats ss = store->stats();
  const int h = static_cast<int>(Tier::kHost), d = static_cast<int>(Tier::kDevice);
  const std::uint64_t shard_bytes = m.shard.shard * shape.wsize;
  std::uint64_t dev_need = 0;
  if (m.update_tier(at) == Tier::kDevice) dev_need = shard_bytes;
  else host_need += shard_bytes;
  return ss.pinned_bytes[h] + host_need <= ss.budget_bytes[h] &&
         (dev_need == 0 || ss.pinned_bytes[d] + dev_need <= ss.budget_bytes[d]);
}

void ZeroEngine::Impl::join_update_ahead() {
  if (!ahead.running()) return;
  const std::uint64_t stall0 = driving_stall_ns();
  // The time the driving thread waited for it: the part of the update the forward did not hide.
  st.deferred_update_ns += ahead.join();
  st.deferred_update_stall_ns += driving_stall_ns() - stall0;
}

void ZeroEngine::Impl::apply_all_pending(Phase phase) {
  for (int i = 0; i < static_cast<int>(mods.size()) && deferred.count() > 0; ++i) apply_pending(i, phase);
}

void ZeroEngine::Impl::replay_outside_accesses(int mi) {
  detail::ZeroModule& m = mods[static_cast<std::size_t>(mi)];
  for (const auto& [id, tier] : m.replay) store->touch(id, tier, Phase::kOptimizer);
  m.replay.clear();
}

// WorkingShardOut (where each sub-group's new working params go): working_shard_out.h.

}  // namespace tiermem
