// src/train/lr_schedule.cc — learning rate schedules (tiermem/lr_schedule.h).
#include "tiermem/lr_schedule.h"

#include <algorithm>
#include <cmath>

namespace tiermem {

LrSchedule make_lr_schedule(const SchedulerConfig& sc, double lr, int warmup, int steps) {
  LrSchedule s;
  s.peak_lr = lr;
  s.warmup_steps = warmup;
  s.total_steps = steps;
  if (sc.type.empty()) return s;
  s.kind = sc.type == "WarmupDecayLR"    ? LrSchedule::Kind::kWarmupDecayLR
           : sc.type == "WarmupCosineLR" ? LrSchedule::Kind::kWarmupCosineLR
                                         : LrSchedule::Kind::kWarmupLR;
  if (s.kind != LrSchedule::Kind::kWarmupCosineLR) {
    s.peak_lr = sc.warmup_max_lr.value_or(lr);
    s.min_lr = sc.warmup_min_lr.value_or(0.0);
  }
  // DeepSpeed keeps at least 2 warm-up steps (its log warm-up divides by log(warmup_num_steps)).
  s.warmup_steps = std::max<long long>(2, sc.warmup_num_steps.value_or(warmup));
  s.total_steps = sc.total_num_steps.value_or(steps);
  s.log_warmup = sc.warmup_type != "linear";
  s.warmup_min_ratio = sc.warmup_min_ratio;
  s.cos_min_ratio = sc.cos_min_ratio;
  return s;
}

double lr_at(const LrSchedule& s, long long t) {
  if (s.kind == LrSchedule::Kind::kTrainer) {
    if (s.warmup_steps > 0 && t <= s.warmup_steps)
      return s.peak_lr * static_cast<double>(t) / static_cast<double>(s.warmup_steps);
    const long long decay_steps = std::max<long long>(1, s.total_steps - s.warmup_steps);
    const double progress =
        std::min(1.0, static_cast<double>(t - s.warmup_steps) / static_cast<double>(decay_steps));
    const double min_lr = s.peak_lr / 10;
    return min_lr + 0.5 * (s.peak_lr - min_lr) * (1 + std::cos(M_PI * progress));
  }
  const long long it = std::max<long long>(0, t - 1);  // DeepSpeed's last_batch_iteration
  const auto w = static_cast<double>(s.warmup_steps);
  // Fraction of the warm-up done at iteration `it` (< warmup_steps): 0 at it = 0.
  const double warm = s.log_warmup ? std::log(static_cast<double>(it + 1)) / std::log(w)
                                   : static_cast<double>(it) / w;
  if (s.kind == LrSchedule::Kind::kWarmupCosineLR) {
    double ratio;
    if (it < s.warmup_steps) {
      ratio = s.warmup_min_ratio + warm * (1.0 - s.warmup_min_ratio);
    } else {
      const long long real_total = s.total_steps - s.warmup_steps;
      // Past total_num_steps the lr stays at the cosine's end (cos_min_ratio x peak).
      const double progress = real_total <= 0
                                  ? 1.0
                                  : std::min(1.0, static_cast<double>(it - s.warmup_steps + 1) /
                                                      static_cast<double>(real_total));
      ratio = std::max(
          0.0, s.cos_min_ratio + (1.0 - s.cos_min_ratio) * 0.5 * (1.0 + std::cos(M_PI * progress)));
    }
    return s.peak_lr * ratio;
  }
  double gamma = 1.0;
  if (it < s.warmup_steps) {
    gamma = warm;
  } else if (s.kind == LrSchedule::Kind::kWarmupDecayLR) {
    gamma = std::max(0.0, static_cast<double>(s.total_steps - it) /
                              std::max(1.0, static_cast<double>(s.total_steps - s.warmup_steps)));
  }
  return s.min_lr + (s.peak_lr - s.min_lr) * gamma;
}

double lr_at_optimizer_step(const LrSchedule& s, long long t) {
  return s.kind == LrSchedule::Kind::kTrainer ? lr_at(s, t) : lr_at(s, std::max<long long>(1, t - 1));
}

}  // namespace tiermem
