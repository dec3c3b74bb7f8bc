// tiermem/version.h: the header's macros, the library's build_info() and version_string() agree
// with each other and with CMake's project(VERSION) (passed as TIERMEM_TEST_PROJECT_VERSION).
#include "tiermem/version.h"

#include <gtest/gtest.h>

#include <string>

namespace tiermem {
namespace {

TEST(Version, MacrosMatchTheProjectVersion) {
  EXPECT_STREQ(TIERMEM_VERSION_STRING, TIERMEM_TEST_PROJECT_VERSION);
  const std::string joined = std::to_string(TIERMEM_VERSION_MAJOR) + "." +
                             std::to_string(TIERMEM_VERSION_MINOR) + "." +
                             std::to_string(TIERMEM_VERSION_PATCH);
  EXPECT_EQ(joined, TIERMEM_VERSION_STRING);
  EXPECT_EQ(TIERMEM_VERSION,
            TIERMEM_VERSION_MAJOR * 10000 + TIERMEM_VERSION_MINOR * 100 + TIERMEM_VERSION_PATCH);
}

TEST(Version, BuildInfoIsTheLibrarysVersion) {
  const BuildInfo b = build_info();
  EXPECT_EQ(b.major, TIERMEM_VERSION_MAJOR);
  EXPECT_EQ(b.minor, TIERMEM_VERSION_MINOR);
  EXPECT_EQ(b.patch, TIERMEM_VERSION_PATCH);
  EXPECT_STREQ(b.version, TIERMEM_VERSION_STRING);
  EXPECT_NE(std::string(b.isa).find("x86-64"), std::string::npos) << b.isa;
  if (b.nccl) {
    EXPECT_TRUE(b.cuda && b.mpi) << "NCCL is built only with CUDA and MPI";
  }
}

TEST(Version, VersionStringSaysTheBuildOptions) {
  const BuildInfo b = build_info();
  const std::string s = version_string();
  const std::string head = std::string("tiermem ") + TIERMEM_VERSION_STRING + " (" +
                           (b.shared ? "shared" : "static") + "; CUDA " + (b.cuda ? "on" : "off") +
                           ", MPI " + (b.mpi ? "on" : "off") + ", NCCL " + (b.nccl ? "on" : "off") +
                           "; ISA " + b.isa + ")";
  EXPECT_EQ(s, head);
}

}  // namespace
}  // namespace tiermem
