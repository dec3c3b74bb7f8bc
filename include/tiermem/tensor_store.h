// tiermem/tensor_store.h — TensorStore: tensors that live in device HBM, pinned host DRAM or
// NVMe and move between them asynchronously, inside per-tier budgets that are never exceeded.
//
//   auto store = std::make_unique<TensorStore>(TensorStoreOptions::from_config(cfg),
//                                              make_device(cfg), swap_space);
//   TensorId w = store->register_tensor({.name = "layer0.w", .dtype = DType::kBF16,
//                                        .shape = {1024, 1024}, .home = Tier::kNvme});
//   store->prefetch({{w}}, Tier::kDevice);               // runs ahead, best-effort
//   {
//     TensorStore::Pin p = store->acquire(w, Tier::kDevice);  // resident + addressable now
//     kernel(p.data(), p.bytes());
//     p.mark_dirty();                                    // written on the device
//   }                                                    // released: may be evicted from now on
//   store->flush();                                      // every dirty tensor back at its home
//
// Model. Every tensor has a HOME tier where a copy always exists (allocated at registration:
// device memory, a host pool block, or an extent of the swap space) and is never evicted. Copies
// at tiers above home (faster) are caches, created by fetch/acquire/prefetch and evicted when the
// tier needs room. Each copy has a state: absent -> loading -> resident -> evicting -> absent.
// A copy is DIRTY when it holds newer bytes than the home copy (mark_dirty at that tier); a dirty
// copy is written one tier down before it is dropped (device -> host copy when one is resident,
// else straight to home through the bounce pipeline; host -> NVMe home); clean copies are dropped
// without I/O. Loads copy from the nearest tier that holds the newest bytes.
//
// Budgets. Per tier: device (device_budget_bytes), host (host_budget_bytes: home copies of host
// tensors + cached host copies), nvme (the swap space's capacity). Accounting uses the allocator's
// rounded sizes; the peak never exceeds the budget (stats().peak_resident_bytes). When a tier is
// full, unpinned resident copies are evicted, chosen by the ResidencyPolicy (LRU by default).
// A request that cannot fit even then (every candidate pinned) waits for a release up to
// acquire_timeout, then throws OutOfMemoryError(tier, requested, available) whose message names
// the pinned bytes. Prefetches never wait: one that does not fit is dropped (counted).
//
// NVMe -> device. Bytes whose newest copy is on NVMe go to the device through a pipeline of
// `pipeline_chunk_bytes` chunks and at most `pipeline_chunks` pinned bounce chunks (shared by all
// transfers): the NVMe read of chunk k+1 overlaps the H2D copy of chunk k. Device -> NVMe
// write-back runs the same way reversed. No host-tier copy is made on this path.
//
// Threads and locks. Thread-safe: any thread may call any method, concurrently. One mutex
// (TensorStore::mu_) guards all residency metadata, budgets, statistics and the policy (policies
// are called with it held and must not call back); it is never held across I/O or copies: a
// transfer marks copies loading/evicting under the lock, moves bytes without it, and publishes the
// result under it (waiters sleep on one condition variable). The bounce chunk pool and the worker
// queue have their own leaf mutexes. acquire() does its transfer on the calling thread; fetch() and
// prefetch() run on the store's worker threads. A Pin must be released before the store is
// destroyed; the destructor waits for outstanding fetches/prefetches.
//
// Tracing: every move is a span on track "<src>-><dst>" (e.g. "nvme->device") and every wait
// a span on track "wait" when Trace::global() is enabled (API or TIERMEM_TRACE=path); an
// acquire's miss span has its phase in args ({"phase": "forward"}), and each change of the
// driving thread's phase (its latest acquire's; helper threads, HelperThread, do not change it)
// is a sample of the counter "store phase" (the Phase value: 0 forward, 1 backward,
// 2 optimizer, 3 other, 4 outside-step).
//
// Phases. The counters of stats().phases split the NVMe traffic, stalls and I/O busy time by
// training phase: each transfer counts to the phase of the access it serves — the `phase` of
// the acquire()/fetch()/touch() that made it, or that issued the prefetch hint, whichever thread
// runs it (an update thread's optimizer reads count to the optimizer while forward runs); a
// transfer with no access phase (a write-back after release_pin, prefetch(), a call of
// acquire_for_overwrite) counts to the driving thread's latest phase.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <future>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "tiermem/dtype.h"
#include "tiermem/export.h"
#include "tiermem/residency_policy.h"
#include "tiermem/tier.h"

namespace tiermem {

struct Config;
class Device;
class SwapSpace;
class PinnedHostPool;

// Settings of a TensorStore; from_config reads tiermem.device_budget_bytes, host_budget_bytes,
// numa_node, pipeline_chunk_bytes, pipeline_chunks, acquire_timeout_s and
// zero_optimization.offload_param.pin_memory.
struct TIERMEM_API TensorStoreOptions {
  std::uint64_t device_budget_bytes = 0;          // 0: the device's whole budget
  std::uint64_t host_budget_bytes = 256ull << 20; // host tier pool (homes + cached copies)
  std::uint64_t pipeline_chunk_bytes = 8ull << 20;  // multiple of 4096
  int pipeline_chunks = 4;                          // pinned bounce chunks (>= 1)
  std::chrono::duration<double> acquire_timeout = std::chrono::seconds(30);
  int worker_threads = 2;  // threads running fetch/prefetch/async write-back (>= 1)
  // Page-lock the host pool and bounce chunks (mlock). true and RLIMIT_MEMLOCK too low:
  // the constructor throws Error saying how to raise it (ulimit -l); false: unlocked memory,
  // one warning.
  bool pin_memory = false;
  int numa_node = -1;  // host pool NUMA node; -1: the calling thread's node
  // A clean device copy evicted to make room goes down to the host tier (one copy, device to host)
  // instead of being dropped, when its home is NVMe and the host has room for it without evicting
  // anything needed sooner: its next use reads host memory, not NVMe. The device and host tiers
  // then cache as one exclusive cache (a LoRA base's last forward modules wait in host memory
  // for backward). true by default (tiermem.demote_to_host); false: dropped, read again from
  // NVMe at its next use.
  bool demote_to_host = true;

  // Throws ConfigError for out-of-range values.
  static TensorStoreOptions from_config(const Config& config);
};

// What to register. bytes == 0: computed from shape and dtype (product of shape * dtype_size).
// When both are given they must agree, else Error. `initial` (optional, bytes long, copied before
// register_tensor returns) fills the home copy; without it the contents are zero.
struct TIERMEM_API TensorSpec {
  std::string name;                  // unique, for traces, errors and find()
  DType dtype = DType::kU8;
  std::vector<std::int64_t> shape{}; // elements per dimension
  std::uint64_t bytes = 0;
  Tier home = Tier::kHost;           // kNvme needs a SwapSpace
  std::span<const std::byte> initial{};
  // Home kNvme: the swap space that holds the tensor (null: the store's). It must outlive the
  // store and should use the same IoEngine as the store's swap space (whose engine the store's
  // pools are registered with); the store never owns it.
  SwapSpace* swap = nullptr;
  // Without `initial`: true writes zeros to the home copy (NVMe: an I/O of `bytes`); false leaves
  // an NVMe home's contents undefined until the first write, for tensors that are always
  // overwritten before they are read (acquire_for_overwrite), e.g. gradient partitions.
  bool zero_fill = true;
  // The caller's label for the NVMe traffic counters (TensorStoreStats::nvme_*_by_group), in
  // [0, kNumGroups): ZeroEngine splits trainable params, frozen params, optimizer state and
  // gradient partitions.
  std::uint8_t group = 0;
  // Read in place: the caller never writes it through a Pin at the device tier (a frozen weight,
  // filled once). On a device whose memory is the CPU's (Device::storage_direct: an unthrottled,
  // host-addressable SimDevice), acquire(id, kDevice) pins a current host copy where it is instead
  // of copying it to the device (the Pin's tier() is then kHost), and a prefetch to kDevice finds
  // such a copy enough: host and device then cache it as one, never both. Elsewhere: no effect.
  bool read_in_place = false;
};

// Labels of TensorSpec::group: 0 .. kNumGroups - 1 (0: unlabelled; ZeroEngine uses 1-4).
inline constexpr int kNumGroups = 5;

struct TIERMEM_API TensorInfo {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<std::int64_t> shape;
  std::uint64_t bytes = 0;
  Tier home = Tier::kHost;
  std::uint8_t group = 0;
};

// The NVMe traffic and the waits of one training phase (TensorStoreStats::phases). Counts the
// same transfers as TensorStoreStats::bytes_moved to and from NVMe (loads, write-backs, flush;
// not read()/write()/register_tensor's own I/O), so that summed over phases each figure is the
// store's total.
struct TIERMEM_API PhaseIoStats {
  // Bytes read from / written to NVMe by transfers made for this phase's accesses (the header's
  // "Phases"; Phase::kOther for those before the first acquire()).
  std::uint64_t nvme_read_bytes = 0;
  std::uint64_t nvme_written_bytes = 0;
  // Time callers waited (TensorStoreStats::stall_ns): an acquire() by its `phase` argument; an
  // acquire_for_overwrite() that had to wait or make room by the driving thread's latest phase.
  std::uint64_t stall_ns = 0;
  // Wall time during which at least one of this phase's NVMe transfers was in flight
  // (overlapping transfers once; two phases' transfers in flight at once count to both, so the
  // phases' figures may sum to more than the drive's busy time).
  std::uint64_t io_busy_ns = 0;
  // Of stall_ns, the waits of helper threads (HelperThread: an engine's update running ahead),
  // which overlap the driving thread's work rather than hold it up.
  std::uint64_t helper_stall_ns = 0;
  // The I/O time the driving thread did not wait for: max(0, io_busy_ns - (stall_ns -
  // helper_stall_ns)). An estimate: a stall may also wait for room or a device copy, and busy
  // time counts I/O a stall waited on once.
  std::uint64_t hidden_io_ns() const {
    const std::uint64_t waited = stall_ns - helper_stall_ns;
    return io_busy_ns > waited ? io_busy_ns - waited : 0;
  }
};

// Snapshot of counters since the store was made. Indexed [from][to] / [tier] by Tier value.
struct TIERMEM_API TensorStoreStats {
  std::uint64_t bytes_moved[kNumTiers][kNumTiers] = {};  // bytes copied from tier to tier
  std::uint64_t moves[kNumTiers][kNumTiers] = {};        // transfers from tier to tier
  std::uint64_t resident_bytes[kNumTiers] = {};          // now (allocator-rounded)
  std::uint64_t peak_resident_bytes[kNumTiers] = {};     // max ever; <= budget_bytes
  std::uint64_t budget_bytes[kNumTiers] = {};
  std::uint64_t pinned_bytes[kNumTiers] = {};            // now: copies with >= 1 pin
  std::uint64_t evictions[kNumTiers] = {};               // copies dropped to make room / by evict()
  std::uint64_t writebacks[kNumTiers] = {};              // dirty copies written down from tier
  std::uint64_t demotions = 0;  // clean device copies kept in host memory on eviction (demote_to_host)
  std::uint64_t promotions = 0;  // read-in-place host copies moved to free device room on eviction
  std::uint64_t nvme_read_by_group[kNumGroups] = {};     // bytes read from NVMe, by TensorSpec::group
  std::uint64_t nvme_written_by_group[kNumGroups] = {};  // bytes written to NVMe, by TensorSpec::group
  std::uint64_t hits = 0;            // acquire/fetch found the copy resident and current
  std::uint64_t misses = 0;          // ... had to load it
  std::uint64_t prefetches_issued = 0;
  std::uint64_t prefetches_dropped = 0;  // did not fit without waiting, or failed
  // The policy's look-ahead (ResidencyPolicy::add_stats): hints it gave (device and NVMe->host),
  // and of those, the ones a step gave while it recorded, by an expected or the previous order
  // (Prefetcher::expect_order, rerecord). 0 for a policy without a look-ahead.
  std::uint64_t prefetch_hints = 0;
  std::uint64_t prefetch_hints_recording = 0;
  // Total time callers waited: acquire() calls that missed (waits + loads), and
  // acquire_for_overwrite() calls that had to wait for a transfer or make room (evictions and
  // their write-backs). fetch() and prefetch() wait on worker threads: never counted.
  std::uint64_t stall_ns = 0;
  // Of stall_ns, the waits of an engine's helper threads (a TensorStore::HelperThread scope: the
  // deferred update running ahead, the gradient hand-off), which overlap the driving thread's
  // work: stall_ns - helper_stall_ns is what the threads that drive the store waited.
  std::uint64_t helper_stall_ns = 0;
  std::uint64_t oom_errors = 0;      // OutOfMemoryError thrown by acquire/fetch
  std::uint64_t discards = 0;        // discard() calls
  std::uint64_t discarded_dirty_bytes = 0;  // newest bytes discard() dropped: write-backs saved
  // NVMe traffic, stalls and I/O busy time by training phase, indexed by Phase value
  // (kForward .. kOutsideStep); each sums over phases to the total above (bytes_moved to and
  // from NVMe, stall_ns).
  PhaseIoStats phases[kNumPhases] = {};
  // Leak checks (tests/fault/soak_test.cc). Both are gauges read now, not counters.
  // Bytes the store's PinnedHostPool has handed out (host homes + cached host copies, rounded);
  // equals resident_bytes[kHost] unless a block leaked.
  std::uint64_t host_pool_allocated_bytes = 0;
  // Pinned bounce chunks held by NVMe<->device transfers now; 0 when no transfer runs.
  std::uint64_t bounce_chunks_in_use = 0;
  std::uint64_t bounce_chunks_committed = 0;  // committed at first use; none without NVMe transfers
};

class TIERMEM_API TensorStore {
 public:
  // RAII pin: the tensor stays resident and at a fixed address at `tier` while the Pin lives.
  // Move-only. data() is a device pointer for Tier::kDevice (host-addressable on SimDevice) and a
  // host pointer for Tier::kHost; Tier::kNvme cannot be pinned. Release it before destroying the
  // store. Methods are not thread-safe on the same Pin object (distinct Pins are independent).
  class Pin {
   public:
    Pin() = default;
    Pin(Pin&& other) noexcept;
    Pin& operator=(Pin&& other) noexcept;
    Pin(const Pin&) = delete;
    Pin& operator=(const Pin&) = delete;
    ~Pin() { release(); }

    void* data() const noexcept { return data_; }
    template <typename T>
    T* as() const noexcept { return static_cast<T*>(data_); }
    std::uint64_t bytes() const noexcept { return bytes_; }
    TensorId id() const noexcept { return id_; }
    Tier tier() const noexcept { return tier_; }
    bool valid() const noexcept { return store_ != nullptr; }
    // Same as store.mark_dirty(id(), tier()).
    void mark_dirty();
    // Drops the pin now (idempotent). Never throws.
    void release() noexcept;

   private:
    friend class TensorStore;
    Pin(TensorStore* s, TensorId id, Tier tier, void* data, std::uint64_t bytes)
        : store_(s), id_(id), tier_(tier), data_(data), bytes_(bytes) {}
    TensorStore* store_ = nullptr;
    TensorId id_ = kInvalidTensor;
    Tier tier_ = Tier::kHost;
    void* data_ = nullptr;
    std::uint64_t bytes_ = 0;
  };

  // `device` may be null only if no tensor ever uses Tier::kDevice (then device requests throw
  // NotSupportedError); `swap` may be null only if no tensor has home kNvme. `policy` null: LRU.
  // The store makes its own PinnedHostPool (host_budget_bytes) and bounce chunks and registers
  // them with the swap space's IoEngine and the device (pinned DMA) when possible.
  // Throws Error/OutOfMemoryError when the pools cannot be made (see pin_memory).
  TensorStore(TensorStoreOptions options, std::shared_ptr<Device> device,
              std::shared_ptr<SwapSpace> swap = nullptr,
              std::unique_ptr<ResidencyPolicy> policy = nullptr);
  ~TensorStore();
  TensorStore(const TensorStore&) = delete;
  TensorStore& operator=(const TensorStore&) = delete;

  // Replaces the policy (e.g. the reuse-distance Prefetcher). Call before traffic starts or
  // between steps; the new policy sees no history.
  void set_policy(std::unique_ptr<ResidencyPolicy> policy);

  // Registers a tensor and allocates its home copy (zeroed or `initial`). Throws Error for a
  // duplicate name or inconsistent bytes/shape, OutOfMemoryError when the home tier cannot hold it
  // (after evicting cached copies), NotSupportedError for a missing tier, IoError from the swap.
  TensorId register_tensor(const TensorSpec& spec);
  // kInvalidTensor when no tensor has that name.
  TensorId find(std::string_view name) const;
  TensorInfo info(TensorId id) const;
  std::size_t size() const;  // number of registered tensors

  // Makes `id` resident and current at `tier` (at or above its home) and pins it. Blocks until
  // then: loads through the pipeline, evicts per the policy, waits for a release up to
  // acquire_timeout. Calls policy.on_access(id, bytes, tier, phase) and issues its prefetch hints.
  // Throws OutOfMemoryError (tier, requested, available; message names the pinned bytes), IoError
  // (the I/O that failed), Error for a tier below home or an unknown id. Several pins of the same
  // tensor and tier may coexist (shared).
  Pin acquire(TensorId id, Tier tier, Phase phase = Phase::kOther);

  // As acquire(), for a caller that will overwrite EVERY byte before reading any: no bytes are
  // loaded (the copy's contents are undefined when it returns) and the copy is the newest at once
  // (as after mark_dirty), so it is written down when evicted. Until the pin is released no
  // transfer uses the copy as its source (a prefetch to another tier waits or loads from
  // elsewhere), so nothing copies half-written bytes. Does not call the policy (the access needs
  // no prefetch). Throws as acquire(); Error when another pin of `id` exists at any
  // tier (its bytes would silently become stale). When it has to wait for a transfer of `id` or
  // make room, its time counts in stats().stall_ns (to the driving thread's latest phase).
  Pin acquire_for_overwrite(TensorId id, Tier tier);

  // Starts making `id` resident and current at `tier` on a worker thread; the future completes
  // then (not pinned: it may be evicted afterwards) or carries the exception acquire() would have
  // thrown. Calls policy.on_access like acquire().
  std::future<void> fetch(TensorId id, Tier tier, Phase phase = Phase::kOther);

  // An access that is part of the step's pattern but whose work was already done outside the step
  // (e.g. an optimizer sub-group a checkpoint export updated early): the policy sees it exactly as
  // acquire() would show it — keeping a recorded access trace in step — and its prefetch hints are
  // issued; nothing is loaded or pinned. With `overwrite`, the access is one that will fill the
  // tensor without reading it (an acquire_for_overwrite made elsewhere, e.g. on another thread
  // whose timing must not reorder the trace): the policy learns it needs room then, not a read.
  // Throws Error for an unknown id.
  void touch(TensorId id, Tier tier, Phase phase, bool overwrite = false);

  // Best-effort, asynchronous fetch of each id to `tier`: skipped when already there, dropped
  // (stats().prefetches_dropped) when it would have to wait for room. Never throws for I/O or
  // space. Does not call the policy.
  void prefetch(std::span<const TensorId> ids, Tier tier);

  // The bytes at `tier` were modified by the caller (who holds a Pin there): they become the
  // newest copy; other cached copies become stale. Throws Error when `id` has no pin at `tier`.
  void mark_dirty(TensorId id, Tier tier);

  // Drops the copy at `tier` now (writing it down first when dirty). Returns false when it is
  // pinned or is the home copy (nothing happens); true when it is absent afterwards. Blocks for
  // the write-back. Throws IoError when the write-back fails (the copy is kept).
  bool evict(TensorId id, Tier tier);

  // The caller no longer needs the tensor's contents (e.g. a gradient partition the optimizer has
  // consumed): the home copy becomes the newest with UNDEFINED contents and every cached copy above
  // home that nobody uses is dropped at once without being written down (dirty ones included: the
  // write-back they would have cost is saved; counted in stats().discarded_dirty_bytes). A copy in
  // transfer is left to finish and is stale afterwards. The next access should overwrite every byte
  // (acquire_for_overwrite); one that reads gets undefined bytes. Does not call the policy. Never
  // does I/O. Throws Error for an unknown id or when a pin of `id` exists at any tier.
  void discard(TensorId id);

  // Writes every dirty copy to its tensor's home and waits. Cached copies stay resident (clean).
  // Pinned dirty copies are flushed too (the caller must not be writing them concurrently).
  // Throws the first IoError.
  void flush();

  // Hands memory back (DeepSpeed's offload_states, RL colocation): waits for queued prefetches,
  // writes every dirty copy home (flush), drops every unpinned copy above its home, then gives
  // the host pool's free pages back to the OS and the device allocator's cache back to the device.
  // What stays is what is homed in memory (host/device homes) and pinned copies. Copies are read
  // back on demand by the next acquire/fetch/prefetch, bit for bit. Returns the bytes of the
  // copies dropped. Throws the first IoError of a write-back (nothing is dropped before it).
  std::uint64_t offload();

  // Synchronous access to the newest bytes, for checkpoints and export. read(): copies the tensor
  // (out.size() == bytes) from the tier holding its newest copy. write(): replaces the contents at
  // home and drops every cached copy; throws Error when a copy is pinned at another tier.
  // Both name the tensor in the IoErrors they throw. write() is all or nothing: an NVMe home is
  // written to fresh extents (so it briefly needs the tensor's size again in swap space) that
  // replace the old ones on success; on IoError/OutOfMemoryError the tensor keeps every copy and
  // its previous contents.
  void read(TensorId id, std::span<std::byte> out);
  void write(TensorId id, std::span<const std::byte> in);

  // Training step boundaries, forwarded to the policy; forget_trace, rerecord, expect_order:
  // ResidencyPolicy's.
  void begin_step();
  void end_step();
  void forget_trace();
  void rerecord();
  void expect_order(std::span<const Access> order);

  TensorStoreStats stats() const;
  // stats().stall_ns alone (nanoseconds callers have waited, summed over callers), without the
  // snapshot's walk over every tensor: for timing one call's waits. Thread-safe.
  std::uint64_t stall_ns() const;
  // stats().helper_stall_ns alone, likewise. Thread-safe.
  std::uint64_t helper_stall_ns() const;
  // While one lives on a thread, that thread's waits also count in helper_stall_ns: a thread the
  // caller runs beside its own (its waits overlap the caller's work). Not copyable; the thread
  // that made it must destroy it.
  class HelperThread {
   public:
    HelperThread();
    ~HelperThread();
    HelperThread(const HelperThread&) = delete;
    HelperThread& operator=(const HelperThread&) = delete;

   private:
    bool was_;
  };
  // Waits for every fetch/prefetch issued so far.
  void drain();

  Device* device() const noexcept;
  const TensorStoreOptions& options() const noexcept;

 private:
  struct TIERMEM_LOCAL Impl;
  std::unique_ptr<Impl> impl_;
  void release_pin(TensorId id, Tier tier) noexcept;
};

}  // namespace tiermem
