#include "tiermem/error.h"

#include <cerrno>

#include <gtest/gtest.h>

namespace tiermem {
namespace {

TEST(Error, IoErrorCarriesContext) {
  IoError e("/nvme/swap.0", 4096, 8192, EIO, "read");
  EXPECT_EQ(e.path(), "/nvme/swap.0");
  EXPECT_EQ(e.offset(), 4096u);
  EXPECT_EQ(e.bytes(), 8192u);
  EXPECT_EQ(e.err(), EIO);
  std::string m = e.what();
  EXPECT_NE(m.find("/nvme/swap.0"), std::string::npos);
  EXPECT_NE(m.find("4096"), std::string::npos);
  EXPECT_NE(m.find("errno 5"), std::string::npos);
}

TEST(Error, OutOfMemoryNamesTierAndSizes) {
  OutOfMemoryError e(Tier::kDevice, 1 << 20, 4096);
  EXPECT_EQ(e.tier(), Tier::kDevice);
  std::string m = e.what();
  EXPECT_NE(m.find("device"), std::string::npos);
  EXPECT_NE(m.find("1048576"), std::string::npos);
  EXPECT_NE(m.find("4096"), std::string::npos);
}

TEST(Error, CheckMacroThrows) {
  auto f = [] {
    errno = ENOENT;
    TM_CHECK_ERRNO(-1);
  };
  EXPECT_THROW(f(), Error);
  EXPECT_EQ(format_bytes(64ull << 20), "64.0 MiB");
  EXPECT_EQ(format_bytes(17), "17 B");
}

}  // namespace
}  // namespace tiermem
