// src/cpu/quantize_avx512.cc — the AVX-512 (F + BW + VL) int8 dequantize kernel: per group of
// 128 codes, 16 lanes at a time sign-extended to int32, converted to fp32 (exact) and multiplied by
// the group's scale (the scalar twin's one multiply, so the same bits); a masked tail. Compiled
// with -mavx512f -mavx512bw -mavx512vl (src/cpu/quantize.cmake), called only when cpuid says the
// CPU has them (src/cpu/quantize.cc).
#include <immintrin.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "tiermem/quantize.h"

namespace tiermem::detail {

void dequantize_int8_avx512(const std::int8_t* codes, const float* scales, std::size_t n, float* dst) {
  constexpr std::size_t G = kInt8GroupElems;
  for (std::size_t g0 = 0; g0 < n; g0 += G) {
    const __m512 s = _mm512_set1_ps(scales[g0 / G]);
    const std::size_t g1 = std::min(n, g0 + G);
    std::size_t i = g0;
    for (; i + 16 <= g1; i += 16) {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i));
      _mm512_storeu_ps(dst + i, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), s));
    }
    if (i < g1) {
      const __mmask16 k = static_cast<__mmask16>((1u << (g1 - i)) - 1u);
      const __m128i q = _mm_maskz_loadu_epi8(k, codes + i);
      _mm512_mask_storeu_ps(dst + i, k, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), s));
    }
  }
}

}  // namespace tiermem::detail
