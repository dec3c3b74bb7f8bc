// src/cpu/cast.cc — bulk fp32 <-> bf16/fp16 casts: run-time ISA choice and the scalar kernels
// (the per-element functions of tiermem/dtype.h in a loop: the obvious twin the vector kernels of
// cast_avx2.cc and cast_avx512.cc are tested against). See include/tiermem/cast.h.
#include "tiermem/cast.h"

#include <string>

#include "tiermem/dtype.h"
#include "tiermem/error.h"

namespace tiermem {
namespace {

bool cpu_has_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
}
bool cpu_has_avx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && cpu_has_avx2();
}

void narrow_bf16_scalar(const float* src, std::uint16_t* dst, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
}
void narrow_f16_scalar(const float* src, std::uint16_t* dst, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) dst[i] = f32_to_f16(src[i]);
}
void widen_bf16_scalar(const std::uint16_t* src, float* dst, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
}
void widen_f16_scalar(const std::uint16_t* src, float* dst, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) dst[i] = f16_to_f32(src[i]);
}

const detail::CastKernels& kernels_for(CastIsa isa) {
  if (isa == CastIsa::kAuto) isa = cast_best_isa();
  switch (isa) {
    case CastIsa::kAvx512:
      if (cpu_has_avx512()) return detail::kCastAvx512;
      break;
    case CastIsa::kAvx2:
      if (cpu_has_avx2()) return detail::kCastAvx2;
      break;
    case CastIsa::kAuto:
    case CastIsa::kScalar: return detail::kCastScalar;
  }
  throw NotSupportedError("cast: this CPU does not support the " + std::string(cast_isa_name(isa)) +
                          " kernel");
}

}  // namespace

namespace detail {
const CastKernels kCastScalar = {narrow_bf16_scalar, narrow_f16_scalar, widen_bf16_scalar,
                                 widen_f16_scalar};
}  // namespace detail

std::string_view cast_isa_name(CastIsa isa) {
  switch (isa) {
    case CastIsa::kAuto: return "auto";
    case CastIsa::kScalar: return "scalar";
    case CastIsa::kAvx2: return "avx2";
    case CastIsa::kAvx512: return "avx512";
  }
  return "?";
}

bool cast_isa_supported(CastIsa isa) {
  switch (isa) {
    case CastIsa::kAuto:
    case CastIsa::kScalar: return true;
    case CastIsa::kAvx2: return cpu_has_avx2();
    case CastIsa::kAvx512: return cpu_has_avx512();
  }
  return false;
}

CastIsa cast_best_isa() {
  static const CastIsa best = cpu_has_avx512() ? CastIsa::kAvx512
                              : cpu_has_avx2()  ? CastIsa::kAvx2
                                                : CastIsa::kScalar;
  return best;
}

void f32_to_bf16_n(const float* src, std::uint16_t* dst, std::size_t n, CastIsa isa) {
  kernels_for(isa).f32_to_bf16(src, dst, n);
}
void f32_to_f16_n(const float* src, std::uint16_t* dst, std::size_t n, CastIsa isa) {
  kernels_for(isa).f32_to_f16(src, dst, n);
}
void bf16_to_f32_n(const std::uint16_t* src, float* dst, std::size_t n, CastIsa isa) {
  kernels_for(isa).bf16_to_f32(src, dst, n);
}
void f16_to_f32_n(const std::uint16_t* src, float* dst, std::size_t n, CastIsa isa) {
  kernels_for(isa).f16_to_f32(src, dst, n);
}

}  // namespace tiermem
