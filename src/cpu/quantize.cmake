# src/cpu/quantize.cmake — per-file ISA flags for the int8 dequantize kernel (included by
# src/cpu/CMakeLists.txt). Only quantize_avx512.cc gets -mavx512*; quantize.cc checks cpuid first.
set_source_files_properties(${CMAKE_CURRENT_SOURCE_DIR}/quantize_avx512.cc PROPERTIES COMPILE_OPTIONS "-mavx512f;-mavx512bw;-mavx512vl;-Wno-maybe-uninitialized")
