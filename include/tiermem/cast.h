// tiermem/cast.h — bulk fp32 <-> bf16 / fp16 conversion of whole buffers, with a kernel per
// instruction set chosen at run time (the per-element functions are in tiermem/dtype.h).
//
// Every kernel gives, for every input bit pattern, exactly the bits of the scalar function it
// stands for: f32_to_bf16_n == f32_to_bf16, f32_to_f16_n == f32_to_f16, bf16_to_f32_n ==
// bf16_to_f32, f16_to_f32_n == f16_to_f32 (round to nearest even, subnormals kept, fp16
// overflow to ±Inf, NaN kept NaN with its payload as dtype.h says). The F16C and AVX-512
// conversions ignore MXCSR (rounding mode, FTZ, DAZ), so the result does not depend on the
// caller's floating-point environment either (tests/unit/cast_test.cc checks all of this).
//
// Thread-safety: the functions are reentrant; concurrent calls must write disjoint buffers.
// Each call runs on the calling thread only (no OpenMP): callers that want more threads split
// the buffer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "tiermem/export.h"

namespace tiermem {

// The instruction set of a cast kernel. kAuto picks the best one the CPU supports.
//   kAvx2:   AVX2 + F16C (vcvtps2ph / vcvtph2ps), 8 lanes.
//   kAvx512: AVX-512 F + BW + VL, 16 lanes, masked tails.
enum class CastIsa : std::uint8_t { kAuto, kScalar, kAvx2, kAvx512 };
TIERMEM_API std::string_view cast_isa_name(CastIsa isa);

// True when this CPU can run `isa` (checked with __builtin_cpu_supports; kAuto and kScalar:
// always).
TIERMEM_API bool cast_isa_supported(CastIsa isa);

// The best kernel this CPU runs (decided once).
TIERMEM_API CastIsa cast_best_isa();

// Converts n elements of src into dst (n may be 0; any alignment). The caller owns both buffers;
// they are only accessed during the call and must not overlap. Units: n is elements, not bytes.
// Throws NotSupportedError if `isa` is not supported by this CPU (kAuto never throws).
TIERMEM_API void f32_to_bf16_n(const float* src, std::uint16_t* dst, std::size_t n,
                               CastIsa isa = CastIsa::kAuto);
TIERMEM_API void f32_to_f16_n(const float* src, std::uint16_t* dst, std::size_t n,
                              CastIsa isa = CastIsa::kAuto);
TIERMEM_API void bf16_to_f32_n(const std::uint16_t* src, float* dst, std::size_t n,
                               CastIsa isa = CastIsa::kAuto);
TIERMEM_API void f16_to_f32_n(const std::uint16_t* src, float* dst, std::size_t n,
                  CastIsa isa = CastIsa::kAuto);

namespace detail {

// The kernels behind the functions above (single-threaded, any n, no ISA check).
struct CastKernels {
  void (*f32_to_bf16)(const float* src, std::uint16_t* dst, std::size_t n);
  void (*f32_to_f16)(const float* src, std::uint16_t* dst, std::size_t n);
  void (*bf16_to_f32)(const std::uint16_t* src, float* dst, std::size_t n);
  void (*f16_to_f32)(const std::uint16_t* src, float* dst, std::size_t n);
};
extern const CastKernels kCastScalar;
extern const CastKernels kCastAvx2;
extern const CastKernels kCastAvx512;

}  // namespace detail
}  // namespace tiermem
