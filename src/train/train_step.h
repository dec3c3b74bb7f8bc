// src/train/train_step.h — one micro-batch of tiermem-train through its engine: the model's
// forward (and backward) module by module, each module's parameters acquired from the engine
// around its compute and its gradient handed back; and the held-out evaluation.
//
// Thread-safety: called from the training thread only (as the engine).
#pragma once

#include "gpt/backend.h"
#include "train/data.h"
#include "train/train_engine.h"
#include "train/train_loop.h"

namespace tiermem::train {

// Seconds spent in the model's compute, cumulative (the summary's time split).
struct Timers {
  double compute = 0;
  // --io-only (tiermem-bench train-offload): every engine call of a step — gathers, gradient
  // reductions (of zero gradients), the optimizer — without the model's compute.
  bool io_only = false;
};

// Forward (and, with `backward`, backward) of one micro-batch through the engine. Returns the loss.
float run_micro_batch(gpt::ModelBackend& model, TrainEngine& engine, const Batch& b, bool backward,
                      Timers* timers);

// The mean loss over plan.eval_batches held-out micro-batches of every rank (no backward; the
// accesses are outside the step's trace).
double evaluate(gpt::ModelBackend& model, TrainEngine& engine, const BatchSampler& eval_sampler,
                const TrainPlan& plan, Timers* timers);

}  // namespace tiermem::train
