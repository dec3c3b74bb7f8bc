// ExtentAllocator — pure logic (no I/O): hands out aligned runs of [0, capacity) and takes them
// back, coalescing neighbours. Best fit (smallest free run that fits, lowest offset on ties), which
// keeps large runs whole. Unit-tested against a bitmap reference model
// (tests/unit/nvme_extent_allocator_test.cc).
//
// Units: bytes. Every offset, length and the capacity are multiples of `alignment` (a power of two
// >= 1); allocate() rounds the request up.
// Thread-safety: none; SwapSpace guards it with its mutex.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <utility>

namespace tiermem::detail {

class ExtentAllocator {
 public:
  // Throws std::invalid_argument when alignment is not a power of two or capacity not aligned.
  ExtentAllocator(std::uint64_t capacity_bytes, std::uint64_t alignment_bytes);

  // The offset of a run of round_up(bytes, alignment) bytes, or nullopt when no free run is large
  // enough. bytes == 0 allocates nothing and returns nullopt.
  std::optional<std::uint64_t> allocate(std::uint64_t bytes);
  // Returns [offset, offset + round_up(bytes)). Throws std::invalid_argument when the range is not
  // aligned, is outside the capacity, or overlaps free space (a double free).
  void free(std::uint64_t offset, std::uint64_t bytes);
  // Adds [capacity, new_capacity) as free space (merged with a free run at the end).
  void grow(std::uint64_t new_capacity_bytes);

  std::uint64_t round_up(std::uint64_t bytes) const { return (bytes + align_ - 1) & ~(align_ - 1); }
  std::uint64_t capacity_bytes() const { return capacity_; }
  std::uint64_t free_bytes() const { return free_; }
  std::uint64_t largest_free_bytes() const;
  std::uint64_t free_runs() const { return by_offset_.size(); }
  // Length of the free run ending exactly at capacity (what growing would extend); 0 if none.
  std::uint64_t free_tail_bytes() const;
  // offset -> length of each free run, ascending (for tests and stats).
  const std::map<std::uint64_t, std::uint64_t>& free_map() const { return by_offset_; }

 private:
  void insert_run(std::uint64_t off, std::uint64_t len);
  void erase_run(std::map<std::uint64_t, std::uint64_t>::iterator it);

  std::uint64_t capacity_;
  std::uint64_t align_;
  std::uint64_t free_ = 0;
  std::map<std::uint64_t, std::uint64_t> by_offset_;        // free runs: offset -> length
  std::set<std::pair<std::uint64_t, std::uint64_t>> by_size_;  // (length, offset)
};

}  // namespace tiermem::detail
