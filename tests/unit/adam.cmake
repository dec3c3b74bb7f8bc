# CPU AdamW (src/cpu/adam*.cc): every ISA kernel against a double-precision reference.
tiermem_test(NAME adam_test SOURCES adam_test.cc DEPS tiermem::cpu TIMEOUT 60)
# GPU AdamW (src/gpu/adam.cu) against the CPU scalar kernel; CUDA builds only, skips without a GPU.
if(TIERMEM_HAVE_CUDA AND TARGET tiermem_gpu)
  tiermem_test(NAME gpu_adam_test SOURCES gpu_adam_test.cc DEPS tiermem::gpu tiermem::cpu CUDA::cudart TIMEOUT 60 LABELS gpu)
endif()
