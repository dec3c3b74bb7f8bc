// bench/adam_bench.cc — Google Benchmark micro-bench of the CPU AdamW kernel per ISA (scalar,
// AVX2, AVX-512 where cpuid has them), with and without the fused bf16 copy-out, against a
// same-run STREAM triad (bench/triad.h).
//
//   cmake --build build/default --target tiermem-adam-bench
//   build/default/bench/tiermem-adam-bench --benchmark_min_time=0.5
//
// Bytes per element (the counter bytes_per_elem; bytes_per_second is built from it): read master,
// grad, m, v (16) + write master, m, v (12) = 28, + 2 with the bf16 copy = 30. GB/s divided by
// the triad's GB/s at the same thread count is the kernel's roofline ratio. Each case checks the
// kernel's output (the first step from zero moves every weight by -lr) before timing.
#include <benchmark/benchmark.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <memory>

#include "bench/triad.h"
#include "tiermem/adam.h"

namespace tiermem::bench {
namespace {

void BM_Adam(benchmark::State& state) {
  const auto isa = static_cast<AdamIsa>(state.range(0));
  const bool with_half = state.range(1) != 0;
  const auto n = static_cast<std::size_t>(state.range(2));
  const int threads = static_cast<int>(state.range(3));
  if (!adam_isa_supported(isa)) {
    state.SkipWithError("this CPU does not run this ISA");
    return;
  }
  std::unique_ptr<float[]> p(new float[n]), g(new float[n]), m(new float[n]), v(new float[n]);
  std::unique_ptr<std::uint16_t[]> half(new std::uint16_t[n]);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (std::size_t i = 0; i < n; ++i) {
    p[i] = 0.0f;
    g[i] = 0.01f;
    m[i] = 0.0f;
    v[i] = 0.0f;
    half[i] = 0;
  }
  AdamParams ap;
  ap.lr = 1e-3f;
  const AdamOptions opts{isa, threads};
  adam_step(ap, p.get(), g.get(), m.get(), v.get(), n, with_half ? half.get() : nullptr, DType::kBF16, opts);
  if (std::abs(p[n / 2] + 1e-3f) > 1e-6f || (with_half && half[n / 2] != f32_to_bf16(p[n / 2]))) {
    state.SkipWithError("kernel output check failed");
    return;
  }
  for (auto _ : state) {
    ++ap.step;
    adam_step(ap, p.get(), g.get(), m.get(), v.get(), n, with_half ? half.get() : nullptr, DType::kBF16, opts);
    benchmark::ClobberMemory();
  }
  const std::int64_t per = with_half ? 30 : 28;
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * static_cast<std::int64_t>(n) * per);
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()) * static_cast<std::int64_t>(n));
  state.counters["bytes_per_elem"] = static_cast<double>(per);
  state.counters["threads"] = threads;
  state.SetLabel(std::string(adam_isa_name(isa)) + (with_half ? "+bf16" : ""));
}

void adam_args(benchmark::internal::Benchmark* b) {
  for (AdamIsa isa : {AdamIsa::kScalar, AdamIsa::kAvx2, AdamIsa::kAvx512}) {
    if (!adam_isa_supported(isa)) continue;
    for (int half : {0, 1}) {
      for (int t : {1, omp_get_max_threads()}) {
        b->Args({static_cast<std::int64_t>(isa), half, 16 << 20, t});
        if (omp_get_max_threads() == 1) break;
      }
    }
  }
  b->ArgNames({"isa", "bf16", "elems", "threads"})->UseRealTime()->Unit(benchmark::kMillisecond);
}

BENCHMARK(BM_Adam)->Apply(adam_args);

}  // namespace
}  // namespace tiermem::bench

BENCHMARK_MAIN();
