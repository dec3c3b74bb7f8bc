// tensor_store.cc — TensorStore's public API: registration, pins, acquire/fetch/prefetch, eviction
// requests, step boundaries and stats. The store's parts and its locking are described in
// tensor_store_impl.h; see tiermem/tensor_store.h for the contract.
#include "tiermem/tensor_store.h"

#include "runtime/tensor_store_impl.h"

namespace tiermem {
namespace {
// Set on a thread while a TensorStore::HelperThread lives there: its stalls also count in
// helper_stall_ns.
thread_local bool tl_helper_thread = false;
}  // namespace

TensorStoreOptions TensorStoreOptions::from_config(const Config& config) {
  TensorStoreOptions o;
  const TiermemConfig& t = config.tiermem;
  o.device_budget_bytes = t.device_budget_bytes;
  if (t.host_budget_bytes != 0) o.host_budget_bytes = t.host_budget_bytes;
  o.numa_node = t.numa_node;
  o.demote_to_host = t.demote_to_host;
  o.pipeline_chunk_bytes = t.pipeline_chunk_bytes;
  o.pipeline_chunks = t.pipeline_chunks;
  o.acquire_timeout = std::chrono::duration<double>(t.acquire_timeout_s);
  o.pin_memory = config.zero.offload_param.pin_memory || config.zero.offload_optimizer.pin_memory;
  if (o.pipeline_chunk_bytes % 4096 != 0) {
    throw ConfigError("tiermem.pipeline_chunk_bytes", std::to_string(o.pipeline_chunk_bytes),
                      "must be a multiple of 4096");
  }
  if (!(t.acquire_timeout_s > 0)) {
    throw ConfigError("tiermem.acquire_timeout_s", fmt::format("{}", t.acquire_timeout_s),
                      TiermemConfig::kAcquireTimeoutRule);
  }
  return o;
}


// ------------------------------------------------------------------ Pin

TensorStore::Pin::Pin(Pin&& o) noexcept
    : store_(o.store_), id_(o.id_), tier_(o.tier_), data_(o.data_), bytes_(o.bytes_) {
  o.store_ = nullptr;
}

TensorStore::Pin& TensorStore::Pin::operator=(Pin&& o) noexcept {
  if (this != &o) {
    release();
    store_ = o.store_;
    id_ = o.id_;
    tier_ = o.tier_;
    data_ = o.data_;
    bytes_ = o.bytes_;
    o.store_ = nullptr;
  }
  return *this;
}

void TensorStore::Pin::mark_dirty() {
  if (store_ == nullptr) throw Error("TensorStore::Pin::mark_dirty on a released pin");
  store_->mark_dirty(id_, tier_);
}

void TensorStore::Pin::release() noexcept {
  if (store_ != nullptr) {
    store_->release_pin(id_, tier_);
    store_ = nullptr;
    data_ = nullptr;
  }
}

// ------------------------------------------------------------------ TensorStore

TensorStore::TensorStore(TensorStoreOptions options, std::shared_ptr<Device> device,
                         std::shared_ptr<SwapSpace> swap, std::unique_ptr<ResidencyPolicy> policy)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  if (options.pipeline_chunk_bytes == 0 || options.pipeline_chunk_bytes % 4096 != 0) {
    throw ConfigError("tiermem.pipeline_chunk_bytes", std::to_string(options.pipeline_chunk_bytes),
                      "must be a positive multiple of 4096");
  }
  if (options.pipeline_chunks < 1) {
    throw ConfigError("tiermem.pipeline_chunks", std::to_string(options.pipeline_chunks), "must be >= 1");
  }
  options.worker_threads = std::max(1, options.worker_threads);
  m.opts = options;
  m.device = std::move(device);
  m.swap = std::move(swap);
  m.policy_ = policy ? std::move(policy) : std::make_unique<LruPolicy>();

  // The pools commit (and pin) memory as it is used, never more than their budgets, and any
  // block fits while the budget holds its bytes (see pinned_host_pool.h).
  PinnedHostPoolOptions hp;
  hp.budget_bytes = options.host_budget_bytes;
  hp.pin_memory = options.pin_memory;
  hp.numa_node = options.numa_node;
  m.host_pool = std::make_unique<PinnedHostPool>(hp);

  PinnedHostPoolOptions bp = hp;
  bp.budget_bytes = options.pipeline_chunk_bytes * static_cast<std::uint64_t>(options.pipeline_chunks);
  bp.verify_huge_pages = true;  // committed once: the engine sizes pieces to its 2 MiB pages
  m.bounce_pool_mem = std::make_unique<PinnedHostPool>(bp);

  // Registration follows the pools' committed slots: each is registered with the device (CUDA)
  // when committed and unregistered before its pages are released. io_uring fixed buffers: the
  // bounce chunks only. Registering a buffer pins its pages once, as a plain O_DIRECT request
  // does per request; a bounce chunk serves every transfer, while a host-pool slot is committed
  // for a cached copy and released when the cache turns over, so registering those cost more than
  // it saved (gpt2 offloaded at a full 1 GiB pool: ~50 registrations a step, 3.6 ms each).
  for (PinnedHostPool* pool : {m.host_pool.get(), m.bounce_pool_mem.get()}) {
    const bool fixed = pool == m.bounce_pool_mem.get();
    pool->set_region_listener(
        [&m, fixed](const HostRegion& r) {
          if (m.device && m.device->kind() != DeviceKind::kSim && m.device->register_host(r.base, r.bytes)) {
            std::lock_guard lock(m.registered_mu);
            m.registered_host.insert(r.base);
          }
          // With its page layout, so the engine sizes pieces to the device.
          if (m.swap && fixed) m.swap->engine().register_buffers(r.base, r.bytes, r.contiguous_bytes);
        },
        [&m, fixed](void* base) {
          if (m.swap && fixed) m.swap->engine().unregister_buffers(base);
          bool host = false;
          {
            std::lock_guard lock(m.registered_mu);
            host = m.registered_host.erase(base) > 0;
          }
          if (host) m.device->unregister_host(base);
        });
  }
  m.bounce = std::make_unique<BouncePool>(*m.bounce_pool_mem, options.pipeline_chunks,
                                          options.pipeline_chunk_bytes);

  m.budget_[idx(Tier::kDevice)] = 0;
  if (m.device) {
    m.budget_[idx(Tier::kDevice)] = options.device_budget_bytes == 0
                                        ? m.device->budget_bytes()
                                        : std::min(options.device_budget_bytes, m.device->budget_bytes());
  }
  m.budget_[idx(Tier::kHost)] = m.host_pool->budget_bytes();
  m.budget_[idx(Tier::kNvme)] = UINT64_MAX;  // bounded by the swap space (OutOfMemoryError there)
  m.pool_ = std::make_unique<boost::asio::thread_pool>(static_cast<std::size_t>(options.worker_threads));
  TM_LOG_DEBUG("RUNTIME", "TensorStore: device {} ({}), host {} ({}), nvme {}",
               m.device ? m.device->name() : "none", format_bytes(m.budget_[0]),
               format_bytes(m.budget_[1]), m.host_pool->pinned() ? "pinned" : "unpinned",
               m.swap ? "swap space" : "none");
}

TensorStore::~TensorStore() {
  Impl& m = *impl_;
  m.pool_->join();  // runs every task already posted (write-backs included), then stops
  std::lock_guard lock(m.mu_);
  for (auto& e : m.entries_) {
    for (int t = 0; t < 2; ++t) {
      Copy& c = e->copy[t];
      if (c.state != State::kAbsent && c.ptr != nullptr) m.tier_free(tier_at(t), c.ptr);
      if (c.pins > 0) {
        TM_LOG_ERROR("RUNTIME", "TensorStore destroyed while tensor '{}' is pinned on {}",
                     e->info.name, tier_name(tier_at(t)));
      }
    }
    if (e->swap) {
      for (const SwapExtent& x : e->extents) {
        try {
          e->swap->free(x);
        } catch (const std::exception& ex) {
          TM_LOG_ERROR("RUNTIME", "freeing swap extent of '{}': {}", e->info.name, ex.what());
        }
      }
    }
  }
  m.host_pool->clear_region_listener();
  m.bounce_pool_mem->clear_region_listener();
}

void TensorStore::set_policy(std::unique_ptr<ResidencyPolicy> policy) {
  std::lock_guard lock(impl_->mu_);
  impl_->policy_ = policy ? std::move(policy) : std::make_unique<LruPolicy>();
}

TensorId TensorStore::register_tensor(const TensorSpec& spec) {
  Impl& m = *impl_;
  std::uint64_t bytes = spec.bytes;
  if (!spec.shape.empty()) {
    std::uint64_t elems = 1;
    for (std::int64_t d : spec.shape) {
      if (d < 0) throw Error("TensorStore: tensor '" + spec.name + "' has a negative dimension");
      elems *= static_cast<std::uint64_t>(d);
    }
    std::uint64_t from_shape = elems * dtype_size(spec.dtype);
    if (bytes != 0 && bytes != from_shape) {
      throw Error(fmt::format("TensorStore: tensor '{}': bytes {} disagree with shape and dtype ({} bytes)",
                              spec.name, bytes, from_shape));
    }
    bytes = from_shape;
  }
  if (!spec.initial.empty() && spec.initial.size() != bytes) {
    throw Error(fmt::format("TensorStore: tensor '{}': initial data has {} bytes, the tensor {}",
                            spec.name, spec.initial.size(), bytes));
  }
  if (spec.group >= kNumGroups) {
    throw Error(fmt::format("TensorStore: tensor '{}': group {} is not below {}", spec.name, spec.group, kNumGroups));
  }
  if (spec.home == Tier::kNvme && !m.swap && !spec.swap) {
    throw NotSupportedError("TensorStore: tensor '" + spec.name + "' has home nvme but no swap space was given");
  }
  if (spec.home == Tier::kDevice && !m.device) {
    throw NotSupportedError("TensorStore: tensor '" + spec.name + "' has home device but no device was given");
  }
  auto e = std::make_unique<Entry>();
  e->info = TensorInfo{spec.name, spec.dtype, spec.shape, bytes, spec.home, spec.group};
  if (spec.home == Tier::kNvme) e->swap = spec.swap ? spec.swap : m.swap.get();
  e->read_in_place = spec.read_in_place && m.device && m.device->storage_direct();
  {
    std::lock_guard lock(m.mu_);
    if (m.by_name_.count(spec.name)) throw Error("TensorStore: duplicate tensor name '" + spec.name + "'");
  }
  Copy& home = e->copy[idx(spec.home)];
  home.state = State::kResident;
  home.version = 1;
  if (spec.home == Tier::kNvme) {
    try {
      for (std::uint64_t off = 0; off < std::max<std::uint64_t>(bytes, 1); off += m.opts.pipeline_chunk_bytes) {
        e->extents.push_back(e->swap->allocate(std::max<std::uint64_t>(
            1, std::min<std::uint64_t>(m.opts.pipeline_chunk_bytes, bytes - std::min(bytes, off)))));
      }
      std::vector<IoRequest> reqs;
      if (!spec.initial.empty()) {
        for (std::size_t k = 0; k < e->extents.size() && bytes > 0; ++k) {
          reqs.push_back(e->swap->write(e->extents[k], spec.initial.data() + k * m.opts.pipeline_chunk_bytes,
                                       m.chunk_len(*e, k)));
        }
        wait_all(reqs);
      } else if (bytes > 0 && spec.zero_fill) {
        void* zero = m.bounce->acquire();
        std::memset(zero, 0, m.opts.pipeline_chunk_bytes);
        try {
          for (std::size_t k = 0; k < e->extents.size(); ++k) {
            reqs.push_back(e->swap->write(e->extents[k], zero, m.chunk_len(*e, k)));
          }
          wait_all(reqs);
        } catch (...) {
          m.bounce->release(zero);
          throw;
        }
        m.bounce->release(zero);
      }
    } catch (const IoError& io) {
      for (const SwapExtent& x : e->extents) e->swap->free(x);
      throw io.with_context(Impl::io_context(*e, "initial write to nvme"));
    } catch (const OutOfMemoryError& oom) {
      for (const SwapExtent& x : e->extents) e->swap->free(x);
      throw OutOfMemoryError(oom.tier(), oom.requested(), oom.available(),
                             "registering tensor '" + spec.name + "' (" + std::to_string(bytes) +
                                 " bytes, home nvme): " + oom.detail());
    } catch (...) {
      for (const SwapExtent& x : e->extents) e->swap->free(x);
      throw;
    }
  }
  std::unique_lock lock(m.mu_);
  if (m.by_name_.count(spec.name)) {
    for (const SwapExtent& x : e->extents) e->swap->free(x);
    throw Error("TensorStore: duplicate tensor name '" + spec.name + "'");
  }
  if (spec.home != Tier::kNvme) {
    std::uint64_t size = m.alloc_size(spec.home, bytes);
    void* p = m.make_room(lock, spec.home, size, Mode::kFetch, std::chrono::steady_clock::now(),
                          kInvalidTensor, /*home=*/true);
    home.ptr = p;
    home.alloc_bytes = size;
    m.account(spec.home, static_cast<std::int64_t>(size));
    if (spec.home == Tier::kHost) {
      if (spec.initial.empty()) {
        std::memset(p, 0, bytes);
      } else {
        std::memcpy(p, spec.initial.data(), bytes);
      }
    } else if (spec.initial.empty()) {
      m.device->memset_async(p, 0, std::max<std::uint64_t>(bytes, 1)).wait();
    } else {
      m.device->copy_h2d(p, spec.initial.data(), bytes);
    }
  }
  TensorId id = static_cast<TensorId>(m.entries_.size());
  m.by_name_[spec.name] = id;
  m.entries_.push_back(std::move(e));
  return id;
}

TensorId TensorStore::find(std::string_view name) const {
  std::lock_guard lock(impl_->mu_);
  auto it = impl_->by_name_.find(std::string(name));
  return it == impl_->by_name_.end() ? kInvalidTensor : it->second;
}

TensorInfo TensorStore::info(TensorId id) const {
  std::lock_guard lock(impl_->mu_);
  return impl_->entry(id).info;
}

std::size_t TensorStore::size() const {
  std::lock_guard lock(impl_->mu_);
  return impl_->entries_.size();
}

TensorStore::Pin TensorStore::acquire(TensorId id, Tier tier, Phase phase) {
  Impl& m = *impl_;
  const auto start = std::chrono::steady_clock::now();
  const std::uint64_t trace_start = Trace::global().enabled() ? Trace::now_ns() : 0;
  const auto deadline =
      start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(m.opts.acquire_timeout);
  std::unique_lock lock(m.mu_);
  Entry& e = m.entry(id);
  ++e.uses;
  const AccessPhase access(phase);                  // its transfers (and hints) count to `phase`
  if (!tl_helper_thread) m.set_phase(phase);        // a helper's phase is not the training's
  m.issue_hints(m.policy_->on_access(id, e.info.bytes, tier, phase, m.view()));
  bool hit = false;
  void* p = m.ensure(lock, id, tier, Mode::kAcquire, deadline, &hit);
  if (tier == Tier::kDevice && p == e.copy[idx(Tier::kHost)].ptr) tier = Tier::kHost;  // read in place
  if (hit) {
    ++m.stats_.hits;
  } else {
    ++m.stats_.misses;
    const auto ns = static_cast<std::uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count());
    m.count_stall(phase, ns, tl_helper_thread);
    // The caller was blocked on this move: a span on the `wait` track (the time lost to I/O).
    if (trace_start != 0) {
      Trace::global().complete("miss " + e.info.name + " -> " + std::string(tier_name(tier)), "wait",
                               trace_start, Trace::now_ns() - trace_start,
                               fmt::format(R"({{"phase":"{}"}})", phase_name(phase)));
    }
  }
  return Pin(this, id, tier, p, e.info.bytes);
}

TensorStore::Pin TensorStore::acquire_for_overwrite(TensorId id, Tier tier) {
  Impl& m = *impl_;
  const auto start = std::chrono::steady_clock::now();
  const auto deadline =
      start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(m.opts.acquire_timeout);
  std::unique_lock lock(m.mu_);
  Entry& e = m.entry(id);
  if (tier == Tier::kNvme || idx(tier) > idx(e.info.home)) {
    throw Error(fmt::format("TensorStore::acquire_for_overwrite: tensor '{}' (home {}) cannot be pinned on {}",
                            e.info.name, tier_name(e.info.home), tier_name(tier)));
  }
  if (tier == Tier::kDevice && !m.device) {
    throw NotSupportedError("TensorStore: no device was given, tensor '" + e.info.name +
                            "' cannot go to the device tier");
  }
  ++e.uses;
  for (int t = 0; t < 2; ++t) {
    if (e.copy[t].pins > 0) {
      throw Error(fmt::format("TensorStore::acquire_for_overwrite: tensor '{}' is pinned on {}; release that "
                              "pin first",
                              e.info.name, tier_name(tier_at(t))));
    }
  }
  bool stalled = false;  // waited for a transfer, or made room: counted in stall_ns
  while (true) {
    Copy& c = e.copy[idx(tier)];
    if (c.state == State::kLoading || c.state == State::kEvicting || c.writing || c.readers > 0) {
      stalled = true;
      if (!m.wait(lock, deadline)) {
        throw OutOfMemoryError(tier, e.info.bytes, 0,
                               fmt::format("timed out after {:.1f} s (tiermem.acquire_timeout_s) waiting for "
                                           "tensor '{}' on {} (in transfer)",
                                           m.opts.acquire_timeout.count(), e.info.name, tier_name(tier)));
      }
      continue;
    }
    if (c.state == State::kAbsent) {
      const std::uint64_t size = m.alloc_size(tier, e.info.bytes);
      stalled |= m.used_[idx(tier)] + size > m.budget_[idx(tier)];  // evicts (and may write back)
      void* p = m.make_room(lock, tier, size, Mode::kAcquire, deadline, id);
      if (c.state != State::kAbsent) {  // someone else started meanwhile (mu_ was released)
        if (p != nullptr) m.tier_free(tier, p);
        continue;
      }
      c.ptr = p;
      c.alloc_bytes = size;
      m.account(tier, static_cast<std::int64_t>(size));
      c.state = State::kResident;
    }
    ++c.pins;
    c.user_writing = true;  // being filled: no transfer may copy from it until it is released
    m.make_newest(e, id, tier);
    if (stalled) {  // access_phase(): this call has no phase of its own
      const auto ns = static_cast<std::uint64_t>(
          std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count());
      m.count_stall(m.access_phase(), ns, tl_helper_thread);
    }
    return Pin(this, id, tier, c.ptr, e.info.bytes);
  }
}

std::future<void> TensorStore::fetch(TensorId id, Tier tier, Phase phase) {
  Impl& m = *impl_;
  auto promise = std::make_shared<std::promise<void>>();
  std::future<void> fut = promise->get_future();
  const AccessPhase access(phase);  // the hints' and the load's transfers count to `phase`
  {
    std::lock_guard lock(m.mu_);
    Entry& e = m.entry(id);
    ++e.uses;
    m.issue_hints(m.policy_->on_access(id, e.info.bytes, tier, phase, m.view()));
  }
  m.submit([&m, id, tier, promise] {
    try {
      const auto deadline = std::chrono::steady_clock::now() +
                            std::chrono::duration_cast<std::chrono::steady_clock::duration>(m.opts.acquire_timeout);
      std::unique_lock lock(m.mu_);
      bool hit = false;
      m.ensure(lock, id, tier, Mode::kFetch, deadline, &hit);
      ++(hit ? m.stats_.hits : m.stats_.misses);
      lock.unlock();
      promise->set_value();
    } catch (...) {
      promise->set_exception(std::current_exception());
    }
  });
  return fut;
}

void TensorStore::touch(TensorId id, Tier tier, Phase phase, bool overwrite) {
  Impl& m = *impl_;
  std::lock_guard lock(m.mu_);
  Entry& e = m.entry(id);
  ++e.uses;
  ResidencyView v = m.view();
  v.overwrite = overwrite;
  const AccessPhase access(phase);
  m.issue_hints(m.policy_->on_access(id, e.info.bytes, tier, phase, v));
}

void TensorStore::prefetch(std::span<const TensorId> ids, Tier tier) {
  Impl& m = *impl_;
  std::vector<PrefetchHint> hints;
  for (TensorId id : ids) hints.push_back({id, tier});
  std::lock_guard lock(m.mu_);
  m.issue_hints(hints);
}

void TensorStore::mark_dirty(TensorId id, Tier tier) {
  Impl& m = *impl_;
  std::lock_guard lock(m.mu_);
  Entry& e = m.entry(id);
  Copy& c = e.copy[idx(tier)];
  if (c.state != State::kResident || c.pins == 0) {
    throw Error(fmt::format("TensorStore::mark_dirty: tensor '{}' is not pinned on {}", e.info.name,
                            tier_name(tier)));
  }
  m.make_newest(e, id, tier);
}

void TensorStore::release_pin(TensorId id, Tier tier) noexcept {
  Impl& m = *impl_;
  std::unique_lock lock(m.mu_);
  Entry& e = *m.entries_[id];
  Copy& c = e.copy[idx(tier)];
  if (c.pins <= 0) {
    TM_LOG_ERROR("RUNTIME", "release of tensor '{}' on {} that is not pinned", e.info.name, tier_name(tier));
    return;
  }
  --c.pins;
  if (c.pins == 0) c.user_writing = false;  // filled (acquire_for_overwrite): a source again
  if (c.pins == 0 && tier != e.info.home && !m.policy_->keep_on_release(id, tier, m.view())) {
    if (!m.needs_writeback(e, tier) && c.readers == 0 && !c.writing) {
      m.tier_free(tier, c.ptr);
      m.account(tier, -static_cast<std::int64_t>(c.alloc_bytes));
      c = Copy{};
      ++m.stats_.evictions[idx(tier)];
      m.policy_->on_evicted(id, tier);
    } else {
      m.submit([this, id, tier] {
        try {
          evict(id, tier);
        } catch (const std::exception& ex) {
          TM_LOG_WARN("RUNTIME", "write-back after release of tensor {} failed: {}", id, ex.what());
        }
      });
    }
  }
  m.cv_.notify_all();
}

void TensorStore::discard(TensorId id) {
  Impl& m = *impl_;
  std::lock_guard lock(m.mu_);
  Entry& e = m.entry(id);
  for (int t = 0; t < kNumTiers; ++t) {
    if (e.copy[t].pins > 0) {
      throw Error(fmt::format("TensorStore::discard: tensor '{}' is pinned on {}; release that pin first",
                              e.info.name, tier_name(tier_at(t))));
    }
  }
  const Tier home = e.info.home;
  for (int t = 0; t < idx(home); ++t) {  // cached copies above home
    Copy& c = e.copy[t];
    if (c.state != State::kResident || c.readers > 0 || c.writing) continue;  // in transfer: goes stale
    if (m.needs_writeback(e, tier_at(t))) m.stats_.discarded_dirty_bytes += e.info.bytes;
    m.tier_free(tier_at(t), c.ptr);
    m.account(tier_at(t), -static_cast<std::int64_t>(c.alloc_bytes));
    c = Copy{};
    m.policy_->on_evicted(id, tier_at(t));
  }
  ++e.latest;  // the home copy is the newest; whatever it holds is what the caller said it may be
  e.copy[idx(home)].version = e.latest;
  e.undefined = true;  // prefetches skip it until it is written again
  ++m.stats_.discards;
  m.policy_->on_discard(id);
  m.cv_.notify_all();
}

bool TensorStore::evict(TensorId id, Tier tier) {
  Impl& m = *impl_;
  std::unique_lock lock(m.mu_);
  Entry& e = m.entry(id);
  if (tier == e.info.home || idx(tier) > idx(e.info.home)) return false;
  while (true) {
    Copy& c = e.copy[idx(tier)];
    if (c.state == State::kAbsent) return true;
    if (c.pins > 0) return false;
    if (c.state == State::kResident && c.readers == 0 && !c.writing) {
      m.evict_locked(lock, id, tier);
      return true;
    }
    m.cv_.wait(lock);  // loading / evicting / in use as a source: short
  }
}

void TensorStore::begin_step() {
  std::lock_guard lock(impl_->mu_);
  impl_->policy_->begin_step();
}

void TensorStore::end_step() {
  std::lock_guard lock(impl_->mu_);
  impl_->policy_->end_step();
}

void TensorStore::forget_trace() {
  std::lock_guard lock(impl_->mu_);
  impl_->policy_->forget_trace();
}

void TensorStore::rerecord() {
  std::lock_guard lock(impl_->mu_);
  impl_->policy_->rerecord();
}

void TensorStore::expect_order(std::span<const Access> order) {
  std::lock_guard lock(impl_->mu_);
  impl_->policy_->expect_order(order);
}

TensorStoreStats TensorStore::stats() const {
  Impl& m = *impl_;
  std::lock_guard lock(m.mu_);
  TensorStoreStats s = m.stats_;
  m.policy_->add_stats(s);
  for (int t = 0; t < kNumTiers; ++t) {
    s.resident_bytes[t] = m.used_[t];
    s.budget_bytes[t] = m.budget_[t];
  }
  for (const auto& e : m.entries_) {
    for (int t = 0; t < 2; ++t) {
      if (e->copy[t].pins > 0) s.pinned_bytes[t] += e->copy[t].alloc_bytes;
    }
  }
  const std::uint64_t now = Trace::now_ns();
  for (int p = 0; p < kNumPhases; ++p) s.phases[p].io_busy_ns = m.io_clock_.busy_ns(static_cast<Phase>(p), now);
  s.host_pool_allocated_bytes = m.host_pool ? m.host_pool->allocated_bytes() : 0;
  s.bounce_chunks_in_use = m.bounce ? m.bounce->in_use() : 0;
  s.bounce_chunks_committed = m.bounce ? m.bounce->committed() : 0;
  return s;
}

std::uint64_t TensorStore::stall_ns() const {
  std::lock_guard lock(impl_->mu_);
  return impl_->stats_.stall_ns;
}

std::uint64_t TensorStore::helper_stall_ns() const {
  std::lock_guard lock(impl_->mu_);
  return impl_->stats_.helper_stall_ns;
}

TensorStore::HelperThread::HelperThread() : was_(tl_helper_thread) { tl_helper_thread = true; }
TensorStore::HelperThread::~HelperThread() { tl_helper_thread = was_; }

void TensorStore::drain() {
  Impl& m = *impl_;
  std::unique_lock lock(m.q_mu_);
  m.idle_cv_.wait(lock, [&] { return m.pending_ == 0; });
}

Device* TensorStore::device() const noexcept { return impl_->device.get(); }
const TensorStoreOptions& TensorStore::options() const noexcept { return impl_->opts; }

}  // namespace tiermem
