// gpt/kernels_cuda.cu — CUDA layers: cuBLAS GEMMs (bf16 in, fp32 accumulate), one thread per row
// over gpt/layer_math.h for everything else.
#include "gpt/kernels_cuda.h"

#include <cuda_bf16.h>

#include <string>

#include "gpt/layer_math.h"
#include "tiermem/error.h"

namespace tiermem::gpt::cuda {
namespace {

constexpr int kThreads = 256;

int blocks(std::int64_t n) { return static_cast<int>((n + kThreads - 1) / kThreads); }

void check_launch(const char* what, const char* file, int line) {
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    throw CudaError(std::string(what) + ": " + cudaGetErrorString(e) + " at " + file + ":" +
                    std::to_string(line));
  }
}
void check_cublas(cublasStatus_t s, const char* what, const char* file, int line) {
  if (s != CUBLAS_STATUS_SUCCESS) {
    throw CudaError(std::string(what) + ": cuBLAS status " + std::to_string(static_cast<int>(s)) +
                    " at " + file + ":" + std::to_string(line));
  }
}
#define TM_GPT_LAUNCHED(what) check_launch(what, __FILE__, __LINE__)
#define TM_GPT_CUBLAS(expr) check_cublas((expr), #expr, __FILE__, __LINE__)

__global__ void cast_kernel(std::uint16_t* dst, const float* src, std::int64_t n) {
  std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) {
    __nv_bfloat16 h = __float2bfloat16_rn(src[i]);
    dst[i] = *reinterpret_cast<std::uint16_t*>(&h);
  }
}

__global__ void encoder_forward_kernel(float* out, const std::int32_t* tokens, const float* wte,
                                       const float* wpe, int N, int T, int C) {
  std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<std::int64_t>(N) * C) return;
  const int n = static_cast<int>(i / C), c = static_cast<int>(i % C);
  out[i] = wte[static_cast<std::int64_t>(tokens[n]) * C + c] + wpe[static_cast<std::int64_t>(n % T) * C + c];
}

__global__ void encoder_backward_kernel(float* dwte, float* dwpe, const float* dout,
                                        const std::int32_t* tokens, int N, int T, int C) {
  int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  for (int n = 0; n < N; ++n) {
    const float g = dout[static_cast<std::int64_t>(n) * C + c];
    dwte[static_cast<std::int64_t>(tokens[n]) * C + c] += g;
    dwpe[static_cast<std::int64_t>(n % T) * C + c] += g;
  }
}

__global__ void layernorm_forward_kernel(float* out, float* mean, float* rstd, const float* inp,
                                         const float* w, const float* b, int N, int C) {
  int n = blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= N) return;
  const std::int64_t o = static_cast<std::int64_t>(n) * C;
  math::layernorm_row_forward(inp + o, w, b, out + o, mean + n, rstd + n, C);
}

__global__ void layernorm_backward_dx_kernel(float* dinp, const float* dout, const float* inp,
                                             const float* w, const float* mean, const float* rstd,
                                             int N, int C) {
  int n = blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= N) return;
  const std::int64_t o = static_cast<std::int64_t>(n) * C;
  math::layernorm_row_backward_dx(dout + o, inp + o, w, mean[n], rstd[n], dinp + o, C);
}

__global__ void layernorm_backward_dwdb_kernel(float* dw, float* db, const float* dout,
                                               const float* inp, const float* mean,
                                               const float* rstd, int N, int C) {
  int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float sw = 0, sb = 0;
  for (int n = 0; n < N; ++n) {
    const std::int64_t o = static_cast<std::int64_t>(n) * C + c;
    sw += dout[o] * (inp[o] - mean[n]) * rstd[n];
    sb += dout[o];
  }
  dw[c] += sw;
  db[c] += sb;
}

__global__ void bias_rows_kernel(float* out, const float* bias, int N, int OC) {
  std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < static_cast<std::int64_t>(N) * OC) out[i] = bias[i % OC];
}

__global__ void column_sum_kernel(float* dbias, const float* dout, int N, int OC) {
  int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= OC) return;
  float s = 0;
  for (int n = 0; n < N; ++n) s += dout[static_cast<std::int64_t>(n) * OC + c];
  dbias[c] += s;
}

struct Row {
  int b, t, h;
};
__device__ Row split_row(std::int64_t r, int T, int NH) {
  Row x;
  x.t = static_cast<int>(r % T);
  x.h = static_cast<int>((r / T) % NH);
  x.b = static_cast<int>(r / (static_cast<std::int64_t>(T) * NH));
  return x;
}

__global__ void attention_forward_kernel(float* out, float* att, const float* qkv, int B, int T,
                                         int C, int NH) {
  std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= static_cast<std::int64_t>(B) * NH * T) return;
  Row x = split_row(r, T, NH);
  math::attention_row_forward(qkv, att, out, T, C, NH, x.b, x.t, x.h);
}

__global__ void attention_dpre_kernel(float* dpre, const float* dout, const float* qkv,
                                      const float* att, int B, int T, int C, int NH) {
  std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= static_cast<std::int64_t>(B) * NH * T) return;
  Row x = split_row(r, T, NH);
  math::attention_row_dpre(qkv, att, dout, dpre, T, C, NH, x.b, x.t, x.h);
}

__global__ void attention_dqkv_kernel(float* dqkv, const float* dpre, const float* dout,
                                      const float* qkv, const float* att, int B, int T, int C,
                                      int NH) {
  std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= static_cast<std::int64_t>(B) * NH * T) return;
  Row x = split_row(r, T, NH);
  math::attention_row_dq(qkv, dpre, dqkv, T, C, NH, x.b, x.t, x.h);
  math::attention_row_dkv(qkv, att, dpre, dout, dqkv, T, C, NH, x.b, x.t, x.h);
}

__global__ void gelu_forward_kernel(float* out, const float* inp, std::int64_t n) {
  std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = math::gelu(inp[i]);
}
__global__ void gelu_backward_kernel(float* dinp, const float* inp, const float* dout,
                                     std::int64_t n) {
  std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) dinp[i] = math::gelu_grad(inp[i]) * dout[i];
}
__global__ void residual_kernel(float* out, const float* a, const float* b, std::int64_t n) {
  std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = a[i] + b[i];
}

__global__ void xent_forward_kernel(float* logits, float* losses, const std::int32_t* targets,
                                    int N, int V) {
  int n = blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= N) return;
  losses[n] = math::softmax_xent_row_forward(logits + static_cast<std::int64_t>(n) * V, V,
                                             targets[n]);
}
__global__ void xent_backward_kernel(float* probs, const std::int32_t* targets, int N, int V,
                                     float dloss) {
  int n = blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= N) return;
  math::softmax_xent_row_backward(probs + static_cast<std::int64_t>(n) * V, V, targets[n], dloss);
}

}  // namespace

void cast_f32_to_bf16(std::uint16_t* dst, const float* src, std::int64_t n, cudaStream_t stream) {
  cast_kernel<<<blocks(n), kThreads, 0, stream>>>(dst, src, n);
  TM_GPT_LAUNCHED("cast_f32_to_bf16");
}

void encoder_forward(float* out, const std::int32_t* tokens, const float* wte, const float* wpe,
                     int B, int T, int C, cudaStream_t stream) {
  const std::int64_t n = static_cast<std::int64_t>(B) * T * C;
  encoder_forward_kernel<<<blocks(n), kThreads, 0, stream>>>(out, tokens, wte, wpe, B * T, T, C);
  TM_GPT_LAUNCHED("encoder_forward");
}

void encoder_backward(float* dwte, float* dwpe, const float* dout, const std::int32_t* tokens,
                      int B, int T, int C, cudaStream_t stream) {
  encoder_backward_kernel<<<blocks(C), kThreads, 0, stream>>>(dwte, dwpe, dout, tokens, B * T, T, C);
  TM_GPT_LAUNCHED("encoder_backward");
}

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* w,
                       const float* b, int N, int C, cudaStream_t stream) {
  layernorm_forward_kernel<<<blocks(N), kThreads, 0, stream>>>(out, mean, rstd, inp, w, b, N, C);
  TM_GPT_LAUNCHED("layernorm_forward");
}

void layernorm_backward(float* dinp, float* dw, float* db, const float* dout, const float* inp,
                        const float* w, const float* mean, const float* rstd, int N, int C,
                        cudaStream_t stream) {
  layernorm_backward_dx_kernel<<<blocks(N), kThreads, 0, stream>>>(dinp, dout, inp, w, mean, rstd,
                                                                   N, C);
  TM_GPT_LAUNCHED("layernorm_backward dx");
  layernorm_backward_dwdb_kernel<<<blocks(C), kThreads, 0, stream>>>(dw, db, dout, inp, mean, rstd,
                                                                     N, C);
  TM_GPT_LAUNCHED("layernorm_backward dw/db");
}

// Row-major X[r, c] is column-major Xᵀ (c × r) with leading dimension c; the calls below are the
// column-major forms of the row-major products documented in the header.
void matmul_forward(cublasHandle_t handle, float* out, const std::uint16_t* inp_bf16,
                    const std::uint16_t* w_bf16, const float* bias, int N, int C, int OC,
                    cudaStream_t stream) {
  float beta = 0;
  if (bias != nullptr) {
    const std::int64_t n = static_cast<std::int64_t>(N) * OC;
    bias_rows_kernel<<<blocks(n), kThreads, 0, stream>>>(out, bias, N, OC);
    TM_GPT_LAUNCHED("matmul_forward bias");
    beta = 1;
  }
  const float alpha = 1;
  TM_GPT_CUBLAS(cublasSetStream(handle, stream));
  // outᵀ (OC × N) = w (OC × C) · inpᵀ (C × N)
  TM_GPT_CUBLAS(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, OC, N, C, &alpha, w_bf16,
                             CUDA_R_16BF, C, inp_bf16, CUDA_R_16BF, C, &beta, out, CUDA_R_32F, OC,
                             CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

void matmul_backward(cublasHandle_t handle, float* dinp, float* dw, float* dbias,
                     const std::uint16_t* dout_bf16, const float* dout, const std::uint16_t* inp_bf16,
                     const std::uint16_t* w_bf16, int N, int C, int OC, cudaStream_t stream) {
  const float one = 1, zero = 0;
  TM_GPT_CUBLAS(cublasSetStream(handle, stream));
  if (dinp != nullptr) {
    // dinpᵀ (C × N) = wᵀ (C × OC) · doutᵀ (OC × N)
    TM_GPT_CUBLAS(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, C, N, OC, &one, w_bf16,
                               CUDA_R_16BF, C, dout_bf16, CUDA_R_16BF, OC, &zero, dinp, CUDA_R_32F,
                               C, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
  // dwᵀ (C × OC) += inpᵀ (C × N) · dout (N × OC)
  TM_GPT_CUBLAS(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_T, C, OC, N, &one, inp_bf16,
                             CUDA_R_16BF, C, dout_bf16, CUDA_R_16BF, OC, &one, dw, CUDA_R_32F, C,
                             CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  if (dbias != nullptr) {
    column_sum_kernel<<<blocks(OC), kThreads, 0, stream>>>(dbias, dout, N, OC);
    TM_GPT_LAUNCHED("matmul_backward dbias");
  }
}

void attention_forward(float* out, float* att, const float* qkv, int B, int T, int C, int NH,
                       cudaStream_t stream) {
  const std::int64_t rows = static_cast<std::int64_t>(B) * NH * T;
  attention_forward_kernel<<<blocks(rows), kThreads, 0, stream>>>(out, att, qkv, B, T, C, NH);
  TM_GPT_LAUNCHED("attention_forward");
}

void attention_backward(float* dqkv, float* dpre, const float* dout, const float* qkv,
                        const float* att, int B, int T, int C, int NH, cudaStream_t stream) {
  const std::int64_t rows = static_cast<std::int64_t>(B) * NH * T;
  attention_dpre_kernel<<<blocks(rows), kThreads, 0, stream>>>(dpre, dout, qkv, att, B, T, C, NH);
  TM_GPT_LAUNCHED("attention_backward dpre");
  attention_dqkv_kernel<<<blocks(rows), kThreads, 0, stream>>>(dqkv, dpre, dout, qkv, att, B, T, C,
                                                               NH);
  TM_GPT_LAUNCHED("attention_backward dqkv");
}

void gelu_forward(float* out, const float* inp, std::int64_t n, cudaStream_t stream) {
  gelu_forward_kernel<<<blocks(n), kThreads, 0, stream>>>(out, inp, n);
  TM_GPT_LAUNCHED("gelu_forward");
}

void gelu_backward(float* dinp, const float* inp, const float* dout, std::int64_t n,
                   cudaStream_t stream) {
  gelu_backward_kernel<<<blocks(n), kThreads, 0, stream>>>(dinp, inp, dout, n);
  TM_GPT_LAUNCHED("gelu_backward");
}

void residual_forward(float* out, const float* a, const float* b, std::int64_t n,
                      cudaStream_t stream) {
  residual_kernel<<<blocks(n), kThreads, 0, stream>>>(out, a, b, n);
  TM_GPT_LAUNCHED("residual_forward");
}

void crossentropy_forward(float* logits, float* losses, const std::int32_t* targets, int N, int V,
                          cudaStream_t stream) {
  xent_forward_kernel<<<blocks(N), kThreads, 0, stream>>>(logits, losses, targets, N, V);
  TM_GPT_LAUNCHED("crossentropy_forward");
}

void crossentropy_backward(float* probs, const std::int32_t* targets, int N, int V, float dloss,
                           cudaStream_t stream) {
  xent_backward_kernel<<<blocks(N), kThreads, 0, stream>>>(probs, targets, N, V, dloss);
  TM_GPT_LAUNCHED("crossentropy_backward");
}

}  // namespace tiermem::gpt::cuda
