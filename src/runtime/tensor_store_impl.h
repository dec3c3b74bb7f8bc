// tensor_store_impl.h — TensorStore::Impl, shared by the store's parts (internal, not installed):
//   tensor_store.cc           the public API: registration, pins, acquire/fetch/prefetch, stats
//   tensor_store_data.cc      caller data in and out: read, write, flush
//   tensor_store_residency.cc residency state: versions, budgets, eviction, ensure
//   tensor_store_transfer.cc  transfers between tiers: the chunk pipelines and the worker pool
//   io_busy_clock.h           per-phase wall time with NVMe transfers in flight (pure)
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
#pragma once

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
#include <unordered_set>

#include <boost/asio/post.hpp>
#include <boost/asio/thread_pool.hpp>

#include <fmt/format.h>

#include "tiermem/config.h"
#include "tiermem/device.h"
#include "tiermem/error.h"
#include "tiermem/log.h"
#include "tiermem/lru_policy.h"
#include "tiermem/pinned_host_pool.h"
#include "tiermem/swap_space.h"
#include "tiermem/trace.h"
#include "runtime/io_busy_clock.h"

namespace tiermem::store_detail {

// The phase of the access the calling thread serves: set by acquire(), touch() and fetch() for
// their call, and by a worker for the task it runs (the phase of the call that queued it), so a
// transfer counts to the phase it was made for whichever thread runs it (Impl::access_phase).
inline thread_local std::optional<Phase> tl_access_phase;
class AccessPhase {
 public:
  explicit AccessPhase(Phase p) : was_(tl_access_phase) { tl_access_phase = p; }
  ~AccessPhase() { tl_access_phase = was_; }
  AccessPhase(const AccessPhase&) = delete;
  AccessPhase& operator=(const AccessPhase&) = delete;

 private:
  std::optional<Phase> was_;
};

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
  bool read_in_place = false;  // TensorSpec::read_in_place, on a storage_direct device
  bool undefined = false;  // discard(): the newest contents are undefined (nothing worth loading)
  // Accesses so far (acquire, acquire_for_overwrite, fetch, touch): a queued prefetch is for the
  // next one, and is stale once another access happened.
  std::uint64_t uses = 0;
  bool prefetch_queued[kNumTiers] = {};  // a prefetch to that tier waits on a worker
  // Acquires in ensure() now: their copies are no one's victims (make_room) while they wait for
  // a load, as if pinned already, or a prefetch's room would drop the copy the acquire waits for.
  int acquiring = 0;
};

// Counts one user in `*n` for its scope (none for nullptr): an acquire in its Entry::acquiring, a
// make_room in Impl::device_room_wanted_. mu_ held at both ends.
class CountScope {
 public:
  explicit CountScope(int* n) : n_(n) {
    if (n_ != nullptr) ++*n_;
  }
  ~CountScope() {
    if (n_ != nullptr) --*n_;
  }
  CountScope(const CountScope&) = delete;
  CountScope& operator=(const CountScope&) = delete;

 private:
  int* n_;
};

constexpr int idx(Tier t) { return static_cast<int>(t); }
constexpr Tier tier_at(int i) { return static_cast<Tier>(i); }

inline std::string track(Tier from, Tier to) {
  return std::string(tier_name(from)) + "->" + std::string(tier_name(to));
}

// Fixed set of pinned bounce chunks shared by all pipelines.
class BouncePool {
 public:
  // Chunks are committed at their first use, one at a time up to `count`, then kept: a store that
  // never moves a byte to or from NVMe (every home in host or device memory) commits none.
  BouncePool(PinnedHostPool& pool, int count, std::uint64_t chunk_bytes)
      : pool_(pool), count_(static_cast<std::size_t>(count)), chunk_bytes_(chunk_bytes) {}
  void* acquire() {
    std::unique_lock lock(mu_);
    if (free_.empty() && made_ < count_) return make_locked();
    cv_.wait(lock, [&] { return !free_.empty(); });
    void* p = free_.back();
    free_.pop_back();
    return p;
  }
  void* try_acquire() {
    std::lock_guard lock(mu_);
    if (free_.empty() && made_ < count_) return make_locked();
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
    return made_ - free_.size();
  }
  // Chunks committed so far.
  std::uint64_t committed() {
    std::lock_guard lock(mu_);
    return made_;
  }

 private:
  void* make_locked() {  // a new chunk (the pool's budget holds `count_` of them)
    void* p = pool_.allocate(chunk_bytes_);
    ++made_;
    return p;
  }
  PinnedHostPool& pool_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<void*> free_;  // guarded by mu_
  std::size_t made_ = 0;     // guarded by mu_
  const std::size_t count_;
  const std::uint64_t chunk_bytes_;
};

}  // namespace tiermem::store_detail

namespace tiermem {

using namespace store_detail;  // NOLINT: the store's parts share these names

struct TensorStore::Impl {
  TensorStoreOptions opts;
  std::shared_ptr<Device> device;
  std::shared_ptr<SwapSpace> swap;
  // Pool slots registered with the device (the pools' region listeners; unregistered with them;
  // declared before the pools, whose destructors call the listeners).
  std::mutex registered_mu;
  std::unordered_set<void*> registered_host;  // guarded by registered_mu
  std::unique_ptr<PinnedHostPool> host_pool;
  std::unique_ptr<PinnedHostPool> bounce_pool_mem;
  std::unique_ptr<BouncePool> bounce;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::unique_ptr<Entry>> entries_;                // guarded by mu_
  std::unordered_map<std::string, TensorId> by_name_;          // guarded by mu_
  std::unique_ptr<ResidencyPolicy> policy_;                    // guarded by mu_
  std::uint64_t budget_[kNumTiers] = {};                       // const after construction
  std::uint64_t used_[kNumTiers] = {};                         // guarded by mu_
  int device_room_wanted_ = 0;  // make_room calls for the device tier under way (promote_locked stays out), mu_
  TensorStoreStats stats_;                                     // guarded by mu_
  IoBusyClock io_clock_;  // guarded by mu_: NVMe transfers in flight, by phase
  Phase latest_phase_ = Phase::kOther;  // guarded by mu_: the driving thread's latest acquire's

  // Worker threads for fetch/prefetch/async write-back: a Boost.Asio thread pool; `pending_`
  // counts tasks posted and not yet finished, for drain().
  std::unique_ptr<boost::asio::thread_pool> pool_;
  std::mutex q_mu_;
  std::condition_variable idle_cv_;
  int pending_ = 0;  // guarded by q_mu_

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
    v.in_memory = [this](TensorId id) {  // mu_ is held by whoever passes the view to the policy
      if (id >= entries_.size()) return false;
      const Entry& e = *entries_[id];
      if (e.undefined) return true;  // nothing to move: its next access overwrites it
      for (int t = 0; t < idx(Tier::kNvme); ++t) {
        const Copy& c = e.copy[t];
        if ((c.state == State::kResident || c.state == State::kLoading) && c.version == e.latest) return true;
      }
      return false;
    };
    v.home = [this](TensorId id) { return id < entries_.size() ? entries_[id]->info.home : Tier::kNvme; };
    v.home_bytes = [this](Tier t) {
      std::uint64_t b = 0;
      for (const auto& e : entries_) {
        const Copy& c = e->copy[idx(t)];
        if (e->info.home == t && c.state != State::kAbsent) b += c.alloc_bytes;
      }
      return b;
    };
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

  std::uint64_t pinned_bytes(Tier t, int* count = nullptr) const;
  // For the timeout message: the largest pinned or homed tensors at `t` by name, and the
  // transfers in flight there.
  std::string holders(Tier t, std::uint64_t pinned, int count) const;
  std::string in_flight(Tier t) const;

  // True when the copy at `t` holds the only newest bytes above home (must be written down).
  bool needs_writeback(const Entry& e, Tier t) const;

  // The copy at `tier` holds the newest bytes from now on (the caller wrote, or will write, all of
  // them): it gets a new version, and the other cached copies nobody uses are dropped (no I/O:
  // they are stale). Wakes waiters.
  void make_newest(Entry& e, TensorId id, Tier tier);

  // Where to load tier t of e from: a current, resident copy not being written; nearest slower
  // tier first, then faster ones. -1 when none is available right now.
  // The copy at tier index s holds the newest bytes and may be read now (a source, or read in place).
  static bool readable(const Entry& e, int s);
  int find_source(const Entry& e, Tier t) const;

  // Waits on cv_ until notified or `deadline`; records the wait in the trace. Returns false on
  // timeout.
  bool wait(std::unique_lock<std::mutex>& lock, std::chrono::steady_clock::time_point deadline) {
    TraceSpan span("wait", "wait");
    return cv_.wait_until(lock, deadline) != std::cv_status::timeout;
  }

  // ---------------------------------------------------------------- phases (mu_ held)

  // The phase of the driving thread's latest acquire() becomes `p` (the phase of a transfer no
  // access phase is set for: access_phase()); a change is a sample of the "store phase" counter
  // in the trace (the Phase value).
  void set_phase(Phase p) {
    if (p == latest_phase_) return;
    latest_phase_ = p;
    Trace::global().counter("store phase", static_cast<double>(p), Trace::now_ns());
  }
  // The phase this thread's transfers count to: that of the access it serves (AccessPhase), else
  // the driving thread's latest.
  Phase access_phase() const { return tl_access_phase.value_or(latest_phase_); }
  PhaseIoStats& phase_stats(Phase p) { return stats_.phases[static_cast<int>(p)]; }
  // A caller's wait of `ns` in phase `p`, counted in the totals and the phase's; a helper
  // thread's (`helper`) also as a helper's.
  void count_stall(Phase p, std::uint64_t ns, bool helper) {
    stats_.stall_ns += ns;
    phase_stats(p).stall_ns += ns;
    if (helper) {
      stats_.helper_stall_ns += ns;
      phase_stats(p).helper_stall_ns += ns;
    }
  }
  // Around a transfer: io_begin(nvme) before mu_ is released for it (returns the phase its bytes
  // count to: access_phase()), io_end(nvme, that phase) once mu_ is held again; only a transfer
  // that reads or writes NVMe (`nvme`) runs the busy clock.
  Phase io_begin(bool nvme) {
    const Phase ph = access_phase();
    if (nvme) io_clock_.begin(ph, Trace::now_ns());
    return ph;
  }
  void io_end(bool nvme, Phase ph) {
    if (nvme) io_clock_.end(ph, Trace::now_ns());
  }
  // A completed transfer of `e` from tier `from` to tier `to` counted in stats_ (bytes_moved,
  // moves, the NVMe group and the phase `ph` it was issued in).
  void count_move(const Entry& e, int from, int to, Phase ph) {
    stats_.bytes_moved[from][to] += e.info.bytes;
    ++stats_.moves[from][to];
    if (from == idx(Tier::kNvme)) {
      stats_.nvme_read_by_group[e.info.group] += e.info.bytes;
      phase_stats(ph).nvme_read_bytes += e.info.bytes;
    }
    if (to == idx(Tier::kNvme)) {
      stats_.nvme_written_by_group[e.info.group] += e.info.bytes;
      phase_stats(ph).nvme_written_bytes += e.info.bytes;
    }
  }

  // ---------------------------------------------------------------- transfers (no lock held)

  void transfer(const Entry& e, Tier from, void* from_ptr, Tier to, void* to_ptr);

  // "tensor 'name' (<what>)": what TensorStore puts in front of the IoErrors it propagates.
  static std::string io_context(const Entry& e, const std::string& what) {
    return "tensor '" + e.info.name + "' (" + what + ")";
  }

  void transfer_bytes(const Entry& e, Tier from, void* from_ptr, Tier to, void* to_ptr);

  std::uint64_t chunk_len(const Entry& e, std::size_t k) const {
    return std::min<std::uint64_t>(opts.pipeline_chunk_bytes, e.info.bytes - k * opts.pipeline_chunk_bytes);
  }

  void nvme_to_host(const Entry& e, void* dst);

  void host_to_nvme(const Entry& e, const void* src);

  // A two-stage chunk pipeline through bounce buffers (the NVMe <-> device paths): for each
  // chunk k < n, start_first(k, buf) starts stage one into/out of a bounce buffer; when it has
  // completed, start_second(k, buf) starts stage two, so stage one of chunk k+1 overlaps stage two
  // of chunk k, with at most opts.pipeline_chunks chunks in flight. Each start returns a handle
  // with wait() (blocks, rethrows the operation's error) and ready() (IoRequest, DeviceEvent).
  // Deadlock-free with other pipelines sharing the bounce pool: it blocks for a buffer only when
  // it holds none; otherwise it finishes its own oldest chunk to free one. On an error (a failed
  // or refused operation) it waits for everything it started, returns every buffer, rethrows.
  template <class StartFirst, class StartSecond>
  void bounce_pipeline(std::size_t n, StartFirst start_first, StartSecond start_second);

  // NVMe -> device: the read of chunk k+1 overlaps the H2D copy of chunk k.
  void nvme_to_device(const Entry& e, void* dst);

  // Device -> NVMe: the D2H copy of chunk k+1 overlaps the NVMe write of chunk k.
  void device_to_nvme(const Entry& e, const void* src);

  // ---------------------------------------------------------------- eviction (mu_ held)

  // Evicts the resident, unpinned copy of `id` at `t` (writing it down first when needed).
  // Releases mu_ during the write-back. Throws the write-back's error (copy kept resident).
  // `to_make_room`: evicted for room at `t` (make_room), when a clean device copy may go down to
  // the host (demote_locked) rather than be dropped; an explicit evict() drops it.
  void evict_locked(std::unique_lock<std::mutex>& lock, TensorId id, Tier t, bool to_make_room = false);

  // Before a clean, current device copy of `id` is freed: copies it to the host tier when its home
  // is NVMe, it has no host copy, and make_room finds host room in prefetch mode (free room, or
  // victims the policy's evict_for_prefetch accepts for `id`). A failed copy is logged and the
  // copy dropped as without it (the home holds the bytes). mu_ held; released during the copy.
  void demote_locked(std::unique_lock<std::mutex>& lock, TensorId id);

  // Before a clean, current host copy of `id` is freed for room: a read-in-place tensor
  // (TensorSpec::read_in_place: host and device cache it as one) homed on NVMe, with no device
  // copy, moves to the device tier when the device has free room for it now and nobody is making
  // room there, rather than be dropped and read from NVMe again. No device copy is evicted for it,
  // and it never takes room a device load is freeing (that load's victim is demoted to the host,
  // whose eviction would fill the room again, forever). Without the move, the host's look-ahead,
  // which reads into the host tier, could leave the device tier nearly empty step after step
  // (1.1 B LoRA: 0.3 of 1 GiB used, the base read 6.1 GB a step instead of 4.6). A failed copy is
  // logged and the copy dropped as without it. mu_ held; released during the copy.
  void promote_locked(std::unique_lock<std::mutex>& lock, TensorId id);
  // demote_locked's and promote_locked's copy: `id`'s copy at `from` (being evicted, current) into
  // `p` (`size` bytes, allocated at `to` and not yet accounted). True when it is resident there; a
  // failed copy is logged and undone. mu_ held; released during the copy.
  bool copy_evicted_locked(std::unique_lock<std::mutex>& lock, TensorId id, Tier from, Tier to, void* p,
                           std::uint64_t size);

  // Allocates `size` accounted bytes at `t`, evicting per the policy; waits for releases until
  // `deadline`. Returns nullptr once `incoming`'s copy at `t` is no longer absent (another call
  // started it meanwhile, as the callers check after any return), and for a prefetch that would
  // have to wait, or whose victims the policy refuses: a prefetch of `incoming` first plans every
  // victim it needs (choose_victim over the remaining candidates) and asks evict_for_prefetch once per planned victim; it evicts
  // none unless all are accepted, so a refused prefetch costs nothing. Throws OutOfMemoryError.
  void* make_room(std::unique_lock<std::mutex>& lock, Tier t, std::uint64_t size, Mode mode,
                  std::chrono::steady_clock::time_point deadline,
                  TensorId incoming = kInvalidTensor, bool home = false);

  // For a prefetch of `incoming` needing `size` bytes at `t`: picks victims among `candidates`
  // (consumed) until the budget fits (at least one when the budget fits but the allocator does
  // not), asking the policy's evict_for_prefetch for each; evicts them all only if every one is
  // accepted. Returns false (nothing evicted, the caller drops the prefetch) on a refusal or when
  // the candidates cannot free enough. mu_ held; released during write-backs.
  bool plan_prefetch_evictions(std::unique_lock<std::mutex>& lock, Tier t, std::uint64_t size,
                               TensorId incoming, std::vector<TensorId>& candidates);

  // ---------------------------------------------------------------- ensure (mu_ held)

  // Makes `id` resident and current at `t`; pins it when mode == kAcquire. Returns the copy's
  // pointer, or nullptr when a prefetch gave up.
  void* ensure(std::unique_lock<std::mutex>& lock, TensorId id, Tier t, Mode mode,
               std::chrono::steady_clock::time_point deadline, bool* hit);

  // ---------------------------------------------------------------- workers

  // Runs `fn` on a pool thread, under the access phase of the call that queued it (its transfers
  // count there: access_phase() now, so mu_ held or an AccessPhase set). `fn` must not throw
  // (tasks catch and record their own errors).
  void submit(std::function<void()> fn);

  void prefetch_one(TensorId id, Tier t, std::uint64_t uses);

  // Issues the policy's hints (mu_ held; the work runs on workers).
  void issue_hints(const std::vector<PrefetchHint>& hints);
};

}  // namespace tiermem
