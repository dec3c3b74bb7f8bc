// src/runtime/io_busy_clock.h — IoBusyClock: per training phase, the wall time during which at
// least one transfer was in flight (TensorStoreStats::phases[].io_busy_ns).
//
// Model. The clock counts transfers in flight (begin/end) and keeps a current phase (set_phase).
// Every nanosecond with a count > 0 is added to the phase current at that nanosecond: a phase
// change while transfers run closes the busy interval so far for the old phase and opens one for
// the new. Overlapping transfers count once (wall time, not transfer time).
//
// Pure: the caller passes every time (ns on one monotonic clock, non-decreasing across calls; a
// time earlier than the last one is taken as the last one), so tests drive it with made-up times.
// Not thread-safe: TensorStore calls it with its mutex held. No errors (an end() without a
// begin() is ignored).
#pragma once

#include <algorithm>
#include <cstdint>

#include "tiermem/residency_policy.h"

namespace tiermem::store_detail {

class IoBusyClock {
 public:
  // The phase current from `now_ns` on (an unchanged phase costs nothing).
  void set_phase(Phase p, std::uint64_t now_ns) {
    if (p == phase_) return;
    settle(now_ns);
    phase_ = p;
  }
  Phase phase() const { return phase_; }

  // A transfer starts / ends at `now_ns`.
  void begin(std::uint64_t now_ns) {
    settle(now_ns);
    ++in_flight_;
  }
  void end(std::uint64_t now_ns) {
    if (in_flight_ == 0) return;
    settle(now_ns);
    --in_flight_;
  }
  int in_flight() const { return in_flight_; }

  // Busy ns of phase `p` up to `now_ns` (a busy interval still open counted to now_ns).
  std::uint64_t busy_ns(Phase p, std::uint64_t now_ns) const {
    std::uint64_t b = busy_[static_cast<int>(p)];
    if (in_flight_ > 0 && p == phase_) b += std::max(now_ns, since_ns_) - since_ns_;
    return b;
  }

 private:
  // Adds [since_ns_, now_ns) to the current phase when busy; the next interval starts at now_ns.
  void settle(std::uint64_t now_ns) {
    now_ns = std::max(now_ns, since_ns_);
    if (in_flight_ > 0) busy_[static_cast<int>(phase_)] += now_ns - since_ns_;
    since_ns_ = now_ns;
  }

  Phase phase_ = Phase::kOther;
  int in_flight_ = 0;
  std::uint64_t since_ns_ = 0;  // the last time settled
  std::uint64_t busy_[kNumPhases] = {};
};

}  // namespace tiermem::store_detail
