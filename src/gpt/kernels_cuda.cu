// gpt/kernels_cuda.cu — CUDA layers: cuBLAS GEMMs (bf16 in, fp32 accumulate); the row layers run
// the phases of gpt/layer_math.h with several threads per row: a warp per row (LayerNorm,
// attention; partials combined by warp shuffles), a block per row (softmax cross-entropy over
// the vocabulary; warp shuffles, then shared memory across the block's warps), a 32-column x
// 8-row-group tile per block for the column sums (LayerNorm dw/db, dbias; a fixed order, so
// deterministic). Attention is the plain O(T²) per-row form (scores materialised in `att`), not a
// fused FlashAttention-style kernel.
#include "gpt/kernels_cuda.h"
#include "gpt/cublas_loader.h"

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

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWarp = 32;
constexpr int kRowsPerBlock = kThreads / kWarp;  // warp-per-row kernels: 8 rows per block
constexpr int kXentThreads = 512;                // block-per-row cross-entropy
constexpr int kXentWarps = kXentThreads / kWarp;

int warp_row_blocks(std::int64_t rows) {
  return static_cast<int>((rows + kRowsPerBlock - 1) / kRowsPerBlock);
}

__device__ float warp_sum(float v) {
  for (int o = kWarp / 2; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}
__device__ float warp_max(float v) {
  for (int o = kWarp / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}
// The sum (or max) of `v` over the block's kWarps warps; every thread gets it. `smem` holds
// kWarps floats. Ends with __syncthreads, so smem may be reused at once.
template <int kWarps, bool kMax>
__device__ float block_reduce(float v, float* smem) {
  v = kMax ? warp_max(v) : warp_sum(v);
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float x = lane < kWarps ? smem[lane] : (kMax ? -3.0e38f : 0.0f);
    x = kMax ? warp_max(x) : warp_sum(x);
    if (lane == 0) smem[0] = x;
  }
  __syncthreads();
  const float r = smem[0];
  __syncthreads();
  return r;
}

// This thread's row of a warp-per-row kernel and its lane; row < 0 past the end (the whole warp
// leaves together, so the shuffles of the warps that stay are complete).
__device__ std::int64_t warp_row(std::int64_t rows, int* lane) {
  *lane = threadIdx.x % kWarp;
  const std::int64_t r =
      static_cast<std::int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
  return r < rows ? r : -1;
}

__global__ void cast_bf16_kernel(float* dst, const std::uint16_t* src, std::int64_t n) {
  std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) dst[i] = __uint_as_float(static_cast<unsigned>(src[i]) << 16);
}

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
  int lane;
  const std::int64_t n = warp_row(N, &lane);
  if (n < 0) return;
  const float* x = inp + n * C;
  const float m = warp_sum(math::layernorm_row_sum(x, C, lane, kWarp)) / static_cast<float>(C);
  const float rs = math::layernorm_rstd(warp_sum(math::layernorm_row_sq_dev(x, m, C, lane, kWarp)), C);
  math::layernorm_row_apply(x, w, b, out + n * C, m, rs, C, lane, kWarp);
  if (lane == 0) {
    mean[n] = m;
    rstd[n] = rs;
  }
}

__global__ void layernorm_backward_dx_kernel(float* dinp, const float* dout, const float* inp,
                                             const float* w, const float* mean, const float* rstd,
                                             int N, int C) {
  int lane;
  const std::int64_t n = warp_row(N, &lane);
  if (n < 0) return;
  const std::int64_t o = n * C;
  float sg, sgx;
  math::layernorm_row_dx_sums(dout + o, inp + o, w, mean[n], rstd[n], C, lane, kWarp, &sg, &sgx);
  sg = warp_sum(sg) / static_cast<float>(C);
  sgx = warp_sum(sgx) / static_cast<float>(C);
  math::layernorm_row_dx_apply(dout + o, inp + o, w, mean[n], rstd[n], sg, sgx, dinp + o, C, lane,
                               kWarp);
}

// Column sums over N rows, 32 columns x 8 row groups per block: thread (x, y) sums rows y, y + 8,
// ... of column blockIdx.x·32 + x, then the 8 partials are added in a fixed order (deterministic).
constexpr int kColTile = 32, kRowGroups = 8;
template <class Term>
__device__ void column_reduce(float* out, int N, int C, Term term) {
  __shared__ float part[kRowGroups][kColTile + 1];
  const int c = blockIdx.x * kColTile + threadIdx.x;
  float s = 0;
  if (c < C)
    for (int n = threadIdx.y; n < N; n += kRowGroups) s += term(n, c);
  part[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    float t = 0;
    for (int g = 0; g < kRowGroups; ++g) t += part[g][threadIdx.x];
    out[c] += t;
  }
}

// The terms the column sums add up (functors: nvcc's extended lambdas need a flag).
struct LnDwTerm {
  const float *dout, *inp, *mean, *rstd;
  int C;
  __device__ float operator()(int n, int c) const {
    const std::int64_t o = static_cast<std::int64_t>(n) * C + c;
    return dout[o] * (inp[o] - mean[n]) * rstd[n];
  }
};
struct ColumnTerm {
  const float* x;
  int C;
  __device__ float operator()(int n, int c) const { return x[static_cast<std::int64_t>(n) * C + c]; }
};

__global__ void layernorm_backward_dwdb_kernel(float* dw, float* db, const float* dout,
                                               const float* inp, const float* mean,
                                               const float* rstd, int N, int C) {
  column_reduce(dw, N, C, LnDwTerm{dout, inp, mean, rstd, C});
  __syncthreads();
  column_reduce(db, N, C, ColumnTerm{dout, C});
}

__global__ void bias_rows_kernel(float* out, const float* bias, int N, int OC) {
  std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < static_cast<std::int64_t>(N) * OC) out[i] = bias[i % OC];
}

__global__ void column_sum_kernel(float* dbias, const float* dout, int N, int OC) {
  column_reduce(dbias, N, OC, ColumnTerm{dout, OC});
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

// Attention: a warp per (b, h, t) row; __syncwarp between phases that read what other lanes
// wrote (the row of att).
__global__ void attention_forward_kernel(float* out, float* att, const float* qkv, int B, int T,
                                         int C, int NH) {
  int lane;
  const std::int64_t r = warp_row(static_cast<std::int64_t>(B) * NH * T, &lane);
  if (r < 0) return;
  const Row x = split_row(r, T, NH);
  const float mx =
      warp_max(math::attention_row_scores(qkv, att, T, C, NH, x.b, x.t, x.h, lane, kWarp));
  __syncwarp();
  const float sum = warp_sum(math::attention_row_exp(att, mx, T, NH, x.b, x.t, x.h, lane, kWarp));
  math::attention_row_normalize(att, 1.0f / sum, T, NH, x.b, x.t, x.h, lane, kWarp);
  __syncwarp();
  math::attention_row_out(qkv, att, out, T, C, NH, x.b, x.t, x.h, lane, kWarp);
}

__global__ void attention_dpre_kernel(float* dpre, const float* dout, const float* qkv,
                                      const float* att, int B, int T, int C, int NH) {
  int lane;
  const std::int64_t r = warp_row(static_cast<std::int64_t>(B) * NH * T, &lane);
  if (r < 0) return;
  const Row x = split_row(r, T, NH);
  const float dot = warp_sum(
      math::attention_row_dpre_dots(qkv, att, dout, dpre, T, C, NH, x.b, x.t, x.h, lane, kWarp));
  math::attention_row_dpre_apply(att, dpre, dot, T, NH, x.b, x.t, x.h, lane, kWarp);
}

__global__ void attention_dqkv_kernel(float* dqkv, const float* dpre, const float* dout,
                                      const float* qkv, const float* att, int B, int T, int C,
                                      int NH) {
  int lane;
  const std::int64_t r = warp_row(static_cast<std::int64_t>(B) * NH * T, &lane);
  if (r < 0) return;
  const Row x = split_row(r, T, NH);
  math::attention_row_dq(qkv, dpre, dqkv, T, C, NH, x.b, x.t, x.h, lane, kWarp);
  math::attention_row_dkv(qkv, att, dpre, dout, dqkv, T, C, NH, x.b, x.t, x.h, lane, kWarp);
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

// Cross-entropy: a block of kXentThreads per row of V logits.
__global__ void xent_forward_kernel(float* logits, float* losses, const std::int32_t* targets,
                                    int N, int V) {
  __shared__ float smem[kXentWarps];
  const int n = blockIdx.x;
  float* l = logits + static_cast<std::int64_t>(n) * V;
  const float target_logit = l[targets[n]];  // read before the apply phase overwrites it
  const float mx = block_reduce<kXentWarps, true>(
      math::xent_row_max(l, V, static_cast<int>(threadIdx.x), kXentThreads), smem);
  const float sum = block_reduce<kXentWarps, false>(
      math::xent_row_sumexp(l, mx, V, static_cast<int>(threadIdx.x), kXentThreads), smem);
  if (threadIdx.x == 0) losses[n] = math::xent_row_loss(target_logit, mx, sum);
  math::xent_row_apply(l, mx, 1.0f / sum, V, static_cast<int>(threadIdx.x), kXentThreads);
}
__global__ void xent_backward_kernel(float* probs, const std::int32_t* targets, int N, int V,
                                     float dloss) {
  const int n = blockIdx.x;
  math::softmax_xent_row_backward(probs + static_cast<std::int64_t>(n) * V, V, targets[n], dloss,
                                  static_cast<int>(threadIdx.x), kXentThreads);
}

}  // namespace

void cast_f32_to_bf16(std::uint16_t* dst, const float* src, std::int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  cast_kernel<<<blocks(n), kThreads, 0, stream>>>(dst, src, n);
  TM_GPT_LAUNCHED("cast_f32_to_bf16");
}

void cast_bf16_to_f32(float* dst, const std::uint16_t* src, std::int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  cast_bf16_kernel<<<blocks(n), kThreads, 0, stream>>>(dst, src, n);
  TM_GPT_LAUNCHED("cast_bf16_to_f32");
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
  layernorm_forward_kernel<<<warp_row_blocks(N), kThreads, 0, stream>>>(out, mean, rstd, inp, w, b, N, C);
  TM_GPT_LAUNCHED("layernorm_forward");
}

void layernorm_backward(float* dinp, float* dw, float* db, const float* dout, const float* inp,
                        const float* w, const float* mean, const float* rstd, int N, int C,
                        cudaStream_t stream) {
  layernorm_backward_dx_kernel<<<warp_row_blocks(N), kThreads, 0, stream>>>(dinp, dout, inp, w, mean, rstd,
                                                                   N, C);
  TM_GPT_LAUNCHED("layernorm_backward dx");
  layernorm_backward_dwdb_kernel<<<(C + kColTile - 1) / kColTile, dim3(kColTile, kRowGroups), 0,
                                   stream>>>(dw, db, dout, inp, mean, rstd, N, C);
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
  TM_GPT_CUBLAS(cublas_api().set_stream(handle, stream));
  // outᵀ (OC × N) = w (OC × C) · inpᵀ (C × N)
  TM_GPT_CUBLAS(cublas_api().gemm_ex(handle, CUBLAS_OP_T, CUBLAS_OP_N, OC, N, C, &alpha, w_bf16,
                             CUDA_R_16BF, C, inp_bf16, CUDA_R_16BF, C, &beta, out, CUDA_R_32F, OC,
                             CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

void matmul_backward(cublasHandle_t handle, float* dinp, float* dw, float* dbias,
                     const std::uint16_t* dout_bf16, const float* dout, const std::uint16_t* inp_bf16,
                     const std::uint16_t* w_bf16, int N, int C, int OC, cudaStream_t stream) {
  const float one = 1, zero = 0;
  TM_GPT_CUBLAS(cublas_api().set_stream(handle, stream));
  if (dinp != nullptr) {
    // dinpᵀ (C × N) = wᵀ (C × OC) · doutᵀ (OC × N)
    TM_GPT_CUBLAS(cublas_api().gemm_ex(handle, CUBLAS_OP_N, CUBLAS_OP_N, C, N, OC, &one, w_bf16,
                               CUDA_R_16BF, C, dout_bf16, CUDA_R_16BF, OC, &zero, dinp, CUDA_R_32F,
                               C, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
  // dwᵀ (C × OC) += inpᵀ (C × N) · dout (N × OC)
  TM_GPT_CUBLAS(cublas_api().gemm_ex(handle, CUBLAS_OP_N, CUBLAS_OP_T, C, OC, N, &one, inp_bf16,
                             CUDA_R_16BF, C, dout_bf16, CUDA_R_16BF, OC, &one, dw, CUDA_R_32F, C,
                             CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  if (dbias != nullptr) {
    column_sum_kernel<<<(OC + kColTile - 1) / kColTile, dim3(kColTile, kRowGroups), 0, stream>>>(dbias, dout, N, OC);
    TM_GPT_LAUNCHED("matmul_backward dbias");
  }
}

void attention_forward(float* out, float* att, const float* qkv, int B, int T, int C, int NH,
                       cudaStream_t stream) {
  const std::int64_t rows = static_cast<std::int64_t>(B) * NH * T;
  attention_forward_kernel<<<warp_row_blocks(rows), kThreads, 0, stream>>>(out, att, qkv, B, T, C, NH);
  TM_GPT_LAUNCHED("attention_forward");
}

void attention_backward(float* dqkv, float* dpre, const float* dout, const float* qkv,
                        const float* att, int B, int T, int C, int NH, cudaStream_t stream) {
  const std::int64_t rows = static_cast<std::int64_t>(B) * NH * T;
  attention_dpre_kernel<<<warp_row_blocks(rows), kThreads, 0, stream>>>(dpre, dout, qkv, att, B, T, C, NH);
  TM_GPT_LAUNCHED("attention_backward dpre");
  attention_dqkv_kernel<<<warp_row_blocks(rows), kThreads, 0, stream>>>(dqkv, dpre, dout, qkv, att, B, T, C,
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
  xent_forward_kernel<<<N, kXentThreads, 0, stream>>>(logits, losses, targets, N, V);
  TM_GPT_LAUNCHED("crossentropy_forward");
}

void crossentropy_backward(float* probs, const std::int32_t* targets, int N, int V, float dloss,
                           cudaStream_t stream) {
  xent_backward_kernel<<<N, kXentThreads, 0, stream>>>(probs, targets, N, V, dloss);
  TM_GPT_LAUNCHED("crossentropy_backward");
}

}  // namespace tiermem::gpt::cuda
