# tiermem-adam-bench: Google Benchmark of the CPU AdamW kernels (bench/adam_bench.cc).
add_executable(tiermem-adam-bench ${CMAKE_CURRENT_SOURCE_DIR}/adam_bench.cc)
target_include_directories(tiermem-adam-bench PRIVATE ${PROJECT_SOURCE_DIR})
target_link_libraries(tiermem-adam-bench PRIVATE tiermem::cpu benchmark::benchmark OpenMP::OpenMP_CXX)
tiermem_set_warnings(tiermem-adam-bench)
