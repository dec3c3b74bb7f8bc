// tiermem/optim_kernels.h — Lion and Adagrad on the CPU, beside AdamW (tiermem/adam.h): fp32
// master weights and one fp32 state tensor, with the same fused bf16/fp16/fp32 copy-out of the
// new master in the same pass, the same ISA choice and the same threading. Pure kernels: the
// caller owns every buffer and the step counter; nothing here allocates or keeps state.
//
// Lion — "Symbolic Discovery of Optimization Algorithms" (Chen et al., 2023), in the form of
// lion-pytorch and DeepSpeed's CPU Lion. For every element i:
//
//   g      = grad[i] * grad_scale
//   c      = beta1 * m[i] + (1 - beta1) * g              (computed fma(1 - beta1, g, beta1 * m))
//   master = master[i] * (1 - lr * weight_decay) - lr * sign(c)   (decoupled weight decay)
//   m[i]   = beta2 * m[i] + (1 - beta2) * g              (computed fma(1 - beta2, g, beta2 * m))
//   sign(0) = 0; sign(NaN) = 0 (as torch.sign on the CPU).
//
// Adagrad — as torch.optim.Adagrad (foreach=False, its CPU default) computes it. With t = step
// (>= 1; the caller counts steps from 1, torch's state["step"] after its increment):
//
//   g      = grad[i] * grad_scale + weight_decay * master[i]   (L2: added to the gradient; the
//                                                              term is skipped when wd == 0)
//   clr    = lr / (1 + (t - 1) * lr_decay)                   (in double, then rounded to fp32)
//   sum[i] = sum[i] + g * g                                  (one fused multiply-add)
//   master = master[i] - clr * g / (sqrt(sum[i]) + eps)      (computed p + ((-clr) * g) / std)
//   The caller fills sum with initial_accumulator_value (torch's default 0) before step 1.
//
// Both: half[i] = round_to_nearest_even(master[i]) in bf16 or fp16 when half != nullptr (the
// bits of tiermem::f32_to_bf16 / f32_to_f16, NaN included), or master[i] itself for kF32.
//
// Precision: all arithmetic is fp32, in the operation order written above, which is torch's on
// the CPU (measured: add with alpha and addcmul round once, a fused multiply-add; addcdiv is mul,
// div, add). Every ISA kernel (scalar, AVX2, AVX-512) performs the same IEEE operations (the
// scalar twin calls std::fma where the vector kernels use vfmadd), so their results are
// bit-identical for every input — tests/unit/optim_kernels_test.cc checks it.
// Against torch 2.15 on the CPU (100003 elements, 10 steps, measured once, not a test): Lion is
// bit-identical to lion-pytorch's update; Adagrad is bit-identical to torch.optim.Adagrad when
// torch's sqrt is made correctly rounded, and with stock torch (whose CPU sqrt is 1 ulp off on
// ~20% of inputs) differs on ~5% of elements by at most 2.4e-7 absolute (|master| <= 4.2): the
// kernels use the correctly rounded IEEE sqrt.
//
// Speed (memory-bound; 2 threads of a shared Xeon, 16 M elements, indicative): AVX-512 ~1000
// Mparam/s, ~700 with the bf16 copy; AVX2 ~700-900; the scalar twin ~100-170 (std::fma is a
// libm call).
//
// NaN/Inf gradients are not filtered (same as torch): the element's state and master go
// non-finite (Adagrad: sum = +Inf/NaN, master NaN; Lion: m = NaN, master keeps only its decay
// because sign(NaN) = 0, and stays frozen while m is NaN). Nothing leaks across elements. Check
// gradients first with count_nonfinite() (tiermem/adam.h) and skip the step.
//
// Thread-safety: lion_step() and adagrad_step() are reentrant; concurrent calls must use disjoint
// buffers. Each runs its own OpenMP parallel region over chunks of 64 Ki elements (threads =
// AdamOptions::threads or OpenMP's default); the result does not depend on the thread count.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "tiermem/adam.h"  // AdamIsa, AdamOptions, adam_best_isa(), adam_isa_supported()
#include "tiermem/dtype.h"
#include "tiermem/export.h"

namespace tiermem {

// Hyper-parameters of one Lion step. The hyper-parameters are double, as Python passes them:
// each derived constant (1 - beta, 1 - lr * weight_decay) is computed in double and rounded to
// fp32 once, where torch rounds it. Not validated (any value is used as given).
struct TIERMEM_API LionParams {
  double lr = 1e-4;            // units: parameter units per step (the step is exactly ±lr)
  double beta1 = 0.9;          // interpolation for the update direction c
  double beta2 = 0.99;         // decay of the momentum m
  double weight_decay = 0.0;   // decoupled: master *= 1 - lr * weight_decay
  float grad_scale = 1.0f;     // gradients are multiplied by this (fp32) before use
};

// Hyper-parameters of one Adagrad step (torch.optim.Adagrad's names and defaults). step is t in
// the formula above; values < 1 are taken as 1. initial_accumulator_value is not a per-step
// parameter: the caller fills sum with it when it creates the state.
struct TIERMEM_API AdagradParams {
  double lr = 1e-2;
  double lr_decay = 0.0;
  double weight_decay = 0.0;   // L2 (coupled): added to the gradient as weight_decay * master
  double eps = 1e-10;          // rounded to fp32 (torch adds it to an fp32 tensor)
  std::int64_t step = 1;
  float grad_scale = 1.0f;     // gradients are multiplied by this (fp32) before use
};

// One Lion step over n elements (any n, including 0 and tails shorter than a vector).
//   master, m: fp32, n elements each, read and written in place (m: exp_avg; caller owns both and
//              zero-fills m before the first step).
//   grad:      fp32, n elements, read only.
//   half:      nullptr, or a caller-owned buffer of n elements of half_dtype, written with the new
//              master in the same pass: DType::kBF16 / kF16 rounded to nearest even, DType::kF32 an
//              exact copy.
//   options:   the kernel (AdamIsa: kAuto = adam_best_isa(), which TIERMEM_ADAM_ISA lowers for
//              every CPU optimizer) and the number of OpenMP threads.
// Buffers may have any alignment; they must not overlap each other. They are only accessed
// during the call (nothing is kept); when it returns every store, the copy's included, is done.
// Throws tiermem::Error when n > 0 and master, grad or m is null (half may be null: no copy);
// NotSupportedError when half != nullptr and half_dtype is not bf16/f16/f32, or when
// options.isa is not supported by this CPU. Nothing is written when it throws.
TIERMEM_API void lion_step(const LionParams& params, float* master, const float* grad, float* m,
                           std::size_t n, void* half = nullptr, DType half_dtype = DType::kBF16,
                           const AdamOptions& options = {});

// One Adagrad step over n elements. As lion_step, with `sum` (fp32, n elements, read and written:
// torch's state["sum"]) in place of m; the caller fills it with initial_accumulator_value before
// step 1. Throws as lion_step (tiermem::Error when n > 0 and master, grad or sum is null).
TIERMEM_API void adagrad_step(const AdagradParams& params, float* master, const float* grad,
                              float* sum, std::size_t n, void* half = nullptr,
                              DType half_dtype = DType::kBF16, const AdamOptions& options = {});

namespace detail {

// The fp32 constants every Lion kernel uses (derived once per step from LionParams).
struct LionCoeffs {
  float beta1, one_minus_beta1, beta2, one_minus_beta2;
  float lr;     // the step size: master moves by exactly ±lr (or 0)
  float decay;  // 1 - lr * weight_decay
  float grad_scale;
};
inline LionCoeffs lion_coeffs(const LionParams& p) {
  LionCoeffs c;
  c.beta1 = static_cast<float>(p.beta1);
  c.one_minus_beta1 = static_cast<float>(1.0 - p.beta1);
  c.beta2 = static_cast<float>(p.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - p.beta2);
  c.lr = static_cast<float>(p.lr);
  c.decay = static_cast<float>(1.0 - p.lr * p.weight_decay);
  c.grad_scale = p.grad_scale;
  return c;
}

// The fp32 constants every Adagrad kernel uses.
struct AdagradCoeffs {
  float neg_clr;       // -(lr / (1 + (t - 1) * lr_decay)), rounded once from double
  float eps;
  float weight_decay;  // used only when has_weight_decay
  bool has_weight_decay;
  float grad_scale;
};
inline AdagradCoeffs adagrad_coeffs(const AdagradParams& p) {
  AdagradCoeffs c;
  const double t = static_cast<double>(std::max<std::int64_t>(p.step, 1));
  c.neg_clr = static_cast<float>(-(p.lr / (1.0 + (t - 1.0) * p.lr_decay)));
  c.eps = static_cast<float>(p.eps);
  c.weight_decay = static_cast<float>(p.weight_decay);
  c.has_weight_decay = p.weight_decay != 0.0;
  c.grad_scale = p.grad_scale;
  return c;
}

// Single-threaded kernels over [0, n). half_kind: 0 = no copy, 1 = bf16, 2 = fp16 (the fp32
// copy is the driver's memcpy, chunk by chunk). The vector ones may be called only when
// adam_isa_supported() says the CPU has their ISA.
void lion_kernel_scalar(const LionCoeffs& c, float* master, const float* grad, float* m,
                        std::size_t n, std::uint16_t* half, int half_kind);
void lion_kernel_avx2(const LionCoeffs& c, float* master, const float* grad, float* m,
                      std::size_t n, std::uint16_t* half, int half_kind);
void lion_kernel_avx512(const LionCoeffs& c, float* master, const float* grad, float* m,
                        std::size_t n, std::uint16_t* half, int half_kind);
void adagrad_kernel_scalar(const AdagradCoeffs& c, float* master, const float* grad, float* sum,
                           std::size_t n, std::uint16_t* half, int half_kind);
void adagrad_kernel_avx2(const AdagradCoeffs& c, float* master, const float* grad, float* sum,
                         std::size_t n, std::uint16_t* half, int half_kind);
void adagrad_kernel_avx512(const AdagradCoeffs& c, float* master, const float* grad, float* sum,
                           std::size_t n, std::uint16_t* half, int half_kind);

}  // namespace detail
}  // namespace tiermem
