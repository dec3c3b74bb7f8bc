// tiermem/lru_policy.h — the default ResidencyPolicy: least-recently-used eviction, keep released
// tensors cached, no prefetch hints. What TensorStore uses until the reuse-distance Prefetcher
// (prefetch/) is plugged in.
//
// Thread-safety: none of its own; TensorStore calls it under its policy mutex (residency_policy.h).
#pragma once

#include <cstdint>
#include <vector>

#include "tiermem/export.h"
#include "tiermem/residency_policy.h"

namespace tiermem {

class TIERMEM_API LruPolicy final : public ResidencyPolicy {
 public:
  // Records the access time of `id` (a logical clock); no hints.
  std::vector<PrefetchHint> on_access(TensorId id, std::uint64_t bytes, Tier tier, Phase phase,
                                      const ResidencyView& view) override;
  // Always keeps the copy: it is evicted only when its tier needs room.
  bool keep_on_release(TensorId id, Tier tier, const ResidencyView& view) override { return true; }
  // The candidate whose last on_access is oldest (never-accessed ones first; ties: smaller id).
  TensorId choose_victim(Tier tier, std::span<const TensorId> candidates) override;

 private:
  std::uint64_t clock_ = 0;
  std::vector<std::uint64_t> last_use_;  // by TensorId; 0 = never accessed
};

}  // namespace tiermem
