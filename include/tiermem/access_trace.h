// tiermem/access_trace.h — the access order of one training step, recorded once and checked after.
//
// Training repeats the same order of tensor accesses every iteration (forward layer by layer, then
// backward in reverse, then the optimizer), so the future is known after one step. AccessTrace
// records the accesses of the first step between begin_step() and end_step(); on later steps it
// checks every access against the recording. A divergence — a different tensor (or bytes, or tier)
// at a position, an access past the recorded end, or a step that ends early — invalidates the trace
// visibly: invalidations() counts it and ONE warning is logged (tag PREFETCH) naming the position,
// the expected and the actual access. The next begin_step() then records afresh. Every change of
// the trace (a recording completed, an invalidation) bumps generation(), so anything derived from
// the trace (reuse distances, next uses, prefetch cursors) is keyed by it and dropped when it moves.
//
// Accesses outside begin_step()/end_step() are ignored (not recorded, not checked), and so are
// accesses of Phase::kOutsideStep (an evaluation pass or a checkpoint between training steps: it
// falls inside a step's window but is not part of the repeating order).
//
// Thread-safety: none; a plain object owned by one Prefetcher (called under TensorStore's policy
// mutex). Errors: none thrown.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "tiermem/export.h"
#include "tiermem/residency_policy.h"
#include "tiermem/tier.h"

namespace tiermem {

class TIERMEM_API AccessTrace {
 public:
  enum class State {
    kIdle,       // outside a step
    kRecording,  // inside a step, appending
    kReplaying,  // inside a step, every access so far matched the recorded trace
    kDiverged,   // inside a step that diverged; the trace is invalid until re-recorded
  };

  // A step begins: replays if a complete, valid trace exists, else starts recording (clearing any
  // previous recording). Calling begin_step() inside a step first ends that step.
  void begin_step();

  // The step ends. A recording becomes the valid trace (if it has at least one access). A replay
  // that stopped before the recorded end is a divergence (logged, counted, invalidated).
  void end_step();

  // Records or checks one access. Returns true when the access is part of a valid trace at
  // position() - 1 afterwards (i.e. replaying and it matched); false while recording, after a
  // divergence, or outside a step.
  bool on_access(const Access& a);

  // Drops the trace without counting a divergence or warning (the caller knows this step's order
  // is not the usual one); the rest of the step in progress is ignored, and the next step records.
  void forget();

  State state() const { return state_; }
  // True while replaying a valid trace whose accesses matched so far in this step.
  bool replaying() const { return state_ == State::kReplaying; }
  // True when a complete recorded trace exists (it may be replayed by the next step).
  bool has_trace() const { return valid_; }
  // Index, in the recorded trace, of the next expected access of the current step.
  std::size_t position() const { return pos_; }
  // The complete recorded trace (empty while none is valid).
  std::span<const Access> accesses() const {
    return valid_ ? std::span<const Access>(trace_) : std::span<const Access>();
  }
  // Divergences seen so far.
  std::uint64_t invalidations() const { return invalidations_; }
  // Bumped whenever the valid trace appears or is dropped.
  std::uint64_t generation() const { return generation_; }
  // Steps fully replayed without divergence.
  std::uint64_t replayed_steps() const { return replayed_steps_; }

 private:
  void diverge(const Access* actual);

  std::vector<Access> trace_;
  State state_ = State::kIdle;
  bool valid_ = false;
  std::size_t pos_ = 0;
  std::uint64_t invalidations_ = 0;
  std::uint64_t generation_ = 0;
  std::uint64_t replayed_steps_ = 0;
};

}  // namespace tiermem
