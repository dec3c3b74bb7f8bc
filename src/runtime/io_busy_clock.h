// src/runtime/io_busy_clock.h — IoBusyClock: per training phase, the wall time during which at
// least one of that phase's NVMe transfers was in flight (TensorStoreStats::phases[].io_busy_ns).
//
// Model. Each transfer belongs to one phase: the phase of the access it serves (the store passes
// it to begin/end). The clock counts each phase's transfers in flight; every nanosecond with a
// phase's count > 0 is added to that phase. Overlapping transfers of one phase count once (wall
// time, not transfer time); transfers of two phases in flight at once (the optimizer's update
// thread reading state while forward loads parameters) count to both, so the phases' busy times
// may sum to more than the drive's.
//
// Pure: the caller passes every time (ns on one monotonic clock, non-decreasing across calls; a
// time earlier than the last one is taken as the last one), so tests drive it with made-up times.
// Not thread-safe: TensorStore calls it with its mutex held. No errors (an end() without a
// begin() of its phase is ignored).
#pragma once

#include <algorithm>
#include <cstdint>

#include "tiermem/residency_policy.h"

namespace tiermem::store_detail {

class IoBusyClock {
 public:
  // A transfer of phase `p` starts / ends at `now_ns`.
  void begin(Phase p, std::uint64_t now_ns) {
    settle(now_ns);
    ++in_flight_[static_cast<int>(p)];
  }
  void end(Phase p, std::uint64_t now_ns) {
    if (in_flight_[static_cast<int>(p)] == 0) return;
    settle(now_ns);
    --in_flight_[static_cast<int>(p)];
  }
  // Transfers in flight, all phases.
  int in_flight() const {
    int n = 0;
    for (int c : in_flight_) n += c;
    return n;
  }

  // Busy ns of phase `p` up to `now_ns` (a busy interval still open counted to now_ns).
  std::uint64_t busy_ns(Phase p, std::uint64_t now_ns) const {
    const int i = static_cast<int>(p);
    std::uint64_t b = busy_[i];
    if (in_flight_[i] > 0) b += std::max(now_ns, since_ns_) - since_ns_;
    return b;
  }

 private:
  // Adds [since_ns_, now_ns) to each phase with a transfer in flight; the next interval starts
  // at now_ns.
  void settle(std::uint64_t now_ns) {
    now_ns = std::max(now_ns, since_ns_);
    for (int i = 0; i < kNumPhases; ++i) {
      if (in_flight_[i] > 0) busy_[i] += now_ns - since_ns_;
    }
    since_ns_ = now_ns;
  }

  int in_flight_[kNumPhases] = {};
  std::uint64_t since_ns_ = 0;  // the last time settled
  std::uint64_t busy_[kNumPhases] = {};
};

}  // namespace tiermem::store_detail
