# src/cpu/cast.cmake — per-file ISA flags for the bulk fp32 <-> bf16/fp16 casts (included by
# src/cpu/CMakeLists.txt). Only these files get -mavx2/-mf16c/-mavx512*; the dispatcher (cast.cc)
# checks cpuid before calling them, so the library still runs on CPUs without F16C.
set_source_files_properties(${CMAKE_CURRENT_SOURCE_DIR}/cast_avx2.cc PROPERTIES COMPILE_OPTIONS "-mavx2;-mf16c")
set_source_files_properties(${CMAKE_CURRENT_SOURCE_DIR}/cast_avx512.cc PROPERTIES COMPILE_OPTIONS "-mavx512f;-mavx512bw;-mavx512vl;-mavx2;-mf16c;-Wno-maybe-uninitialized")
