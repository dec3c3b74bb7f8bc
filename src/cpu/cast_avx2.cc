// src/cpu/cast_avx2.cc — the AVX2 + F16C cast kernels. Compiled with -mavx2 -mf16c
// (src/cpu/cast.cmake) and called only when cpuid says the CPU has them (src/cpu/cast.cc).
// 16 elements per iteration (two 8-lane vectors); the tail (< 16) goes 8 at a time through the
// same vector code on a small zero-padded stack copy, so every element takes the vector path.
// fp16: vcvtps2ph with an immediate round-to-nearest-even (MXCSR is not consulted) and vcvtph2ps;
// bf16: integer arithmetic, the same steps as f32_to_bf16 in tiermem/dtype.h.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "tiermem/cast.h"
#include "cpu/simd_bf16.h"

namespace tiermem::detail {
namespace {

inline __m128i narrow_bf16(__m256 x) { return bf16_round_avx2(x); }
inline __m128i narrow_f16(__m256 x) { return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT); }
inline __m256 widen_bf16(__m128i h) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 widen_f16(__m128i h) { return _mm256_cvtph_ps(h); }

template <__m128i (*Narrow)(__m256)>
void narrow(const float* src, std::uint16_t* dst, std::size_t n) {
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m128i h0 = Narrow(_mm256_loadu_ps(src + i));
    const __m128i h1 = Narrow(_mm256_loadu_ps(src + i + 8));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h0);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i + 8), h1);
  }
  for (; i < n; i += 8) {
    const std::size_t len = n - i < 8 ? n - i : 8;
    alignas(32) float in[8] = {};
    alignas(16) std::uint16_t out[8];
    std::memcpy(in, src + i, len * sizeof(float));
    _mm_store_si128(reinterpret_cast<__m128i*>(out), Narrow(_mm256_load_ps(in)));
    std::memcpy(dst + i, out, len * sizeof(std::uint16_t));
  }
}

template <__m256 (*Widen)(__m128i)>
void widen(const std::uint16_t* src, float* dst, std::size_t n) {
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 f0 = Widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    const __m256 f1 = Widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 8)));
    _mm256_storeu_ps(dst + i, f0);
    _mm256_storeu_ps(dst + i + 8, f1);
  }
  for (; i < n; i += 8) {
    const std::size_t len = n - i < 8 ? n - i : 8;
    alignas(16) std::uint16_t in[8] = {};
    alignas(32) float out[8];
    std::memcpy(in, src + i, len * sizeof(std::uint16_t));
    _mm256_store_ps(out, Widen(_mm_load_si128(reinterpret_cast<const __m128i*>(in))));
    std::memcpy(dst + i, out, len * sizeof(float));
  }
}

}  // namespace

const CastKernels kCastAvx2 = {narrow<narrow_bf16>, narrow<narrow_f16>, widen<widen_bf16>,
                               widen<widen_f16>};

}  // namespace tiermem::detail
