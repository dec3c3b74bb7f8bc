// lru_policy.cc — see tiermem/lru_policy.h.
#include "tiermem/lru_policy.h"

namespace tiermem {

std::vector<PrefetchHint> LruPolicy::on_access(TensorId id, std::uint64_t, Tier, Phase,
                                               const ResidencyView&) {
  if (id >= last_use_.size()) last_use_.resize(id + 1, 0);
  last_use_[id] = ++clock_;
  return {};
}

TensorId LruPolicy::choose_victim(Tier, std::span<const TensorId> candidates) {
  TensorId best = candidates.front();
  std::uint64_t best_t = UINT64_MAX;
  for (TensorId id : candidates) {
    std::uint64_t t = id < last_use_.size() ? last_use_[id] : 0;
    if (t < best_t || (t == best_t && id < best)) {
      best = id;
      best_t = t;
    }
  }
  return best;
}

}  // namespace tiermem
