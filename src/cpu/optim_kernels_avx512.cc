// src/cpu/optim_kernels_avx512.cc — the AVX-512 (F + BW + VL) Lion and Adagrad kernels. Compiled
// with -mavx512f -mavx512bw -mavx512vl -mfma -ffp-contract=off (src/cpu/optim_kernels.cmake) and
// called only when cpuid says the CPU has them (src/cpu/optim_kernels.cc).
// Each kernel is the scalar twin's arithmetic, operation for operation (vfmadd where the twin calls
// std::fma, nothing fused elsewhere), so the results are bit-identical to it. 32 elements per
// iteration in two independent 16-lane chains with plain loads and stores; the tail (< 32) goes
// 16 at a time with masks. Memory-bound (Lion and Adagrad: 12 bytes read + 8 written per element,
// + 2 or 4 for the copy), so there is no more unrolling and no streaming of the copy.
#include <immintrin.h>

#include <cstdint>

#include "cpu/simd_bf16.h"
#include "tiermem/optim_kernels.h"

namespace tiermem::detail {
namespace {

struct LionOp {
  __m512 b1, omb1, b2, omb2, decay, gs;
  __m512i lr_bits, sign_bit;
  explicit LionOp(const LionCoeffs& c)
      : b1(_mm512_set1_ps(c.beta1)), omb1(_mm512_set1_ps(c.one_minus_beta1)),
        b2(_mm512_set1_ps(c.beta2)), omb2(_mm512_set1_ps(c.one_minus_beta2)),
        decay(_mm512_set1_ps(c.decay)), gs(_mm512_set1_ps(c.grad_scale)),
        lr_bits(_mm512_castps_si512(_mm512_set1_ps(c.lr))),
        sign_bit(_mm512_set1_epi32(static_cast<int>(0x80000000u))) {}
  // Returns the new master; m is updated in place.
  __m512 operator()(__m512 p, __m512 g, __m512& m) const {
    g = _mm512_mul_ps(g, gs);
    const __m512 c = _mm512_fmadd_ps(omb1, g, _mm512_mul_ps(b1, m));
    // lr * sign(c): lr with c's sign bit where c is neither zero nor NaN, else +0.
    const __mmask16 nonzero = _mm512_cmp_ps_mask(c, _mm512_setzero_ps(), _CMP_NEQ_OQ);
    const __m512 step = _mm512_castsi512_ps(_mm512_maskz_xor_epi32(
        nonzero, lr_bits, _mm512_and_si512(_mm512_castps_si512(c), sign_bit)));
    m = _mm512_fmadd_ps(omb2, g, _mm512_mul_ps(b2, m));
    return _mm512_sub_ps(_mm512_mul_ps(p, decay), step);
  }
};

template <bool kWeightDecay>
struct AdagradOp {
  __m512 neg_clr, eps, wd, gs;
  explicit AdagradOp(const AdagradCoeffs& c)
      : neg_clr(_mm512_set1_ps(c.neg_clr)), eps(_mm512_set1_ps(c.eps)),
        wd(_mm512_set1_ps(c.weight_decay)), gs(_mm512_set1_ps(c.grad_scale)) {}
  // Returns the new master; sum is updated in place.
  __m512 operator()(__m512 p, __m512 g, __m512& sum) const {
    g = _mm512_mul_ps(g, gs);
    if constexpr (kWeightDecay) g = _mm512_fmadd_ps(wd, p, g);
    sum = _mm512_fmadd_ps(g, g, sum);
    const __m512 denom = _mm512_add_ps(_mm512_sqrt_ps(sum), eps);
    return _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(neg_clr, g), denom));
  }
};

template <int kHalfKind>
inline __m256i to_half(__m512 p) {
  if constexpr (kHalfKind == 1) return bf16_round_avx512(p);
  else return _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT);
}

template <class Op, int kHalfKind>
void loop(const Op& op, float* master, const float* grad, float* state, std::size_t n,
          std::uint16_t* half) {
  std::size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    __m512 s0 = _mm512_loadu_ps(state + i), s1 = _mm512_loadu_ps(state + i + 16);
    const __m512 p0 = op(_mm512_loadu_ps(master + i), _mm512_loadu_ps(grad + i), s0);
    const __m512 p1 = op(_mm512_loadu_ps(master + i + 16), _mm512_loadu_ps(grad + i + 16), s1);
    _mm512_storeu_ps(state + i, s0);
    _mm512_storeu_ps(state + i + 16, s1);
    _mm512_storeu_ps(master + i, p0);
    _mm512_storeu_ps(master + i + 16, p1);
    if constexpr (kHalfKind != 0) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(half + i), to_half<kHalfKind>(p0));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(half + i + 16), to_half<kHalfKind>(p1));
    }
  }
  for (; i < n; i += 16) {
    const std::size_t len = n - i < 16 ? n - i : 16;
    const __mmask16 mask = static_cast<__mmask16>((1u << len) - 1u);
    __m512 s = _mm512_maskz_loadu_ps(mask, state + i);
    const __m512 p =
        op(_mm512_maskz_loadu_ps(mask, master + i), _mm512_maskz_loadu_ps(mask, grad + i), s);
    _mm512_mask_storeu_ps(state + i, mask, s);
    _mm512_mask_storeu_ps(master + i, mask, p);
    if constexpr (kHalfKind != 0) _mm256_mask_storeu_epi16(half + i, mask, to_half<kHalfKind>(p));
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

void lion_kernel_avx512(const LionCoeffs& c, float* master, const float* grad, float* m,
                        std::size_t n, std::uint16_t* half, int half_kind) {
  run(LionOp(c), master, grad, m, n, half, half_kind);
}

void adagrad_kernel_avx512(const AdagradCoeffs& c, float* master, const float* grad, float* sum,
                           std::size_t n, std::uint16_t* half, int half_kind) {
  if (c.has_weight_decay) run(AdagradOp<true>(c), master, grad, sum, n, half, half_kind);
  else run(AdagradOp<false>(c), master, grad, sum, n, half, half_kind);
}

}  // namespace tiermem::detail
