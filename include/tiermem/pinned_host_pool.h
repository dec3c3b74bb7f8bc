// tiermem/pinned_host_pool.h — the host tier's allocator: page-locked, 4 KiB-aligned blocks within
// a byte budget, where any block fits as long as the budget holds its bytes.
//
//   PinnedHostPool pool({.budget_bytes = 1ull << 30, .pin_memory = true});
//   void* p = pool.allocate(64 << 20);   // 4096-aligned; OutOfMemoryError(kHost) only when the
//   ...                                  // budget's free bytes are fewer than the request's
//   pool.free(p);
//
// Why this design (see docs/design/host-pool.md): a best-fit allocator over mappings
// the size of the budget can fail a request while the budget holds its bytes in pieces (a
// TensorStore then waits for a release that never comes). Here the budget counts physical bytes
// only, and address space is cheap, so the pool separates them:
//   - Size classes over reserved address space. A block of r bytes (r rounded to 4096) lives in a
//     slot of class k, the smallest power of two times 4096 that holds it; each class reserves
//     (mmap, MAP_NORESERVE, no memory behind it) ceil(2 * budget / slot) slots when first used.
//     Every block of class k > 0 is more than half its slot, so while allocated bytes stay within
//     the budget at most 2 * budget / slot - 1 blocks of the class are live, and a free slot
//     always exists. Hence: allocate(r) succeeds exactly when allocated_bytes() + r <= budget —
//     no fragmentation, no compaction, nothing to wait for that is not already free.
//   - Memory follows use. Only a slot's first r bytes are committed (faulted in, bound to the
//     NUMA node, mlock'ed with pin_memory, CUDA-registered when a GPU is visible), so RSS tracks
//     the bytes in use, not the budget. A freed slot stays committed ("warm") so the next block
//     of the same size costs no system call (the NVMe path cycles the same sizes every step);
//     committed bytes never exceed the budget: when a commit would pass it, the pages of warm
//     slots move to the slot being committed (mremap: page tables moved, locked pages stay locked,
//     nothing zeroed or copied; their address space is reserved again), which always makes room
//     since allocated bytes alone fit. Only where a move fails (a kernel without mremap across
//     mappings, ENOMEM) are warm slots released (munlock + MADV_DONTNEED) and the commit faulted
//     in afresh. Why: a host tier smaller than the step's working set cycles blocks of every size,
//     and releasing and faulting in again zeroed each byte the NVMe read then overwrote (246 M
//     LoRA at 256 MiB budgets: ~0.15 core-seconds a step of the kernel's clear_page).
//   - Registration follows the slots. set_region_listener() is told each committed slot (base,
//     bytes, page layout) when it is committed or resized and before it is released, so the NVMe
//     engine can register it as io_uring fixed buffers and unregister it before its pages go.
//
// Huge pages (huge_pages, default on): classes of 2 MiB slots and up are 2 MiB-aligned and
// madvise(MADV_HUGEPAGE)'d when transparent huge pages are "always" or "madvise", so the kernel
// backs them with 2 MiB pages where it can, which an I/O request then sees as few physical
// segments. With verify_huge_pages, after a commit the pool reads /proc/self/smaps for how much of
// the slot the kernel gave 2 MiB pages; HostRegion::contiguous_bytes says 2 MiB only when all of
// its 2 MiB-aligned part is huge (without it, 4096), so I/O sizing built on it is never optimistic. Otherwise 4 KiB pages, logged once
// (HOST tag). (Reserved hugetlbfs pages are not used: MAP_HUGETLB reserves the whole mapping.)
//
// Pinning: with pin_memory true the constructor refuses a budget above a finite RLIMIT_MEMLOCK
// (unless root, who may lock past it), and a commit whose mlock fails throws Error naming the
// limit and how to raise it (`ulimit -l unlimited`, memlock in /etc/security/limits.conf,
// LimitMEMLOCK= for systemd). With pin_memory false the memory is not mlock'ed and nothing warns:
// O_DIRECT requests and io_uring fixed buffers lock the pages they use themselves, and with a GPU
// visible each committed slot is registered with CUDA (page-locked by that) either way; unlocked
// pages may only be swapped out under memory pressure (DEBUG log line).
//
// Limits: reserved address space is about 2 x budget per size class used (a 1 GiB budget: at most
// 38 GiB of address space, no memory); budgets beyond ~2 TiB may not find the address space.
//
// Thread-safety: all methods are thread-safe (one internal mutex). The region listener is called
// with that mutex held: it must not call back into the pool.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "tiermem/export.h"

namespace tiermem {

struct TIERMEM_API PinnedHostPoolOptions {
  std::uint64_t budget_bytes = 256ull << 20;  // max allocated bytes (rounded down to 4096)
  bool pin_memory = false;                    // mlock (see the top of the file)
  int numa_node = -1;                         // -1: the node of the calling thread
  bool cuda_register = true;                  // cudaHostRegister when CUDA is present
  bool huge_pages = true;  // 2 MiB pages when the system allows (see the top of the file)
  // After committing a slot of 2 MiB or more, read /proc/self/smaps for its huge-page backing
  // (HostRegion::contiguous_bytes; else 4096 is claimed). The kernel walks every mapping of the
  // process for that (~1-10 ms): for pools whose slots are committed once (bounce chunks, benches'
  // buffers), not for a cache whose slots are committed and released as its contents change.
  bool verify_huge_pages = false;
};

// How a mapping's pages were obtained.
enum class HostPageKind : std::uint8_t {
  kSmall,        // 4 KiB pages (huge pages off or unavailable)
  kTransparent,  // madvise(MADV_HUGEPAGE): 2 MiB where the kernel could (see huge_bytes)
  kHugetlb,      // MAP_HUGETLB: reserved 2 MiB pages (not made by this pool any more)
};

// One committed slot of the pool, for io_uring buffer registration.
struct TIERMEM_API HostRegion {
  void* base;
  std::uint64_t bytes;
  // The region is physically contiguous at least in naturally aligned units of this many bytes:
  // 2 MiB (kHugePageBytes) when all of its 2 MiB-aligned part is backed by huge pages as far as
  // the kernel reported when it was committed, else 4096 (nothing known beyond the base page).
  std::uint64_t contiguous_bytes = 4096;
};

class TIERMEM_API PinnedHostPool {
 public:
  static constexpr std::uint64_t kAlignment = 4096;
  static constexpr std::uint64_t kHugePageBytes = 2ull << 20;

  // Reserves and commits nothing. With pin_memory and a finite RLIMIT_MEMLOCK below the budget
  // (and not root), throws Error with the ulimit advice.
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
  // free(). Throws OutOfMemoryError(Tier::kHost, requested, available) when allocated_bytes() plus
  // its rounded size passes the budget; Error when memory cannot be committed or locked.
  void* allocate(std::uint64_t bytes);
  // Like allocate() but returns nullptr when it does not fit (commit/lock failures still throw).
  void* try_allocate(std::uint64_t bytes);
  // Same as try_allocate (kept for callers that mark long-lived blocks; placement no longer
  // matters, as no block's place can keep another from fitting).
  void* try_allocate_high(std::uint64_t bytes);
  // Backpressure for async callers: waits until the block fits or `timeout` passes; then throws
  // OutOfMemoryError like allocate(). A request larger than the budget throws at once.
  void* allocate_wait(std::uint64_t bytes, std::chrono::duration<double> timeout);
  // Returns a block. nullptr is ignored; an unknown pointer is logged and ignored. Never throws.
  void free(void* ptr) noexcept;
  // Gives the pages of every free ("warm") slot back to the OS (munlock + MADV_DONTNEED): after
  // it, mapped_bytes() == allocated_bytes(). Returns the bytes released. Never throws.
  std::uint64_t release_free() noexcept;

  // Told every committed slot: on_map after it is committed or resized (its new extent), on_unmap
  // before its pages are released or resized. Setting replays on_map for the slots committed now;
  // clear_region_listener() calls on_unmap for each and forgets the pair. Called under the pool's
  // lock; the callbacks must not throw (a throw is logged and ignored) nor call the pool.
  void set_region_listener(std::function<void(const HostRegion&)> on_map,
                           std::function<void(void*)> on_unmap);
  void clear_region_listener();

  std::uint64_t budget_bytes() const noexcept { return options_.budget_bytes; }
  std::uint64_t allocated_bytes() const;
  std::uint64_t peak_allocated_bytes() const;
  // Bytes committed (faulted in; locked with pin_memory): allocated plus warm free slots,
  // never above the budget.
  std::uint64_t mapped_bytes() const;
  std::uint64_t peak_mapped_bytes() const;
  // Bytes committed by faulting fresh (zeroed) pages in, and bytes committed by moving a warm
  // slot's pages over, since construction.
  std::uint64_t faulted_bytes() const;
  std::uint64_t moved_bytes() const;
  // True when pin_memory and every committed slot is page-locked (mlock succeeded).
  bool pinned() const;
  // Bytes of the committed slots backed by 2 MiB pages, as /proc/self/smaps reported at commit.
  std::uint64_t huge_bytes() const;
  // kTransparent when 2 MiB-slot classes are madvise'd for huge pages, else kSmall.
  HostPageKind page_kind() const;
  // The committed slots (live blocks and warm free ones).
  std::vector<HostRegion> regions() const;
  const PinnedHostPoolOptions& options() const noexcept { return options_; }

 private:
  struct Slot {
    std::uint64_t committed = 0;  // bytes faulted in from the slot's base
    std::uint64_t huge_bytes = 0;
    std::uint64_t contiguous_bytes = kAlignment;
    bool live = false;
    bool locked = false;
    bool cuda_registered = false;
  };
  struct SizeClass {
    char* base = nullptr;            // reserved lazily
    std::uint64_t slot_bytes = 0;
    std::uint64_t nslots = 0;
    std::uint64_t reserved_bytes = 0;
    std::vector<Slot> slots;          // slots[0, slots.size()) have been used once
    std::vector<std::uint32_t> warm;  // free, committed > 0
    std::vector<std::uint32_t> cold;  // free, committed == 0
  };
  void* try_allocate_locked(std::uint64_t rounded);  // needs mu_
  void reserve_class_locked(int k);                  // needs mu_
  // Sets slot i of class k to exactly `bytes` committed (0: released). Needs mu_.
  void resize_slot_locked(int k, std::uint32_t i, std::uint64_t bytes);
  bool release_one_warm_locked(int skip_k, std::uint32_t skip_i);  // needs mu_
  // Moves up to `bytes` of warm slots' committed pages (their tails) to `dst`, slot (k, i)'s
  // uncommitted head; returns the bytes moved (a multiple of 4096; fewer where a move failed).
  // The sources shrink by what they gave (released to cold at 0). Needs mu_.
  std::uint64_t move_warm_pages_locked(int k, std::uint32_t i, char* dst, std::uint64_t bytes);
  char* slot_base(int k, std::uint32_t i) const { return classes_[k].base + i * classes_[k].slot_bytes; }
  void notify_map_locked(int k, std::uint32_t i);    // needs mu_
  void notify_unmap_locked(int k, std::uint32_t i);  // needs mu_

  PinnedHostPoolOptions options_;
  bool thp_ = false;  // 2 MiB classes get MADV_HUGEPAGE
  mutable std::mutex mu_;
  std::condition_variable freed_;
  std::vector<SizeClass> classes_;                         // guarded by mu_
  std::function<void(const HostRegion&)> on_map_;          // guarded by mu_
  std::function<void(void*)> on_unmap_;                    // guarded by mu_
  std::uint64_t allocated_ = 0, peak_ = 0;                 // guarded by mu_
  std::uint64_t committed_ = 0, peak_committed_ = 0;       // guarded by mu_
  std::uint64_t moved_bytes_ = 0, faulted_bytes_ = 0;      // guarded by mu_ (stats)
};

}  // namespace tiermem
