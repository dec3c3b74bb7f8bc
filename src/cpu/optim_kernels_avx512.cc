// src/cpu/optim_kernels_avx512.cc — the AVX-512 (F + BW + VL) Lion and Adagrad kernels:
// optim_kernels_driver.h on 16-lane vectors, two chains (32 elements) per iteration; the tail
// 16 at a time with masks. Compiled with -mavx512f -mavx512bw -mavx512vl -mfma
// -ffp-contract=off (src/cpu/optim_kernels.cmake) and called only when cpuid says the CPU has
// them (src/cpu/optim_kernels.cc).
#include "cpu/optim_kernels_driver.h"

namespace tiermem::detail {

void lion_kernel_avx512(const LionCoeffs& c, float* master, const float* grad, float* m,
                        std::size_t n, std::uint16_t* half, int half_kind) {
  lion_driver<Avx512Lanes>(c, master, grad, m, n, half, half_kind);
}

void adagrad_kernel_avx512(const AdagradCoeffs& c, float* master, const float* grad, float* sum,
                           std::size_t n, std::uint16_t* half, int half_kind) {
  adagrad_driver<Avx512Lanes>(c, master, grad, sum, n, half, half_kind);
}

}  // namespace tiermem::detail
