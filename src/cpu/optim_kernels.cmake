# src/cpu/optim_kernels.cmake — per-file flags for the Lion and Adagrad kernels (included by
# src/cpu/CMakeLists.txt). Only the *_avx2/*_avx512 files get ISA flags; the dispatcher
# (optim_kernels.cc) checks cpuid before calling them. -ffp-contract=off on all three: the
# compiler must not fuse a multiply and an add the code did not fuse, or the vector kernels would
# no longer equal their scalar twin bit for bit. (-Wno-maybe-uninitialized: GCC 12 warns inside
# its own masked-load intrinsics.)
set_source_files_properties(${CMAKE_CURRENT_SOURCE_DIR}/optim_kernels.cc PROPERTIES
  COMPILE_OPTIONS "-ffp-contract=off")
set_source_files_properties(${CMAKE_CURRENT_SOURCE_DIR}/optim_kernels_avx2.cc PROPERTIES
  COMPILE_OPTIONS "-mavx2;-mfma;-mf16c;-ffp-contract=off")
set_source_files_properties(${CMAKE_CURRENT_SOURCE_DIR}/optim_kernels_avx512.cc PROPERTIES
  COMPILE_OPTIONS "-mavx512f;-mavx512bw;-mavx512vl;-mavx2;-mfma;-mf16c;-ffp-contract=off;-Wno-maybe-uninitialized")
