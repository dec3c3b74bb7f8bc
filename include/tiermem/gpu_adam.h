// tiermem/gpu_adam.h — AdamW on the CUDA device (multi-tensor), for optimizer state kept on the
// device. Same formula, coefficients and bf16/fp16 copy-out as the CPU kernels (tiermem/adam.h);
// results agree with the scalar CPU kernel within the tolerance stated there.
//
// Available only in CUDA builds (TIERMEM_HAVE_CUDA); elsewhere gpu_adam_step throws
// NotSupportedError. Pointers are DEVICE pointers owned by the caller; they must stay valid until
// the work queued on `stream` completes. The call only enqueues (asynchronous w.r.t. the host).
// Thread-safety: reentrant; concurrent calls must use disjoint tensors.
// Errors: CudaError when the launch fails (message names the CUDA error);
// NotSupportedError for a half dtype other than bf16/fp16.
#pragma once

#include <cstddef>
#include <cstdint>

#include "tiermem/adam.h"
#include "tiermem/export.h"

namespace tiermem {

// One tensor's state on the device; n elements each; half may be null (no copy-out).
struct TIERMEM_API GpuAdamTensor {
  float* master = nullptr;
  const float* grad = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  std::uint16_t* half = nullptr;
  std::size_t n = 0;
};

// Enqueues one AdamW step over tensors[0..count) (launches of up to 32 tensors each) on `stream`
// (a cudaStream_t; nullptr = the default stream).
TIERMEM_API void gpu_adam_step(const AdamParams& params, const GpuAdamTensor* tensors,
                               std::size_t count, DType half_dtype, void* stream);

}  // namespace tiermem
