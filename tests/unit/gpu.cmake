# Device tier: SimDevice, the caching allocator, make_device (tiermem::cpu: the AdamW kernel the
# tests hand SimDevice, and the reference it must equal).
tiermem_test(NAME gpu_test SOURCES sim_device_test.cc caching_allocator_test.cc device_choice_test.cc
  DEPS tiermem::gpu tiermem::cpu tiermem::core TIMEOUT 60 LABELS concurrent)
