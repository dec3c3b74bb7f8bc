// src/cpu/cast_driver.h — the bulk fp32 <-> bf16/fp16 casts once, as a template on the lanes of
// one ISA (simd_lanes.h): cast_avx2.cc instantiates it on Avx2Lanes, cast_avx512.cc on
// Avx512Lanes (with the destination aligned first). Two whole vectors per iteration with plain
// loads and stores (partial stores are slow on some cores, AMD Zen 4), then the tail (< 2 vectors)
// one partial vector at a time: every element takes the vector path and nothing past the buffers
// is touched. With kAlignDst, a partial head first brings the destination to a 64-byte boundary
// so no store of the main loop splits a cache line (AVX-512, whose stores are a line's width or
// half of it).
//
// Include only from a file compiled with the matching ISA flags (see simd_lanes.h).
// Thread-safety: stateless.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cpu/simd_lanes.h"
#include "tiermem/cast.h"

namespace tiermem::detail {
namespace {

// Elements before `dst` reaches a 64-byte boundary (at most n).
template <typename T>
std::size_t cast_head_elems(const T* dst, std::size_t n) {
  const auto a = reinterpret_cast<std::uintptr_t>(dst);
  if (a % sizeof(T) != 0) return 0;
  const std::size_t h = (64 - a % 64) % 64 / sizeof(T);
  return h < n ? h : n;
}

enum class Half { kBf16, kF16 };

template <class L, Half kKind>
inline typename L::H cast_narrow(typename L::F x) {
  if constexpr (kKind == Half::kBf16) return L::to_bf16(x);
  else return L::to_f16(x);
}
template <class L, Half kKind>
inline typename L::F cast_widen(typename L::H h) {
  if constexpr (kKind == Half::kBf16) return L::from_bf16(h);
  else return L::from_f16(h);
}

template <class L, Half kKind>
void narrow_partial(const float* src, std::uint16_t* dst, std::size_t n) {
  for (std::size_t i = 0; i < n; i += L::kLanes) {
    const std::size_t len = n - i < L::kLanes ? n - i : L::kLanes;
    L::store_h_part(dst + i, cast_narrow<L, kKind>(L::load_part(src + i, len)), len);
  }
}

template <class L, Half kKind>
void widen_partial(const std::uint16_t* src, float* dst, std::size_t n) {
  for (std::size_t i = 0; i < n; i += L::kLanes) {
    const std::size_t len = n - i < L::kLanes ? n - i : L::kLanes;
    L::store_part(dst + i, cast_widen<L, kKind>(L::load_h_part(src + i, len)), len);
  }
}

template <class L, Half kKind, bool kAlignDst>
void narrow_driver(const float* src, std::uint16_t* dst, std::size_t n) {
  constexpr std::size_t kW = L::kLanes;
  std::size_t i = 0;
  if constexpr (kAlignDst) {
    i = cast_head_elems(dst, n);
    narrow_partial<L, kKind>(src, dst, i);
  }
  for (; i + 2 * kW <= n; i += 2 * kW) {
    const typename L::H h0 = cast_narrow<L, kKind>(L::load(src + i));
    const typename L::H h1 = cast_narrow<L, kKind>(L::load(src + i + kW));
    L::store_h(dst + i, h0);
    L::store_h(dst + i + kW, h1);
  }
  narrow_partial<L, kKind>(src + i, dst + i, n - i);
}

template <class L, Half kKind, bool kAlignDst>
void widen_driver(const std::uint16_t* src, float* dst, std::size_t n) {
  constexpr std::size_t kW = L::kLanes;
  std::size_t i = 0;
  if constexpr (kAlignDst) {
    i = cast_head_elems(dst, n);
    widen_partial<L, kKind>(src, dst, i);
  }
  for (; i + 2 * kW <= n; i += 2 * kW) {
    const typename L::F f0 = cast_widen<L, kKind>(L::load_h(src + i));
    const typename L::F f1 = cast_widen<L, kKind>(L::load_h(src + i + kW));
    L::store(dst + i, f0);
    L::store(dst + i + kW, f1);
  }
  widen_partial<L, kKind>(src + i, dst + i, n - i);
}

// The four kernels of one ISA (tiermem/cast.h's CastKernels).
template <class L, bool kAlignDst>
constexpr CastKernels cast_kernels() {
  return {narrow_driver<L, Half::kBf16, kAlignDst>, narrow_driver<L, Half::kF16, kAlignDst>,
          widen_driver<L, Half::kBf16, kAlignDst>, widen_driver<L, Half::kF16, kAlignDst>};
}

}  // namespace
}  // namespace tiermem::detail
