// src/cpu/optim_kernels_avx2.cc — the AVX2 + FMA + F16C Lion and Adagrad kernels. Compiled with
// -mavx2 -mfma -mf16c -ffp-contract=off (src/cpu/optim_kernels.cmake) and called only when cpuid
// says the CPU has them (src/cpu/optim_kernels.cc).
// Each kernel is the scalar twin's arithmetic, operation for operation (vfmadd where the twin calls
// std::fma, nothing fused elsewhere), so the results are bit-identical to it. 16 elements per
// iteration in two independent 8-lane chains; the tail (< 16) goes 8 at a time through the same
// vector code on a zero-padded stack copy.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "cpu/simd_bf16.h"
#include "tiermem/optim_kernels.h"

namespace tiermem::detail {
namespace {

struct LionOp {
  __m256 b1, omb1, b2, omb2, decay, gs, lr, sign_bit;
  explicit LionOp(const LionCoeffs& c)
      : b1(_mm256_set1_ps(c.beta1)), omb1(_mm256_set1_ps(c.one_minus_beta1)),
        b2(_mm256_set1_ps(c.beta2)), omb2(_mm256_set1_ps(c.one_minus_beta2)),
        decay(_mm256_set1_ps(c.decay)), gs(_mm256_set1_ps(c.grad_scale)),
        lr(_mm256_set1_ps(c.lr)), sign_bit(_mm256_set1_ps(-0.0f)) {}
  // Returns the new master; m is updated in place.
  __m256 operator()(__m256 p, __m256 g, __m256& m) const {
    g = _mm256_mul_ps(g, gs);
    const __m256 c = _mm256_fmadd_ps(omb1, g, _mm256_mul_ps(b1, m));
    // lr * sign(c): lr with c's sign bit where c is neither zero nor NaN, else +0.
    const __m256 nonzero = _mm256_cmp_ps(c, _mm256_setzero_ps(), _CMP_NEQ_OQ);
    const __m256 step = _mm256_and_ps(nonzero, _mm256_xor_ps(lr, _mm256_and_ps(c, sign_bit)));
    m = _mm256_fmadd_ps(omb2, g, _mm256_mul_ps(b2, m));
    return _mm256_sub_ps(_mm256_mul_ps(p, decay), step);
  }
};

template <bool kWeightDecay>
struct AdagradOp {
  __m256 neg_clr, eps, wd, gs;
  explicit AdagradOp(const AdagradCoeffs& c)
      : neg_clr(_mm256_set1_ps(c.neg_clr)), eps(_mm256_set1_ps(c.eps)),
        wd(_mm256_set1_ps(c.weight_decay)), gs(_mm256_set1_ps(c.grad_scale)) {}
  // Returns the new master; sum is updated in place.
  __m256 operator()(__m256 p, __m256 g, __m256& sum) const {
    g = _mm256_mul_ps(g, gs);
    if constexpr (kWeightDecay) g = _mm256_fmadd_ps(wd, p, g);
    sum = _mm256_fmadd_ps(g, g, sum);
    const __m256 denom = _mm256_add_ps(_mm256_sqrt_ps(sum), eps);
    return _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(neg_clr, g), denom));
  }
};

template <int kHalfKind>
inline __m128i to_half(__m256 p) {
  if constexpr (kHalfKind == 1) return bf16_round_avx2(p);
  else return _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT);
}

template <class Op, int kHalfKind>
void loop(const Op& op, float* master, const float* grad, float* state, std::size_t n,
          std::uint16_t* half) {
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256 s0 = _mm256_loadu_ps(state + i), s1 = _mm256_loadu_ps(state + i + 8);
    const __m256 p0 = op(_mm256_loadu_ps(master + i), _mm256_loadu_ps(grad + i), s0);
    const __m256 p1 = op(_mm256_loadu_ps(master + i + 8), _mm256_loadu_ps(grad + i + 8), s1);
    _mm256_storeu_ps(state + i, s0);
    _mm256_storeu_ps(state + i + 8, s1);
    _mm256_storeu_ps(master + i, p0);
    _mm256_storeu_ps(master + i + 8, p1);
    if constexpr (kHalfKind != 0) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(half + i), to_half<kHalfKind>(p0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(half + i + 8), to_half<kHalfKind>(p1));
    }
  }
  for (; i < n; i += 8) {
    const std::size_t len = n - i < 8 ? n - i : 8;
    const std::size_t bytes = len * sizeof(float);
    alignas(32) float p[8] = {}, g[8] = {}, s[8] = {};
    alignas(16) std::uint16_t h[8];
    std::memcpy(p, master + i, bytes);
    std::memcpy(g, grad + i, bytes);
    std::memcpy(s, state + i, bytes);
    __m256 sv = _mm256_load_ps(s);
    const __m256 np = op(_mm256_load_ps(p), _mm256_load_ps(g), sv);
    _mm256_store_ps(p, np);
    _mm256_store_ps(s, sv);
    std::memcpy(master + i, p, bytes);
    std::memcpy(state + i, s, bytes);
    if constexpr (kHalfKind != 0) {
      _mm_store_si128(reinterpret_cast<__m128i*>(h), to_half<kHalfKind>(np));
      std::memcpy(half + i, h, len * sizeof(std::uint16_t));
    }
  }
}

template <class Op>
void run(const Op& op, float* master, const float* grad, float* state, std::size_t n,
         std::uint16_t* half, int half_kind) {
  if (half == nullptr) half_kind = 0;
  if (half_kind == 1) loop<Op, 1>(op, master, grad, state, n, half);
  else if (half_kind == 2) loop<Op, 2>(op, master, grad, state, n, half);
  else loop<Op, 0>(op, master, grad, state, n, half);
}

}  // namespace

void lion_kernel_avx2(const LionCoeffs& c, float* master, const float* grad, float* m,
                      std::size_t n, std::uint16_t* half, int half_kind) {
  run(LionOp(c), master, grad, m, n, half, half_kind);
}

void adagrad_kernel_avx2(const AdagradCoeffs& c, float* master, const float* grad, float* sum,
                         std::size_t n, std::uint16_t* half, int half_kind) {
  if (c.has_weight_decay) run(AdagradOp<true>(c), master, grad, sum, n, half, half_kind);
  else run(AdagradOp<false>(c), master, grad, sum, n, half, half_kind);
}

}  // namespace tiermem::detail
