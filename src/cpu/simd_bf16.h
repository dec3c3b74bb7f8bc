// src/cpu/simd_bf16.h — fp32 -> bf16 rounding in vector registers, shared by the AdamW kernels'
// fused copy (adam_avx2.cc, adam_avx512.cc) and the bulk casts (cast_avx2.cc, cast_avx512.cc).
// Round to nearest even as tiermem::f32_to_bf16 (tiermem/dtype.h) does, bit for bit: add 0x7fff
// plus the kept LSB and keep the high half; NaN -> (bits >> 16) | 0x40 (quiet, sign and top
// payload bits kept). Integer arithmetic, not vcvtneps2bf16 (which flushes fp32 subnormal inputs
// to zero). Include only from a file compiled with the matching ISA flags (src/cpu/*.cmake): each
// function is declared for one ISA and has internal linkage, so no copy built with other flags
// can be linked in its place.
#pragma once

#include <immintrin.h>

namespace tiermem::detail {

#if defined(__AVX2__)
// 8 fp32 -> 8 bf16.
static inline __m128i bf16_round_avx2(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i hi = _mm256_srli_epi32(u, 16);
  const __m256i abs = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  const __m256i is_nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f800000));
  const __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i quiet = _mm256_or_si256(hi, _mm256_set1_epi32(0x40));
  const __m256i r = _mm256_blendv_epi8(rounded, quiet, is_nan);
  // packus works per 128-bit lane: [r0..r3 r0..r3 | r4..r7 r4..r7]; keep 64-bit lanes 0 and 2.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  return _mm256_castsi256_si128(packed);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
// 16 fp32 -> 16 bf16.
static inline __m256i bf16_round_avx512(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i hi = _mm512_srli_epi32(u, 16);
  const __m512i abs = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
  const __mmask16 is_nan = _mm512_cmpgt_epi32_mask(abs, _mm512_set1_epi32(0x7f800000));
  const __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
  __m512i r =
      _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  r = _mm512_mask_or_epi32(r, is_nan, hi, _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(r);
}
#endif

}  // namespace tiermem::detail
