// src/gpu/adam.cu — multi-tensor AdamW on the device (see include/tiermem/gpu_adam.h).
// Each launch takes up to kMaxTensors tensors by value in the kernel arguments; blockIdx.y picks
// the tensor and a grid-stride loop covers its elements. The per-step coefficients come from
// detail::adam_coeffs (inline in tiermem/adam.h), the same as the CPU kernels'.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "tiermem/error.h"
#include "tiermem/gpu_adam.h"

namespace tiermem {
namespace {

constexpr int kMaxTensors = 32;

struct TensorBatch {
  GpuAdamTensor t[kMaxTensors];
};

__global__ void adam_kernel(TensorBatch batch, detail::AdamCoeffs c, int half_kind) {
  const GpuAdamTensor& t = batch.t[blockIdx.y];
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < t.n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    float g = t.grad[i] * c.grad_scale;
    float mi = fmaf(c.beta1, t.m[i], c.one_minus_beta1 * g);
    float vi = fmaf(c.beta2, t.v[i], c.one_minus_beta2 * (g * g));
    float denom = fmaf(sqrtf(vi), c.inv_sqrt_bc2, c.eps);
    float p = fmaf(-c.step_size, __fdiv_rn(mi, denom), t.master[i] * c.decay);
    t.m[i] = mi;
    t.v[i] = vi;
    t.master[i] = p;
    if (t.half != nullptr) {
      if (half_kind == 1) {
        __nv_bfloat16 b = __float2bfloat16_rn(p);
        t.half[i] = *reinterpret_cast<std::uint16_t*>(&b);
      } else {
        __half h = __float2half_rn(p);
        t.half[i] = *reinterpret_cast<std::uint16_t*>(&h);
      }
    }
  }
}

}  // namespace

void gpu_adam_step(const AdamParams& params, const GpuAdamTensor* tensors, std::size_t tensor_count,
                   DType half_dtype, void* stream) {
  int half_kind = half_dtype == DType::kBF16 ? 1 : half_dtype == DType::kF16 ? 2 : 0;
  if (half_kind == 0) {
    throw NotSupportedError("gpu_adam_step: half dtype " + std::string(dtype_name(half_dtype)) + " is not bf16 or f16");
  }
  const detail::AdamCoeffs c = detail::adam_coeffs(params);
  auto s = static_cast<cudaStream_t>(stream);
  for (std::size_t b = 0; b < tensor_count; b += kMaxTensors) {
    TensorBatch batch{};
    const int count = static_cast<int>(std::min<std::size_t>(kMaxTensors, tensor_count - b));
    std::size_t max_n = 0;
    for (int k = 0; k < count; ++k) {
      batch.t[k] = tensors[b + k];
      max_n = std::max(max_n, batch.t[k].n);
    }
    if (max_n == 0) continue;
    const int threads = 256;
    const unsigned blocks = static_cast<unsigned>(std::min<std::size_t>((max_n + threads - 1) / threads, 4096));
    adam_kernel<<<dim3(blocks, static_cast<unsigned>(count)), threads, 0, s>>>(batch, c, half_kind);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) {
      throw CudaError(std::string("gpu_adam_step: kernel launch failed: ") + cudaGetErrorString(e));
    }
  }
}

}  // namespace tiermem
