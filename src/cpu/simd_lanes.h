// src/cpu/simd_lanes.h — the vector operations of one ISA that the CPU kernel drivers
// (adam_driver.h, cast_driver.h, optim_kernels_driver.h) are written over, so each driver is one
// template on lane width:
//   Avx2Lanes     8 fp32 lanes (__m256), 8 16-bit lanes (__m128i); AVX2 + F16C (+ FMA for fmadd)
//   Avx512Lanes  16 fp32 lanes (__m512), 16 16-bit lanes (__m256i); AVX-512 F + BW + VL
// Each has: load/store (unaligned) of a whole vector of fp32 (F) or 16-bit (H) values, their
// partial forms over len < kLanes elements (load_part fills the other lanes with 0; store_part
// writes only len elements and nothing past them), a streaming (non-temporal) store of H, the
// arithmetic AdamW, Lion and Adagrad need (optim_kernels_driver.h: add, sub and Lion's
// lr * sign(c) as sign_step), and the conversions fp32 <-> bf16/fp16 (bf16 by simd_bf16.h's integer
// rounding; fp16 by vcvtps2ph with an immediate round-to-nearest-even, MXCSR not consulted).
// Partial forms: AVX2 goes through a zero-padded stack copy, AVX-512 through masks; the lanes of
// an element compute the same bits either way.
//
// Include only from a file compiled with the matching ISA flags (src/cpu/adam.cmake, cast.cmake,
// optim_kernels.cmake):
// each struct is defined only when its ISA is enabled and lives in an unnamed namespace, so a copy
// built with other flags cannot be linked in its place. Everything is static and stateless.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "cpu/simd_bf16.h"

namespace tiermem::detail {
namespace {

#if defined(__AVX2__) && defined(__F16C__)
struct Avx2Lanes {
  static constexpr std::size_t kLanes = 8;
  using F = __m256;
  using H = __m128i;
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static H load_h(const std::uint16_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
  static void store_h(std::uint16_t* p, H x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), x); }
  static void stream_h(std::uint16_t* p, H x) { _mm_stream_si128(reinterpret_cast<__m128i*>(p), x); }
  static F load_part(const float* p, std::size_t len) {
    alignas(32) float t[kLanes] = {};
    std::memcpy(t, p, len * sizeof(float));
    return _mm256_load_ps(t);
  }
  static void store_part(float* p, F x, std::size_t len) {
    alignas(32) float t[kLanes];
    _mm256_store_ps(t, x);
    std::memcpy(p, t, len * sizeof(float));
  }
  static H load_h_part(const std::uint16_t* p, std::size_t len) {
    alignas(16) std::uint16_t t[kLanes] = {};
    std::memcpy(t, p, len * sizeof(std::uint16_t));
    return _mm_load_si128(reinterpret_cast<const __m128i*>(t));
  }
  static void store_h_part(std::uint16_t* p, H x, std::size_t len) {
    alignas(16) std::uint16_t t[kLanes];
    _mm_store_si128(reinterpret_cast<__m128i*>(t), x);
    std::memcpy(p, t, len * sizeof(std::uint16_t));
  }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  // mag with c's sign bit xor-ed in where c is neither zero nor NaN, else +0 (Lion's lr * sign(c)).
  static F sign_step(F mag, F c) {
    const F nonzero = _mm256_cmp_ps(c, _mm256_setzero_ps(), _CMP_NEQ_OQ);
    return _mm256_and_ps(nonzero, _mm256_xor_ps(mag, _mm256_and_ps(c, _mm256_set1_ps(-0.0f))));
  }
#if defined(__FMA__)  // AdamW's files have it; the casts' (-mavx2 -mf16c) need none
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }    // a * b + c
  static F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }  // c - a * b
#endif
  static H to_bf16(F x) { return bf16_round_avx2(x); }
  static H to_f16(F x) { return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT); }
  static F from_bf16(H h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
  static F from_f16(H h) { return _mm256_cvtph_ps(h); }
};
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
struct Avx512Lanes {
  static constexpr std::size_t kLanes = 16;
  using F = __m512;
  using H = __m256i;
  static __mmask16 mask(std::size_t len) { return static_cast<__mmask16>((1u << len) - 1u); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static H load_h(const std::uint16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static void store_h(std::uint16_t* p, H x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), x); }
  static void stream_h(std::uint16_t* p, H x) { _mm256_stream_si256(reinterpret_cast<__m256i*>(p), x); }
  static F load_part(const float* p, std::size_t len) { return _mm512_maskz_loadu_ps(mask(len), p); }
  static void store_part(float* p, F x, std::size_t len) { _mm512_mask_storeu_ps(p, mask(len), x); }
  static H load_h_part(const std::uint16_t* p, std::size_t len) { return _mm256_maskz_loadu_epi16(mask(len), p); }
  static void store_h_part(std::uint16_t* p, H x, std::size_t len) { _mm256_mask_storeu_epi16(p, mask(len), x); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F sqrt(F a) { return _mm512_sqrt_ps(a); }
  static F sign_step(F mag, F c) {  // as Avx2Lanes::sign_step
    const __mmask16 nonzero = _mm512_cmp_ps_mask(c, _mm512_setzero_ps(), _CMP_NEQ_OQ);
    const __m512i sign =
        _mm512_and_si512(_mm512_castps_si512(c), _mm512_set1_epi32(static_cast<int>(0x80000000u)));
    return _mm512_castsi512_ps(_mm512_maskz_xor_epi32(nonzero, _mm512_castps_si512(mag), sign));
  }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  static H to_bf16(F x) { return bf16_round_avx512(x); }
  static H to_f16(F x) { return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT); }
  static F from_bf16(H h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
  static F from_f16(H h) { return _mm512_cvtph_ps(h); }
};
#endif

}  // namespace
}  // namespace tiermem::detail
