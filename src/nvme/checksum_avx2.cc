// src/nvme/checksum_avx2.cc — XXH3-64 compiled with -mavx2 (src/nvme/CMakeLists.txt): xxHash's
// header-only build (XXH_INLINE_ALL) selects its AVX2 kernel. Called only after cpuid said AVX2
// (checksum.cc). Everything of xxHash here is static: no symbol clashes with libxxhash.
#include "nvme/checksum.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace tiermem::detail {

std::uint64_t extent_checksum_avx2(const void* data, std::size_t bytes) noexcept {
  return XXH3_64bits(data, bytes);
}

}  // namespace tiermem::detail
