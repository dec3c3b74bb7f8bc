// src/cpu/optim_kernels.cc — Lion and Adagrad: argument checks, run-time ISA choice, threading
// over chunks, and the scalar kernels (the obvious twins the vector kernels must equal bit for
// bit). See include/tiermem/optim_kernels.h. Compiled with -ffp-contract=off
// (src/cpu/optim_kernels.cmake): every fused multiply-add here is an explicit std::fma, so the
// compiler cannot fuse others and break the equality with the vector kernels.
#include "tiermem/optim_kernels.h"

#include <omp.h>

#include <cmath>
#include <cstring>
#include <string>

#include "tiermem/error.h"
#include "cpu/step_dispatch.h"

namespace tiermem {
namespace {

template <class Coeffs>
using Kernel = void (*)(const Coeffs&, float*, const float*, float*, std::size_t, std::uint16_t*,
                        int);

// Checks the arguments, picks the kernel and runs it over chunks (step_dispatch.h) on up to
// options.threads OpenMP threads. Throws before touching any buffer.
template <class Coeffs>
void run_step(const char* who, const char* state_name, const Coeffs& c, float* master,
              const float* grad, float* state, std::size_t n, void* half, DType half_dtype,
              const AdamOptions& options, Kernel<Coeffs> scalar, Kernel<Coeffs> avx2,
              Kernel<Coeffs> avx512) {
  if (n > 0 && (master == nullptr || grad == nullptr || state == nullptr)) {
    throw Error(std::string(who) + ": n=" + std::to_string(n) + " elements but " +
                (master == nullptr ? "master" : grad == nullptr ? "grad" : state_name) +
                " is null");
  }
  const detail::MasterCopy copy = detail::master_copy(half, half_dtype, who);
  const AdamIsa isa = detail::checked_isa(options, who);
  const Kernel<Coeffs> kernel =
      isa == AdamIsa::kAvx512 ? avx512 : isa == AdamIsa::kAvx2 ? avx2 : scalar;
  detail::for_step_chunks(n, options, copy, master, [&](std::size_t b, std::size_t len) {
    kernel(c, master + b, grad + b, state + b, len, copy.half ? copy.half + b : nullptr, copy.half_kind);
  });
}

inline void store_half(std::uint16_t* half, int half_kind, std::size_t i, float p) {
  if (half_kind == 1) half[i] = f32_to_bf16(p);
  else if (half_kind == 2) half[i] = f32_to_f16(p);
}

}  // namespace

namespace detail {

void lion_kernel_scalar(const LionCoeffs& c, float* master, const float* grad, float* m,
                        std::size_t n, std::uint16_t* half, int half_kind) {
  if (half == nullptr) half_kind = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const float g = grad[i] * c.grad_scale;
    const float mi = m[i];
    const float ci = std::fma(c.one_minus_beta1, g, c.beta1 * mi);
    // lr * sign(c), written as the vector kernels form it: ±lr, or +0 for 0, -0 and NaN.
    const float step = ci > 0.0f ? c.lr : ci < 0.0f ? -c.lr : 0.0f;
    const float p = master[i] * c.decay - step;
    m[i] = std::fma(c.one_minus_beta2, g, c.beta2 * mi);
    master[i] = p;
    store_half(half, half_kind, i, p);
  }
}

void adagrad_kernel_scalar(const AdagradCoeffs& c, float* master, const float* grad, float* sum,
                           std::size_t n, std::uint16_t* half, int half_kind) {
  if (half == nullptr) half_kind = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const float p = master[i];
    float g = grad[i] * c.grad_scale;
    if (c.has_weight_decay) g = std::fma(c.weight_decay, p, g);
    const float s = std::fma(g, g, sum[i]);
    const float denom = std::sqrt(s) + c.eps;
    const float np = p + (c.neg_clr * g) / denom;
    sum[i] = s;
    master[i] = np;
    store_half(half, half_kind, i, np);
  }
}

}  // namespace detail

void lion_step(const LionParams& params, float* master, const float* grad, float* m, std::size_t n,
               void* half, DType half_dtype, const AdamOptions& options) {
  run_step<detail::LionCoeffs>("lion_step", "m", detail::lion_coeffs(params), master, grad, m, n,
                               half, half_dtype, options, &detail::lion_kernel_scalar,
                               &detail::lion_kernel_avx2, &detail::lion_kernel_avx512);
}

void adagrad_step(const AdagradParams& params, float* master, const float* grad, float* sum,
                  std::size_t n, void* half, DType half_dtype, const AdamOptions& options) {
  run_step<detail::AdagradCoeffs>("adagrad_step", "sum", detail::adagrad_coeffs(params), master,
                                  grad, sum, n, half, half_dtype, options,
                                  &detail::adagrad_kernel_scalar, &detail::adagrad_kernel_avx2,
                                  &detail::adagrad_kernel_avx512);
}

}  // namespace tiermem
