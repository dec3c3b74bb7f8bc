// src/zero/loss_scaler.cc — fp16 dynamic loss scaling (see include/tiermem/loss_scaler.h).
#include "tiermem/loss_scaler.h"

#include <algorithm>
#include <cmath>

namespace tiermem {

DynamicLossScaler::DynamicLossScaler(const Fp16Config& c)
    : dynamic_(c.loss_scale <= 0),
      scale_(c.loss_scale > 0 ? c.loss_scale : std::ldexp(1.0, c.initial_scale_power)),
      min_scale_(c.min_loss_scale),
      window_(std::max(1, c.loss_scale_window)),
      hysteresis_(std::max(1, c.hysteresis)),
      hysteresis_left_(std::max(1, c.hysteresis)) {}

bool DynamicLossScaler::update(bool overflow) {
  if (!dynamic_) {
    ++iter_;
    return overflow;
  }
  if (overflow) {
    if (hysteresis_left_ <= 1) {
      scale_ = std::max(scale_ / 2.0, min_scale_);
    } else {
      --hysteresis_left_;
    }
    last_overflow_iter_ = iter_;
  } else if ((iter_ - last_overflow_iter_) % window_ == 0) {
    hysteresis_left_ = hysteresis_;
    scale_ *= 2.0;
  }
  ++iter_;
  return overflow;
}

}  // namespace tiermem
