// AccessTrace: record the first step, check later ones, invalidate visibly on divergence.
#include "tiermem/access_trace.h"

#include <fmt/format.h>

#include "tiermem/error.h"
#include "tiermem/log.h"

namespace tiermem {

void AccessTrace::begin_step() {
  if (state_ != State::kIdle) end_step();
  pos_ = 0;
  if (valid_) {
    state_ = State::kReplaying;
  } else {
    trace_.clear();
    state_ = State::kRecording;
  }
}

void AccessTrace::end_step() {
  switch (state_) {
    case State::kRecording:
      if (!trace_.empty()) {
        valid_ = true;
        ++generation_;
        TM_LOG_DEBUG("PREFETCH", "recorded an access trace of {} accesses", trace_.size());
      }
      break;
    case State::kReplaying:
      if (pos_ != trace_.size()) {
        diverge(nullptr);
      } else {
        ++replayed_steps_;
      }
      break;
    case State::kDiverged:
    case State::kIdle:
      break;
  }
  state_ = State::kIdle;
}

bool AccessTrace::on_access(const Access& a) {
  if (a.phase == Phase::kOutsideStep) return false;  // not part of the step's repeating order
  switch (state_) {
    case State::kIdle:
    case State::kDiverged:
      return false;
    case State::kRecording:
      trace_.push_back(a);
      ++pos_;
      return false;
    case State::kReplaying:
      if (pos_ >= trace_.size() || !(trace_[pos_] == a)) {
        diverge(&a);
        return false;
      }
      ++pos_;
      return true;
  }
  return false;
}

void AccessTrace::forget() {
  if (valid_) ++generation_;
  valid_ = false;
  trace_.clear();
  pos_ = 0;
  // The step in progress is the changed one (its first forward has no pending updates to apply):
  // not the order to record; the next step records.
  if (state_ != State::kIdle) state_ = State::kDiverged;
  TM_LOG_DEBUG("PREFETCH", "access trace dropped (the step's order changed on purpose); the next step records anew");
}

void AccessTrace::diverge(const Access* actual) {
  auto describe = [](const Access& x) {
    return fmt::format("tensor {} ({}, {}, {})", x.id, format_bytes(x.bytes), phase_name(x.phase),
                       tier_name(x.tier));
  };
  std::string expected =
      pos_ < trace_.size() ? describe(trace_[pos_]) : std::string("the end of the step");
  std::string got = actual ? describe(*actual) : std::string("the end of the step");
  ++invalidations_;
  TM_LOG_WARN("PREFETCH",
              "access trace diverged at position {} of {}: expected {}, got {}; the trace is "
              "dropped (invalidation #{}) and re-recorded next step",
              pos_, trace_.size(), expected, got, invalidations_);
  valid_ = false;
  trace_.clear();
  ++generation_;
  state_ = State::kDiverged;
}

}  // namespace tiermem
