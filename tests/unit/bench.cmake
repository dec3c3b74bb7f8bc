# tiermem-bench's command line against users' files (issue 14): runs the binary; label "bench".
if(TARGET tiermem-bench)
  tiermem_test(NAME bench_cli_test SOURCES bench_cli_test.cc LABELS bench TIMEOUT 120)
  target_compile_definitions(bench_cli_test PRIVATE TIERMEM_BENCH_BIN="$<TARGET_FILE:tiermem-bench>")
  add_dependencies(bench_cli_test tiermem-bench)
endif()
