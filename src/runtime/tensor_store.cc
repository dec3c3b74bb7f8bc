// tensor_store.cc — TensorStore: per-tier residency with versions, budgets with policy-driven
// eviction, and the chunked NVMe<->host<->device pipelines. See tiermem/tensor_store.h.
//
// Residency bookkeeping. Every tensor has one Copy per tier. A copy's `version` says which write
// of the tensor it holds; Entry::latest is the newest. A copy is current when version == latest.
// The home copy always exists. Loads copy from a current resident copy (preferring the nearest
// slower tier), tagging the destination with the version they started from, so a write racing a
// load leaves the result stale (reloaded later), never silently wrong. A copy must be written down
// before it is dropped exactly when it is current and no slower copy is current (it then holds the
// only newest bytes above home).
//
// Locking (TM_GUARDED_BY in comments): mu_ guards every Entry, the accounting and the policy.
// It is released around every transfer; copies in transfer are marked (state loading/evicting,
// `readers` for a copy used as a source, `writing` for a copy being written as a target) so no
// other thread frees, refreshes or writes them meanwhile. Waiters sleep on cv_, notified on
// every state change. Lock order: mu_ -> (allocator / pool / worker-queue / bounce mutexes, all
// leaves). No lock is held across I/O or device copies.
#include "tiermem/tensor_store.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>

#include <fmt/format.h>

#include "tiermem/config.h"
#include "tiermem/device.h"
#include "tiermem/error.h"
#include "tiermem/log.h"
#include "tiermem/lru_policy.h"
#include "tiermem/pinned_host_pool.h"
#include "tiermem/swap_space.h"
#include "tiermem/trace.h"

namespace tiermem {

TensorStoreOptions TensorStoreOptions::from_config(const Config& config) {
  TensorStoreOptions o;
  const TiermemConfig& t = config.tiermem;
  o.device_budget_bytes = t.device_budget_bytes;
  if (t.host_budget_bytes != 0) o.host_budget_bytes = t.host_budget_bytes;
  o.numa_node = t.numa_node;
  o.pipeline_chunk_bytes = t.pipeline_chunk_bytes;
  o.pipeline_chunks = t.pipeline_chunks;
  o.acquire_timeout = std::chrono::duration<double>(t.acquire_timeout_s);
  o.pin_memory = config.zero.offload_param.pin_memory || config.zero.offload_optimizer.pin_memory;
  if (o.pipeline_chunk_bytes % 4096 != 0) {
    throw ConfigError("tiermem.pipeline_chunk_bytes", std::to_string(o.pipeline_chunk_bytes),
                      "must be a multiple of 4096");
  }
  if (t.acquire_timeout_s < 0) {
    throw ConfigError("tiermem.acquire_timeout_s", std::to_string(t.acquire_timeout_s),
                      "must be >= 0 seconds");
  }
  return o;
}

namespace {

enum class State : std::uint8_t { kAbsent, kLoading, kResident, kEvicting };
enum class Mode : std::uint8_t { kAcquire, kFetch, kPrefetch };

struct Copy {
  State state = State::kAbsent;
  void* ptr = nullptr;            // device or host memory; null for NVMe
  std::uint64_t alloc_bytes = 0;  // accounted against the tier's budget
  std::uint64_t version = 0;
  int pins = 0;                   // user pins
  int readers = 0;                // transfers using this copy as their source
  bool writing = false;           // a transfer is writing this (resident) copy as its target
  bool user_writing = false;      // pinned by acquire_for_overwrite: not a source until released
};

struct Entry {
  TensorInfo info;
  Copy copy[kNumTiers];
  std::vector<SwapExtent> extents;  // home kNvme: one extent per pipeline chunk
  SwapSpace* swap = nullptr;        // home kNvme: the swap space holding `extents`
  std::uint64_t latest = 1;
};

constexpr int idx(Tier t) { return static_cast<int>(t); }
constexpr Tier tier_at(int i) { return static_cast<Tier>(i); }

std::string track(Tier from, Tier to) {
  return std::string(tier_name(from)) + "->" + std::string(tier_name(to));
}

// Fixed set of pinned bounce chunks shared by all pipelines.
class BouncePool {
 public:
  BouncePool(PinnedHostPool& pool, int count, std::uint64_t chunk_bytes) {
    for (int i = 0; i < count; ++i) free_.push_back(pool.allocate(chunk_bytes));
    count_ = free_.size();
  }
  void* acquire() {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return !free_.empty(); });
    void* p = free_.back();
    free_.pop_back();
    return p;
  }
  void* try_acquire() {
    std::lock_guard lock(mu_);
    if (free_.empty()) return nullptr;
    void* p = free_.back();
    free_.pop_back();
    return p;
  }
  void release(void* p) {
    {
      std::lock_guard lock(mu_);
      free_.push_back(p);
    }
    cv_.notify_one();
  }
  // Chunks acquired and not yet released.
  std::uint64_t in_use() {
    std::lock_guard lock(mu_);
    return count_ - free_.size();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<void*> free_;  // guarded by mu_
  std::size_t count_ = 0;    // const after construction
};

}  // namespace

struct TensorStore::Impl {
  TensorStoreOptions opts;
  std::shared_ptr<Device> device;
  std::shared_ptr<SwapSpace> swap;
  std::unique_ptr<PinnedHostPool> host_pool;
  std::unique_ptr<PinnedHostPool> bounce_pool_mem;
  std::unique_ptr<BouncePool> bounce;
  std::vector<void*> registered_host;  // registered with the device (unregister at exit)
  std::vector<void*> registered_io;    // registered with the swap's engine

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::unique_ptr<Entry>> entries_;                // guarded by mu_
  std::unordered_map<std::string, TensorId> by_name_;          // guarded by mu_
  std::unique_ptr<ResidencyPolicy> policy_;                    // guarded by mu_
  std::uint64_t budget_[kNumTiers] = {};                       // const after construction
  std::uint64_t used_[kNumTiers] = {};                         // guarded by mu_
  TensorStoreStats stats_;                                     // guarded by mu_

  // Worker threads for fetch/prefetch/async write-back.
  std::mutex q_mu_;
  std::condition_variable q_cv_, idle_cv_;
  std::deque<std::function<void()>> queue_;  // guarded by q_mu_
  int busy_ = 0;                             // guarded by q_mu_
  bool stop_ = false;                        // guarded by q_mu_
  std::vector<std::thread> workers_;

  // ---------------------------------------------------------------- helpers (need mu_ held)

  Entry& entry(TensorId id) {
    if (id >= entries_.size()) throw Error(fmt::format("TensorStore: unknown tensor id {}", id));
    return *entries_[id];
  }

  ResidencyView view() const {
    ResidencyView v;
    for (int t = 0; t < kNumTiers; ++t) {
      v.resident_bytes[t] = used_[t];
      v.budget_bytes[t] = budget_[t];
    }
    return v;
  }

  std::uint64_t alloc_size(Tier t, std::uint64_t bytes) const {
    return t == Tier::kDevice ? device->allocation_size(bytes) : PinnedHostPool::allocation_size(bytes);
  }

  // `home`: a home copy (lives until the tensor's contents are replaced): host homes are carved
  // from the top of the pool so that they never fragment the space caches cycle through.
  void* tier_alloc(Tier t, std::uint64_t bytes, bool home = false) {
    if (t == Tier::kDevice) return device->try_allocate(bytes);
    return home ? host_pool->try_allocate_high(bytes) : host_pool->try_allocate(bytes);
  }
  void tier_free(Tier t, void* p) {
    if (t == Tier::kDevice) {
      device->free(p);
    } else {
      host_pool->free(p);
    }
  }

  void account(Tier t, std::int64_t delta) {
    used_[idx(t)] = static_cast<std::uint64_t>(static_cast<std::int64_t>(used_[idx(t)]) + delta);
    stats_.peak_resident_bytes[idx(t)] = std::max(stats_.peak_resident_bytes[idx(t)], used_[idx(t)]);
  }

  std::uint64_t pinned_bytes(Tier t, int* count = nullptr) const {
    std::uint64_t b = 0;
    int n = 0;
    for (const auto& e : entries_) {
      const Copy& c = e->copy[idx(t)];
      if (c.state != State::kAbsent && (c.pins > 0 || e->info.home == t)) {
        b += c.alloc_bytes;
        ++n;
      }
    }
    if (count) *count = n;
    return b;
  }

  // True when the copy at `t` holds the only newest bytes above home (must be written down).
  bool needs_writeback(const Entry& e, Tier t) const {
    const Copy& c = e.copy[idx(t)];
    if (c.version != e.latest || t == e.info.home) return false;
    for (int l = idx(t) + 1; l <= idx(e.info.home); ++l) {
      const Copy& lc = e.copy[l];
      if (lc.version == e.latest && (lc.state == State::kResident || lc.state == State::kEvicting)) {
        return false;
      }
    }
    return true;
  }

  // The copy at `tier` holds the newest bytes from now on (the caller wrote, or will write, all of
  // them): it gets a new version, and the other cached copies nobody uses are dropped (no I/O:
  // they are stale). Wakes waiters.
  void make_newest(Entry& e, TensorId id, Tier tier) {
    ++e.latest;
    e.copy[idx(tier)].version = e.latest;
    for (int t = 0; t < 2; ++t) {
      Copy& o = e.copy[t];
      if (t != idx(tier) && tier_at(t) != e.info.home && o.state == State::kResident && o.pins == 0 &&
          o.readers == 0 && !o.writing) {
        tier_free(tier_at(t), o.ptr);
        account(tier_at(t), -static_cast<std::int64_t>(o.alloc_bytes));
        o = Copy{};
        policy_->on_evicted(id, tier_at(t));
      }
    }
    cv_.notify_all();
  }

  // Where to load tier t of e from: a current, resident copy not being written; nearest slower
  // tier first, then faster ones. -1 when none is available right now.
  int find_source(const Entry& e, Tier t) const {
    auto ok = [&](int s) {
      const Copy& c = e.copy[s];
      return s != idx(t) && c.state == State::kResident && c.version == e.latest && !c.writing &&
             !c.user_writing;
    };
    for (int s = idx(t) + 1; s < kNumTiers && s <= idx(e.info.home); ++s) {
      if (ok(s)) return s;
    }
    for (int s = idx(t) - 1; s >= 0; --s) {
      if (ok(s)) return s;
    }
    return -1;
  }

  // Waits on cv_ until notified or `deadline`; records the wait in the trace. Returns false on
  // timeout.
  bool wait(std::unique_lock<std::mutex>& lock, std::chrono::steady_clock::time_point deadline) {
    TraceSpan span("wait", "wait");
    return cv_.wait_until(lock, deadline) != std::cv_status::timeout;
  }

  // ---------------------------------------------------------------- transfers (no lock held)

  void transfer(const Entry& e, Tier from, void* from_ptr, Tier to, void* to_ptr) {
    const std::uint64_t bytes = e.info.bytes;
    if (bytes == 0) return;
    TraceSpan span(e.info.name, track(from, to));
    try {
      transfer_bytes(e, from, from_ptr, to, to_ptr);
    } catch (const IoError& err) {
      throw err.with_context(io_context(e, track(from, to)));
    }
  }

  // "tensor 'name' (<what>)": what TensorStore puts in front of the IoErrors it propagates.
  static std::string io_context(const Entry& e, const std::string& what) {
    return "tensor '" + e.info.name + "' (" + what + ")";
  }

  void transfer_bytes(const Entry& e, Tier from, void* from_ptr, Tier to, void* to_ptr) {
    const std::uint64_t bytes = e.info.bytes;
    if (from == Tier::kHost && to == Tier::kDevice) {
      device->copy_h2d(to_ptr, from_ptr, bytes);
    } else if (from == Tier::kDevice && to == Tier::kHost) {
      device->copy_d2h(to_ptr, from_ptr, bytes);
    } else if (from == Tier::kNvme && to == Tier::kHost) {
      nvme_to_host(e, to_ptr);
    } else if (from == Tier::kHost && to == Tier::kNvme) {
      host_to_nvme(e, from_ptr);
    } else if (from == Tier::kNvme && to == Tier::kDevice) {
      nvme_to_device(e, to_ptr);
    } else if (from == Tier::kDevice && to == Tier::kNvme) {
      device_to_nvme(e, from_ptr);
    } else {
      throw Error("TensorStore: no transfer from " + std::string(tier_name(from)) + " to " +
                  std::string(tier_name(to)));
    }
  }

  std::uint64_t chunk_len(const Entry& e, std::size_t k) const {
    return std::min<std::uint64_t>(opts.pipeline_chunk_bytes, e.info.bytes - k * opts.pipeline_chunk_bytes);
  }

  void nvme_to_host(const Entry& e, void* dst) {
    std::vector<IoRequest> reqs;
    for (std::size_t k = 0; k < e.extents.size(); ++k) {
      reqs.push_back(e.swap->read(e.extents[k], static_cast<char*>(dst) + k * opts.pipeline_chunk_bytes,
                                chunk_len(e, k)));
    }
    wait_all(reqs);
  }

  void host_to_nvme(const Entry& e, const void* src) {
    std::vector<IoRequest> reqs;
    for (std::size_t k = 0; k < e.extents.size(); ++k) {
      reqs.push_back(e.swap->write(e.extents[k],
                                 static_cast<const char*>(src) + k * opts.pipeline_chunk_bytes,
                                 chunk_len(e, k)));
    }
    wait_all(reqs);
  }

  // A two-stage chunk pipeline through bounce buffers (the NVMe <-> device paths): for each
  // chunk k < n, start_first(k, buf) starts stage one into/out of a bounce buffer; when it has
  // completed, start_second(k, buf) starts stage two, so stage one of chunk k+1 overlaps stage two
  // of chunk k, with at most opts.pipeline_chunks chunks in flight. Each start returns a handle
  // with wait() (blocks, rethrows the operation's error) and ready() (IoRequest, DeviceEvent).
  // Deadlock-free with other pipelines sharing the bounce pool: it blocks for a buffer only when
  // it holds none; otherwise it finishes its own oldest chunk to free one. On an error (a failed
  // or refused operation) it waits for everything it started, returns every buffer, rethrows.
  template <class StartFirst, class StartSecond>
  void bounce_pipeline(std::size_t n, StartFirst start_first, StartSecond start_second) {
    using First = decltype(start_first(std::size_t{}, static_cast<void*>(nullptr)));
    using Second = decltype(start_second(std::size_t{}, static_cast<void*>(nullptr)));
    struct Slot {
      std::size_t k;
      void* buf;
      First first;
      Second second;
    };
    const std::size_t window = std::min<std::size_t>(n, static_cast<std::size_t>(opts.pipeline_chunks));
    std::deque<Slot> in_first, in_second;
    std::size_t next = 0;
    // Waits for the oldest stage two, gives its buffer back, rethrows its error.
    auto retire = [&] {
      Slot s = std::move(in_second.front());
      in_second.pop_front();
      try {
        s.second.wait();
      } catch (...) {
        bounce->release(s.buf);
        throw;
      }
      bounce->release(s.buf);
    };
    try {
      while (next < n || !in_first.empty() || !in_second.empty()) {
        while (next < n && in_first.size() + in_second.size() < window) {
          void* buf = (in_first.empty() && in_second.empty()) ? bounce->acquire() : bounce->try_acquire();
          if (buf == nullptr) break;
          First h;
          try {
            h = start_first(next, buf);
          } catch (...) {  // refused at submission: nothing in flight on buf
            bounce->release(buf);
            throw;
          }
          in_first.push_back({next, buf, std::move(h), {}});
          ++next;
        }
        if (!in_first.empty()) {
          Slot s = std::move(in_first.front());
          in_first.pop_front();
          try {  // a failed stage one, or a stage two refused at submission: buf is idle
            s.first.wait();
            s.second = start_second(s.k, s.buf);
          } catch (...) {
            bounce->release(s.buf);
            throw;
          }
          in_second.push_back(std::move(s));
          while (!in_second.empty() && in_second.front().second.ready()) retire();
        } else if (!in_second.empty()) {
          retire();
        }
      }
    } catch (...) {
      for (Slot& s : in_first) {
        try {
          s.first.wait();
        } catch (...) {
        }
        bounce->release(s.buf);
      }
      for (Slot& s : in_second) {
        try {
          s.second.wait();
        } catch (...) {
        }
        bounce->release(s.buf);
      }
      throw;
    }
  }

  // NVMe -> device: the read of chunk k+1 overlaps the H2D copy of chunk k.
  void nvme_to_device(const Entry& e, void* dst) {
    bounce_pipeline(
        e.extents.size(),
        [&](std::size_t k, void* buf) { return e.swap->read(e.extents[k], buf, chunk_len(e, k)); },
        [&](std::size_t k, void* buf) {
          return device->copy_h2d_async(static_cast<char*>(dst) + k * opts.pipeline_chunk_bytes, buf,
                                        chunk_len(e, k));
        });
  }

  // Device -> NVMe: the D2H copy of chunk k+1 overlaps the NVMe write of chunk k.
  void device_to_nvme(const Entry& e, const void* src) {
    bounce_pipeline(
        e.extents.size(),
        [&](std::size_t k, void* buf) {
          return device->copy_d2h_async(
              buf, static_cast<const char*>(src) + k * opts.pipeline_chunk_bytes, chunk_len(e, k));
        },
        [&](std::size_t k, void* buf) { return e.swap->write(e.extents[k], buf, chunk_len(e, k)); });
  }

  // ---------------------------------------------------------------- eviction (mu_ held)

  // Evicts the resident, unpinned copy of `id` at `t` (writing it down first when needed).
  // Releases mu_ during the write-back. Throws the write-back's error (copy kept resident).
  void evict_locked(std::unique_lock<std::mutex>& lock, TensorId id, Tier t) {
    Entry& e = *entries_[id];
    Copy& c = e.copy[idx(t)];
    c.state = State::kEvicting;
    if (needs_writeback(e, t)) {
      // Target: the next tier down when its copy is resident and free to write, else home.
      Tier target = e.info.home;
      if (t == Tier::kDevice && e.info.home == Tier::kNvme) {
        Copy& h = e.copy[idx(Tier::kHost)];
        if (h.state == State::kResident && !h.writing && h.readers == 0 && h.pins == 0) target = Tier::kHost;
      }
      Copy& dst = e.copy[idx(target)];
      while (dst.writing) cv_.wait(lock);  // another write to the same target finishes first
      dst.writing = true;
      const std::uint64_t version = c.version;
      lock.unlock();
      std::exception_ptr err;
      try {
        transfer(e, t, c.ptr, target, dst.ptr);
      } catch (...) {
        err = std::current_exception();
      }
      lock.lock();
      dst.writing = false;
      if (err) {
        c.state = State::kResident;
        cv_.notify_all();
        std::rethrow_exception(err);
      }
      dst.version = std::max(dst.version, version);
      stats_.bytes_moved[idx(t)][idx(target)] += e.info.bytes;
      ++stats_.moves[idx(t)][idx(target)];
      ++stats_.writebacks[idx(t)];
    }
    tier_free(t, c.ptr);
    account(t, -static_cast<std::int64_t>(c.alloc_bytes));
    c = Copy{};
    ++stats_.evictions[idx(t)];
    policy_->on_evicted(id, t);
    cv_.notify_all();
  }

  // Allocates `size` accounted bytes at `t`, evicting per the policy; waits for releases until
  // `deadline`. Returns nullptr for a prefetch that would have to wait, or whose victims the
  // policy refuses: a prefetch of `incoming` first plans every victim it needs (choose_victim
  // over the remaining candidates) and asks evict_for_prefetch once per planned victim; it evicts
  // none unless all are accepted, so a refused prefetch costs nothing. Throws OutOfMemoryError.
  void* make_room(std::unique_lock<std::mutex>& lock, Tier t, std::uint64_t size, Mode mode,
                  std::chrono::steady_clock::time_point deadline,
                  TensorId incoming = kInvalidTensor, bool home = false) {
    if (size > budget_[idx(t)]) {
      throw OutOfMemoryError(t, size, budget_[idx(t)],
                             fmt::format("larger than the whole {} budget", tier_name(t)));
    }
    std::vector<TensorId> candidates;
    while (true) {
      if (used_[idx(t)] + size <= budget_[idx(t)]) {
        if (void* p = tier_alloc(t, size, home)) return p;
      }
      candidates.clear();
      for (TensorId i = 0; i < entries_.size(); ++i) {
        const Entry& e = *entries_[i];
        const Copy& c = e.copy[idx(t)];
        if (c.state == State::kResident && c.pins == 0 && c.readers == 0 && !c.writing && e.info.home != t) {
          candidates.push_back(i);
        }
      }
      if (!candidates.empty() && mode == Mode::kPrefetch) {
        if (!plan_prefetch_evictions(lock, t, size, incoming, candidates)) return nullptr;
        continue;
      }
      if (!candidates.empty()) {
        TensorId victim = policy_->choose_victim(t, candidates);
        if (std::find(candidates.begin(), candidates.end(), victim) == candidates.end()) {
          victim = candidates.front();  // a policy bug must not corrupt the store
        }
        evict_locked(lock, victim, t);
        continue;
      }
      if (mode == Mode::kPrefetch) return nullptr;
      if (!wait(lock, deadline)) {
        if (used_[idx(t)] + size <= budget_[idx(t)]) {
          if (void* p = tier_alloc(t, size, home)) return p;
        }
        int n = 0;
        std::uint64_t pinned = pinned_bytes(t, &n);
        ++stats_.oom_errors;
        throw OutOfMemoryError(
            t, size, budget_[idx(t)] - used_[idx(t)],
            fmt::format("{} tier full after waiting {:.1f} s for a release: budget {}, resident {}, "
                        "pinned {} in {} tensors (pins and home copies cannot be evicted); release "
                        "pins sooner, raise the {} budget or tiermem.acquire_timeout_s",
                        tier_name(t), opts.acquire_timeout.count(), format_bytes(budget_[idx(t)]),
                        format_bytes(used_[idx(t)]), format_bytes(pinned), n, tier_name(t)));
      }
    }
  }

  // For a prefetch of `incoming` needing `size` bytes at `t`: picks victims among `candidates`
  // (consumed) until the budget fits (at least one when the budget fits but the allocator does
  // not), asking the policy's evict_for_prefetch for each; evicts them all only if every one is
  // accepted. Returns false (nothing evicted, the caller drops the prefetch) on a refusal or when
  // the candidates cannot free enough. mu_ held; released during write-backs.
  bool plan_prefetch_evictions(std::unique_lock<std::mutex>& lock, Tier t, std::uint64_t size,
                               TensorId incoming, std::vector<TensorId>& candidates) {
    std::vector<TensorId> plan;
    std::uint64_t freed = 0;
    while (used_[idx(t)] - freed + size > budget_[idx(t)] || plan.empty()) {
      if (candidates.empty()) return false;
      TensorId victim = policy_->choose_victim(t, candidates);
      auto it = std::find(candidates.begin(), candidates.end(), victim);
      if (it == candidates.end()) {
        it = candidates.begin();  // a policy bug must not corrupt the store
        victim = *it;
      }
      if (!policy_->evict_for_prefetch(t, incoming, victim)) return false;
      plan.push_back(victim);
      freed += entries_[victim]->copy[idx(t)].alloc_bytes;
      candidates.erase(it);
    }
    for (TensorId v : plan) {
      // evict_locked releases mu_ during a write-back: re-check each victim is still evictable.
      const Copy& c = entries_[v]->copy[idx(t)];
      if (c.state == State::kResident && c.pins == 0 && c.readers == 0 && !c.writing) {
        evict_locked(lock, v, t);
      }
    }
    return true;
  }

  // ---------------------------------------------------------------- ensure (mu_ held)

  // Makes `id` resident and current at `t`; pins it when mode == kAcquire. Returns the copy's
  // pointer, or nullptr when a prefetch gave up.
  void* ensure(std::unique_lock<std::mutex>& lock, TensorId id, Tier t, Mode mode,
               std::chrono::steady_clock::time_point deadline, bool* hit) {
    Entry& e = entry(id);
    if (t == Tier::kNvme && mode == Mode::kAcquire) {
      throw Error("TensorStore: tensor '" + e.info.name + "' cannot be pinned on the nvme tier");
    }
    if (idx(t) > idx(e.info.home)) {
      throw Error(fmt::format("TensorStore: tensor '{}' has home {}; it cannot be brought to the "
                              "slower tier {}",
                              e.info.name, tier_name(e.info.home), tier_name(t)));
    }
    if (t == Tier::kDevice && !device) {
      throw NotSupportedError("TensorStore: no device was given, tensor '" + e.info.name +
                              "' cannot go to the device tier");
    }
    *hit = true;
    auto timeout = [&] {
      ++stats_.oom_errors;
      int n = 0;
      std::uint64_t pinned = pinned_bytes(t, &n);
      return OutOfMemoryError(t, e.info.bytes, budget_[idx(t)] - used_[idx(t)],
                              fmt::format("timed out after {:.1f} s waiting for tensor '{}' on {} "
                                          "(busy: pinned elsewhere or in transfer); pinned {} in {} tensors",
                                          opts.acquire_timeout.count(), e.info.name, tier_name(t),
                                          format_bytes(pinned), n));
    };
    while (true) {
      Copy& c = e.copy[idx(t)];
      if (c.state == State::kResident && c.version == e.latest && !c.writing) {
        if (mode == Mode::kAcquire) ++c.pins;
        return c.ptr;
      }
      *hit = false;
      if (c.state == State::kLoading || c.state == State::kEvicting || c.writing ||
          (c.state == State::kResident && (c.pins > 0 || c.readers > 0))) {
        if (mode == Mode::kPrefetch) return nullptr;
        if (!wait(lock, deadline)) throw timeout();
        continue;
      }
      int src = find_source(e, t);
      if (src < 0) {  // the newest bytes are in transfer (being written down); wait for them
        if (mode == Mode::kPrefetch) return nullptr;
        if (!wait(lock, deadline)) throw timeout();
        continue;
      }
      if (c.state == State::kAbsent) {
        std::uint64_t size = alloc_size(t, e.info.bytes);
        void* p = make_room(lock, t, size, mode, deadline, id);
        if (p == nullptr) return nullptr;
        if (c.state != State::kAbsent) {  // someone else started meanwhile (mu_ was released)
          tier_free(t, p);
          continue;
        }
        src = find_source(e, t);
        if (src < 0) {
          tier_free(t, p);
          continue;
        }
        c.ptr = p;
        c.alloc_bytes = size;
        account(t, static_cast<std::int64_t>(size));
      }
      // Load (or refresh in place) from src.
      const bool refresh = c.state == State::kResident;
      c.state = State::kLoading;
      Copy& s = e.copy[src];
      ++s.readers;
      const std::uint64_t version = s.version;
      lock.unlock();
      std::exception_ptr err;
      try {
        transfer(e, tier_at(src), s.ptr, t, c.ptr);
      } catch (...) {
        err = std::current_exception();
      }
      lock.lock();
      --s.readers;
      if (err) {
        if (refresh) {  // keep the (stale) allocation; the home copy is never freed
          c.state = State::kResident;
        } else {
          tier_free(t, c.ptr);
          account(t, -static_cast<std::int64_t>(c.alloc_bytes));
          c = Copy{};
        }
        cv_.notify_all();
        std::rethrow_exception(err);
      }
      c.state = State::kResident;
      c.version = version;
      stats_.bytes_moved[src][idx(t)] += e.info.bytes;
      ++stats_.moves[src][idx(t)];
      cv_.notify_all();
      if (c.version == e.latest) {
        if (mode == Mode::kAcquire) ++c.pins;
        return c.ptr;
      }
    }
  }

  // ---------------------------------------------------------------- workers

  void submit(std::function<void()> fn) {
    {
      std::lock_guard lock(q_mu_);
      queue_.push_back(std::move(fn));
    }
    q_cv_.notify_one();
  }

  void worker_loop() {
    while (true) {
      std::function<void()> fn;
      {
        std::unique_lock lock(q_mu_);
        q_cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        fn = std::move(queue_.front());
        queue_.pop_front();
        ++busy_;
      }
      fn();  // never throws: tasks catch their own errors
      {
        std::lock_guard lock(q_mu_);
        --busy_;
      }
      idle_cv_.notify_all();
    }
  }

  void prefetch_one(TensorId id, Tier t) {
    try {
      std::unique_lock lock(mu_);
      bool hit = false;
      void* p = ensure(lock, id, t, Mode::kPrefetch, std::chrono::steady_clock::now(), &hit);
      if (p == nullptr) ++stats_.prefetches_dropped;
    } catch (const std::exception& ex) {
      std::lock_guard lock(mu_);
      ++stats_.prefetches_dropped;
      TM_LOG_DEBUG("RUNTIME", "prefetch of tensor {} to {} dropped: {}", id, tier_name(t), ex.what());
    }
  }

  // Issues the policy's hints (mu_ held; the work runs on workers).
  void issue_hints(const std::vector<PrefetchHint>& hints) {
    for (const PrefetchHint& h : hints) {
      if (h.id >= entries_.size()) continue;
      if (idx(h.tier) > idx(entries_[h.id]->info.home)) continue;
      ++stats_.prefetches_issued;
      submit([this, h] { prefetch_one(h.id, h.tier); });
    }
  }
};

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

  PinnedHostPoolOptions hp;
  hp.budget_bytes = options.host_budget_bytes;
  hp.mapping_bytes = std::max<std::uint64_t>(options.host_budget_bytes, 4096);
  hp.pin_memory = options.pin_memory;
  hp.numa_node = options.numa_node;
  hp.map_now = true;
  // Registering the pool as io_uring fixed buffers faults all of it in anyway; faulting it in
  // first lets the pool see which of it the kernel gave 2 MiB pages, so the engine can size its
  // pieces for them (HostRegion::contiguous_bytes). RSS is the same either way.
  hp.populate = m.swap != nullptr && m.swap->engine().options().fixed_buffers;
  m.host_pool = std::make_unique<PinnedHostPool>(hp);

  PinnedHostPoolOptions bp = hp;
  bp.budget_bytes = options.pipeline_chunk_bytes * static_cast<std::uint64_t>(options.pipeline_chunks);
  bp.mapping_bytes = bp.budget_bytes;
  bp.populate = true;  // small, and always in use: fault it in so its huge pages are known
  m.bounce_pool_mem = std::make_unique<PinnedHostPool>(bp);
  m.bounce = std::make_unique<BouncePool>(*m.bounce_pool_mem, options.pipeline_chunks,
                                          options.pipeline_chunk_bytes);

  for (PinnedHostPool* pool : {m.host_pool.get(), m.bounce_pool_mem.get()}) {
    for (const HostRegion& r : pool->regions()) {
      if (m.device && m.device->kind() != DeviceKind::kSim && m.device->register_host(r.base, r.bytes)) {
        m.registered_host.push_back(r.base);
      }
      // Passed with its page layout so the engine sizes pieces to the device; unregistered at the
      // end whatever the result (the engine remembers the layout either way).
      if (m.swap) {
        m.swap->engine().register_buffers(r.base, r.bytes, r.contiguous_bytes);
        m.registered_io.push_back(r.base);
      }
    }
  }

  m.budget_[idx(Tier::kDevice)] = 0;
  if (m.device) {
    m.budget_[idx(Tier::kDevice)] = options.device_budget_bytes == 0
                                        ? m.device->budget_bytes()
                                        : std::min(options.device_budget_bytes, m.device->budget_bytes());
  }
  m.budget_[idx(Tier::kHost)] = m.host_pool->budget_bytes();
  m.budget_[idx(Tier::kNvme)] = UINT64_MAX;  // bounded by the swap space (OutOfMemoryError there)
  for (int i = 0; i < options.worker_threads; ++i) m.workers_.emplace_back([&m] { m.worker_loop(); });
  TM_LOG_DEBUG("RUNTIME", "TensorStore: device {} ({}), host {} ({}), nvme {}",
               m.device ? m.device->name() : "none", format_bytes(m.budget_[0]),
               format_bytes(m.budget_[1]), m.host_pool->pinned() ? "pinned" : "unpinned",
               m.swap ? "swap space" : "none");
}

TensorStore::~TensorStore() {
  Impl& m = *impl_;
  {
    std::lock_guard lock(m.q_mu_);
    m.stop_ = true;
  }
  m.q_cv_.notify_all();
  for (auto& t : m.workers_) t.join();
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
  for (void* p : m.registered_io) m.swap->engine().unregister_buffers(p);
  for (void* p : m.registered_host) m.device->unregister_host(p);
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
  if (spec.home == Tier::kNvme && !m.swap && !spec.swap) {
    throw NotSupportedError("TensorStore: tensor '" + spec.name + "' has home nvme but no swap space was given");
  }
  if (spec.home == Tier::kDevice && !m.device) {
    throw NotSupportedError("TensorStore: tensor '" + spec.name + "' has home device but no device was given");
  }
  auto e = std::make_unique<Entry>();
  e->info = TensorInfo{spec.name, spec.dtype, spec.shape, bytes, spec.home};
  if (spec.home == Tier::kNvme) e->swap = spec.swap ? spec.swap : m.swap.get();
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
                                 " bytes, home nvme): " + oom.what());
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
  m.issue_hints(m.policy_->on_access(id, e.info.bytes, tier, phase, m.view()));
  bool hit = false;
  void* p = m.ensure(lock, id, tier, Mode::kAcquire, deadline, &hit);
  if (hit) {
    ++m.stats_.hits;
  } else {
    ++m.stats_.misses;
    m.stats_.stall_ns += static_cast<std::uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count());
    // The caller was blocked on this move: a span on the `wait` track (the time lost to I/O).
    if (trace_start != 0) {
      Trace::global().complete("miss " + e.info.name + " -> " + std::string(tier_name(tier)), "wait",
                               trace_start, Trace::now_ns() - trace_start);
    }
  }
  return Pin(this, id, tier, p, e.info.bytes);
}

TensorStore::Pin TensorStore::acquire_for_overwrite(TensorId id, Tier tier) {
  Impl& m = *impl_;
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(m.opts.acquire_timeout);
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
  for (int t = 0; t < 2; ++t) {
    if (e.copy[t].pins > 0) {
      throw Error(fmt::format("TensorStore::acquire_for_overwrite: tensor '{}' is pinned on {}; release that "
                              "pin first",
                              e.info.name, tier_name(tier_at(t))));
    }
  }
  while (true) {
    Copy& c = e.copy[idx(tier)];
    if (c.state == State::kLoading || c.state == State::kEvicting || c.writing || c.readers > 0) {
      if (!m.wait(lock, deadline)) {
        throw OutOfMemoryError(tier, e.info.bytes, 0,
                               fmt::format("timed out after {:.1f} s waiting for tensor '{}' on {} (in transfer)",
                                           m.opts.acquire_timeout.count(), e.info.name, tier_name(tier)));
      }
      continue;
    }
    if (c.state == State::kAbsent) {
      const std::uint64_t size = m.alloc_size(tier, e.info.bytes);
      void* p = m.make_room(lock, tier, size, Mode::kAcquire, deadline, id);
      if (c.state != State::kAbsent) {  // someone else started meanwhile (mu_ was released)
        m.tier_free(tier, p);
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
    return Pin(this, id, tier, c.ptr, e.info.bytes);
  }
}

std::future<void> TensorStore::fetch(TensorId id, Tier tier, Phase phase) {
  Impl& m = *impl_;
  auto promise = std::make_shared<std::promise<void>>();
  std::future<void> fut = promise->get_future();
  {
    std::lock_guard lock(m.mu_);
    Entry& e = m.entry(id);
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

void TensorStore::flush() {
  Impl& m = *impl_;
  std::unique_lock lock(m.mu_);
  for (TensorId id = 0; id < m.entries_.size(); ++id) {
    Entry& e = *m.entries_[id];
    const Tier home = e.info.home;
    while (e.copy[idx(home)].version != e.latest) {
      int src = -1;
      for (int t = 0; t < idx(home); ++t) {
        const Copy& c = e.copy[t];
        if (c.state == State::kResident && c.version == e.latest && !c.writing) src = t;
      }
      Copy& h = e.copy[idx(home)];
      if (src < 0 || h.writing || h.readers > 0) {
        m.cv_.wait(lock);  // the newest copy is in transfer; it lands somewhere shortly
        continue;
      }
      Copy& s = e.copy[src];
      ++s.readers;
      h.writing = true;
      const std::uint64_t version = s.version;
      lock.unlock();
      std::exception_ptr err;
      try {
        m.transfer(e, tier_at(src), s.ptr, home, h.ptr);
      } catch (...) {
        err = std::current_exception();
      }
      lock.lock();
      --s.readers;
      h.writing = false;
      m.cv_.notify_all();
      if (err) std::rethrow_exception(err);
      h.version = std::max(h.version, version);
      m.stats_.bytes_moved[src][idx(home)] += e.info.bytes;
      ++m.stats_.moves[src][idx(home)];
      ++m.stats_.writebacks[src];
    }
  }
}

void TensorStore::read(TensorId id, std::span<std::byte> out) {
  Impl& m = *impl_;
  std::unique_lock lock(m.mu_);
  Entry& e = m.entry(id);
  if (out.size() != e.info.bytes) {
    throw Error(fmt::format("TensorStore::read: tensor '{}' has {} bytes, buffer {}", e.info.name,
                            e.info.bytes, out.size()));
  }
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(m.opts.acquire_timeout);
  int src = -1;
  while ((src = m.find_source(e, Tier::kNvme)) < 0 &&
         !(e.copy[idx(Tier::kNvme)].state == State::kResident &&
           e.copy[idx(Tier::kNvme)].version == e.latest && !e.copy[idx(Tier::kNvme)].writing)) {
    if (!m.wait(lock, deadline)) throw Error("TensorStore::read: timed out waiting for '" + e.info.name + "'");
  }
  if (src < 0) src = idx(Tier::kNvme);
  Copy& s = e.copy[src];
  ++s.readers;
  lock.unlock();
  std::exception_ptr err;
  try {
    TraceSpan span(e.info.name, std::string(tier_name(tier_at(src))) + "->caller");
    if (src == idx(Tier::kDevice)) {
      m.device->copy_d2h(out.data(), s.ptr, e.info.bytes);
    } else if (src == idx(Tier::kHost)) {
      std::memcpy(out.data(), s.ptr, e.info.bytes);
    } else {
      m.nvme_to_host(e, out.data());
    }
  } catch (const IoError& io) {
    err = std::make_exception_ptr(io.with_context(Impl::io_context(e, "nvme->caller")));
  } catch (...) {
    err = std::current_exception();
  }
  lock.lock();
  --s.readers;
  m.cv_.notify_all();
  if (err) std::rethrow_exception(err);
}

void TensorStore::write(TensorId id, std::span<const std::byte> in) {
  Impl& m = *impl_;
  std::unique_lock lock(m.mu_);
  Entry& e = m.entry(id);
  if (in.size() != e.info.bytes) {
    throw Error(fmt::format("TensorStore::write: tensor '{}' has {} bytes, buffer {}", e.info.name,
                            e.info.bytes, in.size()));
  }
  const Tier home = e.info.home;
  while (true) {
    bool busy = false;
    for (int t = 0; t < kNumTiers; ++t) {
      const Copy& c = e.copy[t];
      if (tier_at(t) != home && c.pins > 0) {
        throw Error(fmt::format("TensorStore::write: tensor '{}' is pinned on {}", e.info.name,
                                tier_name(tier_at(t))));
      }
      if (c.readers > 0 || c.writing || c.state == State::kLoading || c.state == State::kEvicting) busy = true;
    }
    if (!busy) break;
    m.cv_.wait(lock);
  }
  // Every resident copy is marked `writing` for the duration: nobody loads from, pins or evicts
  // this tensor meanwhile. Cached copies are dropped only once the new bytes are safely at home,
  // so a failed write leaves the tensor exactly as it was (nothing lost).
  for (int t = 0; t < kNumTiers; ++t) {
    if (e.copy[t].state == State::kResident) e.copy[t].writing = true;
  }
  lock.unlock();
  std::exception_ptr err;
  std::vector<SwapExtent> fresh;  // home kNvme: the new bytes go to new extents, swapped in at the end
  try {
    TraceSpan span(e.info.name, "caller->" + std::string(tier_name(home)));
    Copy& h = e.copy[idx(home)];
    if (home == Tier::kDevice) {
      m.device->copy_h2d(h.ptr, in.data(), e.info.bytes);
    } else if (home == Tier::kHost) {
      std::memcpy(h.ptr, in.data(), e.info.bytes);
    } else {
      // Not in place: a failure halfway must not leave the home copy half old, half new.
      for (const SwapExtent& x : e.extents) fresh.push_back(e.swap->allocate(x.bytes));
      std::vector<IoRequest> reqs;
      for (std::size_t k = 0; k < fresh.size() && e.info.bytes > 0; ++k) {
        reqs.push_back(e.swap->write(fresh[k], in.data() + k * m.opts.pipeline_chunk_bytes,
                                     m.chunk_len(e, k)));
      }
      wait_all(reqs);
    }
  } catch (const IoError& io) {
    err = std::make_exception_ptr(io.with_context(Impl::io_context(e, "caller->nvme")));
  } catch (...) {
    err = std::current_exception();
  }
  if (err) {
    for (const SwapExtent& x : fresh) e.swap->free(x);
    fresh.clear();
  }
  lock.lock();
  for (int t = 0; t < kNumTiers; ++t) e.copy[t].writing = false;
  if (!err) {
    if (home == Tier::kNvme) std::swap(fresh, e.extents);  // `fresh` now holds the old extents
    for (int t = 0; t < idx(home); ++t) {
      Copy& c = e.copy[t];
      if (c.state == State::kResident) {
        m.tier_free(tier_at(t), c.ptr);
        m.account(tier_at(t), -static_cast<std::int64_t>(c.alloc_bytes));
        c = Copy{};
        m.policy_->on_evicted(id, tier_at(t));
      }
    }
    ++e.latest;
    e.copy[idx(home)].version = e.latest;
  }
  m.cv_.notify_all();
  lock.unlock();
  for (const SwapExtent& x : fresh) e.swap->free(x);  // old extents; no I/O on them remains
  if (err) std::rethrow_exception(err);
}

void TensorStore::begin_step() {
  std::lock_guard lock(impl_->mu_);
  impl_->policy_->begin_step();
}

void TensorStore::end_step() {
  std::lock_guard lock(impl_->mu_);
  impl_->policy_->end_step();
}

TensorStoreStats TensorStore::stats() const {
  Impl& m = *impl_;
  std::lock_guard lock(m.mu_);
  TensorStoreStats s = m.stats_;
  for (int t = 0; t < kNumTiers; ++t) {
    s.resident_bytes[t] = m.used_[t];
    s.budget_bytes[t] = m.budget_[t];
  }
  for (const auto& e : m.entries_) {
    for (int t = 0; t < 2; ++t) {
      if (e->copy[t].pins > 0) s.pinned_bytes[t] += e->copy[t].alloc_bytes;
    }
  }
  s.host_pool_allocated_bytes = m.host_pool ? m.host_pool->allocated_bytes() : 0;
  s.bounce_chunks_in_use = m.bounce ? m.bounce->in_use() : 0;
  return s;
}

void TensorStore::drain() {
  Impl& m = *impl_;
  std::unique_lock lock(m.q_mu_);
  m.idle_cv_.wait(lock, [&] { return m.queue_.empty() && m.busy_ == 0; });
}

Device* TensorStore::device() const noexcept { return impl_->device.get(); }
const TensorStoreOptions& TensorStore::options() const noexcept { return impl_->opts; }

}  // namespace tiermem
