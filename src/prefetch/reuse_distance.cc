// Reuse distances in O(n log n) with a Fenwick tree over positions; next uses in O(n).
#include "tiermem/reuse_distance.h"

#include <unordered_map>

namespace tiermem {
namespace {

// Fenwick (binary indexed) tree of (bytes, count) pairs over positions 0..n-1.
class Fenwick {
 public:
  explicit Fenwick(std::size_t n) : bytes_(n + 1, 0), count_(n + 1, 0) {}
  void add(std::size_t pos, std::int64_t bytes, std::int64_t count) {
    for (std::size_t i = pos + 1; i < bytes_.size(); i += i & (~i + 1)) {
      bytes_[i] += bytes;
      count_[i] += count;
    }
  }
  // Sums over positions [0, pos).
  void prefix(std::size_t pos, std::int64_t& bytes, std::int64_t& count) const {
    bytes = 0;
    count = 0;
    for (std::size_t i = pos; i > 0; i -= i & (~i + 1)) {
      bytes += bytes_[i];
      count += count_[i];
    }
  }

 private:
  std::vector<std::int64_t> bytes_, count_;
};

}  // namespace

std::vector<std::uint64_t> next_uses(std::span<const Access> trace, ReuseMode mode) {
  const std::size_t n = trace.size();
  std::vector<std::uint64_t> next(n, kNoNextUse);
  std::unordered_map<TensorId, std::size_t> later;  // tensor -> nearest access to the right
  later.reserve(n);
  for (std::size_t i = n; i-- > 0;) {
    auto it = later.find(trace[i].id);
    if (it != later.end()) {
      next[i] = it->second;
      it->second = i;
    } else {
      later.emplace(trace[i].id, i);
    }
  }
  if (mode == ReuseMode::kCyclic) {
    // `later` now maps each tensor to its first access: the last use wraps to it.
    for (std::size_t i = 0; i < n; ++i) {
      if (next[i] == kNoNextUse) next[i] = later.at(trace[i].id) + n;
    }
  }
  return next;
}

std::vector<ReuseDistance> reuse_distances(std::span<const Access> trace, ReuseMode mode) {
  const std::size_t n = trace.size();
  std::vector<ReuseDistance> out(n);
  if (n == 0) return out;
  // Cyclic: run over the trace twice; the second copy only closes windows opened in the first.
  const std::size_t len = mode == ReuseMode::kCyclic ? 2 * n : n;
  Fenwick tree(len);
  std::unordered_map<TensorId, std::pair<std::size_t, std::uint64_t>> last;  // pos, bytes
  last.reserve(n);
  for (std::size_t j = 0; j < len; ++j) {
    const Access& a = trace[j % n];
    auto it = last.find(a.id);
    if (it != last.end()) {
      const auto [i, old_bytes] = it->second;
      if (i < n) {
        // Distinct tensors whose latest access lies strictly between i and j.
        std::int64_t b_hi, c_hi, b_lo, c_lo;
        tree.prefix(j, b_hi, c_hi);
        tree.prefix(i + 1, b_lo, c_lo);
        out[i].bytes = static_cast<std::uint64_t>(b_hi - b_lo);
        out[i].count = static_cast<std::uint64_t>(c_hi - c_lo);
      }
      tree.add(i, -static_cast<std::int64_t>(old_bytes), -1);
      it->second = {j, a.bytes};
    } else {
      last.emplace(a.id, std::make_pair(j, a.bytes));
    }
    tree.add(j, static_cast<std::int64_t>(a.bytes), 1);
  }
  return out;
}

}  // namespace tiermem
