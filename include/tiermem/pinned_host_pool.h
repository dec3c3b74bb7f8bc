// tiermem/pinned_host_pool.h — the host tier's allocator: page-locked, 4 KiB-aligned blocks carved
// out of a few large anonymous mappings, within a byte budget.
//
//   PinnedHostPool pool({.budget_bytes = 1ull << 30, .pin_memory = true});
//   void* p = pool.allocate(64 << 20);   // 4096-aligned; OutOfMemoryError(kHost) when full
//   ...
//   pool.free(p);
//
// Mappings: the pool maps `mapping_bytes` regions lazily (at most budget_bytes in total), each
// mmap'ed, bound to the NUMA node (libnuma mbind; `numa_node` -1 = the calling thread's node),
// mlock'ed when pin_memory, and cudaHostRegister'ed when the build has CUDA and a GPU is visible.
// regions() lists them so the NVMe engine can register them as io_uring fixed buffers (do that
// with IoEngine::register_buffers; the pool does not know the engine). A mapping is never unmapped
// before the pool is destroyed, so registered regions stay valid.
//
// Huge pages (huge_pages, default on): each mapping gets a 2 MiB-aligned base so its memory can
// be backed by 2 MiB pages, which an I/O request then sees as few physical segments (a 1 MiB
// request over 4 KiB pages can need 256 scatter-gather segments, over 2 MiB pages 1 or 2). The
// pool uses hugetlbfs pages (MAP_HUGETLB) when the system has enough reserved and free
// (HugePages_Free) for a mapping whose size is a multiple of 2 MiB, else transparent huge pages
// (madvise(MADV_HUGEPAGE); THP "always" or "madvise" mode). When neither is possible (THP "never",
// no reserved pages) it uses 4 KiB pages and logs one line (HOST tag, once per process).
// With populate (or pin_memory, since mlock faults every page in) a mapping is faulted in when
// it is made, and the pool then checks /proc/self/smaps for how much of it the kernel really gave
// 2 MiB pages; HostRegion::contiguous_bytes says 2 MiB only when all of its 2 MiB-aligned part is
// huge, so I/O sizing built on it is never optimistic.
//
// Sub-allocation: best-fit over free extents (a size-ordered index of address-ordered free
// extents, coalesced on free), 4096-byte granularity. The budget counts allocated (rounded) bytes;
// fragmentation can make allocate() fail below the budget (it then throws like a full pool).
//
// Pinning: with pin_memory true and RLIMIT_MEMLOCK too low for a mapping, the constructor (first
// mapping) or allocate() throws Error naming the limit and how to raise it (`ulimit -l unlimited`,
// or memlock in /etc/security/limits.conf, or LimitMEMLOCK= for systemd); with pin_memory false
// the memory is unlocked and one warning says so (HOST tag).
//
// Thread-safety: all methods are thread-safe (one internal mutex, a leaf lock).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <utility>
#include <vector>

namespace tiermem {

struct PinnedHostPoolOptions {
  std::uint64_t budget_bytes = 256ull << 20;   // max allocated bytes (rounded to 4096)
  std::uint64_t mapping_bytes = 256ull << 20;  // size of each mapping (the last may be smaller)
  bool pin_memory = false;                     // mlock (see the top of the file)
  int numa_node = -1;                          // -1: the node of the calling thread
  bool cuda_register = true;                   // cudaHostRegister when CUDA is present
  // Map (and lock) the first mapping in the constructor, so regions() is complete from the start
  // when mapping_bytes >= budget_bytes (what TensorStore does before registering with io_uring).
  bool map_now = false;
  bool huge_pages = true;  // 2 MiB pages when the system allows (see the top of the file)
  // Fault every page in when a mapping is made (pin_memory does so anyway): RSS grows by the
  // mapping at once, and huge-page backing is known (HostRegion::contiguous_bytes).
  bool populate = false;
};

// How a mapping's pages were obtained.
enum class HostPageKind : std::uint8_t {
  kSmall,        // 4 KiB pages (huge pages off or unavailable)
  kTransparent,  // madvise(MADV_HUGEPAGE): 2 MiB where the kernel could (see huge_bytes)
  kHugetlb,      // MAP_HUGETLB: reserved 2 MiB pages, all of it
};

// One mapping of the pool, for io_uring buffer registration.
struct HostRegion {
  void* base;
  std::uint64_t bytes;
  // The region is physically contiguous at least in naturally aligned units of this many bytes:
  // 2 MiB (kHugePageBytes) when all of its 2 MiB-aligned part is backed by huge pages as far as
  // the kernel reported when it was populated, else 4096 (nothing known beyond the base page).
  std::uint64_t contiguous_bytes = 4096;
};

class PinnedHostPool {
 public:
  static constexpr std::uint64_t kAlignment = 4096;
  static constexpr std::uint64_t kHugePageBytes = 2ull << 20;

  // Maps nothing yet except, when pin_memory or map_now, the first mapping (with pin_memory this is
  // the probe of RLIMIT_MEMLOCK: throws Error with the ulimit advice when it is too low).
  explicit PinnedHostPool(PinnedHostPoolOptions options);
  ~PinnedHostPool();  // unmaps everything; outstanding blocks become invalid
  PinnedHostPool(const PinnedHostPool&) = delete;
  PinnedHostPool& operator=(const PinnedHostPool&) = delete;

  // Rounded size an allocation of `bytes` takes from the budget (multiple of 4096, >= 4096).
  static std::uint64_t allocation_size(std::uint64_t bytes) noexcept {
    std::uint64_t b = bytes == 0 ? 1 : bytes;
    return (b + kAlignment - 1) / kAlignment * kAlignment;
  }

  // A 4096-aligned block of at least `bytes` bytes (contents undefined), owned by the caller until
  // free(). Throws OutOfMemoryError(Tier::kHost, requested, available) when it does not fit;
  // Error when a mapping cannot be made or locked.
  void* allocate(std::uint64_t bytes);
  // Like allocate() but returns nullptr when it does not fit (mapping/lock failures still throw).
  void* try_allocate(std::uint64_t bytes);
  // As try_allocate, but carved from the END of the highest-addressed free block that fits: for
  // long-lived blocks (a TensorStore's host-homed tensors), which then pack at the top of the
  // pool instead of splitting the space that short-lived blocks (caches, staging) reuse.
  void* try_allocate_high(std::uint64_t bytes);
  // Backpressure for async callers: waits until the block fits or `timeout` passes; then throws
  // OutOfMemoryError like allocate(). A request larger than the budget throws at once.
  void* allocate_wait(std::uint64_t bytes, std::chrono::duration<double> timeout);
  // Returns a block. nullptr is ignored; an unknown pointer is logged and ignored. Never throws.
  void free(void* ptr) noexcept;

  std::uint64_t budget_bytes() const noexcept { return options_.budget_bytes; }
  std::uint64_t allocated_bytes() const;
  std::uint64_t peak_allocated_bytes() const;
  std::uint64_t mapped_bytes() const;
  // True when every mapping is page-locked (mlock succeeded).
  bool pinned() const;
  // Bytes of the mappings backed by 2 MiB pages, as /proc/self/smaps reported when each was
  // populated (0 for mappings not populated yet or made with 4 KiB pages).
  std::uint64_t huge_bytes() const;
  // The kind of the first mapping (kSmall when none is mapped yet).
  HostPageKind page_kind() const;
  std::vector<HostRegion> regions() const;
  const PinnedHostPoolOptions& options() const noexcept { return options_; }

 private:
  struct Mapping {
    char* base;
    std::uint64_t bytes;
    bool locked;
    bool cuda_registered;
    HostPageKind kind = HostPageKind::kSmall;
    std::uint64_t huge_bytes = 0;        // as smaps reported after population
    std::uint64_t contiguous_bytes = kAlignment;
  };
  void* try_allocate_locked(std::uint64_t rounded);  // needs mu_
  bool add_mapping_locked(std::uint64_t at_least);   // needs mu_
  void insert_free_locked(char* p, std::uint64_t bytes);  // needs mu_; coalesces

  PinnedHostPoolOptions options_;
  mutable std::mutex mu_;
  std::condition_variable freed_;
  std::vector<Mapping> mappings_;                          // guarded by mu_
  std::map<char*, std::uint64_t> free_by_addr_;            // guarded by mu_
  std::set<std::pair<std::uint64_t, char*>> free_by_size_; // guarded by mu_
  std::map<char*, std::uint64_t> used_;                    // guarded by mu_
  std::uint64_t allocated_ = 0, peak_ = 0, mapped_ = 0;    // guarded by mu_
};

}  // namespace tiermem
