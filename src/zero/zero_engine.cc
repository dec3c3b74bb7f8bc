// src/zero/zero_engine.cc — ZeroEngine's public calls (see include/tiermem/zero_engine.h):
// construction and validation, registration, stage-3 gathers into device memory (where a deferred
// update is applied first: UpdateScheduler::before_gather), the gradient reduce path (bucketed
// reduce-scatter, accumulation into the tiered gradient partitions), statistics. The set-up of
// tiers and tensors is in zero_setup.cc, the optimizer step (and step_in_backward) in
// zero_step.cc, the state in and out (checkpoints) in zero_state.cc.
#include "tiermem/zero_engine.h"

#include <malloc.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <fmt/format.h>

#include "tiermem/log.h"
#include "tiermem/trace.h"
#include "zero/zero_impl.h"

namespace tiermem {

// --------------------------------------------------------------------------------- Gathered

ZeroEngine::Gathered::Gathered(Gathered&& o) noexcept { *this = std::move(o); }

ZeroEngine::Gathered& ZeroEngine::Gathered::operator=(Gathered&& o) noexcept {
  if (this != &o) {
    release();
    engine_ = o.engine_;
    module_ = o.module_;
    data_ = o.data_;
    numel_ = o.numel_;
    dtype_ = o.dtype_;
    owned_ = o.owned_;
    owned_on_device_ = o.owned_on_device_;
    pin_ = std::move(o.pin_);
    o.engine_ = nullptr;
    o.data_ = nullptr;
    o.owned_ = false;
  }
  return *this;
}

ZeroEngine::Gathered::~Gathered() { release(); }

void ZeroEngine::Gathered::release() {
  if (engine_) engine_->release_gathered(*this);
  pin_.release();
  engine_ = nullptr;
  data_ = nullptr;
  owned_ = false;
}

std::span<const float> ZeroEngine::Gathered::f32() const {
  if (dtype_ != DType::kF32) {
    throw Error("ZeroEngine::Gathered::f32(): module " + std::to_string(module_) + " is " +
                std::string(dtype_name(dtype_)) + ", use half()");
  }
  return {static_cast<const float*>(data_), numel_};
}

std::span<const std::uint16_t> ZeroEngine::Gathered::half() const {
  if (dtype_ == DType::kF32) {
    throw Error("ZeroEngine::Gathered::half(): module " + std::to_string(module_) + " is f32, use f32()");
  }
  return {static_cast<const std::uint16_t*>(data_), numel_};
}

void ZeroEngine::release_gathered(Gathered& g) noexcept {
  if (!g.owned_) return;
  impl_->gatherer.free(g.module_, {const_cast<void*>(g.data_), g.owned_on_device_});
}

// --------------------------------------------------------------------------------- set-up

ZeroEngine::ZeroEngine(const Config& config, Communicator& comm, ZeroEngineOptions options)
    : config_(config), impl_(std::make_unique<Impl>(comm, options, config_)) {
  Impl& I = *impl_;
  const ZeroConfig& z = config_.zero;
  if (options.alignment_elems == 0) throw Error("ZeroEngineOptions::alignment_elems must be >= 1");
  check_zero_config(config_, options.alignment_elems);
  const std::string opt = optimizer_type(config_);
  I.shape.optimizer = opt == "lion"      ? detail::OptimizerKind::kLion
                      : opt == "adagrad" ? detail::OptimizerKind::kAdagrad
                                         : detail::OptimizerKind::kAdamW;
  working_dtype_ = config_.bf16 ? DType::kBF16 : config_.fp16.enabled ? DType::kF16 : DType::kF32;
  I.shape.wdtype = working_dtype_;
  I.shape.wsize = dtype_size(working_dtype_);
  I.shape.comm_dtype = working_dtype_ == DType::kF32 ? DType::kF32 : DType::kU16;
  I.shape.frozen_at_rest = frozen_dtype_of(config_.tiermem.frozen_dtype, working_dtype_);
  I.shape.stage = z.stage;
  I.shape.rank = comm.rank();
  I.shape.world = comm.world_size();
  I.shape.opt_world = z.stage == 0 ? 1 : I.shape.world;
  I.shape.opt_rank = z.stage == 0 ? 0 : I.shape.rank;
  if (config_.fp16.enabled) I.scaler = std::make_unique<DynamicLossScaler>(config_.fp16);
  I.shape.loss_scaled = I.scaler != nullptr;
  // DeepSpeed keys whose meaning the store's budgets and the sub-group plan replace.
  if (z.offload_param.device != OffloadDevice::kNone && z.offload_param.buffer_count_given && I.shape.rank == 0) {
    TM_LOG_INFO("ZERO",
                "offload_param.buffer_count is not used: parameters are paged through the host tier under "
                "tiermem.host_budget_bytes (DeepSpeed's fixed parameter buffers are replaced by it)");
  }
}

ZeroEngine::ZeroEngine(const Config& config, Communicator& comm, std::span<const std::size_t> module_numels,
                       ZeroEngineOptions options)
    : ZeroEngine(config, comm, options) {
  Impl& I = *impl_;
  I.plan_in.expected_numels.assign(module_numels.begin(), module_numels.end());
  I.make_plan(module_numels);
}

ZeroEngine::~ZeroEngine() {
  try {
    impl_->updates.join();
  } catch (const std::exception& e) {
    TM_LOG_ERROR("ZERO", "a deferred update running ahead failed at ZeroEngine destruction: {}", e.what());
  }
  try {
    impl_->sync();
  } catch (const std::exception& e) {
    TM_LOG_ERROR("ZERO", "a collective pending at ZeroEngine destruction failed: {}", e.what());
  }
  try {
    impl_->gatherer.drop_pending();  // sync() stopped at a failure above: free what is left
  } catch (const std::exception&) {
  }
  impl_->store.reset();  // frees its swap extents, before the swap spaces and the device go
}

const ZeroPlan& ZeroEngine::plan() const { return impl_->plan; }

int ZeroEngine::register_module(const std::string& name, std::span<const float> init) {
  Impl& I = *impl_;
  if (I.plan_in.finalized) {
    throw Error("ZeroEngine::register_module(\"" + name +
                "\"): modules must be registered before the first gather/reduce_gradients/step");
  }
  const std::size_t i = I.mods.size();
  if (!I.plan_in.expected_numels.empty() && (i >= I.plan_in.expected_numels.size() || I.plan_in.expected_numels[i] != init.size())) {
    throw Error(fmt::format("ZeroEngine::register_module(\"{}\"): module {} has {} elements but the engine was "
                            "constructed for {}",
                            name, i, init.size(),
                            i < I.plan_in.expected_numels.size() ? std::to_string(I.plan_in.expected_numels[i]) : "fewer modules"));
  }
  I.add_module(name, init.size());
  detail::ZeroModule& m = I.mods.back();
  // This rank's part of the initial values (the shard's padding is zero).
  const ElemRange r = m.shard.range(I.shape.opt_rank);
  const std::size_t lo = std::min(r.begin, init.size()), hi = std::min(r.end, init.size());
  const std::span<const float> mine = init.subspan(lo, hi - lo);
  if (I.plan_in.planned) {
    I.write_module(static_cast<int>(i), mine);
  } else {
    m.init_shard.assign(mine.begin(), mine.end());  // written at finalize, once every size is known
  }
  return static_cast<int>(i);
}

int ZeroEngine::num_modules() const { return static_cast<int>(impl_->mods.size()); }

bool ZeroEngine::is_frozen(int module) const {
  if (module < 0 || module >= num_modules()) throw Error("ZeroEngine: unknown module " + std::to_string(module));
  return impl_->mods[static_cast<std::size_t>(module)].frozen;
}

std::size_t ZeroEngine::module_numel(int module) const {
  if (module < 0 || module >= num_modules()) throw Error("ZeroEngine: unknown module " + std::to_string(module));
  return impl_->mods[static_cast<std::size_t>(module)].numel;
}

// --------------------------------------------------------------------------------- step window

// The driving thread's waits: its own stalls (the store's, less those of the engine's helper
// threads, which overlap its work) and its waits for those threads (the update running ahead,
// the gradient hand-off).
std::uint64_t ZeroEngine::Impl::driving_stall_ns() const {
  const std::uint64_t helper_waits = updates.waited_ns() + reducer.waited_ns();
  if (!store) return helper_waits;
  const std::uint64_t helper = store->helper_stall_ns();  // first: the total read after it is no less
  return store->stall_ns() - helper + helper_waits;
}

namespace {

// Whether any module trains (is not in ZeroEngineOptions::frozen_modules).
bool any_trainable(const std::vector<detail::ZeroModule>& mods) {
  return std::any_of(mods.begin(), mods.end(), [](const detail::ZeroModule& m) { return !m.frozen; });
}

// The step window's counters: the store's NVMe bytes (none without a store) and the driving
// thread's waits.
detail::StepIoMeter::Counters step_counters(const TensorStore* store, std::uint64_t waits) {
  if (!store) return {0, 0, waits};
  const TensorStoreStats t = store->stats();
  const int d = static_cast<int>(Tier::kDevice), h = static_cast<int>(Tier::kHost), n = static_cast<int>(Tier::kNvme);
  return {t.bytes_moved[n][h] + t.bytes_moved[n][d], t.bytes_moved[h][n] + t.bytes_moved[d][n], waits};
}

}  // namespace

void ZeroEngine::Impl::open_step_window(Phase phase) {
  if (phase == Phase::kOutsideStep || step_io.is_open()) return;
  step_io.open(Trace::now_ns(), step_counters(store.get(), driving_stall_ns()));
}

void ZeroEngine::Impl::close_step_window() {
  step_io.close(Trace::now_ns(), step_counters(store.get(), driving_stall_ns()));
}

// --------------------------------------------------------------------------------- gather

bool ZeroEngine::prefetch_gather(int module, Phase phase) {
  Impl& I = *impl_;
  I.finalize();
  if (module < 0 || module >= num_modules()) {
    throw Error("ZeroEngine::prefetch_gather: unknown module " + std::to_string(module));
  }
  detail::ZeroModule& m = I.mods[static_cast<std::size_t>(module)];
  if (I.shape.world == 1 || !m.stored || I.shape.opaque) return false;  // nothing to overlap (one rank: the Prefetcher's)
  I.open_step_window(phase);
  if (I.gatherer.pending(module)) return true;
  I.gatherer.trim(2);  // at most two ahead: a prediction that did not come true holds no more
  I.updates.before_gather(module, phase);
  I.gatherer.prefetch(module, I.store->acquire(m.param, I.staging.gather_tier(m), phase));
  return true;
}

ZeroEngine::Gathered ZeroEngine::gather(int module, Phase phase) {
  Impl& I = *impl_;
  I.finalize();
  if (module < 0 || module >= num_modules()) throw Error("ZeroEngine::gather: unknown module " + std::to_string(module));
  if (phase != Phase::kBackward) I.updates.refuse_half_step("gather");  // a forward or an evaluation would mix steps
  I.open_step_window(phase);
  detail::ZeroModule& m = I.mods[static_cast<std::size_t>(module)];
  Gathered g;
  g.module_ = module;
  g.numel_ = m.numel;
  g.dtype_ = working_dtype_;
  auto own = [&](const detail::Gatherer::Buffer& b) {
    g.data_ = b.data;
    g.owned_on_device_ = b.on_device;
    g.owned_ = true;
    g.engine_ = this;
  };
  if (std::optional<detail::Gatherer::Buffer> b = I.gatherer.take(module)) {
    own(*b);  // started by prefetch_gather (its deferred update applied then): waited for
    return g;
  }
  I.updates.before_gather(module, phase);
  if (!m.stored) {
    g.data_ = I.shape.stage == 0 ? m.mem_shard.p : m.full.p;
    return g;
  }
  // The working shard, resident at the compute tier (loaded from its home unless the Prefetcher
  // brought it already); acquiring it feeds the Prefetcher, whose hints start loading the next
  // modules while this one computes.
  TensorStore::Pin pin = I.store->acquire(m.param, I.staging.gather_tier(m), phase);
  if (I.shape.world == 1 && !m.quantized()) {  // one rank: the shard is the whole module
    g.data_ = pin.data();
    g.pin_ = std::move(pin);
    g.engine_ = this;
  } else if (I.shape.opaque) {  // device memory the CPU cannot address: device_staging.h
    void* buf = I.staging.all_gather_to_device(m, pin);
    I.gatherer.adopt(module);
    own({buf, I.shape.compute_tier == Tier::kDevice});
  } else {  // (one rank and a quantized frozen module: dequantized into a gather buffer)
    own(I.gatherer.gather(module, std::move(pin)));
  }
  if (I.shape.world == 1) {
    // The next module's deferred update runs while this one computes (joined at the next call).
    if (phase == Phase::kForward) I.updates.start_ahead(module);
    if (phase == Phase::kBackward) I.updates.start_in_backward(module);  // the updates in backward
  }
  return g;
}

// --------------------------------------------------------------------------------- gradients

void ZeroEngine::reduce_gradients(int module, std::span<const float> grad) {
  Impl& I = *impl_;
  I.finalize();
  if (module < 0 || module >= num_modules()) {
    throw Error("ZeroEngine::reduce_gradients: unknown module " + std::to_string(module));
  }
  detail::ZeroModule& m = I.mods[static_cast<std::size_t>(module)];
  if (m.frozen) {
    throw Error("ZeroEngine::reduce_gradients: module " + std::to_string(module) + " (" + m.name +
                ") is frozen (ZeroEngineOptions::frozen_modules): it has no gradient to reduce");
  }
  if (grad.size() != m.numel) {
    throw Error("ZeroEngine::reduce_gradients: module " + std::to_string(module) + " (" + m.name + ") gradient has " +
                std::to_string(grad.size()) + " elements, expected " + std::to_string(m.numel));
  }
  I.open_step_window();
  I.reducer.wait_hand_off();  // a hand-off in flight may add into the same partitions
  I.updates.apply(module, Phase::kOptimizer);  // its last step's update first (not gathered since)
  // Updates in backward: complete once this call returns (one rank: no bucket left in flight);
  // noted first, so a module already updated is refused before anything is added.
  if (I.shape.world == 1) I.updates.note_gradient(module, true);
  ++m.grad_calls;
  I.reducer.reduce(module, grad);  // by stage and world: gradient_reducer.h
}

bool ZeroEngine::Impl::begin_hand_off(int module, std::size_t numel) {
  finalize();
  reducer.wait_hand_off();  // one hand-off in flight; its error surfaces here
  if (shape.world != 1 || shape.stage < 2 || module < 0 || module >= static_cast<int>(mods.size()) ||
      numel != mods[static_cast<std::size_t>(module)].numel || mods[static_cast<std::size_t>(module)].frozen) {
    return false;
  }
  open_step_window();
  updates.apply(module, Phase::kOptimizer);  // its last step's update first (not gathered since)
  updates.note_gradient(module, false);       // updates in backward: complete once the hand-off is
  ++mods[static_cast<std::size_t>(module)].grad_calls;
  return true;
}

void ZeroEngine::reduce_gradients(int module, std::vector<float>&& grad) {
  if (!impl_->begin_hand_off(module, grad.size())) {
    reduce_gradients(module, std::span<const float>(grad));  // synchronous (or bucketed), or its error
    return;
  }
  impl_->reducer.hand_off(module, std::move(grad));
}

void ZeroEngine::reduce_gradients(int module, std::span<const float> grad, std::shared_ptr<const void> keep) {
  if (!impl_->begin_hand_off(module, grad.size())) {
    reduce_gradients(module, grad);  // synchronous (or bucketed), or its error; keep goes on return
    return;
  }
  impl_->reducer.lend(module, grad, std::move(keep));
}

std::vector<float> ZeroEngine::gradient_buffer(int module) {
  Impl& I = *impl_;
  I.finalize();
  if (module < 0 || module >= num_modules()) {
    throw Error("ZeroEngine::gradient_buffer: unknown module " + std::to_string(module));
  }
  if (I.mods[static_cast<std::size_t>(module)].frozen) {
    throw Error("ZeroEngine::gradient_buffer: module " + std::to_string(module) + " (" +
                I.mods[static_cast<std::size_t>(module)].name + ") is frozen: it has no gradient");
  }
  return I.reducer.buffer(I.mods[static_cast<std::size_t>(module)].numel);
}

void ZeroEngine::synchronize() { impl_->sync(); }

std::uint64_t ZeroEngine::offload_states() {
  Impl& I = *impl_;
  I.finalize();
  I.updates.refuse_half_step("offload_states");
  I.sync();
  I.updates.apply_all(Phase::kOutsideStep);
  I.reducer.drop_spare();
  const std::uint64_t dropped = I.store->offload();
  ::malloc_trim(0);  // what the engine's own buffers and the steps freed to the heap
  return dropped;
}

void ZeroEngine::Impl::zero_grad() {
  sync();
  reducer.drop_spare();  // not held through the forward pass
  norm.clear();
  for (auto& m : mods) {
    std::fill(m.full_grad.begin(), m.full_grad.end(), 0.0f);
    std::fill(m.shard_grad.begin(), m.shard_grad.end(), 0.0f);
    m.grad_calls = 0;
  }
  for (auto& p : sub_groups) {
    if (updates.pending(p.module)) continue;  // its update still reads it
    if (!p.grad_fresh && p.grad != kInvalidTensor) store->discard(p.grad);  // never written down
    p.grad_fresh = true;  // the next accumulation overwrites
    p.acc_elems = 0;
  }
}

void ZeroEngine::zero_grad() {
  impl_->finalize();  // an update in backward in flight is waited for
  if (impl_->updates.updated_in_backward() > 0) {
    throw Error(fmt::format("ZeroEngine::zero_grad: {} modules were already updated in this backward pass "
                            "(step_in_backward), their gradients consumed; call step() to finish the step, or set "
                            "tiermem.update_in_backward to false to drop gradients between backward and step",
                            impl_->updates.updated_in_backward()));
  }
  impl_->updates.disarm_backward();
  impl_->reducer.hold_pins(false);  // hand-offs let go of their pins again when done
  impl_->sync();
  impl_->updates.apply_all(Phase::kOutsideStep);  // the last step's updates still read theirs
  impl_->zero_grad();
}

void ZeroEngine::set_learning_rate(double lr) {
  if (!std::isfinite(lr) || lr < 0) {
    throw ConfigError("optimizer.params.lr", fmt::format("{}", lr),
                      fmt::format("learning rate {} must be finite and >= 0", lr));
  }
  config_.optimizer.lr = lr;  // Impl::cfg refers to config_
}

double ZeroEngine::loss_scale() const { return impl_->scaler ? impl_->scaler->scale() : 1.0; }

ZeroEngine::StepResult ZeroEngine::step() {
  const auto& mods = impl_->mods;
  if (!mods.empty() && !any_trainable(mods)) {
    throw Error("ZeroEngine::step: every module is frozen (ZeroEngineOptions::frozen_modules): this engine runs "
                "forward only and has nothing to step");
  }
  impl_->finalize();
  impl_->open_step_window();  // a step with nothing before it since the last
  const StepResult res = impl_->step();
  impl_->close_step_window();
  return res;
}

void ZeroEngine::end_forward_pass() {
  Impl& I = *impl_;
  if (any_trainable(I.mods)) {
    throw Error("ZeroEngine::end_forward_pass: a module is trainable (not in ZeroEngineOptions::frozen_modules): "
                "this engine's steps end at step(); end_forward_pass is for forward-only engines");
  }
  I.finalize();
  if (I.step_io.is_open()) I.close_step_window();
  if (I.store) {
    I.store->end_step();
    I.store->begin_step();
  }
}

std::size_t ZeroEngine::shard_numel() {
  impl_->finalize();
  return impl_->plan.rank_flat_elems;
}

// --------------------------------------------------------------------------------- stats

std::uint64_t ZeroEngine::nvme_bytes_written() const {
  const Impl& I = *impl_;
  if (!I.store) return 0;
  const TensorStoreStats t = I.store->stats();
  const int d = static_cast<int>(Tier::kDevice), h = static_cast<int>(Tier::kHost), n = static_cast<int>(Tier::kNvme);
  return t.bytes_moved[h][n] + t.bytes_moved[d][n];
}

std::string ZeroEngine::device_name() const {
  const Impl& I = *impl_;
  if (!I.device) return "host";
  return I.device->kind() == DeviceKind::kSim ? "sim" : "cuda";
}

ZeroStats ZeroEngine::stats() const {
  const Impl& I = *impl_;
  ZeroStats s = I.st;
  I.gatherer.add_stats(s);
  I.reducer.add_stats(s);
  I.updates.add_stats(s);
  const ZeroPlan& p = I.plan;
  s.optimizer_state_bytes = p.optimizer_bytes;
  s.gradient_bytes = p.gradient_bytes;
  s.param_home = p.param_home;
  s.optimizer_home = p.optimizer_home;
  s.gradient_home = p.gradient_home;
  s.sub_group_elems = p.sub_group_elems;
  s.sub_groups = I.sub_groups.size();
  s.frozen_at_rest = I.shape.frozen_at_rest;
  s.host_engine_bytes = I.engine_host_bytes();
  s.host_engine_peak_bytes = std::max(s.host_engine_peak_bytes, s.host_engine_bytes);
  for (const auto& m : I.mods) {
    s.working_param_bytes += m.mem_shard.bytes + m.full.bytes;
    if (m.stored) s.param_store_bytes += at_rest_bytes(m.at_rest, m.shard.shard, I.shape.wsize);
    if (m.stored && m.frozen) s.frozen_param_bytes += at_rest_bytes(m.at_rest, m.shard.shard, I.shape.wsize);
  }
  if (I.store) {
    const TensorStoreStats t = I.store->stats();
    const int d = static_cast<int>(Tier::kDevice), h = static_cast<int>(Tier::kHost),
              n = static_cast<int>(Tier::kNvme);
    s.host_budget_bytes = t.budget_bytes[h];
    s.host_pool_peak_bytes = t.peak_resident_bytes[h];
    s.host_bounce_bytes = I.store->options().pipeline_chunk_bytes * t.bounce_chunks_committed;
    if (I.device) {
      s.device_budget_bytes = I.device->budget_bytes();
      s.device_peak_bytes = t.peak_resident_bytes[d] + s.gathered_bytes_peak + I.staging.device_scratch_bytes();
    }
    s.nvme_read_bytes = t.bytes_moved[n][h] + t.bytes_moved[n][d];
    s.nvme_written_bytes = t.bytes_moved[h][n] + t.bytes_moved[d][n];
    s.nvme_read_trainable_bytes = t.nvme_read_by_group[detail::kGroupTrainable];
    s.nvme_read_frozen_bytes = t.nvme_read_by_group[detail::kGroupFrozen];
    s.nvme_read_optimizer_bytes = t.nvme_read_by_group[detail::kGroupOptimizer];
    s.nvme_written_trainable_bytes = t.nvme_written_by_group[detail::kGroupTrainable];
    s.nvme_written_frozen_bytes = t.nvme_written_by_group[detail::kGroupFrozen];
    s.nvme_written_optimizer_bytes = t.nvme_written_by_group[detail::kGroupOptimizer];
    s.nvme_read_gradient_bytes = t.nvme_read_by_group[detail::kGroupGradient];
    s.nvme_written_gradient_bytes = t.nvme_written_by_group[detail::kGroupGradient];
    s.host_to_device_bytes = t.bytes_moved[h][d];
    s.device_to_host_bytes = t.bytes_moved[d][h];
    s.store_hits = t.hits;
    s.store_misses = t.misses;
    s.store_demotions = t.demotions;
    s.store_promotions = t.promotions;
    s.stall_ns = t.stall_ns;
    s.driving_stall_ns = I.driving_stall_ns();
    std::copy(std::begin(t.phases), std::end(t.phases), std::begin(s.phases));
    s.prefetches_issued = t.prefetches_issued;
    s.prefetch_hints = t.prefetch_hints;
    s.prefetch_hints_recording = t.prefetch_hints_recording;
  }
  I.step_io.add_stats(s);
  I.staging.add_stats(s);  // its own copies, beside the store's
  return s;
}

}  // namespace tiermem
