# src/cpu/adam.cmake — per-file ISA flags for the AdamW kernels (included by src/cpu/CMakeLists.txt).
# (-Wno-maybe-uninitialized: GCC 12 warns inside its own masked-load intrinsics.)
# Only these files get -mavx2/-mavx512*; the dispatcher (adam.cc) checks cpuid before calling them,
# so the library still runs on CPUs without AVX2.
include(CheckCXXCompilerFlag)
check_cxx_compiler_flag("-mavx512f -mavx512bw -mavx512vl" TIERMEM_CXX_HAS_AVX512)
set_source_files_properties(${CMAKE_CURRENT_SOURCE_DIR}/adam_avx2.cc PROPERTIES COMPILE_OPTIONS "-mavx2;-mfma;-mf16c")
if(TIERMEM_CXX_HAS_AVX512)
  set_source_files_properties(${CMAKE_CURRENT_SOURCE_DIR}/adam_avx512.cc PROPERTIES COMPILE_OPTIONS "-mavx512f;-mavx512bw;-mavx512vl;-mavx2;-mfma;-mf16c;-Wno-maybe-uninitialized")
else()
  message(FATAL_ERROR "tiermem: the C++ compiler does not accept -mavx512f -mavx512bw -mavx512vl (needed by src/cpu/adam_avx512.cc)")
endif()
