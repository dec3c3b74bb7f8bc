# tiermem::prefetch — access trace, reuse distances (vs an O(n²) oracle), the Prefetcher policy
# (Belady vs brute force, invalidation) and the tier simulator.
tiermem_test(NAME prefetch_test
  SOURCES access_trace_test.cc reuse_distance_test.cc prefetcher_test.cc tier_simulator_test.cc
  DEPS tiermem::prefetch
  LABELS prefetch
  TIMEOUT 120)

# The Prefetcher wired into TensorStore (SimDevice); only once the runtime library exists.
if(TARGET tiermem_runtime AND EXISTS ${CMAKE_CURRENT_SOURCE_DIR}/prefetch_store_test.cc)
  tiermem_test(NAME prefetch_store_test
    SOURCES prefetch_store_test.cc
    DEPS tiermem::prefetch tiermem::runtime
    LABELS prefetch runtime
    TIMEOUT 120)
endif()
