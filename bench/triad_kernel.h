// bench/triad_kernel.h — the STREAM-triad loop both triad references use (tiermem-bench adam and
// bench/triad.h): a[i] = b[i] + s * c[i] over fp32, written with SSE2 intrinsics (the x86-64
// baseline) so that it is vectorized whatever the bench's compile flags, like STREAM's own -O3
// build. Counted as 12 bytes per element (two 4-byte reads, one write; STREAM's convention, no
// write-allocate) — STREAM's 24 is for its 8-byte doubles.
#pragma once

#include <emmintrin.h>

#include <cstddef>

namespace tiermem::bench {

inline constexpr double kTriadBytesPerElem = 12.0;

inline void triad_range(float* a, const float* b, const float* c, float s, std::size_t lo,
                        std::size_t hi) {
  const __m128 vs = _mm_set1_ps(s);
  std::size_t i = lo;
  for (; i + 8 <= hi; i += 8) {
    _mm_storeu_ps(a + i, _mm_add_ps(_mm_loadu_ps(b + i), _mm_mul_ps(vs, _mm_loadu_ps(c + i))));
    _mm_storeu_ps(a + i + 4, _mm_add_ps(_mm_loadu_ps(b + i + 4), _mm_mul_ps(vs, _mm_loadu_ps(c + i + 4))));
  }
  for (; i < hi; ++i) a[i] = b[i] + s * c[i];
}

}  // namespace tiermem::bench
