// src/zero/optimizer_stepper.h — the engine's optimizer on its sub-groups: AdamW (or Lion,
// Adagrad) on one sub-group at a time through the TensorStore, on the host (the CPU kernels of
// tiermem/adam.h, tiermem/optim_kernels.h) or, for a sub-group homed on the device, on the device
// (Device::adam_step_async); one module's update over its sub-groups with their state read ahead;
// and whether such an update has room to run beside the pins held now. When an update runs (in
// step(), deferred to the module's next gather, ahead of it, or in backward) is the update
// scheduler's (update_scheduler.h); what is updated and how is this part's.
//
// An update of sub-group k: its optimizer state pinned at the host tier (the device tier when
// homed there), its gradient read (stages 0-1: the engine's buffers; 2-3: its partition, pinned,
// or zeros when none arrived since the last step), the kernel run, the state marked dirty (the
// store writes it back to its home), the new working params written through the caller's
// WorkingShardOut (working_shard_out.h), and at stages 2-3 the gradient partition discarded
// (consumed; the next accumulation overwrites it, so it is never written down). At
// Phase::kOutsideStep every pin is added to the module's replay list (ZeroModule::replay).
//
// Units: k indexes the engine's sub-groups, modules the engine's modules; elements and bytes as
// named. Ownership: reads and writes the engine's modules, sub-groups, plan, store, device and
// device staging through references that must outlive it; holds no buffer of its own (the pins
// it takes are released before each call returns). Thread-safety: none of its own; one update at
// a time, on the driving thread or on the update scheduler's helper thread while the driving
// thread leaves the module's tensors alone (update_scheduler.h). Errors: the store's (I/O,
// budgets), the device's, NotSupportedError from a kernel.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "tiermem/adam.h"
#include "tiermem/config.h"
#include "tiermem/device.h"
#include "tiermem/tensor_store.h"
#include "tiermem/zero_plan.h"
#include "zero/device_staging.h"
#include "zero/working_shard_out.h"
#include "zero/zero_types.h"

namespace tiermem::detail {

// tiermem::adam_step (default options) as a SimAdamKernel: the device optimizer's CPU twin runs
// exactly the host optimizer's kernel (set by the engine's tier set-up, zero_setup.cc).
void device_adam_kernel(const AdamParams& params, float* master, const float* grad, float* m, float* v,
                        std::size_t n, void* half, DType half_dtype);

class OptimizerStepper {
 public:
  // Sees sub-group k's gradient (g, its size() elements) before the update reads it (the norm
  // summed as the update goes, step()).
  using OnGrad = std::function<void(std::size_t k, const float* g)>;

  // `cfg`: the optimizer's settings as they are when each update runs (the engine's config, whose
  // learning rate set_learning_rate changes); `plan`: sub_group_elems (the scratch and staging
  // sizes). `device` may be null until the engine's tiers are made.
  OptimizerStepper(const Config& cfg, const EngineShape& shape, std::vector<ZeroModule>& mods,
                   std::vector<SubGroup>& sub_groups, const ZeroPlan& plan, const std::unique_ptr<TensorStore>& store,
                   const std::shared_ptr<Device>& device, DeviceStaging& staging)
      : cfg_(cfg), shape_(shape), mods_(mods), sub_groups_(sub_groups), plan_(plan), store_(store), device_(device),
        staging_(staging) {}

  // offload_optimizer.buffer_count, at least 1: the sub-groups on their way at once.
  std::size_t buffer_count() const;
  // The step's scalars from the config: step number `step` (>= 1), the gradient's scale.
  AdamParams params(double grad_scale, std::int64_t step) const;

  // Where the new working params of the sub-groups updated next go (working_shard_out.h).
  WorkingShardOut working_out(Phase phase = Phase::kOptimizer, std::optional<Tier> publish = std::nullopt);
  // n fp32 values as working params (bf16/fp16 rounded as f32_to_bf16 / f32_to_f16, or copied).
  void to_working(const float* src, std::byte* dst, std::size_t n) const;

  // Sub-group p's gradient for the update (stages 0-1: engine buffers; 2-3: its partition, pinned
  // into `pin`; zero when none arrived since the last step). Valid while `pin` is held.
  const float* grad(SubGroup& p, TensorStore::Pin& pin, Phase phase);
  // Sub-groups k+1 .. k+buffer_count-1 on their way to the host tier (their gradient partitions;
  // with `with_state`, their optimizer state too), skipping those stepped on the device.
  void prefetch_after(std::size_t k, bool with_state);
  // The update of sub-group k with `ap`, its new working params into `working` (see the top).
  void update(std::size_t k, const AdamParams& ap, WorkingShardOut& working, Phase phase,
              const OnGrad& on_grad = {});

  // Module `module`'s whole update with `ap`, its working shard written at `publish` (default
  // shape.publish_tier): its sub-groups in order, each with the next buffer_count - 1 sub-groups
  // of this module and of the modules still to be updated after it (`pending(q)`) read ahead.
  void update_module(int module, const AdamParams& ap, Phase phase, std::optional<Tier> publish,
                     const std::function<bool(int)>& pending);
  // Whether module m's update can run beside the driving thread now: a stored module of
  // host-stepped sub-groups with host gradients, whose working shard (written at `publish`) and
  // first buffer_count sub-groups fit beside every pin held now (TensorStoreStats).
  bool module_fits_now(const ZeroModule& m, Tier publish) const;
  // Module m's accesses made outside a step (ZeroModule::replay) shown to the store's policy now,
  // in the step (TensorStore::touch), and forgotten.
  void replay(ZeroModule& m);

 private:
  // update() of a sub-group homed on the device (SubGroup::on_device): zero_device_step.cc.
  void update_on_device(std::size_t k, const AdamParams& ap, WorkingShardOut& working, Phase phase,
                        const OnGrad& on_grad);

  const Config& cfg_;
  const EngineShape& shape_;
  std::vector<ZeroModule>& mods_;
  std::vector<SubGroup>& sub_groups_;
  const ZeroPlan& plan_;
  const std::unique_ptr<TensorStore>& store_;
  const std::shared_ptr<Device>& device_;
  DeviceStaging& staging_;
};

}  // namespace tiermem::detail
