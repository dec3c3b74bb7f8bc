// src/cpu/adam_avx2.cc — the AVX2 + FMA + F16C AdamW kernel: adam_driver.h on 8-lane vectors, two
// independent chains (16 elements) per iteration; the copy streamed once 16-byte aligned; head and
// tail through a zero-padded stack copy. Compiled with -mavx2 -mfma -mf16c (src/cpu/adam.cmake)
// and called only when cpuid says the CPU has them (src/cpu/adam.cc).
#include "cpu/adam_driver.h"

namespace tiermem::detail {

void adam_kernel_avx2(const AdamCoeffs& c, float* master, const float* grad, float* m, float* v,
                      std::size_t n, std::uint16_t* half, int half_kind) {
  adam_driver<Avx2Lanes, 2, true>(c, master, grad, m, v, n, half, half_kind);
}

}  // namespace tiermem::detail
