# ZeroEngine on a CudaDevice (stage-3 gathers into GPU memory, gradients handed over from it)
# against the same run on SimDevice, bit for bit. Skips without a GPU.
if(TARGET tiermem_zero)
  tiermem_test(NAME zero_cuda_test SOURCES zero_cuda_test.cc DEPS tiermem::zero TIMEOUT 120 LABELS gpu)
endif()
# The device-resident optimizer (offload_optimizer none) on a CudaDevice against its CPU twin.
if(TARGET tiermem_zero)
  tiermem_test(NAME zero_device_optimizer_cuda_test SOURCES zero_device_optimizer_cuda_test.cc
               DEPS tiermem::zero TIMEOUT 120 LABELS gpu)
endif()
