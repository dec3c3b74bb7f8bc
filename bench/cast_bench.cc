// bench/cast_bench.cc — Google Benchmark micro-bench of the fp32 -> bf16 / fp16 casts
// (tiermem::f32_to_bf16 / f32_to_f16, the loops ZeroEngine runs to make working copies) and
// bf16 -> fp32, single-threaded, against a same-run STREAM triad (bench/triad.h).
//
//   cmake --build build/default --target tiermem-cast-bench
//   build/default/bench/tiermem-cast-bench --benchmark_min_time=0.5
//
// Bytes per element (counter bytes_per_elem): 4 read + 2 written = 6 for the narrowing casts,
// 2 + 4 = 6 for the widening one. Outputs are checked against the scalar function before timing.
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <memory>

#include "bench/triad.h"
#include "tiermem/dtype.h"

namespace tiermem::bench {
namespace {

constexpr std::size_t kElems = 16 << 20;

void fill(float* x, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) x[i] = std::sin(static_cast<float>(i) * 0.001f) * 100.0f;
}

template <std::uint16_t (*Cast)(float)>
void BM_Narrow(benchmark::State& state) {
  const std::size_t n = kElems;
  std::unique_ptr<float[]> src(new float[n]);
  std::unique_ptr<std::uint16_t[]> dst(new std::uint16_t[n]);
  fill(src.get(), n);
  for (std::size_t i = 0; i < n; ++i) dst[i] = Cast(src[i]);
  if (dst[n / 3] != Cast(src[n / 3])) {
    state.SkipWithError("cast output check failed");
    return;
  }
  for (auto _ : state) {
    const float* s = src.get();
    std::uint16_t* d = dst.get();
    for (std::size_t i = 0; i < n; ++i) d[i] = Cast(s[i]);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * static_cast<std::int64_t>(n) * 6);
  state.counters["bytes_per_elem"] = 6;
}

void BM_Bf16ToF32(benchmark::State& state) {
  const std::size_t n = kElems;
  std::unique_ptr<std::uint16_t[]> src(new std::uint16_t[n]);
  std::unique_ptr<float[]> dst(new float[n]);
  for (std::size_t i = 0; i < n; ++i) src[i] = static_cast<std::uint16_t>(i * 2654435761u);
  for (auto _ : state) {
    const std::uint16_t* s = src.get();
    float* d = dst.get();
    for (std::size_t i = 0; i < n; ++i) d[i] = bf16_to_f32(s[i]);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * static_cast<std::int64_t>(n) * 6);
  state.counters["bytes_per_elem"] = 6;
}

BENCHMARK_TEMPLATE(BM_Narrow, f32_to_bf16)->Name("F32ToBf16")->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(BM_Narrow, f32_to_f16)->Name("F32ToF16")->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Bf16ToF32)->UseRealTime()->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace tiermem::bench

BENCHMARK_MAIN();
