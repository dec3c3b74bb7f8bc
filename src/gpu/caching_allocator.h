// caching_allocator.h (internal) — the caching allocator shared by SimDevice and CudaDevice:
// exact-size bins of freed blocks over a backend (host memory or cudaMalloc), within a hard budget
// on allocated + cached bytes. When a request does not fit, cached blocks are released to the
// backend, largest first, until it does (all of them when the backend itself fails: its
// fragmentation); only then does it fail.
//
// Thread-safety: all methods are thread-safe (one leaf mutex). The backend functions are called
// with that mutex held and must not call back.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>

#include "tiermem/device.h"

namespace tiermem::detail {

class CachingAllocator {
 public:
  // backend_alloc(bytes) returns memory or nullptr; backend_free(ptr, bytes) returns it.
  CachingAllocator(std::uint64_t budget_bytes, std::function<void*(std::uint64_t)> backend_alloc,
                   std::function<void(void*, std::uint64_t)> backend_free)
      : budget_(budget_bytes), alloc_(std::move(backend_alloc)), free_(std::move(backend_free)) {}
  ~CachingAllocator() { release_all(); }

  // Granularity: 256 bytes up to 4 KiB, then 4 KiB (1 byte minimum).
  static std::uint64_t round(std::uint64_t bytes) noexcept {
    std::uint64_t b = bytes == 0 ? 1 : bytes;
    std::uint64_t g = b <= 4096 ? 256 : 4096;
    return (b + g - 1) / g * g;
  }

  // nullptr when it does not fit in the budget (after releasing the cache) or the backend fails.
  void* try_allocate(std::uint64_t bytes);
  // Returns false for an unknown pointer.
  bool free(void* p);
  void empty_cache();
  // Releases everything, cached and allocated (destructor).
  void release_all();
  // The allocation containing [p, p + bytes), or false.
  bool contains(const void* p, std::uint64_t bytes) const;
  std::uint64_t budget() const noexcept { return budget_; }
  std::uint64_t available() const;
  void fill_stats(DeviceStats& s) const;

 private:
  void empty_cache_locked();
  // Releases cached blocks, largest first, until `need` + what stays cached fits the budget.
  void trim_cache_locked(std::uint64_t need);
  std::uint64_t budget_;
  std::function<void*(std::uint64_t)> alloc_;
  std::function<void(void*, std::uint64_t)> free_;
  mutable std::mutex mu_;
  std::map<const char*, std::uint64_t> live_;       // guarded by mu_
  std::multimap<std::uint64_t, void*> cache_;       // guarded by mu_: size -> block
  std::uint64_t allocated_ = 0, cached_ = 0;        // guarded by mu_
  std::uint64_t peak_allocated_ = 0, peak_reserved_ = 0;  // guarded by mu_
  std::uint64_t allocations_ = 0, hits_ = 0, backend_allocations_ = 0;  // guarded by mu_
};

}  // namespace tiermem::detail
