// src/cpu/cast_avx512.cc — the AVX-512 (F + BW + VL) cast kernels. Compiled with -mavx512f
// -mavx512bw -mavx512vl (src/cpu/cast.cmake) and called only when cpuid says the CPU has them
// (src/cpu/cast.cc). A masked head brings the destination to a 64-byte boundary (so no store
// splits a cache line), then 32 elements per iteration (two 16-lane vectors) with plain loads and
// stores (masked stores are slow on some cores, AMD Zen 4), then the tail (< 32) 16 at a time
// with masks: every element takes the vector path and nothing past the buffers is touched.
// fp16: vcvtps2ph with an immediate round-to-nearest-even (MXCSR is not consulted) and vcvtph2ps;
// bf16: integer arithmetic, the same steps as f32_to_bf16 in tiermem/dtype.h (not
// vcvtneps2bf16, which flushes fp32 subnormal inputs to zero).
#include <immintrin.h>

#include <cstdint>

#include "tiermem/cast.h"
#include "cpu/simd_bf16.h"

namespace tiermem::detail {
namespace {

inline __m256i narrow_bf16(__m512 x) { return bf16_round_avx512(x); }
inline __m256i narrow_f16(__m512 x) { return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT); }
inline __m512 widen_bf16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 widen_f16(__m256i h) { return _mm512_cvtph_ps(h); }

// Elements before `dst` reaches a 64-byte boundary (at most n): the main loop's stores then never
// split a cache line.
template <typename T>
std::size_t head_elems(const T* dst, std::size_t n) {
  const auto a = reinterpret_cast<std::uintptr_t>(dst);
  if (a % sizeof(T) != 0) return 0;
  const std::size_t h = (64 - a % 64) % 64 / sizeof(T);
  return h < n ? h : n;
}

template <__m256i (*Narrow)(__m512)>
void narrow_masked(const float* src, std::uint16_t* dst, std::size_t n) {
  for (std::size_t i = 0; i < n; i += 16) {
    const std::size_t len = n - i < 16 ? n - i : 16;
    const __mmask16 mask = static_cast<__mmask16>((1u << len) - 1u);
    _mm256_mask_storeu_epi16(dst + i, mask, Narrow(_mm512_maskz_loadu_ps(mask, src + i)));
  }
}

template <__m256i (*Narrow)(__m512)>
void narrow(const float* src, std::uint16_t* dst, std::size_t n) {
  const std::size_t head = head_elems(dst, n);
  narrow_masked<Narrow>(src, dst, head);
  std::size_t i = head;
  for (; i + 32 <= n; i += 32) {
    const __m256i h0 = Narrow(_mm512_loadu_ps(src + i));
    const __m256i h1 = Narrow(_mm512_loadu_ps(src + i + 16));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), h0);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i + 16), h1);
  }
  narrow_masked<Narrow>(src + i, dst + i, n - i);
}

template <__m512 (*Widen)(__m256i)>
void widen_masked(const std::uint16_t* src, float* dst, std::size_t n) {
  for (std::size_t i = 0; i < n; i += 16) {
    const std::size_t len = n - i < 16 ? n - i : 16;
    const __mmask16 mask = static_cast<__mmask16>((1u << len) - 1u);
    _mm512_mask_storeu_ps(dst + i, mask, Widen(_mm256_maskz_loadu_epi16(mask, src + i)));
  }
}

template <__m512 (*Widen)(__m256i)>
void widen(const std::uint16_t* src, float* dst, std::size_t n) {
  const std::size_t head = head_elems(dst, n);
  widen_masked<Widen>(src, dst, head);
  std::size_t i = head;
  for (; i + 32 <= n; i += 32) {
    const __m512 f0 = Widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
    const __m512 f1 = Widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 16)));
    _mm512_storeu_ps(dst + i, f0);
    _mm512_storeu_ps(dst + i + 16, f1);
  }
  widen_masked<Widen>(src + i, dst + i, n - i);
}

}  // namespace

const CastKernels kCastAvx512 = {narrow<narrow_bf16>, narrow<narrow_f16>, widen<widen_bf16>,
                                 widen<widen_f16>};

}  // namespace tiermem::detail
