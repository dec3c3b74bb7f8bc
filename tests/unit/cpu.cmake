# Host tier: PinnedHostPool, topology.
tiermem_test(NAME cpu_test SOURCES pinned_host_pool_test.cc topology_test.cc
  DEPS tiermem::cpu TIMEOUT 60 LABELS concurrent)
