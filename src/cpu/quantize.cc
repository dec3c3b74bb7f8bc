// src/cpu/quantize.cc — frozen values at rest: int8 per-group absmax quantization (scalar, run
// once per write), the dequantize dispatch (the AVX-512 kernel of quantize_avx512.cc, or the
// scalar twin it is tested against) and the conversion of a whole shard into the working dtype.
// See include/tiermem/quantize.h.
#include "tiermem/quantize.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "tiermem/error.h"

namespace tiermem {
namespace detail {
// quantize_avx512.cc: codes x scales, n elements from a group start (AVX-512 F + BW + VL).
void dequantize_int8_avx512(const std::int8_t* codes, const float* scales, std::size_t n, float* dst);
}  // namespace detail

namespace {

constexpr std::size_t G = kInt8GroupElems;

void dequantize_int8_scalar(const std::int8_t* codes, const float* scales, std::size_t n, float* dst) {
  for (std::size_t i = 0; i < n; ++i) dst[i] = static_cast<float>(codes[i]) * scales[i / G];
}

bool cpu_has_avx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
}

// Converts n fp32 values to the working dtype at dst.
void narrow(const float* src, std::size_t n, DType working, void* dst, CastIsa isa) {
  switch (working) {
    case DType::kF32: std::memcpy(dst, src, n * 4); return;
    case DType::kBF16: f32_to_bf16_n(src, static_cast<std::uint16_t*>(dst), n, isa); return;
    case DType::kF16: f32_to_f16_n(src, static_cast<std::uint16_t*>(dst), n, isa); return;
    default: break;
  }
  throw Error("read_at_rest: working dtype " + std::string(dtype_name(working)) +
              " is not a floating-point working dtype (f32, bf16 or f16)");
}

}  // namespace

std::string_view frozen_dtype_name(FrozenDtype d) {
  switch (d) {
    case FrozenDtype::kWorking: return "working";
    case FrozenDtype::kBF16: return "bf16";
    case FrozenDtype::kInt8: return "int8";
  }
  return "?";
}

void quantize_int8_n(const float* src, std::size_t n, std::int8_t* codes, float* scales) {
  for (std::size_t g0 = 0; g0 < n; g0 += G) {
    const std::size_t g1 = std::min(n, g0 + G);
    float amax = 0.0f;
    for (std::size_t i = g0; i < g1; ++i) {
      if (!std::isfinite(src[i])) {
        throw Error("quantize_int8_n: element " + std::to_string(i) + " is " + std::to_string(src[i]) +
                    ": an int8 code cannot hold a NaN or an infinity (store this module in bf16 or the working dtype)");
      }
      amax = std::max(amax, std::fabs(src[i]));
    }
    const float s = amax / 127.0f;
    scales[g0 / G] = s;
    for (std::size_t i = g0; i < g1; ++i) {
      const float q = s > 0.0f ? std::nearbyint(src[i] / s) : 0.0f;
      codes[i] = static_cast<std::int8_t>(std::clamp(q, -127.0f, 127.0f));
    }
  }
}

void dequantize_int8_n(const std::int8_t* codes, const float* scales, std::size_t n, float* dst, CastIsa isa) {
  if (isa == CastIsa::kAuto) isa = cpu_has_avx512() ? CastIsa::kAvx512 : CastIsa::kScalar;
  switch (isa) {
    case CastIsa::kAvx512:
      if (!cpu_has_avx512()) break;
      detail::dequantize_int8_avx512(codes, scales, n, dst);
      return;
    case CastIsa::kAvx2:  // no AVX2 kernel: the scalar loop (the compiler vectorises it)
    case CastIsa::kScalar:
    case CastIsa::kAuto: dequantize_int8_scalar(codes, scales, n, dst); return;
  }
  throw NotSupportedError("dequantize_int8_n: this CPU does not support the " + std::string(cast_isa_name(isa)) +
                          " kernel");
}

void write_at_rest(FrozenDtype d, const float* src, std::size_t a, std::size_t b, std::size_t n, std::byte* rest) {
  if (d == FrozenDtype::kBF16) {
    f32_to_bf16_n(src, reinterpret_cast<std::uint16_t*>(rest) + a, b - a);
    return;
  }
  if (d != FrozenDtype::kInt8) throw Error("write_at_rest: the working dtype needs no conversion at rest");
  if (a % G != 0 && b != n) {
    throw Error("write_at_rest: int8 writes start at a group boundary (element " + std::to_string(a) +
                " is not a multiple of " + std::to_string(G) + ")");
  }
  auto* codes = reinterpret_cast<std::int8_t*>(rest);
  float* scales = reinterpret_cast<float*>(rest + n);  // right after the n codes (n % 4 == 0: aligned)
  const std::size_t groups = (b - a + G - 1) / G;
  std::vector<float> s(groups);
  quantize_int8_n(src, b - a, codes + a, s.data());
  std::memcpy(scales + a / G, s.data(), groups * sizeof(float));
}

void read_at_rest(FrozenDtype d, const std::byte* rest, std::size_t n, DType working, void* dst, CastIsa isa) {
  if (d == FrozenDtype::kBF16 && working == DType::kF32) {
    bf16_to_f32_n(reinterpret_cast<const std::uint16_t*>(rest), static_cast<float*>(dst), n, isa);
    return;
  }
  if (d == FrozenDtype::kInt8 && working == DType::kF32) {
    dequantize_int8_n(reinterpret_cast<const std::int8_t*>(rest), reinterpret_cast<const float*>(rest + n), n,
                      static_cast<float*>(dst), isa);
    return;
  }
  if (d == FrozenDtype::kWorking) throw Error("read_at_rest: the working dtype needs no conversion at rest");
  // Into a 2-byte working dtype: through a small fp32 buffer, a group-aligned chunk at a time.
  constexpr std::size_t kChunk = 32 * G;
  alignas(64) float tmp[kChunk];
  auto* out = static_cast<std::byte*>(dst);
  const std::size_t w = dtype_size(working);
  for (std::size_t a = 0; a < n; a += kChunk) {
    const std::size_t m = std::min(kChunk, n - a);
    if (d == FrozenDtype::kBF16) {
      bf16_to_f32_n(reinterpret_cast<const std::uint16_t*>(rest) + a, tmp, m, isa);
    } else {
      dequantize_int8_n(reinterpret_cast<const std::int8_t*>(rest) + a,
                        reinterpret_cast<const float*>(rest + n) + a / G, m, tmp, isa);
    }
    narrow(tmp, m, working, out + a * w, isa);
  }
}

}  // namespace tiermem
