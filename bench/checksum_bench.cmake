# tiermem-checksum-bench: Google Benchmark of the extent checksum (bench/checksum_bench.cc).
add_executable(tiermem-checksum-bench ${CMAKE_CURRENT_SOURCE_DIR}/checksum_bench.cc)
target_include_directories(tiermem-checksum-bench PRIVATE ${PROJECT_SOURCE_DIR} ${PROJECT_SOURCE_DIR}/src)
target_link_libraries(tiermem-checksum-bench PRIVATE tiermem::nvme benchmark::benchmark OpenMP::OpenMP_CXX)
tiermem_set_warnings(tiermem-checksum-bench)
