// pinned_host_pool.cc — size-class slots over reserved address space, committed (faulted in,
// NUMA-bound, mlock'ed) as they are used. Why: see the top of include/tiermem/pinned_host_pool.h.
#include "tiermem/pinned_host_pool.h"

#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include "tiermem/error.h"
#include "tiermem/log.h"
#include "tiermem/tier.h"
#include "tiermem/topology.h"

#if TIERMEM_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace tiermem {
namespace {

constexpr std::uint64_t kHuge = PinnedHostPool::kHugePageBytes;
constexpr std::uint64_t kPage = PinnedHostPool::kAlignment;

std::string memlock_advice(std::uint64_t wanted) {
  struct rlimit rl {};
  std::string limit = "unknown";
  if (getrlimit(RLIMIT_MEMLOCK, &rl) == 0) {
    limit = rl.rlim_cur == RLIM_INFINITY ? "unlimited" : format_bytes(rl.rlim_cur);
  }
  return "cannot page-lock " + format_bytes(wanted) + " of host memory (RLIMIT_MEMLOCK is " + limit +
         "): raise it with `ulimit -l unlimited` in the launching shell, `memlock` in "
         "/etc/security/limits.conf, LimitMEMLOCK=infinity for systemd units or "
         "`--ulimit memlock=-1` for docker; or set pin_memory: false to use unlocked memory";
}

// The bracketed word of /sys/kernel/mm/transparent_hugepage/enabled ("always", "madvise",
// "never"); "" when the file is absent (no THP in the kernel, or no sysfs).
std::string thp_mode() {
  std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string line;
  if (!std::getline(f, line)) return "";
  auto a = line.find('['), b = line.find(']');
  return a == std::string::npos || b == std::string::npos || b < a ? "" : line.substr(a + 1, b - a - 1);
}

// Bytes of [base, base + bytes) that /proc/self/smaps reports as AnonHugePages (the VMAs that
// overlap it; capped at `bytes` since a VMA may extend past it). 0 when smaps is unreadable.
std::uint64_t smaps_huge_bytes(const char* base, std::uint64_t bytes) {
  std::ifstream f("/proc/self/smaps");
  std::string line;
  bool inside = false;
  std::uint64_t kb_total = 0;
  const auto lo = reinterpret_cast<std::uintptr_t>(base), hi = lo + bytes;
  while (std::getline(f, line)) {
    unsigned long start = 0, end = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &start, &end) == 2) {  // a VMA's header line
      inside = start < hi && end > lo;
      continue;
    }
    unsigned long kb = 0;
    if (inside && std::sscanf(line.c_str(), "AnonHugePages: %lu kB", &kb) == 1) kb_total += kb;
  }
  return std::min<std::uint64_t>(kb_total * 1024, bytes);
}

// Faults every page of [p, p + bytes) in for writing: MADV_POPULATE_WRITE (Linux 5.14+), else a
// write to each 4 KiB page.
void populate_range(char* p, std::uint64_t bytes) {
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
  if (madvise(p, bytes, MADV_POPULATE_WRITE) == 0) return;
  for (std::uint64_t off = 0; off < bytes; off += kPage) static_cast<volatile char*>(p)[off] = 0;
}

// Address space of `bytes` (no memory behind it), `align`-aligned (maps `align` more, trims).
char* reserve_aligned(std::uint64_t bytes, std::uint64_t align) {
  const std::uint64_t span = bytes + align;
  void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  const auto r = reinterpret_cast<std::uintptr_t>(raw);
  const std::uintptr_t a = (r + align - 1) / align * align;
  if (a > r) munmap(raw, a - r);
  const std::uintptr_t end = r + span, used_end = a + bytes;
  if (end > used_end) munmap(reinterpret_cast<void*>(used_end), end - used_end);
  return reinterpret_cast<char*>(a);
}

// Class of a rounded size: the smallest k with 4096 << k >= rounded.
int class_of(std::uint64_t rounded) {
  const std::uint64_t pages = rounded / kPage;
  return pages <= 1 ? 0 : static_cast<int>(std::bit_width(pages - 1));
}

std::atomic<bool> g_logged_small_pages{false};
std::atomic<bool> g_warned_numa_node{false};  // a tiermem.numa_node this machine has not (said once)

#if TIERMEM_HAVE_CUDA
bool cuda_visible() {
  static const bool visible = [] {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
  }();
  return visible;
}
#endif

}  // namespace

PinnedHostPool::PinnedHostPool(PinnedHostPoolOptions options) : options_(options) {
  options_.budget_bytes = options_.budget_bytes / kAlignment * kAlignment;
  if (options_.numa_node < 0) {
    options_.numa_node = current_numa_node();
  } else if (const int nodes = numa_node_count(); options_.numa_node >= nodes && !g_warned_numa_node.exchange(true)) {
    // Binding to it fails (mbind), silently: the pool's memory then lands wherever the kernel puts it.
    TM_LOG_WARN("HOST", "tiermem.numa_node = {}: this machine has {} NUMA node(s) (0..{}); the host pool is not bound "
                "to a node (set -1 for the node nearest the GPU or the calling thread)",
                options_.numa_node, nodes, nodes - 1);
  }
  classes_.resize(64 - 12);
  for (std::size_t k = 0; k < classes_.size(); ++k) classes_[k].slot_bytes = kAlignment << k;
  if (options_.huge_pages) {
    const std::string thp = thp_mode();
    thp_ = thp == "always" || thp == "madvise";
    if (!thp_ && !g_logged_small_pages.exchange(true)) {
      TM_LOG_INFO("HOST",
                  "host pool uses 4 KiB pages: transparent huge pages are '{}'; I/O requests will "
                  "carry more segments (logged once)",
                  thp.empty() ? std::string("unavailable") : thp);
    }
  }
  if (options_.pin_memory) {
    struct rlimit rl {};
    if (getrlimit(RLIMIT_MEMLOCK, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY &&
        rl.rlim_cur < options_.budget_bytes && geteuid() != 0) {
      throw Error(memlock_advice(options_.budget_bytes) + " (the host budget may be locked in full)");
    }
  } else {
    // Nothing to warn of: O_DIRECT requests and io_uring's fixed buffers lock the pages they use
    // themselves, a SimDevice reads host memory where it is, and with a GPU visible each slot is
    // registered with CUDA (page-locked by the registration) whatever pin_memory says. Unlocked,
    // the pages may only be swapped out under memory pressure, as any other memory of the process.
    TM_LOG_DEBUG("HOST", "host pool memory is not mlock'ed (pin_memory: false)");
  }
}

PinnedHostPool::~PinnedHostPool() {
  std::lock_guard lock(mu_);
  for (std::size_t k = 0; k < classes_.size(); ++k) {
    SizeClass& c = classes_[k];
    if (c.base == nullptr) continue;
    for (std::uint32_t i = 0; i < c.slots.size(); ++i) {
      if (c.slots[i].committed == 0) continue;
      notify_unmap_locked(static_cast<int>(k), i);
#if TIERMEM_HAVE_CUDA
      if (c.slots[i].cuda_registered) cudaHostUnregister(slot_base(static_cast<int>(k), i));
#endif
    }
    munmap(c.base, c.reserved_bytes);  // unlocks what was locked
  }
}

void PinnedHostPool::reserve_class_locked(int k) {
  SizeClass& c = classes_[k];
  // At most 2 * budget / slot - 1 blocks of this class are live at once (each is more than half
  // a slot, class 0's exactly one), so this many slots never run out.
  c.nslots = std::max<std::uint64_t>(1, (2 * options_.budget_bytes + c.slot_bytes - 1) / c.slot_bytes);
  c.reserved_bytes = c.nslots * c.slot_bytes;
  const bool huge = thp_ && c.slot_bytes >= kHuge;
  c.base = reserve_aligned(c.reserved_bytes, huge ? kHuge : kAlignment);
  if (c.base == nullptr) {
    throw OutOfMemoryError(Tier::kHost, c.slot_bytes, options_.budget_bytes - allocated_,
                           errno_message("reserving " + format_bytes(c.reserved_bytes) +
                                             " of address space for the host pool's " +
                                             format_bytes(c.slot_bytes) + " slots",
                                         errno));
  }
  if (huge) madvise(c.base, c.reserved_bytes, MADV_HUGEPAGE);
}

void PinnedHostPool::notify_map_locked(int k, std::uint32_t i) {
  if (!on_map_) return;
  const Slot& s = classes_[k].slots[i];
  try {
    on_map_(HostRegion{slot_base(k, i), s.committed, s.contiguous_bytes});
  } catch (const std::exception& e) {
    TM_LOG_ERROR("HOST", "host pool region listener (map) threw: {}", e.what());
  }
}

void PinnedHostPool::notify_unmap_locked(int k, std::uint32_t i) {
  if (!on_unmap_) return;
  try {
    on_unmap_(slot_base(k, i));
  } catch (const std::exception& e) {
    TM_LOG_ERROR("HOST", "host pool region listener (unmap) threw: {}", e.what());
  }
}

void PinnedHostPool::resize_slot_locked(int k, std::uint32_t i, std::uint64_t bytes) {
  Slot& s = classes_[k].slots[i];
  if (s.committed == bytes) return;
  char* base = slot_base(k, i);
  if (s.committed > 0) notify_unmap_locked(k, i);
#if TIERMEM_HAVE_CUDA
  if (s.cuda_registered) {
    cudaHostUnregister(base);
    s.cuda_registered = false;
  }
#endif
  if (bytes < s.committed) {  // release the tail (all of it when bytes is 0)
    char* tail = base + bytes;
    const std::uint64_t n = s.committed - bytes;
    if (s.locked) munlock(tail, n);
    madvise(tail, n, MADV_DONTNEED);
    committed_ -= n;
    s.committed = bytes;
    if (bytes == 0) s.locked = false;
  } else {  // commit [committed, bytes)
    char* head = base + s.committed;
    std::uint64_t n = bytes - s.committed;
    // Past the budget: warm slots' pages first (moved, not zeroed), then warm slots released.
    if (committed_ + n > options_.budget_bytes) {
      const std::uint64_t moved = move_warm_pages_locked(k, i, head, committed_ + n - options_.budget_bytes);
      if (moved > 0) {
        s.committed += moved;  // already faulted in, locked with pin_memory, counted in committed_
        s.locked = options_.pin_memory;
        head += moved;
        n -= moved;
      }
      while (committed_ + n > options_.budget_bytes && release_one_warm_locked(k, i)) {
      }
    }
    faulted_bytes_ += n;
    bind_to_numa_node(head, n, options_.numa_node);
    populate_range(head, n);
    if (options_.pin_memory) {
      if (mlock(head, n) != 0) {
        const int err = errno;
        madvise(head, n, MADV_DONTNEED);
        if (s.committed > 0) notify_map_locked(k, i);  // back as it was
        throw Error(memlock_advice(committed_ + n) + " (" + errno_message("mlock", err) + ")");
      }
      s.locked = true;
    }
    committed_ += n;
    peak_committed_ = std::max(peak_committed_, committed_);
    s.committed = bytes;
  }
  s.huge_bytes = 0;
  s.contiguous_bytes = kAlignment;
  if (s.committed == 0) return;
  if (options_.verify_huge_pages && thp_ && classes_[k].slot_bytes >= kHuge && s.committed >= kHuge) {
    s.huge_bytes = smaps_huge_bytes(base, s.committed);
    if (s.huge_bytes >= s.committed / kHuge * kHuge) s.contiguous_bytes = kHuge;
  }
#if TIERMEM_HAVE_CUDA
  if (options_.cuda_register && cuda_visible()) {
    s.cuda_registered = cudaHostRegister(base, s.committed, cudaHostRegisterDefault) == cudaSuccess;
    if (!s.cuda_registered) {
      cudaGetLastError();
      TM_LOG_DEBUG("HOST", "cudaHostRegister of {} failed; copies will be staged",
                   format_bytes(s.committed));
    }
  }
#endif
  notify_map_locked(k, i);
}

std::uint64_t PinnedHostPool::move_warm_pages_locked(int k, std::uint32_t i, char* dst, std::uint64_t bytes) {
  std::uint64_t moved = 0;
  // Largest slots first (as release_one_warm_locked): fewest moves for the bytes.
  for (int c = static_cast<int>(classes_.size()) - 1; c >= 0 && moved < bytes; --c) {
    SizeClass& sc = classes_[c];
    for (std::size_t w = 0; w < sc.warm.size() && moved < bytes;) {
      const std::uint32_t j = sc.warm[w];
      if (c == k && j == i) {
        ++w;
        continue;
      }
      Slot& src = sc.slots[j];
      const std::uint64_t take = std::min(bytes - moved, src.committed);
      char* from = slot_base(c, j) + (src.committed - take);
      notify_unmap_locked(c, j);
#if TIERMEM_HAVE_CUDA
      if (src.cuda_registered) {
        cudaHostUnregister(slot_base(c, j));
        src.cuda_registered = false;
      }
#endif
      // MREMAP_DONTUNMAP: the source range stays mapped, with its flags (reserved, NORESERVE, no
      // memory behind it; VM_LOCKED dropped there), so it is never a hole. A plain move unmaps it
      // until the range is mapped again, and another thread's mmap (a large malloc, a sanitizer's
      // own mappings) could land in that hole, to be overwritten by the MAP_FIXED that re-reserves
      // it: test MovingPagesNeverUnmapsAWarmSlotsRangeUnderAnotherThread crashed that way.
      if (mremap(from, take, take, MREMAP_MAYMOVE | MREMAP_FIXED | MREMAP_DONTUNMAP, dst + moved) == MAP_FAILED) {
        // A kernel before 6.17 cannot move a range that earlier moves made of several mappings
        // (EFAULT), nor one before 5.7 with MREMAP_DONTUNMAP (EINVAL): the caller releases and
        // faults in instead.
        TM_LOG_DEBUG("HOST", "moving {} of a warm slot's pages failed ({}); faulting in fresh pages",
                     format_bytes(take), std::strerror(errno));
        notify_map_locked(c, j);
        return moved;
      }
      moved += take;
      moved_bytes_ += take;
      src.committed -= take;
      src.huge_bytes = 0;
      src.contiguous_bytes = kAlignment;
      if (src.committed == 0) {
        src.locked = false;
        sc.warm.erase(sc.warm.begin() + static_cast<std::ptrdiff_t>(w));
        sc.cold.push_back(j);
      } else {
        notify_map_locked(c, j);
        ++w;
      }
    }
  }
  return moved;
}

std::uint64_t PinnedHostPool::release_free() noexcept {
  std::lock_guard lock(mu_);
  const std::uint64_t before = committed_;
  while (release_one_warm_locked(-1, 0)) {
  }
  return before - committed_;
}

bool PinnedHostPool::release_one_warm_locked(int skip_k, std::uint32_t skip_i) {
  // Largest slots first: fewest system calls for the bytes released.
  for (int k = static_cast<int>(classes_.size()) - 1; k >= 0; --k) {
    SizeClass& c = classes_[k];
    for (std::size_t w = 0; w < c.warm.size(); ++w) {
      const std::uint32_t i = c.warm[w];
      if (k == skip_k && i == skip_i) continue;
      c.warm.erase(c.warm.begin() + static_cast<std::ptrdiff_t>(w));
      resize_slot_locked(k, i, 0);
      c.cold.push_back(i);
      return true;
    }
  }
  return false;
}

void* PinnedHostPool::try_allocate_locked(std::uint64_t rounded) {
  if (allocated_ + rounded > options_.budget_bytes) return nullptr;
  const int k = class_of(rounded);
  SizeClass& c = classes_[k];
  if (c.base == nullptr) reserve_class_locked(k);
  // A warm slot of exactly this size first (no system call), else the warm one closest to it,
  // else a released one, else one never used.
  std::uint32_t i = 0;
  bool found = false;
  auto distance = [&](std::uint32_t w) {
    const std::uint64_t have = c.slots[w].committed;
    return have > rounded ? have - rounded : rounded - have;
  };
  std::size_t best = c.warm.size();
  for (std::size_t w = 0; w < c.warm.size(); ++w) {
    if (best == c.warm.size() || distance(c.warm[w]) < distance(c.warm[best])) best = w;
    if (distance(c.warm[best]) == 0) break;
  }
  if (best < c.warm.size()) {
    i = c.warm[best];
    c.warm.erase(c.warm.begin() + static_cast<std::ptrdiff_t>(best));
    found = true;
  } else if (!c.cold.empty()) {
    i = c.cold.back();
    c.cold.pop_back();
    found = true;
  } else if (c.slots.size() < c.nslots) {
    i = static_cast<std::uint32_t>(c.slots.size());
    c.slots.emplace_back();
    found = true;
  }
  if (!found) {  // cannot happen while allocated_ <= budget (see reserve_class_locked)
    TM_LOG_ERROR("HOST", "host pool: no free {} slot with {} of {} allocated", format_bytes(c.slot_bytes),
                 format_bytes(allocated_), format_bytes(options_.budget_bytes));
    return nullptr;
  }
  Slot& s = c.slots[i];
  s.live = true;  // not a release candidate while the room is made
  // Committed bytes stay within the budget: resize_slot_locked takes warm slots' pages (or
  // releases warm slots) until this one's growth fits. Allocated bytes alone fit, so it does.
  try {
    resize_slot_locked(k, i, rounded);
  } catch (...) {
    s.live = false;
    (s.committed > 0 ? c.warm : c.cold).push_back(i);
    throw;
  }
  allocated_ += rounded;
  peak_ = std::max(peak_, allocated_);
  return slot_base(k, i);
}

void* PinnedHostPool::try_allocate(std::uint64_t bytes) {
  std::lock_guard lock(mu_);
  return try_allocate_locked(allocation_size(bytes));
}

void* PinnedHostPool::try_allocate_high(std::uint64_t bytes) { return try_allocate(bytes); }

void* PinnedHostPool::allocate(std::uint64_t bytes) {
  std::uint64_t rounded = allocation_size(bytes);
  std::lock_guard lock(mu_);
  void* p = try_allocate_locked(rounded);
  if (p == nullptr) {
    throw OutOfMemoryError(Tier::kHost, rounded, options_.budget_bytes - allocated_,
                           "host pool (budget " + format_bytes(options_.budget_bytes) +
                               ", allocated " + format_bytes(allocated_) +
                               "); raise tiermem.host_budget_bytes or free blocks");
  }
  return p;
}

void* PinnedHostPool::allocate_wait(std::uint64_t bytes, std::chrono::duration<double> timeout) {
  std::uint64_t rounded = allocation_size(bytes);
  if (rounded > options_.budget_bytes) return allocate(bytes);  // throws at once
  auto deadline = std::chrono::steady_clock::now() +
                  std::chrono::duration_cast<std::chrono::steady_clock::duration>(timeout);
  std::unique_lock lock(mu_);
  while (true) {
    if (void* p = try_allocate_locked(rounded)) return p;
    if (freed_.wait_until(lock, deadline) == std::cv_status::timeout) {
      if (void* p = try_allocate_locked(rounded)) return p;
      throw OutOfMemoryError(Tier::kHost, rounded, options_.budget_bytes - allocated_,
                             "host pool still full after waiting for a free (budget " +
                                 format_bytes(options_.budget_bytes) + ", allocated " +
                                 format_bytes(allocated_) + ")");
    }
  }
}

void PinnedHostPool::free(void* ptr) noexcept {
  if (ptr == nullptr) return;
  {
    std::lock_guard lock(mu_);
    char* p = static_cast<char*>(ptr);
    bool done = false;
    for (std::size_t k = 0; k < classes_.size() && !done; ++k) {
      SizeClass& c = classes_[k];
      if (c.base == nullptr || p < c.base || p >= c.base + c.reserved_bytes) continue;
      const std::uint64_t off = static_cast<std::uint64_t>(p - c.base);
      const auto i = static_cast<std::uint32_t>(off / c.slot_bytes);
      if (off % c.slot_bytes != 0 || i >= c.slots.size() || !c.slots[i].live) break;
      c.slots[i].live = false;
      allocated_ -= c.slots[i].committed;
      c.warm.push_back(i);
      done = true;
    }
    if (!done) {
      TM_LOG_ERROR("HOST", "free of a pointer the pool did not allocate ({})", ptr);
      return;
    }
  }
  freed_.notify_all();
}

void PinnedHostPool::set_region_listener(std::function<void(const HostRegion&)> on_map,
                                         std::function<void(void*)> on_unmap) {
  std::lock_guard lock(mu_);
  on_map_ = std::move(on_map);
  on_unmap_ = std::move(on_unmap);
  for (std::size_t k = 0; k < classes_.size(); ++k) {
    for (std::uint32_t i = 0; i < classes_[k].slots.size(); ++i) {
      if (classes_[k].slots[i].committed > 0) notify_map_locked(static_cast<int>(k), i);
    }
  }
}

void PinnedHostPool::clear_region_listener() {
  std::lock_guard lock(mu_);
  for (std::size_t k = 0; k < classes_.size(); ++k) {
    for (std::uint32_t i = 0; i < classes_[k].slots.size(); ++i) {
      if (classes_[k].slots[i].committed > 0) notify_unmap_locked(static_cast<int>(k), i);
    }
  }
  on_map_ = nullptr;
  on_unmap_ = nullptr;
}

std::uint64_t PinnedHostPool::allocated_bytes() const {
  std::lock_guard lock(mu_);
  return allocated_;
}
std::uint64_t PinnedHostPool::peak_allocated_bytes() const {
  std::lock_guard lock(mu_);
  return peak_;
}
std::uint64_t PinnedHostPool::mapped_bytes() const {
  std::lock_guard lock(mu_);
  return committed_;
}
std::uint64_t PinnedHostPool::faulted_bytes() const {
  std::lock_guard lock(mu_);
  return faulted_bytes_;
}
std::uint64_t PinnedHostPool::moved_bytes() const {
  std::lock_guard lock(mu_);
  return moved_bytes_;
}
std::uint64_t PinnedHostPool::peak_mapped_bytes() const {
  std::lock_guard lock(mu_);
  return peak_committed_;
}
bool PinnedHostPool::pinned() const {
  std::lock_guard lock(mu_);
  if (!options_.pin_memory) return false;
  for (const SizeClass& c : classes_) {
    for (const Slot& s : c.slots) {
      if (s.committed > 0 && !s.locked) return false;
    }
  }
  return true;
}
std::vector<HostRegion> PinnedHostPool::regions() const {
  std::lock_guard lock(mu_);
  std::vector<HostRegion> out;
  for (std::size_t k = 0; k < classes_.size(); ++k) {
    for (std::uint32_t i = 0; i < classes_[k].slots.size(); ++i) {
      const Slot& s = classes_[k].slots[i];
      if (s.committed > 0) out.push_back({slot_base(static_cast<int>(k), i), s.committed, s.contiguous_bytes});
    }
  }
  return out;
}
std::uint64_t PinnedHostPool::huge_bytes() const {
  std::lock_guard lock(mu_);
  std::uint64_t n = 0;
  for (const SizeClass& c : classes_) {
    for (const Slot& s : c.slots) n += s.huge_bytes;
  }
  return n;
}
HostPageKind PinnedHostPool::page_kind() const {
  return thp_ ? HostPageKind::kTransparent : HostPageKind::kSmall;
}

}  // namespace tiermem
