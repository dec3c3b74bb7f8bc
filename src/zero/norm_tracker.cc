// src/zero/norm_tracker.cc — see norm_tracker.h.
#include "zero/norm_tracker.h"

#include <algorithm>
#include <cstdint>

namespace tiermem::detail {

std::size_t NormTracker::valid_len(std::size_t k) const {
  const SubGroup& p = sub_groups_[k];
  const ZeroModule& m = mods_[static_cast<std::size_t>(p.module)];
  const ElemRange valid = m.shard.valid(shape_.opt_rank);
  const std::size_t valid_end = valid.end - m.shard.range(shape_.opt_rank).begin;  // shard-local
  return std::min(p.end, std::max(valid_end, p.begin)) - p.begin;
}

double NormTracker::sub_group_sumsq(std::size_t k, const float* g, double running, std::optional<double> partial) const {
  const SubGroup& p = sub_groups_[k];
  const ZeroModule& m = mods_[static_cast<std::size_t>(p.module)];
  const std::int64_t n = static_cast<std::int64_t>(valid_len(k));
  const bool first = static_cast<std::size_t>(m.sub_groups.front()) == k;
  const bool last = static_cast<std::size_t>(m.sub_groups.back()) == k;
  if (first && last) {
    double part = 0;
#pragma omp parallel for reduction(+ : part) schedule(static) if (n > (1 << 18))
    for (std::int64_t i = 0; i < n; ++i) part += static_cast<double>(g[i]) * g[i];
    return part;
  }
  // A module of several sub-groups: its sub-groups' sums (sumsq_lanes, or `partial` when the
  // caller computed it in its own pass over g) added in order.
  if (first) running = 0;
  return running + (partial ? *partial : sumsq_lanes(g, static_cast<std::size_t>(n)));
}

void NormTracker::fold(int pi, const float* g, std::optional<double> partial) {
  const std::size_t k = static_cast<std::size_t>(pi);
  const std::size_t mi = static_cast<std::size_t>(sub_groups_[k].module);
  const ZeroModule& m = mods_[mi];
  const std::size_t first = static_cast<std::size_t>(m.sub_groups.front());  // a module's sub-groups are consecutive
  folds_[mi].complete(k - first, m.sub_groups.size(), module_valid_len(m),
                      [&](double running) { return sub_group_sumsq(k, g, running, partial); });
}

bool NormTracker::folded_sumsq(double& sumsq) const {
  if (!folds()) return false;
  auto has_grad = [&](const ZeroModule& m) {
    return !m.sub_groups.empty() && (m.stepped_in_backward || !sub_groups_[static_cast<std::size_t>(m.sub_groups.front())].grad_fresh);
  };
  for (std::size_t i = 0; i < mods_.size(); ++i) {
    if (has_grad(mods_[i]) && !module_ready(i)) return false;
  }
  for (std::size_t i = 0; i < mods_.size(); ++i) {
    if (has_grad(mods_[i]) && module_has_real(static_cast<int>(i))) sumsq += folds_[i].sum();
  }
  return true;
}

bool NormTracker::module_has_real(int module) const {
  const ZeroModule& m = mods_[static_cast<std::size_t>(module)];
  return has_real(m.sub_groups.size(), module_valid_len(m));
}

void NormTracker::clear() {
  for (ModuleNormFold& f : folds_) f.clear();
}

void NormTracker::add(Sum& sum, std::size_t k, const float* g) const {
  sum.module = sub_group_sumsq(k, g, sum.module);
  if (static_cast<std::size_t>(mods_[static_cast<std::size_t>(sub_groups_[k].module)].sub_groups.back()) == k) {
    sum.total += sum.module;
  }
}

double NormTracker::sum_over_ranks(double sumsq) {
  if (shape_.stage == 0 || shape_.world == 1) return sumsq;  // stage 0: every rank has the whole gradient
  float f = static_cast<float>(sumsq);
  comm_.all_reduce(&f, &f, 1, DType::kF32, ReduceOp::kSum);
  return f;
}

ModuleNormFold::ValidLen NormTracker::module_valid_len(const ZeroModule& m) const {
  const std::size_t first = m.sub_groups.empty() ? 0 : static_cast<std::size_t>(m.sub_groups.front());
  return [this, first](std::size_t j) { return valid_len(first + j); };
}

bool NormTracker::module_ready(std::size_t module) const {
  const ZeroModule& m = mods_[module];
  return folds_[module].ready(m.sub_groups.size(), module_valid_len(m));
}

}  // namespace tiermem::detail
