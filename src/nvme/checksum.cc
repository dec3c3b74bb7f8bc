// src/nvme/checksum.cc — see checksum.h: dispatch between libxxhash's XXH3 and the AVX2 build.
#include "nvme/checksum.h"

#include <xxhash.h>

namespace tiermem::detail {

std::uint64_t extent_checksum_portable(const void* data, std::size_t bytes) noexcept {
  return XXH3_64bits(data, bytes);
}

bool extent_checksum_has_avx2() noexcept {
  static const bool avx2 = __builtin_cpu_supports("avx2");
  return avx2;
}

std::uint64_t extent_checksum(const void* data, std::size_t bytes) noexcept {
  return extent_checksum_has_avx2() ? extent_checksum_avx2(data, bytes)
                                    : extent_checksum_portable(data, bytes);
}

}  // namespace tiermem::detail
