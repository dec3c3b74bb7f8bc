// src/zero/norm_fold.h — the gradient reducer's folded clipping norm: one module's running sum
// of squares, moved on as each of its sub-groups' gradient partitions completes, so that step()
// has the global norm without a second read of the partitions (stages 2-3, no fp16 overflow
// check; NormTracker, norm_tracker.h, owns one a module).
//
// The sum is usable only when the module's sub-groups completed in order, each exactly once, in
// its latest reduce call: then it equals the sum step()'s pre-pass would add over the same
// partitions, bit for bit (the caller's `add` is the pre-pass's arithmetic). A sub-group that
// completes out of order breaks the fold for that call (ready() is false: step() reads the
// partitions instead). Sub-groups with no real element (all padding, possible on the last ranks)
// never complete; they keep their place in the order and add nothing.
//
// The lane sums below (sumsq_lanes and its copying twins) are that arithmetic's per-sub-group sum,
// also used by the reduce path's fused copy.
//
// Units: sub-groups are indices within the module (0 .. sub_groups-1); `valid(j)` is sub-group j's
// count of real elements. No I/O; no allocation. Thread-safety: none; one thread at a time (the
// engine's gradient thread or its driving thread, as the reduce path runs).
#pragma once

#include <cstddef>
#include <functional>

namespace tiermem::detail {

class ModuleNormFold {
 public:
  using ValidLen = std::function<std::size_t(std::size_t)>;  // sub-group j -> real elements
  using AddSubGroup = std::function<double(double running)>;    // the running sum moved on by j

  // Sub-group j (of `sub_groups`) completed: the running sum moves on by `add` when j is the next in
  // order (the module's first real sub-group starts a reduce call afresh), else the fold breaks.
  void complete(std::size_t j, std::size_t sub_groups, const ValidLen& valid, const AddSubGroup& add);
  // Every sub-group folded, in order (or the module holds no real element: it adds nothing).
  bool ready(std::size_t sub_groups, const ValidLen& valid) const;
  double sum() const { return running_; }  // meaningful when ready()
  void clear() {  // zero_grad: the next reduce call starts afresh
    next_ = 0;
    broken_ = false;
  }

 private:
  void skip_empty(std::size_t sub_groups, const ValidLen& valid);
  double running_ = 0;    // after the first next_ sub-groups
  std::size_t next_ = 0;  // the sub-group expected next
  bool broken_ = false;   // a sub-group completed out of order
};

// Sum of squares of g[0, n) in double, in 32 lanes (element i in lane i mod 32) added in lane
// order: deterministic for a given n (the same on every ISA), and fast. copy_sumsq_lanes copies src[0, n) to dst in the
// same pass and returns the sum over src[0, n_sum) (n_sum <= n; the same value as sumsq_lanes).
// copy_lanes is the copy alone. Both store to a 16-byte-aligned dst of 64 Ki floats or more with
// non-temporal stores, fenced before they return (copy_lanes not when the caller reads dst next,
// `read_next`). `clear`: nullptr, or src itself (writable), which is then left zero,
// each block zeroed right after it is read, while its lines are in cache (the gradient hand-off
// recycles its buffer: one pass over it instead of a copy and a later fill). dst and src must not
// overlap.
double sumsq_lanes(const float* g, std::size_t n);
double copy_sumsq_lanes(float* dst, const float* src, std::size_t n, std::size_t n_sum, float* clear = nullptr);
void copy_lanes(float* dst, const float* src, std::size_t n, float* clear = nullptr, bool read_next = false);

// Whether any of the module's `sub_groups` sub-groups holds a real element.
bool has_real(std::size_t sub_groups, const ModuleNormFold::ValidLen& valid);

}  // namespace tiermem::detail
