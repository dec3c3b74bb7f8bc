#include "nvme/extent_allocator.h"

#include <iterator>
#include <stdexcept>
#include <string>

namespace tiermem::detail {

ExtentAllocator::ExtentAllocator(std::uint64_t capacity_bytes, std::uint64_t alignment_bytes)
    : capacity_(capacity_bytes), align_(alignment_bytes) {
  if (align_ == 0 || (align_ & (align_ - 1)) != 0)
    throw std::invalid_argument("ExtentAllocator: alignment " + std::to_string(align_) +
                                " is not a power of two");
  if (capacity_ % align_ != 0)
    throw std::invalid_argument("ExtentAllocator: capacity not a multiple of the alignment");
  if (capacity_ > 0) insert_run(0, capacity_);
}

void ExtentAllocator::insert_run(std::uint64_t off, std::uint64_t len) {
  by_offset_.emplace(off, len);
  by_size_.emplace(len, off);
  free_ += len;
}

void ExtentAllocator::erase_run(std::map<std::uint64_t, std::uint64_t>::iterator it) {
  by_size_.erase({it->second, it->first});
  free_ -= it->second;
  by_offset_.erase(it);
}

std::optional<std::uint64_t> ExtentAllocator::allocate(std::uint64_t bytes) {
  if (bytes == 0) return std::nullopt;
  std::uint64_t len = round_up(bytes);
  if (len < bytes) return std::nullopt;  // overflow
  auto fit = by_size_.lower_bound({len, 0});
  if (fit == by_size_.end()) return std::nullopt;
  std::uint64_t off = fit->second, run = fit->first;
  erase_run(by_offset_.find(off));
  if (run > len) insert_run(off + len, run - len);
  return off;
}

void ExtentAllocator::free(std::uint64_t offset, std::uint64_t bytes) {
  std::uint64_t len = round_up(bytes);
  if (len == 0 || offset % align_ != 0 || offset + len > capacity_ || offset + len < offset)
    throw std::invalid_argument("ExtentAllocator::free: bad range [" + std::to_string(offset) +
                                ", +" + std::to_string(bytes) + ")");
  auto next = by_offset_.lower_bound(offset);
  if (next != by_offset_.end() && next->first < offset + len)
    throw std::invalid_argument("ExtentAllocator::free: range at " + std::to_string(offset) +
                                " overlaps free space (double free?)");
  if (next != by_offset_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second > offset)
      throw std::invalid_argument("ExtentAllocator::free: range at " + std::to_string(offset) +
                                  " overlaps free space (double free?)");
    if (prev->first + prev->second == offset) {  // coalesce with the run before
      offset = prev->first;
      len += prev->second;
      erase_run(prev);
    }
  }
  next = by_offset_.lower_bound(offset);
  if (next != by_offset_.end() && next->first == offset + len) {  // and the run after
    len += next->second;
    erase_run(next);
  }
  insert_run(offset, len);
}

void ExtentAllocator::grow(std::uint64_t new_capacity_bytes) {
  if (new_capacity_bytes % align_ != 0)
    throw std::invalid_argument("ExtentAllocator::grow: capacity not a multiple of the alignment");
  if (new_capacity_bytes <= capacity_) return;
  std::uint64_t old = capacity_;
  capacity_ = new_capacity_bytes;
  free(old, new_capacity_bytes - old);
}

std::uint64_t ExtentAllocator::largest_free_bytes() const {
  return by_size_.empty() ? 0 : by_size_.rbegin()->first;
}

std::uint64_t ExtentAllocator::free_tail_bytes() const {
  if (by_offset_.empty()) return 0;
  auto last = std::prev(by_offset_.end());
  return last->first + last->second == capacity_ ? last->second : 0;
}

}  // namespace tiermem::detail
