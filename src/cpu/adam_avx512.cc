// src/cpu/adam_avx512.cc — the AVX-512 (F + BW + VL) AdamW kernel. Compiled with -mavx512f -mavx512bw -mavx512vl
// (src/cpu/adam.cmake) and called only when cpuid says the CPU has them (src/cpu/adam.cc).
// 16 lanes per iteration; the tail uses masked loads/stores (no scalar loop).
#include <immintrin.h>

#include "tiermem/adam.h"

namespace tiermem::detail {
namespace {

// 16 fp32 -> 16 bf16, round to nearest even; NaN -> quiet NaN (same bits as f32_to_bf16).
inline __m256i to_bf16(__m512 p) {
  const __m512i u = _mm512_castps_si512(p);
  const __m512i abs = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
  const __mmask16 is_nan = _mm512_cmpgt_epi32_mask(abs, _mm512_set1_epi32(0x7f800000));
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  r = _mm512_mask_or_epi32(r, is_nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(r);
}

}  // namespace

void adam_kernel_avx512(const AdamCoeffs& c, float* master, const float* grad, float* m, float* v,
                        std::size_t n, std::uint16_t* half, int half_kind) {
  const __m512 b1 = _mm512_set1_ps(c.beta1), omb1 = _mm512_set1_ps(c.one_minus_beta1);
  const __m512 b2 = _mm512_set1_ps(c.beta2), omb2 = _mm512_set1_ps(c.one_minus_beta2);
  const __m512 step = _mm512_set1_ps(c.step_size), inv = _mm512_set1_ps(c.inv_sqrt_bc2);
  const __m512 eps = _mm512_set1_ps(c.eps), decay = _mm512_set1_ps(c.decay);
  const __m512 gs = _mm512_set1_ps(c.grad_scale);
  for (std::size_t i = 0; i < n; i += 16) {
    const std::size_t left = n - i;
    const __mmask16 k = left >= 16 ? static_cast<__mmask16>(0xffff)
                                   : static_cast<__mmask16>((1u << left) - 1u);
    __m512 g = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, grad + i), gs);
    __m512 mi = _mm512_fmadd_ps(b1, _mm512_maskz_loadu_ps(k, m + i), _mm512_mul_ps(omb1, g));
    __m512 vi = _mm512_fmadd_ps(b2, _mm512_maskz_loadu_ps(k, v + i), _mm512_mul_ps(omb2, _mm512_mul_ps(g, g)));
    __m512 denom = _mm512_fmadd_ps(_mm512_sqrt_ps(vi), inv, eps);
    __m512 p = _mm512_fnmadd_ps(step, _mm512_div_ps(mi, denom),
                                _mm512_mul_ps(_mm512_maskz_loadu_ps(k, master + i), decay));
    _mm512_mask_storeu_ps(m + i, k, mi);
    _mm512_mask_storeu_ps(v + i, k, vi);
    _mm512_mask_storeu_ps(master + i, k, p);
    if (half_kind == 1) {
      _mm256_mask_storeu_epi16(half + i, k, to_bf16(p));
    } else if (half_kind == 2) {
      _mm256_mask_storeu_epi16(half + i, k, _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT));
    }
  }
}

}  // namespace tiermem::detail
