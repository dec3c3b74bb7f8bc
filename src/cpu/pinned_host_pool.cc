// pinned_host_pool.cc — mmap'ed, NUMA-bound, mlock'ed mappings with a best-fit sub-allocator.
#include "tiermem/pinned_host_pool.h"

#include <sys/mman.h>
#include <sys/resource.h>

#include <atomic>
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

constexpr std::uint64_t kHuge = PinnedHostPool::kHugePageBytes;

// The bracketed word of /sys/kernel/mm/transparent_hugepage/enabled ("always", "madvise",
// "never"); "" when the file is absent (no THP in the kernel, or no sysfs).
std::string thp_mode() {
  std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string line;
  if (!std::getline(f, line)) return "";
  auto a = line.find('['), b = line.find(']');
  return a == std::string::npos || b == std::string::npos || b < a ? "" : line.substr(a + 1, b - a - 1);
}

// Free reserved hugetlbfs pages of 2 MiB (HugePages_Free when Hugepagesize is 2048 kB), else 0.
std::uint64_t hugetlb_free_pages() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  std::uint64_t value = 0, free_pages = 0, page_kb = 0;
  std::string line;
  while (std::getline(f, line)) {
    std::istringstream in(line);
    if (!(in >> key >> value)) continue;
    if (key == "HugePages_Free:") free_pages = value;
    if (key == "Hugepagesize:") page_kb = value;
  }
  return page_kb == kHuge / 1024 ? free_pages : 0;
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
  for (std::uint64_t off = 0; off < bytes; off += PinnedHostPool::kAlignment) {
    static_cast<volatile char*>(p)[off] = 0;
  }
}

// Anonymous read-write memory of `bytes` whose base is 2 MiB-aligned (maps 2 MiB more, trims).
char* map_huge_aligned(std::uint64_t bytes) {
  const std::uint64_t span = bytes + kHuge;
  void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  const auto r = reinterpret_cast<std::uintptr_t>(raw);
  const std::uintptr_t a = (r + kHuge - 1) / kHuge * kHuge;
  if (a > r) munmap(raw, a - r);
  const std::uintptr_t end = r + span, used_end = a + bytes;
  if (end > used_end) munmap(reinterpret_cast<void*>(used_end), end - used_end);
  return reinterpret_cast<char*>(a);
}

std::atomic<bool> g_logged_small_pages{false};

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
  if (options_.mapping_bytes < kAlignment) options_.mapping_bytes = kAlignment;
  options_.mapping_bytes = allocation_size(options_.mapping_bytes);
  options_.budget_bytes = options_.budget_bytes / kAlignment * kAlignment;
  if (options_.numa_node < 0) options_.numa_node = current_numa_node();
  if ((options_.pin_memory || options_.map_now) && options_.budget_bytes > 0) {
    std::lock_guard lock(mu_);
    add_mapping_locked(std::min(options_.mapping_bytes, options_.budget_bytes));
  }
}

PinnedHostPool::~PinnedHostPool() {
  for (const Mapping& m : mappings_) {
#if TIERMEM_HAVE_CUDA
    if (m.cuda_registered) cudaHostUnregister(m.base);
#endif
    if (m.locked) munlock(m.base, m.bytes);
    munmap(m.base, m.bytes);
  }
}

bool PinnedHostPool::add_mapping_locked(std::uint64_t at_least) {
  if (mapped_ >= options_.budget_bytes) return false;
  std::uint64_t room = options_.budget_bytes - mapped_;
  std::uint64_t bytes = std::max(at_least, std::min(options_.mapping_bytes, room));
  if (bytes > room) return false;
  Mapping m{nullptr, bytes, false, false};
  if (options_.huge_pages && bytes % kHuge == 0 && hugetlb_free_pages() >= bytes / kHuge) {
    // Reserved pages: MAP_HUGETLB reserves them at mmap time, so a later fault cannot fail.
    void* h = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB,
                   -1, 0);
    if (h != MAP_FAILED) {
      m.base = static_cast<char*>(h);
      m.kind = HostPageKind::kHugetlb;
    }
  }
  const std::string thp = options_.huge_pages && m.base == nullptr ? thp_mode() : std::string();
  if (m.base == nullptr && (thp == "always" || thp == "madvise")) {
    m.base = map_huge_aligned(bytes);
    if (m.base != nullptr && (thp == "always" || madvise(m.base, bytes, MADV_HUGEPAGE) == 0)) {
      m.kind = HostPageKind::kTransparent;
    }
  }
  if (m.base == nullptr) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      throw OutOfMemoryError(Tier::kHost, bytes, room,
                             errno_message("mmap of a host pool mapping", errno));
    }
    m.base = static_cast<char*>(p);
  }
  if (options_.huge_pages && m.kind == HostPageKind::kSmall &&
      !g_logged_small_pages.exchange(true)) {
    TM_LOG_INFO("HOST",
                "host pool uses 4 KiB pages: transparent huge pages are '{}' and {} hugetlbfs pages "
                "are free; I/O requests will carry more segments (logged once)",
                thp.empty() ? std::string("unavailable") : thp, hugetlb_free_pages());
  }
  void* p = m.base;
  bind_to_numa_node(p, bytes, options_.numa_node);
  if (options_.populate) populate_range(m.base, bytes);
  if (options_.pin_memory) {
    if (mlock(p, bytes) != 0) {
      int err = errno;
      munmap(p, bytes);
      throw Error(memlock_advice(mapped_ + bytes) + " (" + errno_message("mlock", err) + ")");
    }
    m.locked = true;
  } else {
    // Every pool of the process (the store's, the bounce chunks', ...) and every rank would say
    // the same: once per job.
    TM_LOG_WARN_ONCE_RANK0("HOST", "host-pool-unpinned",
                           "host pool memory is not page-locked (pin_memory: false); NVMe and "
                           "device copies from it may be slower");
  }
#if TIERMEM_HAVE_CUDA
  if (options_.cuda_register && cuda_visible()) {
    m.cuda_registered = cudaHostRegister(p, bytes, cudaHostRegisterDefault) == cudaSuccess;
    if (!m.cuda_registered) {
      cudaGetLastError();
      TM_LOG_DEBUG("HOST", "cudaHostRegister of {} failed; copies will be staged", format_bytes(bytes));
    }
  }
#endif
  const std::uint64_t aligned_part = bytes / kHuge * kHuge;
  if (m.kind == HostPageKind::kHugetlb) {
    m.huge_bytes = bytes;
  } else if (m.kind == HostPageKind::kTransparent && (options_.populate || m.locked)) {
    m.huge_bytes = smaps_huge_bytes(m.base, bytes);
  }
  if (aligned_part > 0 && m.huge_bytes >= aligned_part) m.contiguous_bytes = kHuge;
  mappings_.push_back(m);
  mapped_ += bytes;
  insert_free_locked(m.base, bytes);
  TM_LOG_DEBUG("HOST", "mapped {} on NUMA node {} ({}; {} in 2 MiB pages)", format_bytes(bytes),
               options_.numa_node, m.locked ? "locked" : "unlocked", format_bytes(m.huge_bytes));
  return true;
}

void PinnedHostPool::insert_free_locked(char* p, std::uint64_t bytes) {
  // Coalesce with the neighbours inside the same mapping (mappings are not contiguous in general,
  // and when they are, merging across them is still correct: both are ours and mapped).
  auto next = free_by_addr_.lower_bound(p);
  if (next != free_by_addr_.end() && p + bytes == next->first) {
    free_by_size_.erase({next->second, next->first});
    bytes += next->second;
    next = free_by_addr_.erase(next);
  }
  if (next != free_by_addr_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == p) {
      free_by_size_.erase({prev->second, prev->first});
      p = prev->first;
      bytes += prev->second;
      free_by_addr_.erase(prev);
    }
  }
  free_by_addr_[p] = bytes;
  free_by_size_.insert({bytes, p});
}

void* PinnedHostPool::try_allocate_locked(std::uint64_t rounded) {
  if (allocated_ + rounded > options_.budget_bytes) return nullptr;
  auto it = free_by_size_.lower_bound({rounded, nullptr});
  if (it == free_by_size_.end()) {
    if (!add_mapping_locked(rounded)) return nullptr;
    it = free_by_size_.lower_bound({rounded, nullptr});
    if (it == free_by_size_.end()) return nullptr;
  }
  auto [size, p] = *it;
  free_by_size_.erase(it);
  free_by_addr_.erase(p);
  if (size > rounded) {
    free_by_addr_[p + rounded] = size - rounded;
    free_by_size_.insert({size - rounded, p + rounded});
  }
  used_[p] = rounded;
  allocated_ += rounded;
  peak_ = std::max(peak_, allocated_);
  return p;
}

void* PinnedHostPool::try_allocate(std::uint64_t bytes) {
  std::lock_guard lock(mu_);
  return try_allocate_locked(allocation_size(bytes));
}

void* PinnedHostPool::try_allocate_high(std::uint64_t bytes) {
  const std::uint64_t rounded = allocation_size(bytes);
  std::lock_guard lock(mu_);
  if (allocated_ + rounded > options_.budget_bytes) return nullptr;
  for (int attempt = 0; attempt < 2; ++attempt) {
    for (auto it = free_by_addr_.rbegin(); it != free_by_addr_.rend(); ++it) {
      auto [base, size] = *it;
      if (size < rounded) continue;
      free_by_size_.erase({size, base});
      char* p = base + (size - rounded);
      if (size > rounded) {
        it->second = size - rounded;  // the block keeps its start, shrinks from the top
        free_by_size_.insert({size - rounded, base});
      } else {
        free_by_addr_.erase(base);
      }
      used_[p] = rounded;
      allocated_ += rounded;
      peak_ = std::max(peak_, allocated_);
      return p;
    }
    if (attempt == 0 && !add_mapping_locked(rounded)) return nullptr;
  }
  return nullptr;
}

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
                             "host pool still full after waiting for a free");
    }
  }
}

void PinnedHostPool::free(void* ptr) noexcept {
  if (ptr == nullptr) return;
  {
    std::lock_guard lock(mu_);
    auto it = used_.find(static_cast<char*>(ptr));
    if (it == used_.end()) {
      TM_LOG_ERROR("HOST", "free of a pointer the pool did not allocate ({})", ptr);
      return;
    }
    allocated_ -= it->second;
    insert_free_locked(it->first, it->second);
    used_.erase(it);
  }
  freed_.notify_all();
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
  return mapped_;
}
bool PinnedHostPool::pinned() const {
  std::lock_guard lock(mu_);
  for (const Mapping& m : mappings_) {
    if (!m.locked) return false;
  }
  return true;
}
std::vector<HostRegion> PinnedHostPool::regions() const {
  std::lock_guard lock(mu_);
  std::vector<HostRegion> out;
  for (const Mapping& m : mappings_) out.push_back({m.base, m.bytes, m.contiguous_bytes});
  return out;
}
std::uint64_t PinnedHostPool::huge_bytes() const {
  std::lock_guard lock(mu_);
  std::uint64_t n = 0;
  for (const Mapping& m : mappings_) n += m.huge_bytes;
  return n;
}
HostPageKind PinnedHostPool::page_kind() const {
  std::lock_guard lock(mu_);
  return mappings_.empty() ? HostPageKind::kSmall : mappings_.front().kind;
}

}  // namespace tiermem
