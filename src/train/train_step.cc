// src/train/train_step.cc — a micro-batch through the engine, and evaluation (train_step.h).
#include "train/train_step.h"

#include <chrono>
#include <cstdint>
#include <span>
#include <string>

#include "tiermem/trace.h"

namespace tiermem::train {

// Forward (and backward) of one micro-batch through the engine. Returns the loss.
float run_micro_batch(gpt::ModelBackend& model, TrainEngine& engine, const Batch& b, bool backward,
                      Timers* timers) {
  const gpt::GptConfig& cfg = model.config();
  model.set_batch(b.inputs, b.targets);
  // An evaluation pass (no backward) runs between training steps: outside the step's access trace.
  const Phase fwd_phase = backward ? Phase::kForward : Phase::kOutsideStep;
  for (const gpt::Step& s : gpt::forward_steps(cfg)) {
    gpt::ParamView p = engine.acquire_params(s.module, fwd_phase);
    {
      TraceSpan span(backward ? "fwd " + gpt::step_name(s) : "eval " + gpt::step_name(s),
                     "compute");
      const auto t0 = std::chrono::steady_clock::now();
      if (!timers->io_only) model.forward(s, p);
      timers->compute += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    engine.release_params(s.module);
  }
  const float loss = timers->io_only ? 0.0f : model.loss();
  if (!backward) return loss;
  for (const gpt::Step& s : gpt::backward_steps(cfg)) {
    const bool needs_params = s.kind != gpt::StepKind::kEmbed;
    gpt::ParamView p;
    if (needs_params) p = engine.acquire_params(s.module, Phase::kBackward);
    // The gradient buffer before the timer starts: acquiring it may wait for I/O, which the
    // summary counts as I/O wait (a wait timed here too made its time split pass 100 %).
    const std::span<float> g = engine.grads(s.module);
    {
      TraceSpan span("bwd " + gpt::step_name(s), "compute");
      const auto t0 = std::chrono::steady_clock::now();
      if (!timers->io_only) model.backward(s, p, g);
      timers->compute += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    if (needs_params) engine.release_params(s.module);
    if (s.module != 0 || s.kind == gpt::StepKind::kEmbed) engine.grads_done(s.module);
  }
  return loss;
}

double evaluate(gpt::ModelBackend& model, TrainEngine& engine, const BatchSampler& eval_sampler,
                const TrainPlan& plan, Timers* timers) {
  Batch b;
  double sum = 0;
  const std::uint64_t global_rows = static_cast<std::uint64_t>(plan.batch) * plan.world_size;
  for (int i = 0; i < plan.eval_batches; ++i) {
    eval_sampler.fill(i * global_rows + static_cast<std::uint64_t>(plan.rank) * plan.batch,
                      plan.batch, &b);
    sum += run_micro_batch(model, engine, b, /*backward=*/false, timers);
  }
  return engine.all_reduce_sum(sum) / (plan.eval_batches * plan.world_size);
}

}  // namespace tiermem::train
