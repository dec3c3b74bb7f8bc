// src/cpu/adam_avx2.cc — the AVX2 + FMA + F16C AdamW kernel. Compiled with -mavx2 -mfma -mf16c
// (src/cpu/adam.cmake) and called only when cpuid says the CPU has them (src/cpu/adam.cc).
// 8 lanes per iteration; the tail (< 8 elements) goes through the scalar kernel.
#include <immintrin.h>

#include "tiermem/adam.h"

namespace tiermem::detail {
namespace {

// 8 fp32 -> 8 bf16, round to nearest even; NaN -> quiet NaN (same bits as f32_to_bf16).
inline __m128i to_bf16(__m256 p) {
  const __m256i u = _mm256_castps_si256(p);
  const __m256i abs = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  const __m256i is_nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f800000));
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  const __m256i r = _mm256_blendv_epi8(rounded, quiet, is_nan);
  // packus works per 128-bit lane: [r0..r3 r0..r3 | r4..r7 r4..r7]; gather lanes 0 and 2.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  return _mm256_castsi256_si128(packed);
}

}  // namespace

void adam_kernel_avx2(const AdamCoeffs& c, float* master, const float* grad, float* m, float* v,
                      std::size_t n, std::uint16_t* half, int half_kind) {
  const __m256 b1 = _mm256_set1_ps(c.beta1), omb1 = _mm256_set1_ps(c.one_minus_beta1);
  const __m256 b2 = _mm256_set1_ps(c.beta2), omb2 = _mm256_set1_ps(c.one_minus_beta2);
  const __m256 step = _mm256_set1_ps(c.step_size), inv = _mm256_set1_ps(c.inv_sqrt_bc2);
  const __m256 eps = _mm256_set1_ps(c.eps), decay = _mm256_set1_ps(c.decay);
  const __m256 gs = _mm256_set1_ps(c.grad_scale);
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 g = _mm256_mul_ps(_mm256_loadu_ps(grad + i), gs);
    __m256 mi = _mm256_fmadd_ps(b1, _mm256_loadu_ps(m + i), _mm256_mul_ps(omb1, g));
    __m256 vi = _mm256_fmadd_ps(b2, _mm256_loadu_ps(v + i), _mm256_mul_ps(omb2, _mm256_mul_ps(g, g)));
    __m256 denom = _mm256_fmadd_ps(_mm256_sqrt_ps(vi), inv, eps);
    __m256 p = _mm256_fnmadd_ps(step, _mm256_div_ps(mi, denom),
                                _mm256_mul_ps(_mm256_loadu_ps(master + i), decay));
    _mm256_storeu_ps(m + i, mi);
    _mm256_storeu_ps(v + i, vi);
    _mm256_storeu_ps(master + i, p);
    if (half_kind == 1) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(half + i), to_bf16(p));
    } else if (half_kind == 2) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(half + i), _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT));
    }
  }
  if (i < n) {
    adam_kernel_scalar(c, master + i, grad + i, m + i, v + i, n - i, half ? half + i : nullptr, half_kind);
  }
}

}  // namespace tiermem::detail
