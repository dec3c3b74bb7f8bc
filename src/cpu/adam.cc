// src/cpu/adam.cc — AdamW dispatch (run-time ISA choice), threading over chunks, and the scalar
// kernel (the obvious twin the vector kernels are tested against). See include/tiermem/adam.h.
#include "tiermem/adam.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "tiermem/env.h"
#include "tiermem/error.h"
#include "tiermem/log.h"
#include "cpu/step_dispatch.h"

namespace tiermem {
namespace {

bool cpu_has_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}
bool cpu_has_avx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && cpu_has_avx2();
}

AdamIsa detect_best() {
  AdamIsa best = cpu_has_avx512() ? AdamIsa::kAvx512 : cpu_has_avx2() ? AdamIsa::kAvx2 : AdamIsa::kScalar;
  if (auto want = env_param("TIERMEM_ADAM_ISA")) {
    AdamIsa w = best;
    if (*want == "scalar") w = AdamIsa::kScalar;
    else if (*want == "avx2") w = AdamIsa::kAvx2;
    else if (*want == "avx512") w = AdamIsa::kAvx512;
    else TM_LOG_WARN("CPU", "TIERMEM_ADAM_ISA={} is not scalar|avx2|avx512; using {}", *want, adam_isa_name(best));
    if (w != best) {
      if (adam_isa_supported(w)) best = w;
      else TM_LOG_WARN("CPU", "TIERMEM_ADAM_ISA={} is not supported by this CPU; using {}", *want, adam_isa_name(best));
    }
  }
  return best;
}

}  // namespace

std::string_view adam_isa_name(AdamIsa isa) {
  switch (isa) {
    case AdamIsa::kAuto: return "auto";
    case AdamIsa::kScalar: return "scalar";
    case AdamIsa::kAvx2: return "avx2";
    case AdamIsa::kAvx512: return "avx512";
  }
  return "?";
}

bool adam_isa_supported(AdamIsa isa) {
  switch (isa) {
    case AdamIsa::kAuto:
    case AdamIsa::kScalar: return true;
    case AdamIsa::kAvx2: return cpu_has_avx2();
    case AdamIsa::kAvx512: return cpu_has_avx512();
  }
  return false;
}

AdamIsa adam_best_isa() {
  static const AdamIsa best = detect_best();
  return best;
}

namespace detail {

void adam_kernel_scalar(const AdamCoeffs& c, float* master, const float* grad, float* m, float* v,
                        std::size_t n, std::uint16_t* half, int half_kind) {
  for (std::size_t i = 0; i < n; ++i) {
    float g = grad[i] * c.grad_scale;
    float mi = c.beta1 * m[i] + c.one_minus_beta1 * g;
    float vi = c.beta2 * v[i] + c.one_minus_beta2 * (g * g);
    float denom = std::sqrt(vi) * c.inv_sqrt_bc2 + c.eps;
    float p = master[i] * c.decay - c.step_size * (mi / denom);
    m[i] = mi;
    v[i] = vi;
    master[i] = p;
    if (half_kind == 1) half[i] = f32_to_bf16(p);
    else if (half_kind == 2) half[i] = f32_to_f16(p);
  }
}

}  // namespace detail

void adam_step(const AdamParams& params, float* master, const float* grad, float* m, float* v,
               std::size_t n, void* half, DType half_dtype, const AdamOptions& options) {
  const detail::MasterCopy copy = detail::master_copy(half, half_dtype, "adam_step");
  const AdamIsa isa = detail::checked_isa(options, "adam_step");
  auto kernel = isa == AdamIsa::kAvx512 ? &detail::adam_kernel_avx512
                : isa == AdamIsa::kAvx2 ? &detail::adam_kernel_avx2
                                        : &detail::adam_kernel_scalar;
  const detail::AdamCoeffs c = detail::adam_coeffs(params);
  detail::for_step_chunks(n, options, copy, master, [&](std::size_t b, std::size_t len) {
    kernel(c, master + b, grad + b, m + b, v + b, len, copy.half ? copy.half + b : nullptr, copy.half_kind);
  });
}

std::size_t count_nonfinite(const float* x, std::size_t n) {
  std::size_t bad = 0;
#pragma omp parallel for reduction(+ : bad) schedule(static) if (n > (1u << 18))
  for (std::size_t i = 0; i < n; ++i) {
    std::uint32_t u = f32_bits(x[i]);
    bad += (u & 0x7f800000u) == 0x7f800000u;
  }
  return bad;
}

}  // namespace tiermem
