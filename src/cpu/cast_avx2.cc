// src/cpu/cast_avx2.cc — the AVX2 + F16C cast kernels: cast_driver.h on 8-lane vectors, 16
// elements per iteration, the tail through a zero-padded stack copy. Compiled with -mavx2 -mf16c
// (src/cpu/cast.cmake) and called only when cpuid says the CPU has them (src/cpu/cast.cc).
#include "cpu/cast_driver.h"

namespace tiermem::detail {

const CastKernels kCastAvx2 = cast_kernels<Avx2Lanes, false>();

}  // namespace tiermem::detail
