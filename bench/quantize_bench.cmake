# tiermem-quantize-bench: Google Benchmark of a frozen base's dequantize at gather against a plain
# memcpy of its fp32 bytes (bench/quantize_bench.cc).
add_executable(tiermem-quantize-bench ${CMAKE_CURRENT_SOURCE_DIR}/quantize_bench.cc)
target_include_directories(tiermem-quantize-bench PRIVATE ${PROJECT_SOURCE_DIR})
target_link_libraries(tiermem-quantize-bench PRIVATE tiermem::cpu benchmark::benchmark)
tiermem_set_warnings(tiermem-quantize-bench)
