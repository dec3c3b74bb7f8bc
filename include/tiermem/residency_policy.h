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
#include <functional>
#include <limits>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "tiermem/export.h"
#include "tiermem/tier.h"

namespace tiermem {

struct TensorStoreStats;  // tensor_store.h

// Dense id of a registered tensor (0, 1, 2, ... in registration order).
using TensorId = std::uint32_t;
inline constexpr TensorId kInvalidTensor = std::numeric_limits<TensorId>::max();

// Phase of training an access belongs to (recorded in traces; used by the simulator).
// kOutsideStep: an access outside the repeating training step — a checkpoint save or load, an
// evaluation pass between steps. Policies see it for recency only: the Prefetcher neither records
// it in nor matches it against the step's access trace, so it never makes the trace diverge.
enum class Phase : std::uint8_t { kForward, kBackward, kOptimizer, kOther, kOutsideStep };
inline constexpr int kNumPhases = 5;  // Phase values are 0 .. kNumPhases - 1 (per-phase counters)

// "forward", "backward", "optimizer", "other", "outside-step" (traces, logs).
constexpr std::string_view phase_name(Phase p) {
  switch (p) {
    case Phase::kForward: return "forward";
    case Phase::kBackward: return "backward";
    case Phase::kOptimizer: return "optimizer";
    case Phase::kOther: return "other";
    case Phase::kOutsideStep: return "outside-step";
  }
  return "?";
}

// One access: tensor `id` of `bytes` bytes used at `tier` during `phase` (access_trace.h).
struct TIERMEM_API Access {
  TensorId id = kInvalidTensor;
  std::uint64_t bytes = 0;
  Phase phase = Phase::kOther;
  Tier tier = Tier::kDevice;

  bool operator==(const Access&) const = default;
};

// A request the policy makes: bring `id` up to `tier` ahead of use.
struct TIERMEM_API PrefetchHint {
  TensorId id;
  Tier tier;
};

// What the policy may read of the current state when deciding (a snapshot taken by TensorStore).
struct TIERMEM_API ResidencyView {
  // Bytes resident per tier and the budget of each tier (bytes).
  std::uint64_t resident_bytes[kNumTiers] = {};
  std::uint64_t budget_bytes[kNumTiers] = {};
  // True when tensor `id` has a current copy in memory (host or device tier, resident or being
  // loaded): using it needs no NVMe read. Empty when the caller cannot tell (then a policy must
  // assume every tensor may need one). TensorStore's view answers from its own state and may
  // only be called during the policy call it was passed to.
  std::function<bool(TensorId)> in_memory;
  // The access being reported replaces the tensor's contents (TensorStore::touch with overwrite,
  // for a later acquire_for_overwrite): it needs room at its tier but no read.
  bool overwrite = false;
  // The tier holding `id`'s home copy (never evicted from it), and the bytes of home copies
  // resident at a tier (room no cache can use). Empty when the caller cannot tell.
  std::function<Tier(TensorId)> home;
  std::function<std::uint64_t(Tier)> home_bytes;
};

class TIERMEM_API ResidencyPolicy {
 public:
  virtual ~ResidencyPolicy() = default;

  // A training step (iteration) begins / ends. The trace-based policy records the first step and
  // replays later ones.
  virtual void begin_step() {}
  virtual void end_step() {}
  // The step's access order changed for a reason the caller knows (a checkpoint's optimizer state
  // replaced the updates the next forward would have applied): a recorded order is dropped
  // without being called a divergence; the step in progress is not recorded, the next one is.
  virtual void forget_trace() {}
  // Between steps: the next step's order will differ from the recorded one only where the
  // optimizer's accesses fall (the first step that defers updates into the next forward, or steps
  // them in backward), for good. The trace-based policy records that step afresh and, while it
  // records, reads ahead along the old order's forward and backward accesses (Prefetcher::rerecord).
  virtual void rerecord() {}
  // Before or at the start of the first step: the order its forward and backward accesses are
  // expected in (an engine's modules in registration order, then in reverse), which the trace-based
  // policy reads ahead along while that step records (Prefetcher::expect_order). Only a hint:
  // accesses it does not have, or in another order, are served as without it.
  virtual void expect_order(std::span<const Access> /*order*/) {}
  // Its counters into a TensorStore::stats() snapshot (prefetch_hints*), under the store's lock.
  virtual void add_stats(TensorStoreStats& /*out*/) const {}

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

  // `id`'s contents were declared dead (TensorStore::discard): its cached copies are gone without
  // a write-back and its next access overwrites it. Default: nothing.
  virtual void on_discard(TensorId /*id*/) {}

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
