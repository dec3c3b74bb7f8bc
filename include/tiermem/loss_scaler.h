// tiermem/loss_scaler.h — fp16 dynamic loss scaling, with DeepSpeed's rules (pure logic).
//
// The loss is multiplied by scale() before backward; gradients are divided by it in the
// optimizer. After each step the caller reports whether any gradient was non-finite:
//   overflow:    the step is skipped. If hysteresis is exhausted (hysteresis_left == 1) the scale is
//                divided by 2 (not below min_loss_scale), else hysteresis_left is decremented.
//   no overflow: when loss_scale_window steps have passed since the last overflow (or start), the
//                scale doubles (and hysteresis_left is restored to hysteresis).
// A static scale (Fp16Config::loss_scale > 0) never changes. (DeepSpeed's DynamicLossScaler with
// consecutive_hysteresis = false.)
// Thread-safety: a plain value; not thread-safe.
#pragma once

#include <cstdint>

#include "tiermem/config.h"
#include "tiermem/export.h"

namespace tiermem {

// Everything a DynamicLossScaler's future decisions depend on (for checkpoints): restoring it into
// a scaler built from the same Fp16Config makes that scaler behave exactly like the saved one.
struct TIERMEM_API LossScalerState {
  double scale = 1.0;                     // the current loss scale
  int hysteresis_left = 1;                // overflows still tolerated before the scale halves
  std::int64_t iter = 0;                  // update() calls so far
  std::int64_t last_overflow_iter = -1;   // iter of the last overflow (-1: none yet)
};

class TIERMEM_API DynamicLossScaler {
 public:
  explicit DynamicLossScaler(const Fp16Config& config);

  double scale() const { return scale_; }
  int hysteresis_left() const { return hysteresis_left_; }
  // Reports one step's outcome (true = some gradient was NaN/Inf). Returns true when the step
  // must be skipped (== overflow).
  bool update(bool overflow);

  // The state to checkpoint, and its restoration. restore() throws Error (naming the field and
  // value) when the state is impossible: scale not finite or <= 0, hysteresis_left outside
  // [1, the config's hysteresis], iter < 0, last_overflow_iter outside [-1, iter).
  LossScalerState state() const;
  void restore(const LossScalerState& s);

 private:
  bool dynamic_;
  double scale_;
  double min_scale_;
  int window_;
  int hysteresis_;
  int hysteresis_left_;
  std::int64_t iter_ = 0;
  std::int64_t last_overflow_iter_ = -1;
};

}  // namespace tiermem
