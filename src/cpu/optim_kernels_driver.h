// src/cpu/optim_kernels_driver.h — the Lion and Adagrad vector kernels once, as templates on the
// lanes of one ISA (simd_lanes.h): optim_kernels_avx2.cc instantiates them on Avx2Lanes,
// optim_kernels_avx512.cc on Avx512Lanes.
// Each kernel is the scalar twin's arithmetic (optim_kernels.cc), operation for operation (fmadd
// where the twin calls std::fma, nothing fused elsewhere: the including files are compiled with
// -ffp-contract=off, src/cpu/optim_kernels.cmake), so the results are bit-identical to it. Two
// independent chains (2 x kLanes elements) per iteration with plain loads and stores; the tail
// (< 2 vectors) one partial vector at a time through the same update (AVX2: a zero-padded stack
// copy, AVX-512: masks). Memory-bound (12 bytes read + 8 written per element, + 2 or 4 for the
// copy), so there is no more unrolling and no streaming of the copy.
//
// Include only from a file compiled with the matching ISA flags (see simd_lanes.h).
// Thread-safety: stateless; callers run it on disjoint ranges.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cpu/simd_lanes.h"
#include "tiermem/optim_kernels.h"

namespace tiermem::detail {
namespace {

template <class L>
struct LionOp {
  using F = typename L::F;
  F b1, omb1, b2, omb2, decay, gs, lr;
  explicit LionOp(const LionCoeffs& c)
      : b1(L::set1(c.beta1)), omb1(L::set1(c.one_minus_beta1)), b2(L::set1(c.beta2)),
        omb2(L::set1(c.one_minus_beta2)), decay(L::set1(c.decay)), gs(L::set1(c.grad_scale)),
        lr(L::set1(c.lr)) {}
  // Returns the new master; m is updated in place.
  F operator()(F p, F g, F& m) const {
    g = L::mul(g, gs);
    const F c = L::fmadd(omb1, g, L::mul(b1, m));
    const F step = L::sign_step(lr, c);  // lr * sign(c): ±lr, or +0 for 0, -0 and NaN
    m = L::fmadd(omb2, g, L::mul(b2, m));
    return L::sub(L::mul(p, decay), step);
  }
};

template <class L, bool kWeightDecay>
struct AdagradOp {
  using F = typename L::F;
  F neg_clr, eps, wd, gs;
  explicit AdagradOp(const AdagradCoeffs& c)
      : neg_clr(L::set1(c.neg_clr)), eps(L::set1(c.eps)), wd(L::set1(c.weight_decay)),
        gs(L::set1(c.grad_scale)) {}
  // Returns the new master; sum is updated in place.
  F operator()(F p, F g, F& sum) const {
    g = L::mul(g, gs);
    if constexpr (kWeightDecay) g = L::fmadd(wd, p, g);
    sum = L::fmadd(g, g, sum);
    const F denom = L::add(L::sqrt(sum), eps);
    return L::add(p, L::div(L::mul(neg_clr, g), denom));
  }
};

template <class L, int kHalfKind>
inline typename L::H optim_to_half(typename L::F p) {
  if constexpr (kHalfKind == 1) return L::to_bf16(p);
  else return L::to_f16(p);
}

template <class L, class Op, int kHalfKind>
void optim_loop(const Op& op, float* master, const float* grad, float* state, std::size_t n,
                std::uint16_t* half) {
  using F = typename L::F;
  constexpr std::size_t kW = L::kLanes;
  std::size_t i = 0;
  for (; i + 2 * kW <= n; i += 2 * kW) {
    F s0 = L::load(state + i), s1 = L::load(state + i + kW);
    const F p0 = op(L::load(master + i), L::load(grad + i), s0);
    const F p1 = op(L::load(master + i + kW), L::load(grad + i + kW), s1);
    L::store(state + i, s0);
    L::store(state + i + kW, s1);
    L::store(master + i, p0);
    L::store(master + i + kW, p1);
    if constexpr (kHalfKind != 0) {
      L::store_h(half + i, optim_to_half<L, kHalfKind>(p0));
      L::store_h(half + i + kW, optim_to_half<L, kHalfKind>(p1));
    }
  }
  for (; i < n; i += kW) {
    const std::size_t len = n - i < kW ? n - i : kW;
    F s = L::load_part(state + i, len);
    const F p = op(L::load_part(master + i, len), L::load_part(grad + i, len), s);
    L::store_part(state + i, s, len);
    L::store_part(master + i, p, len);
    if constexpr (kHalfKind != 0) L::store_h_part(half + i, optim_to_half<L, kHalfKind>(p), len);
  }
}

template <class L, class Op>
void optim_run(const Op& op, float* master, const float* grad, float* state, std::size_t n,
               std::uint16_t* half, int half_kind) {
  if (half == nullptr) half_kind = 0;
  if (half_kind == 1) optim_loop<L, Op, 1>(op, master, grad, state, n, half);
  else if (half_kind == 2) optim_loop<L, Op, 2>(op, master, grad, state, n, half);
  else optim_loop<L, Op, 0>(op, master, grad, state, n, half);
}

// lion_kernel_<isa> (tiermem/optim_kernels.h).
template <class L>
void lion_driver(const LionCoeffs& c, float* master, const float* grad, float* m, std::size_t n,
                 std::uint16_t* half, int half_kind) {
  optim_run<L>(LionOp<L>(c), master, grad, m, n, half, half_kind);
}

// adagrad_kernel_<isa> (tiermem/optim_kernels.h).
template <class L>
void adagrad_driver(const AdagradCoeffs& c, float* master, const float* grad, float* sum,
                    std::size_t n, std::uint16_t* half, int half_kind) {
  if (c.has_weight_decay)
    optim_run<L>(AdagradOp<L, true>(c), master, grad, sum, n, half, half_kind);
  else
    optim_run<L>(AdagradOp<L, false>(c), master, grad, sum, n, half, half_kind);
}

}  // namespace
}  // namespace tiermem::detail
