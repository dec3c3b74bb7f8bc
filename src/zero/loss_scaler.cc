// src/zero/loss_scaler.cc — fp16 dynamic loss scaling (see include/tiermem/loss_scaler.h).
#include "tiermem/loss_scaler.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "tiermem/error.h"

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

LossScalerState DynamicLossScaler::state() const {
  return {scale_, hysteresis_left_, iter_, last_overflow_iter_};
}

void DynamicLossScaler::restore(const LossScalerState& s) {
  auto bad = [](const std::string& field, const std::string& value, const std::string& why) {
    return Error("DynamicLossScaler::restore: " + field + " = " + value + " " + why);
  };
  if (!std::isfinite(s.scale) || s.scale <= 0) {
    throw bad("scale", std::to_string(s.scale), "must be finite and > 0");
  }
  if (s.hysteresis_left < 1 || s.hysteresis_left > hysteresis_) {
    throw bad("hysteresis_left", std::to_string(s.hysteresis_left),
              "must be in [1, " + std::to_string(hysteresis_) + "] (fp16.hysteresis)");
  }
  if (s.iter < 0) throw bad("iter", std::to_string(s.iter), "must be >= 0");
  if (s.last_overflow_iter != -1 && (s.last_overflow_iter < 0 || s.last_overflow_iter >= s.iter)) {
    throw bad("last_overflow_iter", std::to_string(s.last_overflow_iter),
              "must be -1 or in [0, iter = " + std::to_string(s.iter) + ")");
  }
  scale_ = s.scale;
  hysteresis_left_ = s.hysteresis_left;
  iter_ = s.iter;
  last_overflow_iter_ = s.last_overflow_iter;
}

}  // namespace tiermem
