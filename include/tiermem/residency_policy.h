// tiermem/residency_policy.h — how TensorStore asks which tensors to keep, evict and prefetch.
//
// TensorStore owns the mechanism (budgets, copies, I/O); a ResidencyPolicy owns the decisions.
// The default is LRU (runtime/lru_policy); the reuse-distance Prefetcher (prefetch/) implements
// Belady's MIN over a recorded access trace. Policies are pure logic: they never do I/O, never
// block, and never call back into TensorStore.
//
// Thread-safety: TensorStore calls a policy with its own policy mutex held, so implementations
// need no locking of their own, but must not be shared between two TensorStores.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <vector>

#include "tiermem/tier.h"

namespace tiermem {

// Dense id of a registered tensor (0, 1, 2, ... in registration order).
using TensorId = std::uint32_t;
inline constexpr TensorId kInvalidTensor = std::numeric_limits<TensorId>::max();

// Phase of training an access belongs to (recorded in traces; used by the simulator). kEval: a
// forward-only pass between training steps (held-out loss), which the trace-based policy leaves
// out of the step's trace (AccessTrace ignores it), so an evaluation is no divergence.
enum class Phase : std::uint8_t { kForward, kBackward, kOptimizer, kOther, kEval };

// A request the policy makes: bring `id` up to `tier` ahead of use.
struct PrefetchHint {
  TensorId id;
  Tier tier;
};

// What the policy may read of the current state when deciding (a snapshot taken by TensorStore).
struct ResidencyView {
  // Bytes resident per tier and the budget of each tier (bytes).
  std::uint64_t resident_bytes[kNumTiers] = {};
  std::uint64_t budget_bytes[kNumTiers] = {};
};

class ResidencyPolicy {
 public:
  virtual ~ResidencyPolicy() = default;

  // A training step (iteration) begins / ends. The trace-based policy records the first step and
  // replays later ones.
  virtual void begin_step() {}
  virtual void end_step() {}

  // `id` (of `bytes` bytes) is being acquired at `tier` by the caller now. Returns the tensors to
  // bring up ahead of need (possibly none). TensorStore issues them asynchronously, best-effort:
  // a prefetch that would need to evict a pinned tensor is dropped, never waited on.
  virtual std::vector<PrefetchHint> on_access(TensorId id, std::uint64_t bytes, Tier tier,
                                              Phase phase, const ResidencyView& view) = 0;

  // The last pin of `id` at `tier` was released. Return true to keep it resident (its next use is
  // near), false to let TensorStore drop it (clean) or write it back (dirty) right away.
  virtual bool keep_on_release(TensorId id, Tier tier, const ResidencyView& view) = 0;

  // `tier` needs room: pick one victim among `candidates` (resident, unpinned; never empty).
  // Returns an element of candidates.
  virtual TensorId choose_victim(Tier tier, std::span<const TensorId> candidates) = 0;

  // `id` left `tier` (evicted or dropped). Default: nothing.
  virtual void on_evicted(TensorId /*id*/, Tier /*tier*/) {}

  // A PREFETCH of `incoming` to `tier` needs room and choose_victim picked `victim`. Return false
  // to drop the prefetch rather than evict `victim` ("do no harm", Cao, Felten, Karlin and Li,
  // SIGMETRICS 1995: never evict a tensor needed sooner than the one prefetched). Demand loads
  // never ask. Default: true (always evict). Added for the Prefetcher; without it a look-ahead into
  // a full tier can evict what the very next accesses need.
  virtual bool evict_for_prefetch(Tier /*tier*/, TensorId /*incoming*/, TensorId /*victim*/) {
    return true;
  }
};

}  // namespace tiermem
