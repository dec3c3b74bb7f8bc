// src/zero/zero_impl.h — ZeroEngine's internal state, shared by its files:
//   zero_engine.cc      the public calls: construction, gather, reduce_gradients, the updates in
//                       backward (step_in_backward), stats (each part adds its counters)
//   zero_setup.cc       layout, plan, the device and TensorStore, every module's tensors (registration)
//   zero_step.cc        the optimizer step over sub-groups, in phases
//   zero_state.cc       checkpoints (export_state, rewrite_state), export_master, set_module_params
//   zero_device.cc      reduce_gradients_from_device (a gradient in device memory)
// Impl keeps the plan, the tiers and the store, the modules and their sub-groups, and the order of a
// step; the parts it owns hold their own state and counters, each with its own header (contract at
// its top) and test: Gatherer (gatherer.h), GradientReducer (gradient_reducer.h), NormTracker
// (norm_tracker.h), DeviceStaging (device_staging.h) with WorkingShardOut (working_shard_out.h),
// OptimizerStepper (optimizer_stepper.h; its device-resident sub-groups in zero_device_step.cc),
// UpdateScheduler (update_scheduler.h: the deferred updates of deferred_updates.h, the update
// running ahead on a HelperTask of helper_task.h, the updates in backward), StepIoMeter
// (step_io_meter.h); and the pure functions they use: partition_layout.h, norm_fold.h,
// reduce_bucket.h, tier_setup.h.
// Shared plain data (EngineShape, ZeroModule, SubGroup, the engine's buffers): zero_types.h.
// Not a public header. Thread-safety: one thread drives an engine (see zero_engine.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tiermem/adam.h"
#include "tiermem/cast.h"
#include "tiermem/communicator.h"
#include "tiermem/device.h"
#include "tiermem/device_choice.h"
#include "tiermem/dtype.h"
#include "tiermem/error.h"
#include "tiermem/io_engine.h"
#include "tiermem/loss_scaler.h"
#include "tiermem/shard.h"
#include "tiermem/swap_space.h"
#include "tiermem/tensor_store.h"
#include "tiermem/zero_engine.h"
#include "tiermem/zero_plan.h"
#include "zero/device_staging.h"
#include "zero/gatherer.h"
#include "zero/gradient_reducer.h"
#include "zero/norm_tracker.h"
#include "zero/optimizer_stepper.h"
#include "zero/partition_layout.h"
#include "zero/step_io_meter.h"
#include "zero/tier_setup.h"
#include "zero/update_scheduler.h"
#include "zero/working_shard_out.h"
#include "zero/zero_types.h"

namespace tiermem::detail {

// What make_plan was given and resolved, kept for a re-plan (fall_back_to_host_optimizer, ratio
// "auto"), and the registration's progress.
struct PlanInputs {
  ZeroPlanOptions opts;                    // what `plan` was made with
  std::vector<std::size_t> numels;         // ... and for which modules
  std::vector<std::size_t> expected_numels;  // given up front (streamed registration)
  // tiermem.device resolved once, by make_plan (auto probes CUDA there, and only there): the plan
  // assumes this kind and make_tiers makes it.
  ResolvedDevice device_choice;
  bool planned = false;    // plan + store exist
  bool finalized = false;  // every module registered; training calls allowed
};

}  // namespace tiermem::detail

namespace tiermem {

struct ZeroEngine::Impl {
  Communicator& comm;
  ZeroEngineOptions opts;
  const Config& cfg;  // ZeroEngine::config_ (declared before impl_, so it outlives this)
  detail::EngineShape shape;  // rank, world, stage, dtypes; the tiers make_tiers chose

  std::vector<detail::ZeroModule> mods;
  std::vector<detail::SubGroup> sub_groups;
  ZeroPlan plan;
  detail::PlanInputs plan_in;

  // Tiers. Destruction order (reverse of declaration): the parts (their buffers), the store, the
  // swap spaces and io, the device.
  std::shared_ptr<Device> device;
  detail::SwapTier swaps;  // io engine and swap spaces (tier_setup.h)
  std::unique_ptr<TensorStore> store;

  std::unique_ptr<DynamicLossScaler> scaler;
  ZeroStats st;  // the engine's own counters (steps, registration's all-gathers, host peak); the
                 // parts add theirs in stats()

  // The parts (each header says its contract).
  detail::NormTracker norm{comm, shape, mods, sub_groups};
  detail::DeviceStaging staging{comm, shape, device, [this](std::uint64_t u) { sample_host_peak(u); }};
  detail::Gatherer gatherer{comm, shape, mods, device};
  detail::GradientReducer reducer{comm,
                                  shape,
                                  {cfg.zero.reduce_bucket_size_elems, cfg.zero.overlap_comm,
                                   opts.max_inflight_buckets, opts.alignment_elems},
                                  mods,
                                  sub_groups,
                                  store,
                                  norm,
                                  [this](std::uint64_t u) { sample_host_peak(u); }};
  // The last step's I/O, wall time and bound (ZeroStats::last_step_*), at the config's NVMe rates.
  detail::StepIoMeter step_io;
  detail::OptimizerStepper stepper{cfg, shape, mods, sub_groups, plan, store, device, staging};
  // When each module's update runs: in step(), deferred to its gather or ahead of it, or in
  // backward. Last, so that it is destroyed first: the update on its thread uses the members above.
  detail::UpdateScheduler updates{
      shape, mods, opts.mean_over_micro_batches,
      {.run = [this](int m, const AdamParams& ap, Phase phase, std::optional<Tier> publish,
                     const std::function<bool(int)>& pending) { stepper.update_module(m, ap, phase, publish, pending); },
       .fits_now = [this](const detail::ZeroModule& m, Tier at) { return stepper.module_fits_now(m, at); },
       .gather_tier = [this](const detail::ZeroModule& m) { return staging.gather_tier(m); },
       .replay = [this](detail::ZeroModule& m) { stepper.replay(m); },
       .driving_stall_ns = [this] { return driving_stall_ns(); }}};

  // Reads tiermem.machine_profile when the config names one (ConfigError when it cannot).
  Impl(Communicator& c, ZeroEngineOptions o, const Config& config)
      : comm(c), opts(o), cfg(config), step_io(detail::step_io_meter_for(config)) {}

  // The step's window opens (step_io_meter.h) at an in-step call: a gather of `phase` other than
  // kOutsideStep, a reduce_gradients, a step. zero_engine.cc.
  void open_step_window(Phase phase = Phase::kOther);
  void close_step_window();
  // The driving thread's waits so far (ZeroStats::driving_stall_ns): the store's stalls less
  // those of the engine's helper threads, plus its waits for those threads. zero_engine.cc.
  std::uint64_t driving_stall_ns() const;
  // The common start of the reduce_gradients forms that run on the gradient thread (taking or
  // lending the buffer): waits for the hand-off in flight, then, when this one can run there too
  // (one rank, stage 2/3, a known trainable module of `numel` elements), opens the step window,
  // applies the module's pending update and counts the call. False: the caller runs the span form
  // instead (which also reports a bad call). zero_engine.cc.
  bool begin_hand_off(int module, std::size_t numel);
  // The engine's host footprint sampled into st.host_engine_peak_bytes, less `uncounted` bytes.
  void sample_host_peak(std::uint64_t uncounted = 0) {
    st.host_engine_peak_bytes = std::max(st.host_engine_peak_bytes, engine_host_bytes() - uncounted);
  }

  // zero_setup.cc
  void make_plan(std::span<const std::size_t> numels);
  void make_tiers();
  void fall_back_to_host_optimizer();  // re-plans with the optimizer state in the host pool (logged)
  void add_module(const std::string& name, std::size_t numel);
  void write_module(int i, std::span<const float> init_shard);
  void write_working(int i, std::span<const float> init_shard);  // working params only (zero_setup.cc)
  // Every module registered and written (the plan made when the sizes came one by one); first of
  // all, the update running ahead joined: every engine call but a gather's own compute waits for it.
  void finalize();
  std::uint64_t engine_host_bytes() const;

  // zero_step.cc
  StepResult step();
  // step()'s phases, in the order it runs them (reductions finished by the reducer first).
  bool norm_pre_pass(bool folded, detail::NormTracker::Sum& sum, StepResult& res);  // false: fp16 overflow, skipped
  // AdamW over the sub-groups in order; with `defer`, a stored module's update is left pending in
  // the scheduler instead; `sum`: when given, each gradient's squares are added as it is read.
  void stream_update(const AdamParams& ap, bool defer, detail::NormTracker::Sum* sum);
  void end_step(bool defer);

  // zero_state.cc
  std::vector<float> frozen_params(int module);  // a frozen module's working params as fp32
  // One third of module's fp32 state (0 master, 1 exp_avg, 2 exp_avg_sq) over every rank's shard
  // (numel elements; collective); set_state rewrites it from full values (the working params
  // republished from the master, as rewrite_state does).
  std::vector<float> gather_state(int module, std::size_t third);
  void set_state(int module, std::size_t third, std::span<const float> values);
  // The checkpoint's state, one sub-group at a time in order: host-tier pins for sub-groups homed
  // below the device, one host sub-group of device staging (DeviceStaging::state_buffer) for
  // device-homed ones.
  void export_state(const std::function<void(const ZeroStateChunk&)>& sink);
  // Rewrites the optimizer state of every sub-group (module -1) or of one module's, in order, in
  // one loop (import_optimizer_state, set_module_params): `fill(p, s)` writes sub-group p's
  // s = [master | exp_avg | exp_avg_sq] (3 x p.size() fp32, host memory, valid during the call),
  // which holds the old state first when `keep`, else undefined (acquired for overwrite). The
  // sub-group's working params are rewritten from the new master in the same pass, as step() does.
  void rewrite_state(int module, bool keep, const std::function<void(const detail::SubGroup&, float*)>& fill);

  void sync() {
    reducer.sync();
    gatherer.drop_pending();  // what follows may change the shards they read
  }
  void zero_grad();
};

}  // namespace tiermem
