// caching_allocator.cc — see caching_allocator.h.
#include "gpu/caching_allocator.h"

#include <iterator>

namespace tiermem::detail {

void* CachingAllocator::try_allocate(std::uint64_t bytes) {
  std::uint64_t size = round(bytes);
  std::lock_guard lock(mu_);
  void* p = nullptr;
  auto it = cache_.find(size);
  if (it != cache_.end()) {
    p = it->second;
    cache_.erase(it);
    cached_ -= size;
    ++hits_;
  } else {
    if (allocated_ + cached_ + size > budget_) trim_cache_locked(allocated_ + size);
    if (allocated_ + cached_ + size > budget_) return nullptr;
    p = alloc_(size);
    if (p == nullptr && cached_ > 0) {  // backend fragmentation: retry on an empty cache
      empty_cache_locked();
      p = alloc_(size);
    }
    if (p == nullptr) return nullptr;
    ++backend_allocations_;
  }
  live_[static_cast<const char*>(p)] = size;
  allocated_ += size;
  ++allocations_;
  peak_allocated_ = std::max(peak_allocated_, allocated_);
  peak_reserved_ = std::max(peak_reserved_, allocated_ + cached_);
  return p;
}

bool CachingAllocator::free(void* p) {
  std::lock_guard lock(mu_);
  auto it = live_.find(static_cast<const char*>(p));
  if (it == live_.end()) return false;
  std::uint64_t size = it->second;
  live_.erase(it);
  allocated_ -= size;
  cache_.emplace(size, p);
  cached_ += size;
  return true;
}

void CachingAllocator::empty_cache_locked() {
  for (auto& [size, p] : cache_) free_(p, size);
  cache_.clear();
  cached_ = 0;
}

void CachingAllocator::trim_cache_locked(std::uint64_t need) {
  // Largest first: the fewest blocks given back, and the small ones, cheap to keep, kept for reuse.
  while (cached_ > 0 && need + cached_ > budget_) {
    auto it = std::prev(cache_.end());
    free_(it->second, it->first);
    cached_ -= it->first;
    cache_.erase(it);
  }
}

void CachingAllocator::empty_cache() {
  std::lock_guard lock(mu_);
  empty_cache_locked();
}

void CachingAllocator::release_all() {
  std::lock_guard lock(mu_);
  empty_cache_locked();
  for (auto& [p, size] : live_) free_(const_cast<char*>(p), size);
  live_.clear();
  allocated_ = 0;
}

bool CachingAllocator::contains(const void* p, std::uint64_t bytes) const {
  const char* c = static_cast<const char*>(p);
  std::lock_guard lock(mu_);
  auto it = live_.upper_bound(c);
  if (it == live_.begin()) return false;
  --it;
  return c >= it->first && c + bytes <= it->first + it->second;
}

std::uint64_t CachingAllocator::available() const {
  std::lock_guard lock(mu_);
  return budget_ - allocated_;
}

void CachingAllocator::fill_stats(DeviceStats& s) const {
  std::lock_guard lock(mu_);
  s.budget_bytes = budget_;
  s.allocated_bytes = allocated_;
  s.cached_bytes = cached_;
  s.peak_allocated_bytes = peak_allocated_;
  s.peak_reserved_bytes = peak_reserved_;
  s.allocations = allocations_;
  s.cache_hits = hits_;
  s.backend_allocations = backend_allocations_;
}

}  // namespace tiermem::detail
