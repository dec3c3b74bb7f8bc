// src/cpu/cast_avx512.cc — the AVX-512 (F + BW + VL) cast kernels: cast_driver.h on 16-lane
// vectors, the destination first brought to a 64-byte boundary, 32 elements per iteration, head
// and tail with masks. Compiled with -mavx512f -mavx512bw -mavx512vl (src/cpu/cast.cmake) and
// called only when cpuid says the CPU has them (src/cpu/cast.cc).
#include "cpu/cast_driver.h"

namespace tiermem::detail {

const CastKernels kCastAvx512 = cast_kernels<Avx512Lanes, true>();

}  // namespace tiermem::detail
