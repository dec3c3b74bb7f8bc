// src/cpu/adam_driver.h — the AdamW kernel once, as a template on the lanes of one ISA
// (simd_lanes.h): adam_avx2.cc instantiates it on Avx2Lanes with 2 chains, accesses grouped by
// kind; adam_avx512.cc on Avx512Lanes with 4, chain after chain (see adam_main_loop). Every
// element gets the same bits as the scalar twin's arithmetic in vector form (adam.cc), whatever
// its position: the head and the tail go through the same update on partial vectors.
//
// Where the time goes (memory-bound: 16 bytes read + 12 written per element, + 2 for the copy):
//   - the main loop does kChains x kLanes elements per iteration (AVX2: 2 x 8, AVX-512: 4 x 16)
//     with plain (unmasked) loads and stores; partial (masked) stores are far slower than plain
//     ones on some cores (AMD Zen 4), so they are kept for the head and the tail only;
//   - independent chains keep the divider busy while loads are waited on (AVX-512, measured: with
//     the bf16 copy 1230 -> 1359 and, in a second run, 1229 -> 1264 Mparam/s on 2 threads of an
//     Intel Xeon with four chains against two, without it 1533 -> 1550; 64 M params, 9
//     interleaved reps, medians; docs/notes/2026-11-30-adam-kernels-against-deepspeed.md);
//   - the bf16/fp16 copy is written with streaming (non-temporal) stores once its address is
//     aligned to a whole H vector (16 bytes AVX2, 32 AVX-512; when it can be: an even address):
//     nothing reads it back in this pass, so it skips the read-for-ownership a normal store of a
//     new line costs (2 bytes per element less traffic) and does not evict the state; an sfence
//     at the end orders them before the caller sees the step as done;
//   - master, m and v are read first, so their lines are in cache when written: normal stores.
//
// Include only from a file compiled with the matching ISA flags (see simd_lanes.h).
// Thread-safety: stateless; callers run it on disjoint ranges.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "cpu/simd_lanes.h"
#include "tiermem/adam.h"

namespace tiermem::detail {
namespace {

template <class L>
struct AdamConsts {
  using F = typename L::F;
  F b1, omb1, b2, omb2, step, inv, eps, decay, gs;
  explicit AdamConsts(const AdamCoeffs& c)
      : b1(L::set1(c.beta1)), omb1(L::set1(c.one_minus_beta1)), b2(L::set1(c.beta2)),
        omb2(L::set1(c.one_minus_beta2)), step(L::set1(c.step_size)), inv(L::set1(c.inv_sqrt_bc2)),
        eps(L::set1(c.eps)), decay(L::set1(c.decay)), gs(L::set1(c.grad_scale)) {}
};

// The update of one vector from loaded values; returns the new master, writes the new m and v.
template <class L>
inline typename L::F adam_update(const AdamConsts<L>& k, typename L::F p, typename L::F g, typename L::F& m,
                                 typename L::F& v) {
  g = L::mul(g, k.gs);
  m = L::fmadd(k.b1, m, L::mul(k.omb1, g));
  v = L::fmadd(k.b2, v, L::mul(k.omb2, L::mul(g, g)));
  const typename L::F denom = L::fmadd(L::sqrt(v), k.inv, k.eps);
  return L::fnmadd(k.step, L::div(m, denom), L::mul(p, k.decay));
}

template <class L>
inline typename L::H adam_to_half(typename L::F p, int half_kind) {
  return half_kind == 1 ? L::to_bf16(p) : L::to_f16(p);
}

// Fewer than kLanes elements (the head that aligns the copy, and the tail): partial vectors.
template <class L>
inline void adam_partial(const AdamConsts<L>& k, float* master, const float* grad, float* m, float* v,
                         std::size_t len, std::uint16_t* half, int half_kind) {
  typename L::F mi = L::load_part(m, len), vi = L::load_part(v, len);
  const typename L::F p = adam_update(k, L::load_part(master, len), L::load_part(grad, len), mi, vi);
  L::store_part(m, mi, len);
  L::store_part(v, vi, len);
  L::store_part(master, p, len);
  if (half_kind != 0) L::store_h_part(half, adam_to_half<L>(p, half_kind), len);
}

template <class L, bool kStream>
inline void store_half(std::uint16_t* dst, typename L::H h) {
  if constexpr (kStream) L::stream_h(dst, h);
  else L::store_h(dst, h);
}

// The main loop: kChains whole vectors per iteration; the copy streamed when kStream (half + i is
// then aligned to a whole H vector for every i the loop visits). Returns the elements done.
// kGrouped: each kind of access for every chain before the next kind (loads of m, of v, the
// updates, stores of m, v, master, copy), as the AVX2 kernel was written and measured; otherwise
// chain after chain (AVX-512). Same bits either way; the order only changes the schedule.
template <class L, int kChains, bool kGrouped, int kHalfKind, bool kStream>
std::size_t adam_main_loop(const AdamConsts<L>& k, float* master, const float* grad, float* m, float* v,
                           std::size_t n, std::uint16_t* half) {
  constexpr std::size_t kW = L::kLanes, kStep = kW * kChains;
  std::size_t i = 0;
  for (; i + kStep <= n; i += kStep) {
    typename L::F mm[kChains], vv[kChains], pp[kChains];
    if constexpr (kGrouped) {
#pragma GCC unroll 4
      for (int u = 0; u < kChains; ++u) mm[u] = L::load(m + i + kW * u);
#pragma GCC unroll 4
      for (int u = 0; u < kChains; ++u) vv[u] = L::load(v + i + kW * u);
#pragma GCC unroll 4
      for (int u = 0; u < kChains; ++u)
        pp[u] = adam_update(k, L::load(master + i + kW * u), L::load(grad + i + kW * u), mm[u], vv[u]);
#pragma GCC unroll 4
      for (int u = 0; u < kChains; ++u) L::store(m + i + kW * u, mm[u]);
#pragma GCC unroll 4
      for (int u = 0; u < kChains; ++u) L::store(v + i + kW * u, vv[u]);
#pragma GCC unroll 4
      for (int u = 0; u < kChains; ++u) L::store(master + i + kW * u, pp[u]);
      if constexpr (kHalfKind != 0) {
        typename L::H hh[kChains];
#pragma GCC unroll 4
        for (int u = 0; u < kChains; ++u) hh[u] = kHalfKind == 1 ? L::to_bf16(pp[u]) : L::to_f16(pp[u]);
#pragma GCC unroll 4
        for (int u = 0; u < kChains; ++u) store_half<L, kStream>(half + i + kW * u, hh[u]);
      }
    } else {
#pragma GCC unroll 4
      for (int u = 0; u < kChains; ++u) {
        mm[u] = L::load(m + i + kW * u);
        vv[u] = L::load(v + i + kW * u);
        pp[u] = adam_update(k, L::load(master + i + kW * u), L::load(grad + i + kW * u), mm[u], vv[u]);
      }
#pragma GCC unroll 4
      for (int u = 0; u < kChains; ++u) {
        L::store(m + i + kW * u, mm[u]);
        L::store(v + i + kW * u, vv[u]);
        L::store(master + i + kW * u, pp[u]);
        if constexpr (kHalfKind != 0)
          store_half<L, kStream>(half + i + kW * u, kHalfKind == 1 ? L::to_bf16(pp[u]) : L::to_f16(pp[u]));
      }
    }
  }
  return i;
}

// adam_kernel_<isa> (tiermem/adam.h): AdamW over [0, n), the new master also written to `half`
// as bf16 (half_kind 1) or fp16 (2) when half is not null.
template <class L, int kChains, bool kGrouped>
void adam_driver(const AdamCoeffs& c, float* master, const float* grad, float* m, float* v, std::size_t n,
                 std::uint16_t* half, int half_kind) {
  constexpr std::size_t kW = L::kLanes, kHalfVecBytes = kW * sizeof(std::uint16_t);
  const AdamConsts<L> k(c);
  if (half == nullptr) half_kind = 0;
  std::size_t i = 0;
  bool stream = false;
  // Peel fewer than kLanes elements so that the copy's address is aligned to a whole H vector
  // (when it can be: an even address), then stream it.
  if (half_kind != 0 && reinterpret_cast<std::uintptr_t>(half) % 2 == 0) {
    const std::size_t mis = reinterpret_cast<std::uintptr_t>(half) % kHalfVecBytes;
    const std::size_t head = mis == 0 ? 0 : (kHalfVecBytes - mis) / 2;
    if (head < n) {
      if (head > 0) adam_partial<L>(k, master, grad, m, v, head, half, half_kind);
      i = head;
      stream = true;
    }
  }
  float *pm = master + i, *mm = m + i, *vm = v + i;
  const float* gm = grad + i;
  std::uint16_t* hm = half_kind != 0 ? half + i : nullptr;
  const std::size_t rest = n - i;
  std::size_t done;
  if (half_kind == 0) done = adam_main_loop<L, kChains, kGrouped, 0, false>(k, pm, gm, mm, vm, rest, hm);
  else if (half_kind == 1) done = stream ? adam_main_loop<L, kChains, kGrouped, 1, true>(k, pm, gm, mm, vm, rest, hm)
                                         : adam_main_loop<L, kChains, kGrouped, 1, false>(k, pm, gm, mm, vm, rest, hm);
  else done = stream ? adam_main_loop<L, kChains, kGrouped, 2, true>(k, pm, gm, mm, vm, rest, hm)
                     : adam_main_loop<L, kChains, kGrouped, 2, false>(k, pm, gm, mm, vm, rest, hm);
  if (stream) _mm_sfence();
  for (std::size_t j = done; j < rest; j += kW) {
    const std::size_t len = rest - j < kW ? rest - j : kW;
    adam_partial<L>(k, pm + j, gm + j, mm + j, vm + j, len, hm ? hm + j : nullptr, half_kind);
  }
}

}  // namespace
}  // namespace tiermem::detail
