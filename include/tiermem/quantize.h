// tiermem/quantize.h — a frozen module's working shard stored at rest in fewer bytes than the
// working dtype (tiermem.frozen_dtype, zero_optimization.zero_quantized_nontrainable_weights:
// docs/config.md), quantized once when its values are written and dequantized into the working
// dtype at every gather (src/zero/frozen_at_rest.h uses these).
//
// Formats of a shard of n elements at rest:
//   kWorking: the working dtype itself (n x wsize bytes; nothing here is called).
//   kBF16:    n bf16 values (2n bytes), rounded to nearest even from fp32 (tiermem/dtype.h).
//   kInt8:    n int8 codes, then ceil(n / kInt8GroupElems) fp32 scales (n a multiple of 4, so the
//             scales are 4-byte aligned) (n + 4 ceil(n/128) bytes,
//             1.03 bytes per element). Group g is elements [128 g, 128 g + 128) of the flat shard;
//             its scale is s = max |x| / 127 over the group (0 for an all-zero group), each code
//             q = round-to-nearest-even(x / s) clamped to [-127, 127], and the value read back is
//             q x s (one fp32 multiply). Error bound: |x - q s| <= s / 2 (+ one fp32 rounding),
//             i.e. half of max|x|/127 of its group. Symmetric absmax ("absmax") quantization per
//             contiguous group as described for ZeRO++'s quantized weights (Wang et al. 2023,
//             "ZeRO++", section 3.1: block-based quantization); the group size 128 is ours. DeepSpeed's
//             zero_quantized_nontrainable_weights (its config docstring: non-trainable weights
//             stored in quantized precision, for LoRA; CUDA only) names the option; none of its
//             code is used here.
//
// Units: n is elements; *_bytes are bytes. The caller owns every buffer; each is accessed only
// during the call; source and destination must not overlap.
// Thread-safety: pure functions; reentrant. Concurrent calls must write disjoint buffers.
// Errors: Error from quantize_int8_n for a non-finite value (an int8 code cannot hold it), naming
// its element; NotSupportedError for an ISA this CPU lacks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "tiermem/cast.h"
#include "tiermem/dtype.h"
#include "tiermem/export.h"

namespace tiermem {

// How a frozen module's working shard is stored on its tier.
enum class FrozenDtype : std::uint8_t { kWorking, kBF16, kInt8 };

// Elements per int8 scale group (see above).
inline constexpr std::size_t kInt8GroupElems = 128;

// "working" (the working dtype), "bf16", "int8".
TIERMEM_API std::string_view frozen_dtype_name(FrozenDtype d);

// The format tiermem.frozen_dtype (as the config parser resolved it: "auto", "bf16", "int8")
// means for a run whose working dtype is `working`: kWorking where the two are the same.
constexpr FrozenDtype frozen_dtype_of(std::string_view key, DType working) {
  if (key == "int8") return FrozenDtype::kInt8;
  if (key == "bf16" && working != DType::kBF16) return FrozenDtype::kBF16;
  return FrozenDtype::kWorking;
}

// Bytes of a shard of n elements at rest; wsize: bytes per working element (for kWorking).
constexpr std::uint64_t at_rest_bytes(FrozenDtype d, std::uint64_t n, std::uint64_t wsize) {
  switch (d) {
    case FrozenDtype::kWorking: return n * wsize;
    case FrozenDtype::kBF16: return 2 * n;
    case FrozenDtype::kInt8: return n + 4 * ((n + kInt8GroupElems - 1) / kInt8GroupElems);
  }
  return n * wsize;
}

// Quantizes n fp32 values: codes[i] for each, scales[g] for each group (ceil(n/128) of them).
// src must be aligned to a group start (element 0 of a group). Throws Error for a NaN or ±Inf.
TIERMEM_API void quantize_int8_n(const float* src, std::size_t n, std::int8_t* codes, float* scales);
// codes[i] x scales[i / 128] into dst, n elements from a group start.
TIERMEM_API void dequantize_int8_n(const std::int8_t* codes, const float* scales, std::size_t n, float* dst,
                                   CastIsa isa = CastIsa::kAuto);

// Writes elements [a, b) of a shard of n elements in format `d` (not kWorking) at `rest` (the
// shard's at_rest_bytes buffer), from fp32 `src` (b - a values). `a` must be a group start
// (a multiple of kInt8GroupElems) unless b == n.
TIERMEM_API void write_at_rest(FrozenDtype d, const float* src, std::size_t a, std::size_t b, std::size_t n,
                               std::byte* rest);
// The whole shard of n elements (format `d`, not kWorking) into `dst` in the working dtype
// (kF32, kBF16 or kF16; n x dtype_size bytes). The hot path of a quantized module's gather:
// vectorised where the CPU allows (AVX-512), a scalar twin otherwise (same bits).
TIERMEM_API void read_at_rest(FrozenDtype d, const std::byte* rest, std::size_t n, DType working, void* dst,
                              CastIsa isa = CastIsa::kAuto);

}  // namespace tiermem
