// src/train/train_loop.h — tiermem-train's training run: resolve the plan from the options,
// load the data, build the engine (where parameters and optimizer state live), train, evaluate,
// checkpoint, report.
//
// Thread-safety: run_training is called once per process from main.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "gpt/model.h"
#include "tiermem/config.h"
#include "train/train_options.h"

namespace tiermem::train {

// Everything the run does, resolved from the options, the --config file and the demo defaults.
struct TrainPlan {
  std::string model_name;
  gpt::GptConfig model;
  int steps = 0;
  int batch = 0;        // micro-batch per rank
  int grad_accum = 1;
  int seq_len = 0;
  double lr = 0;
  int warmup = 0;
  int eval_every = 0;
  int eval_batches = 4;
  std::uint64_t seed = 0;
  int rank = 0, world_size = 1;
  Config config;
};

// The learning rate of 1-based step t: linear warm-up over `warmup` steps to `lr`, then cosine
// decay to lr / 10 at step `steps`.
double learning_rate(const TrainPlan& plan, int t);

// The run's plan from the options and the effective config (effective_config): model, steps,
// batch, sequence length, and for the demo (mini, no --config) its device and host budgets. The
// vocabulary is the preset's; run_training makes it byte-level (256) for text data (not *.bin).
// tiermem-plan calls this so that it plans the run tiermem-train would make. Throws ConfigError.
TrainPlan make_train_plan(const TrainOptions& opts, const Config& cfg, int rank, int world_size);

// Runs the whole program after option parsing. Returns the process exit code (0 ok, 1 error;
// the error is printed as one line "tiermem-train: error: ..." on stderr).
int run_training(const TrainOptions& opts);

}  // namespace tiermem::train
