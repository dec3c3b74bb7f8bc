// tiermem/lr_schedule.h — the learning rate per optimizer step: tiermem-train's own schedule
// (linear warm-up, cosine decay to lr / 10) or DeepSpeed's `scheduler` section (WarmupLR,
// WarmupDecayLR, WarmupCosineLR; deepspeed/runtime/lr_schedules.py), as plain functions. Used by
// tiermem-train and by tiermem.torch (_tiermem.lr_at); the library is tiermem::train_state
// (src/train/lr_schedule.cc).
//
// Units: learning rates are plain doubles; steps and iterations are counts (long long).
// Errors: none thrown; a config's missing required keys are the caller's to check (ConfigError).
//
// Step numbering: the trainer's steps are 1-based; DeepSpeed's schedulers are indexed by
// last_batch_iteration, 0-based. Optimizer step t uses DeepSpeed's lr at iteration t - 1, so
// step 1 of WarmupLR runs at warmup_min_lr.
//
// Ownership: plain values, nothing held. Thread-safety: pure functions, reentrant.
#pragma once

#include "tiermem/config.h"
#include "tiermem/export.h"

namespace tiermem {

struct TIERMEM_API LrSchedule {
  enum class Kind { kTrainer, kWarmupLR, kWarmupDecayLR, kWarmupCosineLR };
  Kind kind = Kind::kTrainer;
  double peak_lr = 0;             // the lr after the warm-up
  double min_lr = 0;              // WarmupLR/WarmupDecayLR: the lr at iteration 0
  long long warmup_steps = 0;     // trainer: linear warm-up steps; DeepSpeed: warmup_num_steps
  long long total_steps = 0;      // trainer: --steps; WarmupDecayLR/WarmupCosineLR: total_num_steps
  bool log_warmup = true;         // DeepSpeed warmup_type "log" (else "linear")
  double warmup_min_ratio = 0;    // WarmupCosineLR
  double cos_min_ratio = 0.0001;  // WarmupCosineLR
};

// The schedule of a run: `scheduler.type` empty = the trainer's own (linear warm-up over `warmup`
// steps to `lr`, cosine decay to lr / 10 at step `steps`); otherwise DeepSpeed's, with any unset
// parameter filled from the trainer's values (peak `lr`, `warmup` steps, `steps` total).
TIERMEM_API LrSchedule make_lr_schedule(const SchedulerConfig& scheduler, double lr, int warmup,
                                        int steps);

// The learning rate of the schedule at 1-based step t: DeepSpeed's last_batch_iteration t - 1
// (clamped at 0) for its kinds, the trainer's own step t for kTrainer.
TIERMEM_API double lr_at(const LrSchedule& schedule, long long t);

// The learning rate 1-based optimizer step t runs at, as DeepSpeed's engine steps its schedulers:
// the scheduler's constructor sets iteration -1's lr (the warm-up's start, iteration 0's) and it is
// stepped after each optimizer step, so step t runs at iteration t - 2 (steps 1 and 2 both at the
// warm-up's start; deepspeed/runtime/lr_schedules.py, engine.py _take_model_step). The trainer's own
// schedule is lr_at. What tiermem-train and tiermem.torch (_tiermem.lr_at) both use.
TIERMEM_API double lr_at_optimizer_step(const LrSchedule& schedule, long long t);

}  // namespace tiermem
