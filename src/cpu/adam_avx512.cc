// src/cpu/adam_avx512.cc — the AVX-512 (F + BW + VL) AdamW kernel. Compiled with -mavx512f -mavx512bw -mavx512vl
// (src/cpu/adam.cmake) and called only when cpuid says the CPU has them (src/cpu/adam.cc).
//
// Where the time goes (memory-bound: 16 bytes read + 12 written per element, + 2 for the copy):
//   - the main loop does 64 elements per iteration with plain (unmasked) loads and stores; masked
//     stores are far slower than plain ones on some cores (AMD Zen 4), so masks are kept for the
//     tail only;
//   - four independent 16-lane chains per iteration keep the divider busy while loads are waited
//     on (measured: with the bf16 copy 1230 -> 1359 and, in a second run, 1229 -> 1264 Mparam/s on
//     2 threads of an Intel Xeon against two chains, without it 1533 -> 1550; 64 M params, 9
//     interleaved reps, medians; docs/notes/2026-11-30-adam-kernels-against-deepspeed.md);
//   - the bf16/fp16 copy is written with streaming (non-temporal) stores once its address is
//     32-byte aligned: nothing reads it back in this pass, so it skips the read-for-ownership that
//     a normal store of a new line costs (2 bytes per element less traffic) and does not evict
//     the state; an sfence at the end orders them before the caller sees the step as done.
//   master, m and v are read first, so their lines are in cache when written: normal stores.
#include <immintrin.h>

#include <cstdint>

#include "tiermem/adam.h"
#include "cpu/simd_bf16.h"

namespace tiermem::detail {
namespace {


struct Consts {
  __m512 b1, omb1, b2, omb2, step, inv, eps, decay, gs;
  explicit Consts(const AdamCoeffs& c)
      : b1(_mm512_set1_ps(c.beta1)), omb1(_mm512_set1_ps(c.one_minus_beta1)),
        b2(_mm512_set1_ps(c.beta2)), omb2(_mm512_set1_ps(c.one_minus_beta2)),
        step(_mm512_set1_ps(c.step_size)), inv(_mm512_set1_ps(c.inv_sqrt_bc2)),
        eps(_mm512_set1_ps(c.eps)), decay(_mm512_set1_ps(c.decay)), gs(_mm512_set1_ps(c.grad_scale)) {}
};

// The update of 16 lanes from loaded values; returns the new master, writes the new m and v.
inline __m512 update(const Consts& k, __m512 p, __m512 g, __m512& m, __m512& v) {
  g = _mm512_mul_ps(g, k.gs);
  m = _mm512_fmadd_ps(k.b1, m, _mm512_mul_ps(k.omb1, g));
  v = _mm512_fmadd_ps(k.b2, v, _mm512_mul_ps(k.omb2, _mm512_mul_ps(g, g)));
  const __m512 denom = _mm512_fmadd_ps(_mm512_sqrt_ps(v), k.inv, k.eps);
  return _mm512_fnmadd_ps(k.step, _mm512_div_ps(m, denom), _mm512_mul_ps(p, k.decay));
}

inline __m256i to_half(__m512 p, int half_kind) {
  return half_kind == 1 ? bf16_round_avx512(p) : _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT);
}

// Up to 16 elements with masks (the head that aligns the copy, and the tail).
inline void masked_step(const Consts& k, float* master, const float* grad, float* m, float* v,
                        std::size_t len, std::uint16_t* half, int half_kind) {
  const __mmask16 mask = static_cast<__mmask16>((1u << len) - 1u);
  __m512 mi = _mm512_maskz_loadu_ps(mask, m), vi = _mm512_maskz_loadu_ps(mask, v);
  const __m512 p = update(k, _mm512_maskz_loadu_ps(mask, master), _mm512_maskz_loadu_ps(mask, grad), mi, vi);
  _mm512_mask_storeu_ps(m, mask, mi);
  _mm512_mask_storeu_ps(v, mask, vi);
  _mm512_mask_storeu_ps(master, mask, p);
  if (half_kind != 0) _mm256_mask_storeu_epi16(half, mask, to_half(p, half_kind));
}

// The main loop: 64 elements per iteration, plain loads and stores; the copy streamed when
// kStream (half + i is then 32-byte aligned for every i the loop visits).
template <int kHalfKind, bool kStream>
std::size_t main_loop(const Consts& k, float* master, const float* grad, float* m, float* v,
                      std::size_t n, std::uint16_t* half) {
  std::size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    __m512 mm[4], vv[4], pp[4];
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) {
      mm[u] = _mm512_loadu_ps(m + i + 16 * u);
      vv[u] = _mm512_loadu_ps(v + i + 16 * u);
      pp[u] = update(k, _mm512_loadu_ps(master + i + 16 * u), _mm512_loadu_ps(grad + i + 16 * u), mm[u], vv[u]);
    }
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) {
      _mm512_storeu_ps(m + i + 16 * u, mm[u]);
      _mm512_storeu_ps(v + i + 16 * u, vv[u]);
      _mm512_storeu_ps(master + i + 16 * u, pp[u]);
      if constexpr (kHalfKind != 0) {
        auto* dst = reinterpret_cast<__m256i*>(half + i + 16 * u);
        if constexpr (kStream) _mm256_stream_si256(dst, to_half(pp[u], kHalfKind));
        else _mm256_storeu_si256(dst, to_half(pp[u], kHalfKind));
      }
    }
  }
  return i;
}

}  // namespace

void adam_kernel_avx512(const AdamCoeffs& c, float* master, const float* grad, float* m, float* v,
                        std::size_t n, std::uint16_t* half, int half_kind) {
  const Consts k(c);
  if (half == nullptr) half_kind = 0;
  std::size_t i = 0;
  // Peel up to 15 elements so that the copy's address is 32-byte aligned (when it can be: an even
  // address), then stream it.
  bool stream = false;
  if (half_kind != 0 && reinterpret_cast<std::uintptr_t>(half) % 2 == 0) {
    const std::size_t mis = reinterpret_cast<std::uintptr_t>(half) % 32;
    const std::size_t head = mis == 0 ? 0 : (32 - mis) / 2;
    if (head < n) {
      if (head > 0) masked_step(k, master, grad, m, v, head, half, half_kind);
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
  for (std::size_t j = done; j < rest; j += 16) {
    const std::size_t len = rest - j < 16 ? rest - j : 16;
    masked_step(k, pm + j, gm + j, mm + j, vm + j, len, hm ? hm + j : nullptr, half_kind);
  }
}

}  // namespace tiermem::detail
