// src/zero/zero_engine.cc — ZeroEngine's public calls (see include/tiermem/zero_engine.h):
// construction and validation, registration, stage-3 gathers into device memory (where a deferred
// update is applied first), the gradient reduce path (bucketed reduce-scatter, accumulation into the
// tiered gradient partitions), statistics. The set-up of tiers and tensors is in zero_setup.cc, the
// optimizer step in zero_step.cc, the state in and out (checkpoints) in zero_state.cc.
#include "tiermem/zero_engine.h"

#include <malloc.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <fmt/format.h>

#include "tiermem/log.h"
#include "zero/zero_impl.h"

namespace tiermem {
namespace {

std::string lower(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

}  // namespace

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
  impl_->free_gather_buf(impl_->mods[static_cast<std::size_t>(g.module_)], const_cast<void*>(g.data_),
                         g.owned_on_device_);
}

// --------------------------------------------------------------------------------- set-up

ZeroEngine::ZeroEngine(const Config& config, Communicator& comm, ZeroEngineOptions options)
    : config_(config), impl_(std::make_unique<Impl>(comm, options, config_)) {
  Impl& I = *impl_;
  const ZeroConfig& z = config_.zero;
  if (z.stage < 0 || z.stage > 3) {
    throw ConfigError("zero_optimization.stage", std::to_string(z.stage), "ZeRO stage must be 0, 1, 2 or 3");
  }
  if (options.alignment_elems == 0) throw Error("ZeroEngineOptions::alignment_elems must be >= 1");
  check_sub_group_size(z, options.alignment_elems);
  std::string opt = lower(config_.optimizer.type);
  if (opt != "adamw" && opt != "adam") {
    throw ConfigError("optimizer.type", config_.optimizer.type,
                      "config key 'optimizer.type' = \"" + config_.optimizer.type +
                          "\" is not supported by ZeroEngine (Adam, AdamW)");
  }
  if (z.offload_optimizer.device != OffloadDevice::kNone && z.stage == 0) {
    throw ConfigError("zero_optimization.offload_optimizer.device",
                      std::string(offload_device_name(z.offload_optimizer.device)),
                      "config key 'zero_optimization.offload_optimizer.device' needs stage >= 1");
  }
  if (z.offload_param.device != OffloadDevice::kNone && z.stage != 3) {
    throw ConfigError("zero_optimization.offload_param.device",
                      std::string(offload_device_name(z.offload_param.device)),
                      "config key 'zero_optimization.offload_param.device' needs stage 3");
  }
  for (const auto* o : {&z.offload_optimizer, &z.offload_param}) {
    const char* key = o == &z.offload_param ? "zero_optimization.offload_param" : "zero_optimization.offload_optimizer";
    if (o->device == OffloadDevice::kNvme && o->nvme_path.empty()) {
      throw ConfigError(std::string(key) + ".nvme_path", "", std::string("config key '") + key +
                                                                 ".device' is \"nvme\" but no nvme_path is given");
    }
    if (o->buffer_count < 1) {
      throw ConfigError(std::string(key) + ".buffer_count", std::to_string(o->buffer_count),
                        std::string("config key '") + key + ".buffer_count' must be >= 1");
    }
  }
  if (config_.fp16.enabled && config_.bf16) {
    throw ConfigError("fp16.enabled", "true", "fp16 and bf16 cannot both be enabled");
  }
  working_dtype_ = config_.bf16 ? DType::kBF16 : config_.fp16.enabled ? DType::kF16 : DType::kF32;
  I.wdtype = working_dtype_;
  I.wsize = dtype_size(working_dtype_);
  I.comm_dtype = working_dtype_ == DType::kF32 ? DType::kF32 : DType::kU16;
  I.stage = z.stage;
  I.rank = comm.rank();
  I.world = comm.world_size();
  I.opt_world = z.stage == 0 ? 1 : I.world;
  I.opt_rank = z.stage == 0 ? 0 : I.rank;
  if (config_.fp16.enabled) I.scaler = std::make_unique<DynamicLossScaler>(config_.fp16);
  // DeepSpeed keys whose meaning the store's budgets and the sub-group plan replace.
  if (z.offload_param.device != OffloadDevice::kNone && I.rank == 0) {
    TM_LOG_INFO("ZERO",
                "offload_param.buffer_count is not used: parameters are paged through the host tier under "
                "tiermem.host_budget_bytes (DeepSpeed's fixed parameter buffers are replaced by it)");
  }
}

ZeroEngine::ZeroEngine(const Config& config, Communicator& comm, std::span<const std::size_t> module_numels,
                       ZeroEngineOptions options)
    : ZeroEngine(config, comm, options) {
  Impl& I = *impl_;
  I.expected_numels.assign(module_numels.begin(), module_numels.end());
  I.make_plan(module_numels);
}

ZeroEngine::~ZeroEngine() {
  try {
    impl_->sync();
  } catch (const std::exception& e) {
    TM_LOG_ERROR("ZERO", "a collective pending at ZeroEngine destruction failed: {}", e.what());
  }
  try {
    impl_->drop_pending_gathers();  // sync() stopped at a failure above: free what is left
  } catch (const std::exception&) {
  }
  impl_->store.reset();  // frees its swap extents, before the swap spaces and the device go
}

const ZeroPlan& ZeroEngine::plan() const { return impl_->plan; }

int ZeroEngine::register_module(const std::string& name, std::span<const float> init) {
  Impl& I = *impl_;
  if (I.finalized) {
    throw Error("ZeroEngine::register_module(\"" + name +
                "\"): modules must be registered before the first gather/reduce_gradients/step");
  }
  const std::size_t i = I.mods.size();
  if (!I.expected_numels.empty() && (i >= I.expected_numels.size() || I.expected_numels[i] != init.size())) {
    throw Error(fmt::format("ZeroEngine::register_module(\"{}\"): module {} has {} elements but the engine was "
                            "constructed for {}",
                            name, i, init.size(),
                            i < I.expected_numels.size() ? std::to_string(I.expected_numels[i]) : "fewer modules"));
  }
  I.add_module(name, init.size());
  detail::ZeroModule& m = I.mods.back();
  // This rank's part of the initial values (the shard's padding is zero).
  const ElemRange r = m.shard.range(I.opt_rank);
  const std::size_t lo = std::min(r.begin, init.size()), hi = std::min(r.end, init.size());
  const std::span<const float> mine = init.subspan(lo, hi - lo);
  if (I.planned) {
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

// --------------------------------------------------------------------------------- gather

void ZeroEngine::Impl::count_gather_buf(const detail::ZeroModule& m) {
  gathered_live += m.shard.padded * wsize;
  st.gathered_bytes_peak = std::max(st.gathered_bytes_peak, gathered_live);
}

void* ZeroEngine::Impl::alloc_gather_buf(const detail::ZeroModule& m, bool on_device) {
  const std::size_t bytes = m.shard.padded * wsize;
  void* buf = nullptr;
  if (on_device) {
    buf = device->allocate(bytes);  // OutOfMemoryError(kDevice) beyond the gather reserve
  } else {
    buf = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
    if (!buf) throw OutOfMemoryError(Tier::kHost, bytes, 0, "ZeroEngine all-gather buffer");
  }
  count_gather_buf(m);
  return buf;
}

void ZeroEngine::Impl::free_gather_buf(const detail::ZeroModule& m, void* buf, bool on_device) noexcept {
  if (on_device) {
    device->free(buf);
  } else {
    std::free(buf);
  }
  gathered_live -= m.shard.padded * wsize;
}

ZeroEngine::Impl::PendingGather ZeroEngine::Impl::start_gather(int module, TensorStore::Pin pin) {
  const detail::ZeroModule& m = mods[static_cast<std::size_t>(module)];
  PendingGather pg;
  pg.module = module;
  pg.on_device = compute_tier == Tier::kDevice;
  pg.buf = alloc_gather_buf(m, pg.on_device);
  std::byte* mine = static_cast<std::byte*>(pg.buf) + static_cast<std::size_t>(rank) * m.shard.shard * wsize;
  std::memcpy(mine, pin.data(), m.shard.shard * wsize);
  pin.release();
  try {
    pg.handle = comm.all_gather_async(mine, pg.buf, m.shard.shard, comm_dtype);  // in place
  } catch (...) {
    free_gather_buf(m, pg.buf, pg.on_device);
    throw;
  }
  ++st.all_gather_calls;
  return pg;
}

void* ZeroEngine::Impl::take_gather(PendingGather&& pg) {
  try {
    pg.handle.wait();
  } catch (...) {
    free_gather_buf(mods[static_cast<std::size_t>(pg.module)], pg.buf, pg.on_device);
    throw;
  }
  return pg.buf;
}

void ZeroEngine::Impl::drop_pending_gathers() {
  std::exception_ptr first;
  while (!pending_gathers.empty()) {
    PendingGather pg = std::move(pending_gathers.front());
    pending_gathers.pop_front();
    const bool on_device = pg.on_device;
    const detail::ZeroModule& m = mods[static_cast<std::size_t>(pg.module)];
    try {
      free_gather_buf(m, take_gather(std::move(pg)), on_device);
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

// The module's update of the last step (deferred), or its accesses outside the step, before its
// working shard is read.
void ZeroEngine::Impl::before_gather(int module, Phase phase) {
  detail::ZeroModule& m = mods[static_cast<std::size_t>(module)];
  if (deferred.pending(module)) {  // the overlapped optimizer step: this module's update, now that it is needed
    apply_pending(module, phase == Phase::kOutsideStep ? Phase::kOutsideStep : Phase::kOptimizer);
  } else if (!m.replay.empty() && phase != Phase::kOutsideStep) {
    replay_outside_accesses(module);
  }
}

bool ZeroEngine::prefetch_gather(int module, Phase phase) {
  Impl& I = *impl_;
  I.finalize();
  if (module < 0 || module >= num_modules()) {
    throw Error("ZeroEngine::prefetch_gather: unknown module " + std::to_string(module));
  }
  detail::ZeroModule& m = I.mods[static_cast<std::size_t>(module)];
  if (I.world == 1 || !m.stored || I.opaque) return false;  // nothing to overlap (one rank: the Prefetcher's)
  for (const auto& pg : I.pending_gathers) {
    if (pg.module == module) return true;
  }
  // At most two ahead: a prediction that did not come true (a changed module order) holds no more.
  while (I.pending_gathers.size() >= 2) {
    Impl::PendingGather old = std::move(I.pending_gathers.front());
    I.pending_gathers.pop_front();
    const bool on_device = old.on_device;
    const detail::ZeroModule& om = I.mods[static_cast<std::size_t>(old.module)];
    I.free_gather_buf(om, I.take_gather(std::move(old)), on_device);
  }
  I.before_gather(module, phase);
  I.pending_gathers.push_back(I.start_gather(module, I.store->acquire(m.param, I.gather_tier(m), phase)));
  ++I.st.all_gathers_prefetched;
  return true;
}

ZeroEngine::Gathered ZeroEngine::gather(int module, Phase phase) {
  Impl& I = *impl_;
  I.finalize();
  if (module < 0 || module >= num_modules()) throw Error("ZeroEngine::gather: unknown module " + std::to_string(module));
  detail::ZeroModule& m = I.mods[static_cast<std::size_t>(module)];
  Gathered g;
  g.module_ = module;
  g.numel_ = m.numel;
  g.dtype_ = working_dtype_;
  for (auto it = I.pending_gathers.begin(); it != I.pending_gathers.end(); ++it) {
    if (it->module != module) continue;
    // Started by prefetch_gather (its deferred update applied then): wait for its end.
    Impl::PendingGather pg = std::move(*it);
    I.pending_gathers.erase(it);
    g.owned_on_device_ = pg.on_device;
    g.data_ = I.take_gather(std::move(pg));
    g.owned_ = true;
    g.engine_ = this;
    return g;
  }
  I.before_gather(module, phase);
  if (!m.stored) {
    g.data_ = I.stage == 0 ? m.mem_shard.p : m.full.p;
    return g;
  }
  // The working shard, resident at the compute tier (loaded from its home unless the Prefetcher
  // brought it already); acquiring it feeds the Prefetcher, whose hints start loading the next
  // modules while this one computes.
  TensorStore::Pin pin = I.store->acquire(m.param, I.gather_tier(m), phase);
  if (I.world == 1) {  // one rank: the shard is the whole module
    g.data_ = pin.data();
    g.pin_ = std::move(pin);
    g.engine_ = this;
    return g;
  }
  g.owned_on_device_ = I.compute_tier == Tier::kDevice;
  if (I.opaque) {  // device memory the CPU cannot address: zero_device.cc
    g.data_ = I.all_gather_to_device(m, pin);
    ++I.st.all_gather_calls;
    I.count_gather_buf(m);
  } else {
    g.data_ = I.take_gather(I.start_gather(module, std::move(pin)));
  }
  g.owned_ = true;
  g.engine_ = this;
  return g;
}

// --------------------------------------------------------------------------------- gradients

std::vector<ZeroEngine::Impl::GradPiece> ZeroEngine::Impl::pin_grad(int mi, std::size_t begin, std::size_t n) {
  detail::ZeroModule& m = mods[static_cast<std::size_t>(mi)];
  const std::size_t end = begin + n;
  std::vector<GradPiece> work;
  for (int pi : m.pieces) {
    detail::Piece& p = pieces[static_cast<std::size_t>(pi)];
    const std::size_t lo = std::max(begin, p.begin), hi = std::min(end, p.end);
    if (lo >= hi) continue;
    GradPiece w;
    w.piece = pi;
    w.lo = lo;
    w.hi = hi;
    w.fresh = p.grad_fresh;
    if (p.grad_fresh) {
      // First gradient since the step: no need to read the old partition. Pinned by add_grad
      // (acquire_for_overwrite is no access the Prefetcher records, so it may run on the gradient
      // thread, and so may the write-back of whatever it evicts for room). The policy hears of it
      // here, in call order: it needs room now, and that shapes what the pool can hold.
      store->touch(p.grad, p.gtier, Phase::kBackward, /*overwrite=*/true);
      p.grad_fresh = false;
    } else {
      w.pin = store->acquire(p.grad, p.gtier, Phase::kBackward);
    }
    work.push_back(std::move(w));
  }
  return work;
}

std::size_t ZeroEngine::Impl::add_grad(std::vector<GradPiece>& work, std::size_t begin, const float* src,
                                       float* clear) {
  std::size_t cleared = 0;
  for (GradPiece& w : work) {
    const int pi = w.piece;
    detail::Piece& p = pieces[static_cast<std::size_t>(pi)];
    if (!w.pin.valid()) w.pin = store->acquire_for_overwrite(p.grad, p.gtier);
    float* g = w.pin.as<float>();
    const std::size_t lo = w.lo, hi = w.hi;
    const float* s = src + (lo - begin);
    float* c = clear ? clear + (lo - begin) : nullptr;
    const std::size_t t = valid_len(static_cast<std::size_t>(pi));
    std::optional<double> partial;  // its sum of squares, when the copy computed it
    if (w.fresh) {  // the covered range is copied, the rest zeroed: one pass, no read of g
      std::memset(g, 0, (lo - p.begin) * sizeof(float));
      const bool whole = lo == p.begin && hi >= p.begin + t;  // every real element arrives now
      const bool several = mods[static_cast<std::size_t>(p.module)].pieces.size() > 1;
      if (whole && several && fold_norm()) {
        partial = detail::copy_sumsq_lanes(g, s, hi - lo, t, c);  // the norm's read in the same pass
      } else {
        detail::copy_lanes(g + (lo - p.begin), s, hi - lo, c, /*read_next=*/fold_norm());  // the norm reads g
      }
      std::memset(g + (hi - p.begin), 0, (p.end - hi) * sizeof(float));
    } else {
      float* d = g + (lo - p.begin);
      for (std::size_t k = 0; k < hi - lo; ++k) d[k] += s[k];
      if (c) std::fill(c, c + (hi - lo), 0.0f);
    }
    if (c) cleared += hi - lo;
    // Count the real elements this call gave the piece: when all have arrived (exactly once per
    // reduce call), its partition holds the gradient as of this call — fold its norm now.
    const std::size_t vlo = std::max(lo, p.begin), vhi = std::min(hi, p.begin + t);
    if (vhi > vlo) p.acc_elems += vhi - vlo;
    if (t > 0 && p.acc_elems == t) {
      p.acc_elems = 0;
      if (fold_norm()) fold_piece_norm(pi, g, partial);
    }
    w.pin.mark_dirty();
    w.pin.release();
  }
  return cleared;
}

void ZeroEngine::Impl::accumulate_grad(int mi, std::size_t begin, const float* src, std::size_t n) {
  std::vector<GradPiece> work = pin_grad(mi, begin, n);
  add_grad(work, begin, src);
}

void ZeroEngine::Impl::wait_grad_task() {
  if (!grad_task.valid()) return;
  std::future<void> f = std::move(grad_task);
  std::shared_ptr<std::vector<float>> buf = std::move(grad_task_buf);
  grad_task_bytes = 0;
  f.get();  // rethrows
  // Its buffer, zeroed by the task, becomes the spare for the next gradient_buffer() call.
  if (buf && buf->capacity() >= grad_spare.capacity()) grad_spare = std::move(*buf);
}

void ZeroEngine::Impl::complete_front() {
  Inflight f = std::move(inflight.front());
  inflight.pop_front();
  f.handle.wait();
  bucket_bytes_live -= 4 * (f.send.size() + f.recv.size());
  accumulate_grad(f.module, f.begin, f.recv.data(), f.recv.size());
}

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
  I.wait_grad_task();  // a hand-off in flight may add into the same partitions
  I.apply_pending(module, Phase::kOptimizer);  // its last step's update first (not gathered since)
  ++m.grad_calls;
  if (I.stage <= 1) {
    float* dst = m.full_grad.data();
    for (std::size_t i = 0; i < grad.size(); ++i) dst[i] += grad[i];
    return;
  }
  if (I.world == 1) {  // the shard is the module: straight into the gradient partitions
    I.accumulate_grad(module, 0, grad.data(), grad.size());
    return;
  }
  for (const ElemRange& c : make_reduce_chunks(m.shard.shard, I.world, config_.zero.reduce_bucket_size_elems,
                                               I.opts.alignment_elems)) {
    Impl::Inflight f;
    const std::size_t len = c.size();
    f.send = detail::pack_bucket(grad, m.shard, I.world, c);  // grad_reducer.h
    f.recv.assign(len, 0.0f);
    f.module = module;
    f.begin = c.begin;
    f.handle = I.comm.reduce_scatter_async(f.send.data(), f.recv.data(), len, DType::kF32, ReduceOp::kSum);
    ++I.st.reduce_scatter_calls;
    I.bucket_bytes_live += 4 * (f.send.size() + f.recv.size());
    I.st.host_engine_peak_bytes = std::max(I.st.host_engine_peak_bytes, I.engine_host_bytes());
    I.inflight.push_back(std::move(f));
    if (!config_.zero.overlap_comm) {
      I.complete_front();
    } else {
      while (I.inflight.size() > static_cast<std::size_t>(std::max(1, I.opts.max_inflight_buckets))) {
        I.complete_front();
      }
    }
  }
}

void ZeroEngine::reduce_gradients(int module, std::vector<float>&& grad) {
  Impl& I = *impl_;
  I.finalize();
  I.wait_grad_task();  // one hand-off in flight; its error surfaces here
  if (I.world != 1 || I.stage < 2 || module < 0 || module >= num_modules() ||
      grad.size() != I.mods[static_cast<std::size_t>(module)].numel || I.mods[static_cast<std::size_t>(module)].frozen) {
    reduce_gradients(module, std::span<const float>(grad));  // synchronous (or bucketed), or its error
    return;
  }
  I.apply_pending(module, Phase::kOptimizer);  // its last step's update first (not gathered since)
  ++I.mods[static_cast<std::size_t>(module)].grad_calls;
  auto work = std::make_shared<std::vector<Impl::GradPiece>>(I.pin_grad(module, 0, grad.size()));
  auto buf = std::make_shared<std::vector<float>>(std::move(grad));
  if (!I.grad_pool) I.grad_pool = std::make_unique<boost::asio::thread_pool>(1);
  auto task = std::make_shared<std::packaged_task<void()>>([&I, work, buf] {
    try {
      // Leaves what it read zero: the buffer is ready to be handed out again (gradient_buffer).
      const std::size_t zeroed = I.add_grad(*work, 0, buf->data(), buf->data());
      if (zeroed != buf->size()) std::fill(buf->begin(), buf->end(), 0.0f);  // pieces not covering it all
    } catch (...) {
      work->clear();  // the pins go before the error is reported
      throw;
    }
    work->clear();
  });
  I.grad_task = task->get_future();
  I.grad_task_buf = buf;
  I.grad_task_bytes = buf->size() * sizeof(float);
  // The spare is not sampled here: it is the buffer the caller's next gradient_buffer() takes
  // (counted by the caller then), and until then it stands for the one the caller just gave up.
  I.st.host_engine_peak_bytes = std::max(I.st.host_engine_peak_bytes,
                                         I.engine_host_bytes() - I.grad_spare.capacity() * sizeof(float));
  boost::asio::post(*I.grad_pool, [task] { (*task)(); });
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
  const std::size_t n = I.mods[static_cast<std::size_t>(module)].numel;
  if (I.grad_spare.capacity() < n) return std::vector<float>(n);
  std::vector<float> v = std::move(I.grad_spare);  // zeroed; resize() zeroes any growth
  I.grad_spare = {};
  v.resize(n);
  return v;
}

void ZeroEngine::synchronize() { impl_->sync(); }

std::uint64_t ZeroEngine::offload_states() {
  Impl& I = *impl_;
  I.finalize();
  I.sync();
  I.apply_all_pending(Phase::kOutsideStep);
  std::vector<float>().swap(I.grad_spare);
  const std::uint64_t dropped = I.store->offload();
  ::malloc_trim(0);  // what the engine's own buffers and the steps freed to the heap
  return dropped;
}

void ZeroEngine::Impl::zero_grad() {
  sync();
  std::vector<float>().swap(grad_spare);  // not held through the forward pass
  for (auto& m : mods) {
    std::fill(m.full_grad.begin(), m.full_grad.end(), 0.0f);
    std::fill(m.shard_grad.begin(), m.shard_grad.end(), 0.0f);
    m.grad_calls = 0;
    m.norm.clear();
  }
  for (auto& p : pieces) {
    if (deferred.pending(p.module)) continue;  // its update still reads it
    if (!p.grad_fresh && p.grad != kInvalidTensor) store->discard(p.grad);  // never written down
    p.grad_fresh = true;  // the next accumulation overwrites
    p.acc_elems = 0;
  }
}

void ZeroEngine::zero_grad() {
  impl_->sync();
  impl_->apply_all_pending(Phase::kOutsideStep);  // the last step's updates still read theirs
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
  if (!mods.empty() && std::all_of(mods.begin(), mods.end(), [](const detail::ZeroModule& m) { return m.frozen; })) {
    throw Error("ZeroEngine::step: every module is frozen (ZeroEngineOptions::frozen_modules): this engine runs "
                "forward only and has nothing to step");
  }
  return impl_->step();
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
  const ZeroPlan& p = I.plan;
  s.optimizer_state_bytes = p.optimizer_bytes;
  s.gradient_bytes = p.gradient_bytes;
  s.param_home = p.param_home;
  s.optimizer_home = p.optimizer_home;
  s.gradient_home = p.gradient_home;
  s.sub_group_elems = p.piece_elems;
  s.sub_groups = I.pieces.size();
  s.host_engine_bytes = I.engine_host_bytes();
  s.host_engine_peak_bytes = std::max(s.host_engine_peak_bytes, s.host_engine_bytes);
  for (const auto& m : I.mods) {
    s.working_param_bytes += m.mem_shard.bytes + m.full.bytes;
    if (m.stored) s.param_store_bytes += m.shard.shard * I.wsize;
    if (m.stored && m.frozen) s.frozen_param_bytes += m.shard.shard * I.wsize;
  }
  if (I.store) {
    const TensorStoreStats t = I.store->stats();
    const int d = static_cast<int>(Tier::kDevice), h = static_cast<int>(Tier::kHost),
              n = static_cast<int>(Tier::kNvme);
    s.host_budget_bytes = t.budget_bytes[h];
    s.host_pool_peak_bytes = t.peak_resident_bytes[h];
    s.host_bounce_bytes = I.store->options().pipeline_chunk_bytes *
                          static_cast<std::uint64_t>(I.store->options().pipeline_chunks);
    if (I.device) {
      s.device_budget_bytes = I.device->budget_bytes();
      s.device_peak_bytes = t.peak_resident_bytes[d] + s.gathered_bytes_peak + I.device_scratch_bytes();
    }
    s.nvme_read_bytes = t.bytes_moved[n][h] + t.bytes_moved[n][d];
    s.nvme_written_bytes = t.bytes_moved[h][n] + t.bytes_moved[d][n];
    s.nvme_read_trainable_bytes = t.nvme_read_by_group[detail::kGroupTrainable];
    s.nvme_read_frozen_bytes = t.nvme_read_by_group[detail::kGroupFrozen];
    s.nvme_read_optimizer_bytes = t.nvme_read_by_group[detail::kGroupOptimizer];
    s.nvme_written_trainable_bytes = t.nvme_written_by_group[detail::kGroupTrainable];
    s.nvme_written_frozen_bytes = t.nvme_written_by_group[detail::kGroupFrozen];
    s.nvme_written_optimizer_bytes = t.nvme_written_by_group[detail::kGroupOptimizer];
    s.host_to_device_bytes = t.bytes_moved[h][d] + I.engine_h2d_bytes;
    s.device_to_host_bytes = t.bytes_moved[d][h] + I.engine_d2h_bytes;
    s.store_hits = t.hits;
    s.store_misses = t.misses;
    s.stall_ns = t.stall_ns;
    s.prefetches_issued = t.prefetches_issued;
  }
  return s;
}

}  // namespace tiermem
