// src/zero/optimizer_stepper.cc — see optimizer_stepper.h. The device-resident sub-groups'
// update (update_on_device) is in zero_device_step.cc.
#include "zero/optimizer_stepper.h"

#include <algorithm>
#include <cstring>

#include "tiermem/cast.h"
#include "tiermem/optim_kernels.h"

namespace tiermem::detail {

std::size_t OptimizerStepper::buffer_count() const {
  return static_cast<std::size_t>(std::max(1, cfg_.zero.offload_optimizer.buffer_count));
}

AdamParams OptimizerStepper::params(double grad_scale, std::int64_t step) const {
  AdamParams ap;
  ap.lr = static_cast<float>(cfg_.optimizer.lr);
  ap.beta1 = cfg_.optimizer.beta1;  // double: 1 - beta computed from the configured value
  ap.beta2 = cfg_.optimizer.beta2;
  ap.eps = static_cast<float>(cfg_.optimizer.eps);
  ap.weight_decay = static_cast<float>(cfg_.optimizer.weight_decay);
  ap.step = step;
  ap.grad_scale = static_cast<float>(grad_scale);
  return ap;
}

WorkingShardOut OptimizerStepper::working_out(Phase phase, std::optional<Tier> publish) {
  return {mods_, store_, shape_, staging_, plan_.sub_group_elems, phase, publish};
}

void OptimizerStepper::to_working(const float* src, std::byte* dst, std::size_t n) const {
  if (shape_.wsize == 4) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  }
  // The bulk casts of tiermem/cast.h: the same bits as f32_to_bf16 / f32_to_f16 per element,
  // with the best vector kernel the CPU has (F16C / AVX-512).
  auto* d = reinterpret_cast<std::uint16_t*>(dst);
  if (shape_.wdtype == DType::kBF16) f32_to_bf16_n(src, d, n);
  else f32_to_f16_n(src, d, n);
}

const float* OptimizerStepper::grad(SubGroup& p, TensorStore::Pin& pin, Phase phase) {
  ZeroModule& m = mods_[static_cast<std::size_t>(p.module)];
  if (shape_.stage == 0) return m.full_grad.data() + p.begin;
  if (shape_.stage == 1) return m.shard_grad.data() + p.begin;
  if (p.grad_fresh) {  // no gradient since the last step: zero
    pin = store_->acquire_for_overwrite(p.grad, p.gtier);
    std::memset(pin.data(), 0, pin.bytes());
    p.grad_fresh = false;
  } else {
    pin = store_->acquire(p.grad, p.gtier, phase);
    if (phase == Phase::kOutsideStep) m.replay.emplace_back(p.grad, p.gtier);
  }
  return pin.as<const float>();
}

void OptimizerStepper::prefetch_after(std::size_t k, bool with_state) {
  const std::size_t B = buffer_count();
  std::vector<TensorId> ids;
  std::vector<TensorId> masters;  // the working shards that hold the master (shared_master)
  for (std::size_t j = k + 1; j < sub_groups_.size() && j < k + B; ++j) {
    if (sub_groups_[j].on_device) continue;  // state (and gradient) already where it is used
    if (with_state) ids.push_back(sub_groups_[j].optim);
    if (shape_.stage >= 2 && !sub_groups_[j].grad_fresh) ids.push_back(sub_groups_[j].grad);
    const ZeroModule& m = mods_[static_cast<std::size_t>(sub_groups_[j].module)];
    if (with_state && m.shared_master && sub_groups_[j].module != sub_groups_[k].module &&
        std::find(masters.begin(), masters.end(), m.param) == masters.end()) {
      masters.push_back(m.param);
    }
  }
  if (!ids.empty()) store_->prefetch(ids, Tier::kHost);
  if (!masters.empty()) store_->prefetch(masters, shape_.publish_tier);
}

void OptimizerStepper::update(std::size_t k, const AdamParams& ap, WorkingShardOut& working, Phase phase,
                              const OnGrad& on_grad) {
  SubGroup& p = sub_groups_[k];
  if (p.on_device) return update_on_device(k, ap, working, phase, on_grad);  // zero_device_step.cc
  working.begin(p);  // a new module: the last one's shard released first
  TensorStore::Pin state = store_->acquire(p.optim, Tier::kHost, phase);
  if (phase == Phase::kOutsideStep) mods_[static_cast<std::size_t>(p.module)].replay.emplace_back(p.optim, Tier::kHost);
  TensorStore::Pin gpin;
  const float* g = grad(p, gpin, phase);
  if (on_grad) on_grad(k, g);
  std::byte* out = working.dest(p);
  float* s = state.as<float>();
  const std::size_t n = p.size();
  // The master: slot 0 of the state, or (shared_master) the fp32 working params themselves,
  // updated in place, with no copy to write. Else the new working params are written by the same
  // pass (bf16/fp16 rounded, or an fp32 copy).
  const bool shared = mods_[static_cast<std::size_t>(p.module)].shared_master;
  float* master = shared ? reinterpret_cast<float*>(out) : s;
  float* m1 = shared ? s : s + n;  // slot 1 (exp_avg), then slot 2 (exp_avg_sq) at m1 + n
  void* copy = shared ? nullptr : out;
  switch (shape_.optimizer) {
    case OptimizerKind::kAdamW:
      adam_step(ap, master, g, m1, m1 + n, n, copy, shape_.wdtype);
      break;
    case OptimizerKind::kLion:
      // lr as the step was given it (a deferred update keeps its step's); the rest as configured.
      lion_step(LionParams{ap.lr, ap.beta1, ap.beta2, cfg_.optimizer.weight_decay, ap.grad_scale}, master, g, m1, n,
                copy, shape_.wdtype);
      break;
    case OptimizerKind::kAdagrad:
      adagrad_step(AdagradParams{ap.lr, cfg_.optimizer.lr_decay, cfg_.optimizer.weight_decay, cfg_.optimizer.eps,
                                 ap.step, ap.grad_scale},
                   master, g, m1 + n, n, copy, shape_.wdtype);
      break;
  }
  state.mark_dirty();
  state.release();
  gpin.release();
  if (shape_.stage >= 2) {  // consumed: the next accumulation overwrites it, so it is never written down
    store_->discard(p.grad);
    p.grad_fresh = true;
  }
}

void OptimizerStepper::update_module(int mi, const AdamParams& ap, Phase phase, std::optional<Tier> publish,
                                     const std::function<bool(int)>& pending) {
  ZeroModule& m = mods_[static_cast<std::size_t>(mi)];
  const std::size_t B = buffer_count();
  WorkingShardOut working = working_out(phase, publish);
  for (std::size_t j = 0; j < m.sub_groups.size(); ++j) {
    // The next B - 1 sub-groups to be stepped on their way while this one steps: this module's,
    // then those of the modules still pending after it (in the order the forward pass gathers
    // them, as registered), so the next module's state is read during this module's compute
    // rather than at its gather (GPT-2 124 M at 256 MiB budgets: step 3.19 -> 3.06 s, median of 4
    // interleaved pairs, each faster). The Prefetcher's trace-driven look-ahead does not reach it:
    // the plan's room is spent on the parameters ahead. The scan stops after a few modules' worth.
    std::vector<TensorId> ids;
    const std::size_t k = static_cast<std::size_t>(m.sub_groups[j]);
    std::size_t read_ahead = 0;
    for (std::size_t q = k + 1; q < sub_groups_.size() && read_ahead + 1 < B && q < k + 8 * B; ++q) {
      const SubGroup& nxt = sub_groups_[q];
      if (nxt.on_device || (nxt.module != mi && !pending(nxt.module))) continue;
      ++read_ahead;
      ids.push_back(nxt.optim);
      if (!nxt.grad_fresh) ids.push_back(nxt.grad);
    }
    if (!ids.empty()) store_->prefetch(ids, Tier::kHost);
    update(k, ap, working, phase);
  }
  working.finish();
}

bool OptimizerStepper::module_fits_now(const ZeroModule& m, Tier publish) const {
  if (!m.stored) return false;
  const std::size_t B = buffer_count();
  std::uint64_t host_need = 0;
  for (std::size_t j = 0; j < m.sub_groups.size(); ++j) {
    const SubGroup& p = sub_groups_[static_cast<std::size_t>(m.sub_groups[j])];
    if (p.on_device || p.gtier != Tier::kHost) return false;  // the device optimizer, device gradients
    if (j < B) host_need += 4ull * p.size() * (m.shared_master ? 3 : 4);  // moments (and master), gradient
  }
  const TensorStoreStats ss = store_->stats();
  const int h = static_cast<int>(Tier::kHost), d = static_cast<int>(Tier::kDevice);
  const std::uint64_t shard_bytes = m.shard.shard * shape_.wsize;
  std::uint64_t dev_need = 0;
  if (m.update_tier(publish) == Tier::kDevice) dev_need = shard_bytes;
  else host_need += shard_bytes;
  return ss.pinned_bytes[h] + host_need <= ss.budget_bytes[h] &&
         (dev_need == 0 || ss.pinned_bytes[d] + dev_need <= ss.budget_bytes[d]);
}

void OptimizerStepper::replay(ZeroModule& m) {
  for (const auto& [id, tier] : m.replay) store_->touch(id, tier, Phase::kOptimizer);
  m.replay.clear();
}

}  // namespace tiermem::detail
