// src/cpu/optim_kernels_avx2.cc — the AVX2 + FMA + F16C Lion and Adagrad kernels:
// optim_kernels_driver.h on 8-lane vectors, two chains (16 elements) per iteration; the tail
// 8 at a time through a zero-padded stack copy. Compiled with -mavx2 -mfma -mf16c
// -ffp-contract=off (src/cpu/optim_kernels.cmake) and called only when cpuid says the CPU has
// them (src/cpu/optim_kernels.cc).
#include "cpu/optim_kernels_driver.h"

namespace tiermem::detail {

void lion_kernel_avx2(const LionCoeffs& c, float* master, const float* grad, float* m,
                      std::size_t n, std::uint16_t* half, int half_kind) {
  lion_driver<Avx2Lanes>(c, master, grad, m, n, half, half_kind);
}

void adagrad_kernel_avx2(const AdagradCoeffs& c, float* master, const float* grad, float* sum,
                         std::size_t n, std::uint16_t* half, int half_kind) {
  adagrad_driver<Avx2Lanes>(c, master, grad, sum, n, half, half_kind);
}

}  // namespace tiermem::detail
