// bench/triad.h — the STREAM-triad reference every Google Benchmark micro-bench (bench/*_bench.cc)
// registers in its own binary, so that its GB/s figures can be read as ratios of the memory
// bandwidth measured in the same run: a[i] = b[i] + s * c[i] over fp32 arrays, 12 bytes per
// element counted (STREAM's convention: two reads, one write, no write-allocate; the loop is
// bench/triad_kernel.h), with OpenMP on the given number of threads, each a contiguous slice.
//
// Registered as Triad/<elements>/threads:<t> for t = 1 and OpenMP's default. Include this header
// in exactly one source file per binary.
#pragma once

#include <benchmark/benchmark.h>
#include <omp.h>

#include <cstddef>
#include <memory>

#include "bench/triad_kernel.h"

namespace tiermem::bench {

inline void BM_Triad(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const int threads = static_cast<int>(state.range(1));
  std::unique_ptr<float[]> a(new float[n]), b(new float[n]), c(new float[n]);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (std::size_t i = 0; i < n; ++i) {  // first touch by the threads that use them
    a[i] = 0.0f;
    b[i] = 1.0f;
    c[i] = 2.0f;
  }
  const float s = 3.0f;
  float* pa = a.get();
  const float* pb = b.get();
  const float* pc = c.get();
  for (auto _ : state) {
#pragma omp parallel num_threads(threads)
    {
      const auto t = static_cast<std::size_t>(omp_get_thread_num());
      const auto nt = static_cast<std::size_t>(omp_get_num_threads());
      triad_range(pa, pb, pc, s, n * t / nt, n * (t + 1) / nt);
    }
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * static_cast<std::int64_t>(n) *
                          static_cast<std::int64_t>(kTriadBytesPerElem));
  state.counters["bytes_per_elem"] = 12;
  state.counters["threads"] = threads;
}

inline void triad_args(benchmark::internal::Benchmark* b) {
  for (int t : {1, omp_get_max_threads()}) {
    b->Args({32 << 20, t});
    if (omp_get_max_threads() == 1) break;
  }
  b->ArgNames({"elems", "threads"})->UseRealTime()->Unit(benchmark::kMillisecond);
}

BENCHMARK(BM_Triad)->Apply(triad_args);

}  // namespace tiermem::bench
