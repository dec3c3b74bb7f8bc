// src/gpu/adam_no_cuda.cc — gpu_adam_step in builds without CUDA: the backend is absent, so it
// throws NotSupportedError (style: a missing backend is a clear error, not a link failure).
#include "tiermem/error.h"
#include "tiermem/gpu_adam.h"

#ifndef TIERMEM_HAVE_CUDA
namespace tiermem {
void gpu_adam_step(const AdamParams&, const GpuAdamTensor*, std::size_t, DType, void*) {
  throw NotSupportedError("gpu_adam_step: this build has no CUDA (configure with -DTIERMEM_WITH_CUDA=ON)");
}
}  // namespace tiermem
#endif
