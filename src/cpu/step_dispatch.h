// src/cpu/step_dispatch.h — what the CPU optimizer steps (adam_step, lion_step, adagrad_step)
// share around their kernels: the fused copy of the new master (bf16/fp16 in the kernel, fp32 by
// memcpy per chunk while it is in cache), the ISA check, and the split into OpenMP chunks.
// Private to src/cpu. Thread-safety: reentrant. Errors: NotSupportedError naming `who`.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "tiermem/adam.h"
#include "tiermem/dtype.h"
#include "tiermem/error.h"

namespace tiermem::detail {

// Elements per OpenMP work item: 64 Ki (a few MiB of traffic) amortises scheduling and balances 2..64 threads;
// a multiple of 64, so every chunk but the last is whole vectors.
inline constexpr std::size_t kStepChunkElems = std::size_t{1} << 16;

// The step's copy of the new master into `half` (null: none): half_kind 1 bf16, 2 fp16 (written
// by the kernel), or copy32 (fp32, copied after it).
struct MasterCopy {
  int half_kind = 0;
  std::uint16_t* half = nullptr;
  float* copy32 = nullptr;
};

inline MasterCopy master_copy(void* half, DType half_dtype, const char* who) {
  MasterCopy out;
  if (half == nullptr) return out;
  if (half_dtype == DType::kBF16) out.half_kind = 1;
  else if (half_dtype == DType::kF16) out.half_kind = 2;
  else if (half_dtype == DType::kF32) out.copy32 = static_cast<float*>(half);
  else
    throw NotSupportedError(std::string(who) + ": copy dtype " + std::string(dtype_name(half_dtype)) +
                            " is not bf16, f16 or f32");
  if (out.half_kind != 0) out.half = static_cast<std::uint16_t*>(half);
  return out;
}

// options.isa resolved (kAuto: the best this CPU runs) and checked.
inline AdamIsa checked_isa(const AdamOptions& options, const char* who) {
  const AdamIsa isa = options.isa == AdamIsa::kAuto ? adam_best_isa() : options.isa;
  if (!adam_isa_supported(isa)) {
    throw NotSupportedError(std::string(who) + ": this CPU does not support the " +
                            std::string(adam_isa_name(isa)) + " kernel");
  }
  return isa;
}

// Runs kernel_on(begin, len) over [0, n) in chunks of kStepChunkElems, on up to options.threads
// OpenMP threads (one chunk: on the caller's thread), each chunk's fp32 copy right after it.
template <class F>
void for_step_chunks(std::size_t n, const AdamOptions& options, const MasterCopy& copy, const float* master,
                     F&& kernel_on) {
  if (n == 0) return;
  const std::size_t chunks = (n + kStepChunkElems - 1) / kStepChunkElems;
  if (chunks <= 1) {
    kernel_on(std::size_t{0}, n);
    if (copy.copy32 != nullptr) std::memcpy(copy.copy32, master, n * sizeof(float));
    return;
  }
  int threads = options.threads > 0 ? options.threads : omp_get_max_threads();
  threads = static_cast<int>(std::min<std::size_t>(static_cast<std::size_t>(threads), chunks));
#pragma omp parallel for schedule(static) num_threads(threads)
  for (std::size_t k = 0; k < chunks; ++k) {
    const std::size_t b = k * kStepChunkElems;
    const std::size_t len = std::min(kStepChunkElems, n - b);
    kernel_on(b, len);
    if (copy.copy32 != nullptr) std::memcpy(copy.copy32 + b, master + b, len * sizeof(float));
  }
}

}  // namespace tiermem::detail
