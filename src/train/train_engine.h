// src/train/train_engine.h — where tiermem-train's parameters, gradients and optimizer state
// live, behind one small interface the training loop drives module by module.
//
// The loop (train_loop.cc) runs the model's steps (gpt/model.h): before a step it asks the engine
// for that module's parameters (acquire_params), after it gives them back (release_params);
// backward accumulates into grads(module) and then calls grads_done(module); after the
// micro-batches of one optimizer step it calls step(). Implementations:
//   ResidentEngine  every fp32 parameter, gradient and Adam moment in ordinary host memory; the
//                   reference run ("offload none" without any tier machinery).
//   (see train_engine.cc for the tiered engines wired in as the stack lands.)
// All engines use the same AdamW kernel (tiermem::adam_step) in the same order over the same
// fp32 values, so a tiered run reproduces the resident run's losses bit for bit.
//
// Thread-safety: an engine is driven by one thread.
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "gpt/model.h"
#include "tiermem/residency_policy.h"
#include "train/train_stats.h"

namespace tiermem {
class CheckpointWriter;  // tiermem/checkpoint.h
class CheckpointReader;
}  // namespace tiermem

namespace tiermem::train {

// Counters of an engine since it was made.
struct EngineStats {
  TierTraffic moved;                         // bytes [from][to]
  std::uint64_t peak_bytes[kNumTiers] = {};  // peak resident per tier
  std::uint64_t budget_bytes[kNumTiers] = {};  // 0 = unbounded
  std::uint64_t nvme_read_bytes = 0, nvme_written_bytes = 0;
  double stall_seconds = 0;      // compute waiting for parameters / state to arrive
  double comm_seconds = 0;       // collectives
  double optimizer_seconds = 0;  // optimizer step including its swaps
  double optimizer_stall_seconds = 0;  // part of stall_seconds spent inside the optimizer step
  // Host memory by part (peak_bytes[host] is their sum; 0 where an engine has no such part):
  std::uint64_t host_pool_peak_bytes = 0;    // the store's pinned pool (<= its budget)
  std::uint64_t host_bounce_bytes = 0;       // pinned NVMe<->device bounce chunks
  std::uint64_t host_engine_peak_bytes = 0;  // the engine's own buffers (working copies, buckets)
  std::uint64_t host_grad_buffer_peak_bytes = 0;  // the trainer's per-module gradient buffers
  std::uint64_t host_sim_device_bytes = 0;   // SimDevice's peak (its "device memory" is host RAM)
  std::uint64_t updates_in_backward = 0;  // modules updated during backward (tiermem.update_in_backward)
  StepIo last_step_io;  // the last optimizer step's NVMe traffic and bound (ZeroEngine only)
};

// Hyper-parameters of one optimizer step (AdamW, see tiermem/adam.h).
struct OptimStep {
  std::int64_t t = 1;        // 1-based optimizer step
  float lr = 1e-3f, eps = 1e-8f, weight_decay = 0.0f;
  double beta1 = 0.9, beta2 = 0.999;  // double, as AdamParams takes them
  float grad_scale = 1.0f;   // multiplies accumulated gradients (1 / micro-batches / ranks)
};

class TrainEngine {
 public:
  virtual ~TrainEngine() = default;

  // One line for the header: where parameters and optimizer state live.
  virtual std::string describe() const = 0;
  virtual std::string param_home() const = 0;      // "device", "cpu", "nvme"
  virtual std::string optimizer_home() const = 0;  // "device", "cpu", "nvme"
  virtual int zero_stage() const = 0;
  virtual std::string device_kind() const = 0;     // "sim", "cuda", "host"

  // Bytes of the whole model's parameters (working copy) and optimizer state (fp32 master when
  // separate, m, v), summed over ranks.
  virtual std::uint64_t param_bytes() const = 0;
  virtual std::uint64_t optimizer_bytes() const = 0;

  // True when step() computes the global gradient norm and applies the config's
  // gradient_clipping itself (ZeroEngine: gradients are sharded across ranks); it then reports
  // the norm through last_grad_norm(). Otherwise the loop clips through OptimStep::grad_scale,
  // from grads() of every module.
  virtual bool clips_gradients() const { return false; }
  // Global L2 norm of the mean gradient of the last step(), before clipping; NaN when unknown.
  virtual double last_grad_norm() const { return std::nan(""); }

  virtual void begin_step() {}
  virtual void end_step() {}
  // The micro-batch that follows is the step's last, and step() follows it at learning rate `lr`
  // (ZeroEngine::step_in_backward: its modules' updates may run during its backward).
  virtual void before_last_micro_batch(double lr) { (void)lr; }

  // The parameters of `module` for one model step; valid until release_params(module).
  virtual gpt::ParamView acquire_params(int module, Phase phase) = 0;
  virtual void release_params(int module) = 0;

  // The fp32 gradient accumulation buffer of `module` (module_layout(module).numel elements).
  virtual std::span<float> grads(int module) = 0;
  // The module's gradient contribution of this micro-batch is complete.
  virtual void grads_done(int module) {}
  virtual void zero_grad() = 0;
  // AdamW over every parameter with the accumulated gradients.
  virtual void step(const OptimStep& s) = 0;

  // Sum over ranks of `value` (the mean loss is sum / world). One rank: value.
  virtual double all_reduce_sum(double value) { return value; }
  virtual int rank() const { return 0; }
  virtual int world_size() const { return 1; }
  // Ends every rank of the job (MPI_Abort) after a failure on this one, which the other ranks
  // would otherwise wait for in their next collective; no-op with one rank. Never throws.
  virtual void abort_job(int exit_code) noexcept { (void)exit_code; }

  // Checkpoint every parameter and optimizer tensor this rank owns / restore them.
  virtual void save(CheckpointWriter& w) = 0;
  virtual void load(CheckpointReader& r) = 0;

  virtual EngineStats stats() const = 0;
};

// Every fp32 parameter, gradient and moment in host memory.
class ResidentEngine final : public TrainEngine {
 public:
  ResidentEngine(const gpt::GptConfig& cfg, std::uint64_t seed);
  std::string describe() const override;
  std::string param_home() const override { return "host"; }
  std::string optimizer_home() const override { return "host"; }
  int zero_stage() const override { return 0; }
  std::string device_kind() const override { return "host"; }
  std::uint64_t param_bytes() const override;
  std::uint64_t optimizer_bytes() const override;
  gpt::ParamView acquire_params(int module, Phase phase) override;
  void release_params(int module) override {}
  std::span<float> grads(int module) override;
  void zero_grad() override;
  void step(const OptimStep& s) override;
  void save(CheckpointWriter& w) override;
  void load(CheckpointReader& r) override;
  EngineStats stats() const override;

 private:
  gpt::GptConfig cfg_;
  std::vector<std::vector<float>> params_, grads_, m_, v_;
  double optimizer_seconds_ = 0;
};

// One AdamW update of n elements, the kernel every engine uses.
void adamw_update(const OptimStep& s, float* param, const float* grad, float* m, float* v,
                  std::size_t n);

}  // namespace tiermem::train
