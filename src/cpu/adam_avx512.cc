// src/cpu/adam_avx512.cc — the AVX-512 (F + BW + VL) AdamW kernel: adam_driver.h on 16-lane
// vectors, four independent chains (64 elements) per iteration; the copy streamed once 32-byte
// aligned; head and tail with masks. Compiled with -mavx512f -mavx512bw -mavx512vl
// (src/cpu/adam.cmake) and called only when cpuid says the CPU has them (src/cpu/adam.cc).
#include "cpu/adam_driver.h"

namespace tiermem::detail {

void adam_kernel_avx512(const AdamCoeffs& c, float* master, const float* grad, float* m, float* v,
                        std::size_t n, std::uint16_t* half, int half_kind) {
  adam_driver<Avx512Lanes, 4, false>(c, master, grad, m, v, n, half, half_kind);
}

}  // namespace tiermem::detail
