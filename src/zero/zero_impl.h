// src/zero/zero_impl.h — ZeroEngine's internal state, shared by its files:
//   zero_engine.cc      the public calls: construction, gather, reduce_gradients, stats (each part
//                       adds its counters)
//   zero_setup.cc       layout, plan, the device and TensorStore, every module's tensors (registration)
//   zero_step.cc        the optimizer step over sub-groups, in phases; deferred updates applied
//   zero_state.cc       checkpoints, export_master, set_module_params (one rewrite_state loop)
//   zero_device.cc      reduce_gradients_from_device (a gradient in device memory)
//   zero_device_step.cc the device-resident optimizer (plan.optimizer_on_device)
// Impl keeps the plan, the tiers and the store, the modules and their sub-groups, and the order of a
// step; the parts it owns hold their own state and counters, each with its own header (contract at
// its top) and test: Gatherer (gatherer.h), GradientReducer (gradient_reducer.h), NormTracker
// (norm_tracker.h), DeviceStaging (device_staging.h) with WorkingShardOut (working_shard_out.h),
// DeferredUpdates (deferred_updates.h), StepIoMeter (step_io_meter.h); and the pure functions they
// use: partition_layout.h,
// norm_fold.h, reduce_bucket.h, tier_setup.h.
// Shared plain data (EngineShape, ZeroModule, SubGroup, the engine's buffers): zero_types.h.
// Not a public header. Thread-safety: one thread drives an engine (see zero_engine.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
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
#include "zero/deferred_updates.h"
#include "zero/device_staging.h"
#include "zero/gatherer.h"
#include "zero/gradient_reducer.h"
#include "zero/helper_task.h"
#include "zero/norm_tracker.h"
#include "zero/partition_layout.h"
#include "zero/step_io_meter.h"
#include "zero/tier_setup.h"
#include "zero/working_shard_out.h"
#include "zero/zero_types.h"

namespace tiermem::detail {

// tiermem::adam_step (default options) as a SimAdamKernel: the device optimizer's CPU twin runs
// exactly the host optimizer's kernel (zero_device_step.cc).
void device_adam_kernel(const AdamParams& params, float* master, const float* grad, float* m, float* v,
                        std::size_t n, void* half, DType half_dtype);

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
  ZeroStats st;  // the engine's own counters (steps, whole-module all-gathers, host peak); the
                 // parts add theirs in stats()

  // The parts (each header says its contract).
  // The overlapped optimizer step (tiermem.overlap_optimizer_step): step() leaves the stored
  // modules' updates pending in `deferred`; apply_pending(m) applies module m's, if any, exactly
  // once — called by gather() before it pins the shard, by reduce_gradients, and by whatever reads
  // or rewrites m's state; apply_all_pending: every one. replay_outside_accesses(m): see
  // ZeroModule::replay.
  detail::DeferredUpdates deferred;
  // The updates in backward (ZeroEngine::step_in_backward; backward_step.cc): armed until step()
  // (or zero_grad: disarm_backward_step), with the step's scalars `ap`. A module's gradient is
  // complete once its last hand-off has finished: `handing` is the module whose hand-off may be in
  // flight (-1: none), `ready` the modules complete and not yet updated, oldest first; `state`:
  // each module's part this step (gathered again after a gradient came: left to step());
  // `stepped`: the modules updated so far (ZeroModule::stepped_in_backward set).
  struct BackwardStep {
    bool armed = false;
    AdamParams ap;
    std::deque<int> ready;
    enum ModuleState : unsigned char { kNone, kReduced, kLeftToStep };
    std::vector<ModuleState> state;
    std::vector<int> stepped;
    int handing = -1;
    int micro = 0;      // the micro-batches the updates divided by (mean_over_micro_batches)
    int updated() const { return static_cast<int>(stepped.size()); }
    bool seen = false;  // a step has had updates in backward (the store's trace re-recorded once)
  } bwd;
  detail::NormTracker norm{comm, shape, mods, sub_groups};
  detail::DeviceStaging staging{comm, shape, device, [this](std::uint64_t u) { sample_host_peak(u); }};
  detail::Gatherer gatherer{comm, shape, mods, device};
  detail::GradientReducer reducer{comm,   shape, reducer_options(), mods, sub_groups, store, norm,
                                  [this](std::uint64_t u) { sample_host_peak(u); }};
  // The last step's I/O, wall time and bound (ZeroStats::last_step_*), at the config's NVMe rates.
  detail::StepIoMeter step_io;

  // Reads tiermem.machine_profile when the config names one (ConfigError when it cannot).
  Impl(Communicator& c, ZeroEngineOptions o, const Config& config)
      : comm(c), opts(o), cfg(config), step_io(make_step_io_meter(config)) {}

  static detail::StepIoMeter make_step_io_meter(const Config& config) {
    const NvmeRates r = resolve_nvme_rates(config);
    return detail::StepIoMeter(r.read_gbps, r.write_gbps);
  }
  // The step's window opens (step_io_meter.h) at an in-step call: a gather of `phase` other than
  // kOutsideStep, a reduce_gradients, a step. zero_engine.cc.
  void open_step_window(Phase phase = Phase::kOther);
  void close_step_window();
  detail::StepIoMeter::Counters step_counters() const;  // zero_engine.cc
  // The driving thread's waits so far (ZeroStats::driving_stall_ns): the store's stalls less
  // those of the engine's helper threads, plus its waits for those threads. zero_engine.cc.
  std::uint64_t driving_stall_ns() const;

  detail::GradientReducer::Options reducer_options() const {
    return {cfg.zero.reduce_bucket_size_elems, cfg.zero.overlap_comm, opts.max_inflight_buckets,
            opts.alignment_elems};
  }
  // The common start of the reduce_gradients forms that run on the gradient thread (taking or
  // lending the buffer): waits for the hand-off in flight, then, when this one can run there too
  // (one rank, stage 2/3, a known trainable module of `numel` elements), opens the step window,
  // applies the module's pending update and counts the call. False: the caller runs the span form
  // instead (which also reports a bad call). zero_engine.cc.
  bool begin_hand_off(int module, std::size_t numel);
  // Before module's working shard is read for a gather: its deferred update of the last step, or
  // the replay of its accesses outside the step (zero_engine.cc).
  void before_gather(int module, Phase phase);
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
  void finalize();
  std::uint64_t engine_host_bytes() const;

  // zero_step.cc
  StepResult step();
  // step()'s phases, in the order it runs them (reductions finished by the reducer first).
  bool norm_pre_pass(bool folded, detail::NormTracker::Sum& sum, StepResult& res);  // false: fp16 overflow, skipped
  AdamParams step_params(double grad_scale) const;
  void stream_update(const AdamParams& ap, bool defer, detail::NormTracker::Sum* norm);
  void end_step(bool defer);
  void prefetch_after(std::size_t k, bool with_state);
  // `publish`: where the module's new working shard goes (default shape.publish_tier).
  void apply_pending(int module, Phase phase, std::optional<Tier> publish = std::nullopt);
  // Module `module`'s update with the step's scalars `ap` (apply_pending's, and the update running
  // ahead's); `pending(q)`: whether module q's update is still to come (its read-ahead).
  void run_update(int module, const AdamParams& ap, Phase phase, std::optional<Tier> publish,
                  const std::function<bool(int)>& pending);
  // After the forward gather of `after`: the update of the next module still pending starts on
  // `ahead`'s thread when it can run there (helper_task.h); join: waits for it (finalize()).
  void start_update_ahead(int after);
  // Updates in backward (step_in_backward): a reduce_gradients of `module` begins (after the
  // previous hand-off was waited for); `complete`: its gradient is added already (no hand-off).
  void note_gradient(int module, bool complete);
  // At the backward gather of `gathered`: the oldest module whose gradient is complete starts its
  // update on `ahead`'s thread when it can run there (the rule of start_update_ahead).
  void start_update_in_backward(int gathered);
  // Throws Error naming `call` while a step is half done: modules updated in backward, step() not
  // yet called (their state and params are this step's, the others' the last step's).
  void refuse_half_step(const char* call) const;
  // The step's end (or zero_grad before any update): nothing armed, the updated modules' marks
  // cleared, hand-offs let go of their pins again when done.
  void disarm_backward_step();
  // Whether module m's update can run beside the driving thread now: a stored module of
  // host-stepped sub-groups with host gradients, whose working shard (written at `publish`) and first
  // `buffer_count` sub-groups fit beside every pin held now.
  bool update_fits_now(const detail::ZeroModule& m, Tier publish) const;
  void join_update_ahead();
  void apply_all_pending(Phase phase);
  void replay_outside_accesses(int module);
  // Sub-group p's gradient for the update (stages 0-1: engine buffers; 2-3: its partition, pinned
  // into `pin`; zero when none arrived since the last step).
  const float* sub_group_grad(detail::SubGroup& p, TensorStore::Pin& pin, Phase phase);
  ZeroOptimizerState state_header() const;  // partition fields, steps, scaler; no vectors
  std::vector<float> frozen_params(int module);
  // One third of module's fp32 state (0 master, 1 exp_avg, 2 exp_avg_sq) over every rank's shard
  // (numel elements; collective); set_state rewrites it from full values (the working params
  // republished from the master, as rewrite_state does). zero_state.cc.
  std::vector<float> gather_state(int module, std::size_t third);
  void set_state(int module, std::size_t third, std::span<const float> values);  // a frozen module's working params as fp32 (zero_state.cc)
  const detail::ZeroModule& trained_module(int module, const char* call) const;  // or Error

  // Where step() and import write each sub-group's new working params (working_shard_out.h).
  detail::WorkingShardOut working_out(Phase phase = Phase::kOptimizer,
                                      std::optional<Tier> publish = std::nullopt) {
    return {mods, store, shape, staging, plan.sub_group_elems, phase, publish};
  }
  // AdamW on sub-group k with `ap`, its new working params into `working`; its gradient partition is
  // discarded after (stages 2-3). `on_grad(k, g)` sees the gradient first when given.
  void update_sub_group(std::size_t k, const AdamParams& ap, detail::WorkingShardOut& working, Phase phase,
                    const std::function<void(std::size_t, const float*)>& on_grad);
  // zero_device_step.cc: the device-resident optimizer (SubGroup::on_device). AdamW on sub-group k in
  // device memory (Device::adam_step_async), as update_sub_group.
  void update_sub_group_on_device(std::size_t k, const AdamParams& ap, detail::WorkingShardOut& working, Phase phase,
                              const std::function<void(std::size_t, const float*)>& on_grad);
  // The checkpoint's state, one sub-group at a time in order (zero_step.cc): host-tier pins for
  // sub-groups homed below the device, one host sub-group of staging (DeviceStaging::state_buffer) for
  // device-homed ones.
  void export_state(const std::function<void(const ZeroStateChunk&)>& sink);
  // Rewrites the optimizer state of every sub-group (module -1) or of one module's, in order, in
  // one loop (import_optimizer_state, set_module_params): `fill(p, s)` writes sub-group p's
  // s = [master | exp_avg | exp_avg_sq] (3 x p.size() fp32, host memory, valid during the call),
  // which holds the old state first when `keep`, else undefined (acquired for overwrite). The
  // sub-group's working params are rewritten from the new master in the same pass, as step() does.
  void rewrite_state(int module, bool keep, const std::function<void(const detail::SubGroup&, float*)>& fill);
  // All-gathers the new working params of the modules kept whole (every module, or `module`).
  void publish_whole_modules(int module);
  void validate_import(const ZeroOptimizerState& state, bool vectors) const;

  // Helpers.
  void to_working(const float* src, std::byte* dst, std::size_t n) const {
    if (shape.wsize == 4) {
      std::memcpy(dst, src, n * sizeof(float));
      return;
    }
    // The bulk casts of tiermem/cast.h: the same bits as f32_to_bf16 / f32_to_f16 per element,
    // with the best vector kernel the CPU has (F16C / AVX-512).
    auto* d = reinterpret_cast<std::uint16_t*>(dst);
    if (shape.wdtype == DType::kBF16) f32_to_bf16_n(src, d, n);
    else f32_to_f16_n(src, d, n);
  }
  void sync() {
    reducer.sync();
    gatherer.drop_pending();  // what follows may change the shards they read
  }
  void zero_grad();

  // Last, so that it is destroyed first: its work uses the members above.
  detail::HelperTask ahead{"a deferred update running ahead"};
};

}  // namespace tiermem
