# tiermem-cast-bench: Google Benchmark of the fp32 <-> bf16/fp16 casts, per-element loops and the
# bulk kernels of tiermem::cpu per ISA (bench/cast_bench.cc).
add_executable(tiermem-cast-bench ${CMAKE_CURRENT_SOURCE_DIR}/cast_bench.cc)
target_include_directories(tiermem-cast-bench PRIVATE ${PROJECT_SOURCE_DIR})
target_link_libraries(tiermem-cast-bench PRIVATE tiermem::cpu benchmark::benchmark OpenMP::OpenMP_CXX)
tiermem_set_warnings(tiermem-cast-bench)
