// tiermem/adam.h — AdamW on the CPU: fp32 master weights and moments, with a fused bf16/fp16
// copy-out of the new master in the same pass (no second pass over memory).
//
// Algorithm: AdamW, "Decoupled Weight Decay Regularization" (Loshchilov & Hutter, ICLR 2019),
// with the bias correction of Adam (Kingma & Ba, 2015), in the form PyTorch's torch.optim.AdamW
// computes it. For step t >= 1 (t counts optimizer steps, starting at 1) and every element i:
//
//   g     = grad[i] * grad_scale                       (grad_scale: 1/loss_scale, 1/world, ...)
//   m[i]  = beta1 * m[i] + (1 - beta1) * g
//   v[i]  = beta2 * v[i] + (1 - beta2) * g * g
//   p     = master[i] * (1 - lr * weight_decay)        (decoupled weight decay)
//   denom = sqrt(v[i]) / sqrt(1 - beta2^t) + eps
//   master[i] = p - (lr / (1 - beta1^t)) * m[i] / denom
//   half[i]   = round_to_nearest_even(master[i])       (bf16 or fp16; only when half != nullptr)
//               or master[i] itself                     (fp32 copy: half_dtype kF32)
//
// Precision: all arithmetic is fp32. The AVX2/AVX-512 kernels use FMA, so their results differ
// from the scalar kernel by a few ulp; every kernel stays within 1e-6 x scale + 1e-9 of a
// double-precision evaluation of the same formula per step, where scale is the magnitude of the
// terms a value is summed from (m's two terms can cancel) — see tests/unit/adam_test.cc.
// The bf16/fp16 copy is bit-identical to tiermem::f32_to_bf16 / f32_to_f16 of the new master for
// every value, NaN included (the scalar functions give vcvtps2ph's NaN bits).
//
// NaN/Inf gradients: the kernels do NOT filter them (same as PyTorch). An element whose scaled
// gradient is NaN or ±Inf gets m, v and master = NaN (Inf: m = ±Inf, v = +Inf, Inf/Inf = NaN);
// every other element is updated normally — the update is element-wise, nothing leaks across
// elements. Callers that must not corrupt state (fp16 loss scaling) check first with
// count_nonfinite() and skip the step; ZeroEngine does that.
//
// Thread-safety: adam_step() is reentrant; concurrent calls must use disjoint buffers. It runs
// its own OpenMP parallel region over chunks (threads = AdamOptions::threads or OpenMP's default).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "tiermem/dtype.h"
#include "tiermem/export.h"

namespace tiermem {

// Hyper-parameters of one AdamW step. step is t in the formula above (>= 1).
struct TIERMEM_API AdamParams {
  float lr = 1e-3f;
  // The betas stay double so that 1 - beta and the bias corrections are computed from the value
  // the caller gave (PyTorch passes Python floats): with float betas, 1 - 0.999f differs from
  // torch's (float)(1 - 0.999) by 4.7e-5 relative. Callers passing floats get what they had.
  double beta1 = 0.9;
  double beta2 = 0.999;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  std::int64_t step = 1;
  float grad_scale = 1.0f;  // gradients are multiplied by this before use
};

// The instruction set of a kernel. kAuto picks the best one the CPU supports.
enum class AdamIsa { kAuto, kScalar, kAvx2, kAvx512 };
TIERMEM_API std::string_view adam_isa_name(AdamIsa isa);

// The best kernel this CPU runs (checked once with __builtin_cpu_supports: AVX-512 needs
// avx512f+avx512bw+avx512vl; AVX2 needs avx2+fma+f16c). The environment variable TIERMEM_ADAM_ISA
// (scalar|avx2|avx512) lowers the choice; asking for more than the CPU has is ignored with a warning.
TIERMEM_API AdamIsa adam_best_isa();

// True when this CPU can run `isa` (kAuto and kScalar: always).
TIERMEM_API bool adam_isa_supported(AdamIsa isa);

struct TIERMEM_API AdamOptions {
  AdamIsa isa = AdamIsa::kAuto;
  int threads = 0;  // 0 = OpenMP's default (OMP_NUM_THREADS or the number of cores)
};

// One AdamW step over n elements (any n, including 0 and tails shorter than a vector).
//   master, m, v: fp32, n elements each, read and written in place (caller owns them).
//   grad:         fp32, n elements, read only.
//   half:         nullptr, or a caller-owned buffer of n elements of half_dtype, written with the
//                 rounded new master in the same pass (e.g. the pinned buffer that is uploaded).
//   half_dtype:   DType::kBF16 or DType::kF16; or DType::kF32: `half` gets an exact copy of the
//                 new master (fp32 working params), chunk by chunk while it is still in cache,
//                 instead of a second pass over memory.
// Buffers may have any alignment; they must not overlap each other.
// Throws NotSupportedError if options.isa is not supported by this CPU or half_dtype is not
// bf16/fp16/fp32; ConfigError-free otherwise (hyper-parameters are not validated here).
TIERMEM_API void adam_step(const AdamParams& params, float* master, const float* grad, float* m,
                           float* v, std::size_t n, void* half = nullptr,
                           DType half_dtype = DType::kBF16, const AdamOptions& options = {});

// Number of elements of x[0..n) that are NaN or ±Inf (fp32). Multi-threaded like adam_step.
TIERMEM_API std::size_t count_nonfinite(const float* x, std::size_t n);

namespace detail {

// The per-step constants every kernel uses (derived once from AdamParams).
struct AdamCoeffs {
  float beta1, one_minus_beta1, beta2, one_minus_beta2;
  float step_size;     // lr / (1 - beta1^t)
  float inv_sqrt_bc2;  // 1 / sqrt(1 - beta2^t)
  float eps;
  float decay;         // 1 - lr * weight_decay
  float grad_scale;
};
// Inline so the CPU kernels (src/cpu) and the CUDA kernel (src/gpu, which does not link
// tiermem::cpu) derive the coefficients from one definition. Bias corrections in double.
inline AdamCoeffs adam_coeffs(const AdamParams& p) {
  AdamCoeffs c;
  double t = static_cast<double>(std::max<std::int64_t>(p.step, 1));
  double bc1 = 1.0 - std::pow(p.beta1, t);
  double bc2 = 1.0 - std::pow(p.beta2, t);
  c.beta1 = static_cast<float>(p.beta1);
  c.one_minus_beta1 = static_cast<float>(1.0 - p.beta1);
  c.beta2 = static_cast<float>(p.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - p.beta2);
  c.step_size = static_cast<float>(static_cast<double>(p.lr) / bc1);
  c.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  c.eps = p.eps;
  c.decay = static_cast<float>(1.0 - static_cast<double>(p.lr) * p.weight_decay);
  c.grad_scale = p.grad_scale;
  return c;
}

// half_kind: 0 = no copy, 1 = bf16, 2 = fp16. Single-threaded kernels over [0, n).
void adam_kernel_scalar(const AdamCoeffs& c, float* master, const float* grad, float* m, float* v,
                        std::size_t n, std::uint16_t* half, int half_kind);
void adam_kernel_avx2(const AdamCoeffs& c, float* master, const float* grad, float* m, float* v,
                      std::size_t n, std::uint16_t* half, int half_kind);
void adam_kernel_avx512(const AdamCoeffs& c, float* master, const float* grad, float* m, float* v,
                        std::size_t n, std::uint16_t* half, int half_kind);

}  // namespace detail
}  // namespace tiermem
