// The extent checksum (src/nvme/checksum.h): the AVX2 build and libxxhash's give the same XXH3-64
// for every length around the kernels' block boundaries and for unaligned starts; the dispatcher
// returns that value too.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "nvme/checksum.h"
#include "unit/nvme_test_util.h"

namespace tiermem {
namespace {

TEST(ExtentChecksum, Avx2BuildEqualsTheLibraryForEveryLengthAndAlignment) {
  std::vector<char> buf((1 << 20) + 64);
  test::fill_pattern(buf.data(), buf.size(), 11);
  std::vector<std::size_t> lengths;
  for (std::size_t n = 0; n <= 300; ++n) lengths.push_back(n);  // the small-input paths
  for (std::size_t n : {1023u, 1024u, 1025u, 4095u, 4096u, 4097u, 65536u + 7u, 1u << 20})
    lengths.push_back(n);
  const bool avx2 = detail::extent_checksum_has_avx2();
  for (std::size_t start : {0u, 1u, 7u, 32u}) {
    for (std::size_t n : lengths) {
      const char* p = buf.data() + start;
      const std::uint64_t want = detail::extent_checksum_portable(p, n);
      EXPECT_EQ(detail::extent_checksum(p, n), want) << "start " << start << " length " << n;
      if (avx2) {
        EXPECT_EQ(detail::extent_checksum_avx2(p, n), want) << "start " << start << " length " << n;
      }
    }
  }
  if (!avx2) GTEST_SKIP() << "no AVX2 on this CPU: only the library build was checked";
}

TEST(ExtentChecksum, OneFlippedBitChangesTheHash) {
  std::vector<char> buf(1 << 16);
  test::fill_pattern(buf.data(), buf.size(), 12);
  const std::uint64_t h = detail::extent_checksum(buf.data(), buf.size());
  for (std::size_t at : {0u, 4095u, 40000u, 65535u}) {
    buf[at] = static_cast<char>(buf[at] ^ 0x08);
    EXPECT_NE(detail::extent_checksum(buf.data(), buf.size()), h) << "flip at " << at;
    buf[at] = static_cast<char>(buf[at] ^ 0x08);
  }
  EXPECT_EQ(detail::extent_checksum(buf.data(), buf.size()), h);
}

}  // namespace
}  // namespace tiermem
