// tiermem/version.h — which tiermem this is: the version of the headers (macros, for #if) and of
// the library a program runs on, with the options it was built with (build_info()). A program
// linked against a shared libtiermem.so can compare the two: the headers it was compiled with
// against the library the loader found.
//
//   std::printf("%s\n", tiermem::version_string().c_str());
//   // tiermem 0.1.0 (static; CUDA on, MPI on, NCCL on; ISA x86-64 baseline + AVX2, AVX-512 kernels)
//
// Thread-safety: both functions are thread-safe (they read constants).
#pragma once

#include <string>

#include "tiermem/export.h"

// The version of these headers. CMake's project(VERSION ...) must say the same (src/core/version.cc
// does not compile otherwise); the library's own is build_info().version.
#define TIERMEM_VERSION_MAJOR 0
#define TIERMEM_VERSION_MINOR 1
#define TIERMEM_VERSION_PATCH 0
#define TIERMEM_VERSION_STRING "0.1.0"
// One number that orders versions: major * 10000 + minor * 100 + patch (0.1.0 = 100).
#define TIERMEM_VERSION \
  (TIERMEM_VERSION_MAJOR * 10000 + TIERMEM_VERSION_MINOR * 100 + TIERMEM_VERSION_PATCH)

namespace tiermem {

// The library's version and the options it was compiled with. Strings are static (never freed).
struct TIERMEM_API BuildInfo {
  int major = 0;             // TIERMEM_VERSION_MAJOR of the library
  int minor = 0;
  int patch = 0;
  const char* version = "";  // "0.1.0"
  bool shared = false;  // a shared libtiermem.so (BUILD_SHARED_LIBS=ON), else static libtiermem.a
  bool cuda = false;    // CudaDevice and the GPU kernels were compiled (TIERMEM_WITH_CUDA)
  bool mpi = false;     // the MPI communicator was compiled (make_mpi_communicator)
  bool nccl = false;    // the NCCL communicator was compiled (CUDA + MPI + NCCL found)
  // The CPU code: the baseline ISA the library was compiled for, then the AdamW and cast kernels
  // compiled beside it, of which adam_best_isa() / cast_best_isa() pick one per CPU at run time.
  const char* isa = "";
  const char* build_type = "";  // CMAKE_BUILD_TYPE: "RelWithDebInfo", "Release", "Debug", ...
};

// What the library linked into this program is (not the headers': see TIERMEM_VERSION_STRING).
TIERMEM_API BuildInfo build_info() noexcept;

// build_info() as one line for a log or a --version:
// "tiermem <version> (<static|shared>; CUDA <on|off>, MPI <on|off>, NCCL <on|off>; ISA <isa>)".
TIERMEM_API std::string version_string();

}  // namespace tiermem
