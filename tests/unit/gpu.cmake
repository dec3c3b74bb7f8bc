# Device tier: SimDevice, the caching allocator, make_device.
tiermem_test(NAME gpu_test SOURCES sim_device_test.cc caching_allocator_test.cc
  DEPS tiermem::gpu tiermem::core TIMEOUT 60 LABELS concurrent)
