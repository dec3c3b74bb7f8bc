#include "tiermem/version.h"

#include <string_view>

// The build options come from src/core/CMakeLists.txt as TIERMEM_BUILD_* definitions on this file,
// TIERMEM_BUILD_VERSION being CMake's project(VERSION ...).
static_assert(std::string_view(TIERMEM_BUILD_VERSION) == TIERMEM_VERSION_STRING,
              "include/tiermem/version.h and project(VERSION) in CMakeLists.txt differ");

namespace tiermem {
namespace {

// The baseline the compiler was told to target (-march / CMAKE_CXX_FLAGS); the kernels beside it
// are compiled with their own flags in src/cpu (adam.cmake, cast.cmake) whatever the baseline.
constexpr const char* kIsa =
#if defined(__AVX512F__)
    "x86-64 + AVX-512 baseline + AVX2, AVX-512 kernels";
#elif defined(__AVX2__)
    "x86-64 + AVX2 baseline + AVX2, AVX-512 kernels";
#else
    "x86-64 baseline + AVX2, AVX-512 kernels";
#endif

}  // namespace

BuildInfo build_info() noexcept {
  BuildInfo b;
  b.major = TIERMEM_VERSION_MAJOR;
  b.minor = TIERMEM_VERSION_MINOR;
  b.patch = TIERMEM_VERSION_PATCH;
  b.version = TIERMEM_VERSION_STRING;
  b.shared = TIERMEM_BUILD_SHARED;
  b.cuda = TIERMEM_BUILD_CUDA;
  b.mpi = TIERMEM_BUILD_MPI;
  b.nccl = TIERMEM_BUILD_NCCL;
  b.isa = kIsa;
  b.build_type = TIERMEM_BUILD_TYPE;
  return b;
}

std::string version_string() {
  const BuildInfo b = build_info();
  auto on = [](bool x) { return x ? "on" : "off"; };
  return std::string("tiermem ") + b.version + " (" + (b.shared ? "shared" : "static") + "; CUDA " +
         on(b.cuda) + ", MPI " + on(b.mpi) + ", NCCL " + on(b.nccl) + "; ISA " + b.isa + ")";
}

}  // namespace tiermem
