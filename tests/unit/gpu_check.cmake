# scripts/gpu-check.sh's paths that need no GPU: no GPU (exit 3, one line), --probe-only, a bad
# argument, a failed build still printing the table and JSON. Fake nvidia-smi / cmake; no build.
add_test(NAME gpu_check_script_test COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/gpu_check_test.sh)
set_tests_properties(gpu_check_script_test PROPERTIES TIMEOUT 60 LABELS scripts)
