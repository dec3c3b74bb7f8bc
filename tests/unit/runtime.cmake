# TensorStore and its policy. The property/concurrency tests carry the "concurrent" label so
# `ctest -L concurrent` runs them (also under the tsan preset).
tiermem_test(NAME runtime_test SOURCES tensor_store_test.cc lru_policy_test.cc io_busy_clock_test.cc
  DEPS tiermem::runtime TIMEOUT 120 LABELS concurrent)
# Designated initializers of TensorSpec/options leave defaulted members out on purpose.
target_compile_options(runtime_test PRIVATE -Wno-missing-field-initializers)
