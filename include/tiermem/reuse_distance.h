// tiermem/reuse_distance.h — reuse distances and next uses over an access trace (pure functions).
//
// The reuse distance of access i (tensor x) is measured up to the next access j > i of x: the
// number of DISTINCT other tensors accessed strictly between i and j, and the sum of their bytes
// (each counted once, with the bytes of its last access in that window). It is what
// DeepSpeed's stage3_max_reuse_distance compares against, and it is the LRU stack distance of
// Mattson et al., "Evaluation techniques for storage hierarchies" (IBM Systems Journal, 1970).
//
// Cyclic or linear. Training repeats its trace every step, so by default (ReuseMode::kCyclic) the
// trace is treated as repeating forever: the last use of x in a step reuses at x's first access of
// the next step (distance over the wrap-around), so a tensor used once per step has the distance of
// every other tensor of the step. ReuseMode::kLinear treats the trace as run
// once: a last use has distance kInfiniteReuse. The prefetcher uses kCyclic, because the tensors
// used at the end of backward are the first ones forward needs again.
//
// Complexity: O(n log n) time, O(n + tensors) memory (a Fenwick tree over positions holds, for each
// tensor, its bytes at the position of its latest access; the distance of i is a range sum).
// Thread-safety: pure functions; thread-safe. Errors: none.
#pragma once

#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "tiermem/access_trace.h"
#include "tiermem/export.h"

namespace tiermem {

inline constexpr std::uint64_t kInfiniteReuse = std::numeric_limits<std::uint64_t>::max();

enum class ReuseMode { kCyclic, kLinear };

struct TIERMEM_API ReuseDistance {
  std::uint64_t bytes = kInfiniteReuse;  // bytes of distinct other tensors before the next use
  std::uint64_t count = kInfiniteReuse;  // how many distinct other tensors

  bool infinite() const { return count == kInfiniteReuse; }
  bool operator==(const ReuseDistance&) const = default;
};

// One entry per access of `trace`.
TIERMEM_API std::vector<ReuseDistance> reuse_distances(std::span<const Access> trace,
                                                       ReuseMode mode = ReuseMode::kCyclic);

// Index of the next access of the same tensor after each access: j > i in the trace, or in
// kCyclic mode (first access of that tensor) + trace.size() when it wraps; kNoNextUse (linear
// mode, last use). O(n) time with a hash map over tensor ids.
inline constexpr std::uint64_t kNoNextUse = std::numeric_limits<std::uint64_t>::max();
TIERMEM_API std::vector<std::uint64_t> next_uses(std::span<const Access> trace,
                                                 ReuseMode mode = ReuseMode::kCyclic);

}  // namespace tiermem
