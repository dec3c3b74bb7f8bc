// tiermem/dtype.h — element types and bf16/fp16 <-> fp32 conversion.
//
// Conversions round to nearest even (as PyTorch and CUDA's __float2bfloat16_rn do); NaN stays NaN,
// overflow of fp16 gives ±Inf. NaN results are quiet and keep the sign and the high bits of the
// payload, as x86's F16C conversions (vcvtps2ph / vcvtph2ps) and IEEE 754 convertFormat do, so
// the vector kernels of tiermem/cast.h (whole buffers) give exactly these bits for every input.
// They are constexpr-free inline functions usable from host code; CUDA kernels have their own
// intrinsics.
// Thread-safety: pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <cstring>
#include <string_view>

namespace tiermem {

enum class DType : std::uint8_t { kF32, kF16, kBF16, kU8, kI32, kI64, kU16 };

constexpr std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::kF32: return 4;
    case DType::kF16: return 2;
    case DType::kBF16: return 2;
    case DType::kU8: return 1;
    case DType::kI32: return 4;
    case DType::kI64: return 8;
    case DType::kU16: return 2;
  }
  return 0;
}

constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::kF32: return "f32";
    case DType::kF16: return "f16";
    case DType::kBF16: return "bf16";
    case DType::kU8: return "u8";
    case DType::kI32: return "i32";
    case DType::kI64: return "i64";
    case DType::kU16: return "u16";
  }
  return "?";
}

inline std::uint32_t f32_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_f32(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// fp32 -> bf16, round to nearest even; NaN -> quiet NaN with the sign and the top 7 payload bits.
inline std::uint16_t f32_to_bf16(float f) {
  std::uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}
inline float bf16_to_f32(std::uint16_t h) { return bits_f32(static_cast<std::uint32_t>(h) << 16); }

// fp32 -> IEEE fp16, round to nearest even, overflow to ±Inf, subnormals kept. NaN -> quiet NaN
// with the sign and the top 10 payload bits (vcvtps2ph's result).
inline std::uint16_t f32_to_f16(float f) {
  std::uint32_t x = f32_bits(f);
  std::uint32_t sign = (x >> 16) & 0x8000u;
  std::uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) {  // NaN
    return static_cast<std::uint16_t>(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
  }
  if (ax >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // >= 65520 -> Inf
  if (ax < 0x38800000u) {                                                      // subnormal / zero
    if (ax < 0x33000000u) return static_cast<std::uint16_t>(sign);             // < 2^-25 -> 0
    std::uint32_t e = ax >> 23;
    std::uint32_t m = (ax & 0x7fffffu) | 0x800000u;
    std::uint32_t shift = 126 - e;  // 14..24
    std::uint32_t half = m >> shift;
    std::uint32_t rem = m & ((1u << shift) - 1);
    std::uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1u))) ++half;
    return static_cast<std::uint16_t>(sign | half);
  }
  std::uint32_t r = ax - 0x38000000u;  // rebias exponent 127 -> 15
  std::uint32_t half = r >> 13;
  std::uint32_t rem = r & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (half & 1u))) ++half;
  return static_cast<std::uint16_t>(sign | half);
}
// IEEE fp16 -> fp32, exact. NaN -> quiet NaN with the sign and payload (vcvtph2ps's result: a
// signaling NaN comes back quiet).
inline float f16_to_f32(std::uint16_t h) {
  std::uint32_t sign = (static_cast<std::uint32_t>(h) & 0x8000u) << 16;
  std::uint32_t e = (h >> 10) & 0x1fu;
  std::uint32_t m = h & 0x3ffu;
  if (e == 0) {
    if (m == 0) return bits_f32(sign);
    float v = static_cast<float>(m) * (1.0f / 16777216.0f);  // m * 2^-24
    return sign ? -v : v;
  }
  if (e == 31) return bits_f32(sign | 0x7f800000u | (m << 13) | (m != 0 ? 0x400000u : 0u));
  return bits_f32(sign | ((e + 112) << 23) | (m << 13));
}

}  // namespace tiermem
