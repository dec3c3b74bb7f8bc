// gpt/kernels_cuda.h — the CUDA layers of the GPT model (built only when CUDA is found: the
// library then defines TIERMEM_HAVE_CUDA=1). Same layers, shapes and "=" / "+=" conventions as
// gpt/kernels_cpu.h, and the same per-row math (gpt/layer_math.h, __host__ __device__), so the
// CPU gradient checks cover it; tests/gpu/gpt_cuda_test.cc compares every kernel with the CPU.
//
// Memory: every pointer is device memory (cudaMalloc or managed), caller-owned; fp32 activations
// except GEMM inputs, which are bf16 (raw bits, uint16) with fp32 accumulation and fp32 outputs
// (cuBLAS cublasGemmEx, CUBLAS_COMPUTE_32F; cuBLAS is loaded on first use, gpt/cublas_loader.h,
// so a handle comes from cublas_api().create). cast_f32_to_bf16 makes those bf16 copies.
// Asynchrony: every function enqueues work on `stream` and returns; results are ready when the
// stream is synchronised. Buffers may be reused after that. Row kernels run the phases of
// gpt/layer_math.h with a warp per row (LayerNorm, attention) or a block of 512 threads per row
// (cross-entropy), combining partials with warp shuffles and shared memory; column sums (LayerNorm
// dw/db, dbias) use 32 x 8 tiles in a fixed order, so every kernel is deterministic
// (no atomics). Attention materialises the [B, NH, T, T] probabilities (no fused
// FlashAttention-style tiling yet).
// Thread-safety: functions are reentrant; a cublasHandle_t must not be used by two threads at once.
// Errors: launch and cuBLAS failures throw tiermem::CudaError naming the call and file:line.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace tiermem::gpt::cuda {

// dst[i] = bf16(src[i]), round to nearest even; n elements.
void cast_f32_to_bf16(std::uint16_t* dst, const float* src, std::int64_t n, cudaStream_t stream);
// dst[i] = float(bf16 bits src[i]) (exact); n elements.
void cast_bf16_to_f32(float* dst, const std::uint16_t* src, std::int64_t n, cudaStream_t stream);

// out[n, c] = wte[tokens[n], c] + wpe[n % T, c]   (=)
void encoder_forward(float* out, const std::int32_t* tokens, const float* wte, const float* wpe,
                     int B, int T, int C, cudaStream_t stream);
// dwte[tokens[n]] += dout[n]; dwpe[n % T] += dout[n]   (+=, deterministic: a thread per column)
void encoder_backward(float* dwte, float* dwpe, const float* dout, const std::int32_t* tokens,
                      int B, int T, int C, cudaStream_t stream);

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* w,
                       const float* b, int N, int C, cudaStream_t stream);
// dinp, dw, db (+=)
void layernorm_backward(float* dinp, float* dw, float* db, const float* dout, const float* inp,
                        const float* w, const float* mean, const float* rstd, int N, int C,
                        cudaStream_t stream);

// out[N, OC] = inp[N, C]·w[OC, C]ᵀ + bias (=); inp and w bf16, bias fp32 or null.
void matmul_forward(cublasHandle_t handle, float* out, const std::uint16_t* inp_bf16,
                    const std::uint16_t* w_bf16, const float* bias, int N, int C, int OC,
                    cudaStream_t stream);
// dinp = dout·w (=, skipped when null); dw += doutᵀ·inp; dbias += Σ_n dout (fp32 dout, skipped
// when null). dout, inp, w bf16.
void matmul_backward(cublasHandle_t handle, float* dinp, float* dw, float* dbias,
                     const std::uint16_t* dout_bf16, const float* dout, const std::uint16_t* inp_bf16,
                     const std::uint16_t* w_bf16, int N, int C, int OC, cudaStream_t stream);

void attention_forward(float* out, float* att, const float* qkv, int B, int T, int C, int NH,
                       cudaStream_t stream);
void attention_backward(float* dqkv, float* dpre, const float* dout, const float* qkv,
                        const float* att, int B, int T, int C, int NH, cudaStream_t stream);

void gelu_forward(float* out, const float* inp, std::int64_t n, cudaStream_t stream);
void gelu_backward(float* dinp, const float* inp, const float* dout, std::int64_t n,
                   cudaStream_t stream);
void residual_forward(float* out, const float* a, const float* b, std::int64_t n,
                      cudaStream_t stream);

// In place over [N, V]: logits become probabilities; losses[n] = −log p[target_n] (=).
void crossentropy_forward(float* logits, float* losses, const std::int32_t* targets, int N, int V,
                          cudaStream_t stream);
// probs become (p − onehot)·dloss, in place.
void crossentropy_backward(float* probs, const std::int32_t* targets, int N, int V, float dloss,
                           cudaStream_t stream);

}  // namespace tiermem::gpt::cuda
