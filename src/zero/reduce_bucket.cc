// src/zero/reduce_bucket.cc — see reduce_bucket.h.
#include "zero/reduce_bucket.h"

#include <algorithm>

namespace tiermem::detail {

std::vector<float> pack_reduce_bucket(std::span<const float> grad, const ModuleShard& shard, int world, ElemRange chunk) {
  const std::size_t len = chunk.size();
  const std::size_t n = grad.size();
  std::vector<float> send(len * static_cast<std::size_t>(world), 0.0f);
  for (int r = 0; r < world; ++r) {
    const std::size_t src = static_cast<std::size_t>(r) * shard.shard + chunk.begin;
    const std::size_t hi = std::min(src + len, n);
    if (src < hi) {
      std::copy(grad.begin() + static_cast<std::ptrdiff_t>(src), grad.begin() + static_cast<std::ptrdiff_t>(hi),
                send.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(r) * len));
    }
  }
  return send;
}

}  // namespace tiermem::detail
