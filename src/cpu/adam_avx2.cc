// src/cpu/adam_avx2.cc — the AVX2 + FMA + F16C AdamW kernel. Compiled with -mavx2 -mfma -mf16c
// (src/cpu/adam.cmake) and called only when cpuid says the CPU has them (src/cpu/adam.cc).
// 16 elements per iteration in two independent 8-lane chains; the bf16/fp16 copy is streamed
// (non-temporal stores: nothing reads it back in this pass) once its address is 16-byte aligned,
// with an sfence at the end. The head that aligns the copy and the tail (< 16 elements) go
// through the same vector arithmetic on a small stack copy, so every element gets the same bits
// whatever its position, with or without the copy.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "tiermem/adam.h"
#include "cpu/simd_bf16.h"

namespace tiermem::detail {
namespace {


struct Consts {
  __m256 b1, omb1, b2, omb2, step, inv, eps, decay, gs;
  explicit Consts(const AdamCoeffs& c)
      : b1(_mm256_set1_ps(c.beta1)), omb1(_mm256_set1_ps(c.one_minus_beta1)),
        b2(_mm256_set1_ps(c.beta2)), omb2(_mm256_set1_ps(c.one_minus_beta2)),
        step(_mm256_set1_ps(c.step_size)), inv(_mm256_set1_ps(c.inv_sqrt_bc2)),
        eps(_mm256_set1_ps(c.eps)), decay(_mm256_set1_ps(c.decay)), gs(_mm256_set1_ps(c.grad_scale)) {}
};

inline __m256 update(const Consts& k, __m256 p, __m256 g, __m256& m, __m256& v) {
  g = _mm256_mul_ps(g, k.gs);
  m = _mm256_fmadd_ps(k.b1, m, _mm256_mul_ps(k.omb1, g));
  v = _mm256_fmadd_ps(k.b2, v, _mm256_mul_ps(k.omb2, _mm256_mul_ps(g, g)));
  const __m256 denom = _mm256_fmadd_ps(_mm256_sqrt_ps(v), k.inv, k.eps);
  return _mm256_fnmadd_ps(k.step, _mm256_div_ps(m, denom), _mm256_mul_ps(p, k.decay));
}

inline __m128i to_half(__m256 p, int half_kind) {
  return half_kind == 1 ? bf16_round_avx2(p) : _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT);
}

// Up to 8 elements through a stack copy (same arithmetic as the main loop).
void short_step(const Consts& k, float* master, const float* grad, float* m, float* v,
                std::size_t len, std::uint16_t* half, int half_kind) {
  alignas(32) float p[8] = {}, g[8] = {}, mm[8] = {}, vv[8] = {};
  alignas(16) std::uint16_t h[8];
  const std::size_t b = len * sizeof(float);
  std::memcpy(p, master, b);
  std::memcpy(g, grad, b);
  std::memcpy(mm, m, b);
  std::memcpy(vv, v, b);
  __m256 mi = _mm256_load_ps(mm), vi = _mm256_load_ps(vv);
  const __m256 np = update(k, _mm256_load_ps(p), _mm256_load_ps(g), mi, vi);
  _mm256_store_ps(p, np);
  _mm256_store_ps(mm, mi);
  _mm256_store_ps(vv, vi);
  std::memcpy(master, p, b);
  std::memcpy(m, mm, b);
  std::memcpy(v, vv, b);
  if (half_kind != 0) {
    _mm_store_si128(reinterpret_cast<__m128i*>(h), to_half(np, half_kind));
    std::memcpy(half, h, len * sizeof(std::uint16_t));
  }
}

template <int kHalfKind, bool kStream>
std::size_t main_loop(const Consts& k, float* master, const float* grad, float* m, float* v,
                      std::size_t n, std::uint16_t* half) {
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256 m0 = _mm256_loadu_ps(m + i), m1 = _mm256_loadu_ps(m + i + 8);
    __m256 v0 = _mm256_loadu_ps(v + i), v1 = _mm256_loadu_ps(v + i + 8);
    const __m256 p0 = update(k, _mm256_loadu_ps(master + i), _mm256_loadu_ps(grad + i), m0, v0);
    const __m256 p1 = update(k, _mm256_loadu_ps(master + i + 8), _mm256_loadu_ps(grad + i + 8), m1, v1);
    _mm256_storeu_ps(m + i, m0);
    _mm256_storeu_ps(m + i + 8, m1);
    _mm256_storeu_ps(v + i, v0);
    _mm256_storeu_ps(v + i + 8, v1);
    _mm256_storeu_ps(master + i, p0);
    _mm256_storeu_ps(master + i + 8, p1);
    if constexpr (kHalfKind != 0) {
      auto* dst = reinterpret_cast<__m128i*>(half + i);
      const __m128i h0 = to_half(p0, kHalfKind), h1 = to_half(p1, kHalfKind);
      if constexpr (kStream) {
        _mm_stream_si128(dst, h0);
        _mm_stream_si128(dst + 1, h1);
      } else {
        _mm_storeu_si128(dst, h0);
        _mm_storeu_si128(dst + 1, h1);
      }
    }
  }
  return i;
}

}  // namespace

void adam_kernel_avx2(const AdamCoeffs& c, float* master, const float* grad, float* m, float* v,
                      std::size_t n, std::uint16_t* half, int half_kind) {
  const Consts k(c);
  if (half == nullptr) half_kind = 0;
  std::size_t i = 0;
  bool stream = false;
  if (half_kind != 0 && reinterpret_cast<std::uintptr_t>(half) % 2 == 0) {
    const std::size_t mis = reinterpret_cast<std::uintptr_t>(half) % 16;
    const std::size_t head = mis == 0 ? 0 : (16 - mis) / 2;
    if (head < n) {
      if (head > 0) short_step(k, master, grad, m, v, head, half, half_kind);
      i = head;
      stream = true;
    }
  }
  float *pm = master + i, *mm = m + i, *vm = v + i;
  const float* gm = grad + i;
  std::uint16_t* hm = half_kind != 0 ? half + i : nullptr;
  const std::size_t rest = n - i;
  std::size_t done;
  if (half_kind == 0) done = main_loop<0, false>(k, pm, gm, mm, vm, rest, hm);
  else if (half_kind == 1) done = stream ? main_loop<1, true>(k, pm, gm, mm, vm, rest, hm)
                                         : main_loop<1, false>(k, pm, gm, mm, vm, rest, hm);
  else done = stream ? main_loop<2, true>(k, pm, gm, mm, vm, rest, hm)
                     : main_loop<2, false>(k, pm, gm, mm, vm, rest, hm);
  if (stream) _mm_sfence();
  for (std::size_t j = done; j < rest; j += 8) {
    const std::size_t len = rest - j < 8 ? rest - j : 8;
    short_step(k, pm + j, gm + j, mm + j, vm + j, len, hm ? hm + j : nullptr, half_kind);
  }
}

}  // namespace tiermem::detail
