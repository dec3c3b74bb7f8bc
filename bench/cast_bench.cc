// bench/cast_bench.cc — Google Benchmark micro-bench of the fp32 -> bf16 / fp16 casts and back:
// the per-element scalar functions of tiermem/dtype.h in a loop (what ZeroEngine ran before issue
// 12) beside the bulk kernels of tiermem/cast.h per ISA the CPU has (scalar twin, AVX2 + F16C,
// AVX-512; ZeroEngine now calls the best one), single-threaded, against a same-run STREAM triad
// (bench/triad.h).
//
//   cmake --build build/default --target tiermem-cast-bench
//   build/default/bench/tiermem-cast-bench --benchmark_min_time=0.5
//
// Bytes per element (counter bytes_per_elem): 4 read + 2 written = 6 for the narrowing casts,
// 2 + 4 = 6 for the widening ones (write-allocate not counted). Every output is checked against
// the scalar function, element by element, before timing.
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>

#include "bench/triad.h"
#include "tiermem/cast.h"
#include "tiermem/dtype.h"

namespace tiermem::bench {
namespace {

constexpr std::size_t kElems = 16 << 20;

void fill(float* x, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) x[i] = std::sin(static_cast<float>(i) * 0.001f) * 100.0f;
}
void fill(std::uint16_t* x, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) x[i] = static_cast<std::uint16_t>(i * 2654435761u);
}
bool same(std::uint16_t a, std::uint16_t b) { return a == b; }
bool same(float a, float b) { return f32_bits(a) == f32_bits(b); }

void set_counters(benchmark::State& state, std::size_t n) {
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(n) * 6);
  state.counters["bytes_per_elem"] = 6;
}

// The per-element loop over `Cast` (the code path before the bulk kernels).
template <typename From, typename To, To (*Cast)(From)>
void BM_Loop(benchmark::State& state) {
  const std::size_t n = kElems;
  std::unique_ptr<From[]> src(new From[n]);
  std::unique_ptr<To[]> dst(new To[n]);
  fill(src.get(), n);
  for (std::size_t i = 0; i < n; ++i) dst[i] = Cast(src[i]);
  if (!same(dst[n / 3], Cast(src[n / 3]))) {
    state.SkipWithError("cast output check failed");
    return;
  }
  for (auto _ : state) {
    const From* s = src.get();
    To* d = dst.get();
    for (std::size_t i = 0; i < n; ++i) d[i] = Cast(s[i]);
    benchmark::ClobberMemory();
  }
  set_counters(state, n);
}

// One bulk kernel (`Bulk` with the ISA in state.range(0)), checked against `Cast` before timing.
template <typename From, typename To, To (*Cast)(From),
          void (*Bulk)(const From*, To*, std::size_t, CastIsa)>
void BM_Bulk(benchmark::State& state) {
  const auto isa = static_cast<CastIsa>(state.range(0));
  state.SetLabel(std::string(cast_isa_name(isa)));
  if (!cast_isa_supported(isa)) {
    state.SkipWithError("not supported by this CPU");
    return;
  }
  const std::size_t n = kElems;
  std::unique_ptr<From[]> src(new From[n]);
  std::unique_ptr<To[]> dst(new To[n]);
  fill(src.get(), n);
  Bulk(src.get(), dst.get(), n, isa);
  for (std::size_t i = 0; i < n; ++i) {
    if (!same(dst[i], Cast(src[i]))) {
      state.SkipWithError("cast output differs from the scalar function");
      return;
    }
  }
  for (auto _ : state) {
    Bulk(src.get(), dst.get(), n, isa);
    benchmark::ClobberMemory();
  }
  set_counters(state, n);
}

void isa_args(benchmark::internal::Benchmark* b) {
  for (CastIsa isa : {CastIsa::kScalar, CastIsa::kAvx2, CastIsa::kAvx512}) {
    if (cast_isa_supported(isa)) b->Arg(static_cast<std::int64_t>(isa));
  }
  b->ArgName("isa")->UseRealTime()->Unit(benchmark::kMillisecond);
}

BENCHMARK_TEMPLATE(BM_Loop, float, std::uint16_t, f32_to_bf16)
    ->Name("F32ToBf16")
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(BM_Loop, float, std::uint16_t, f32_to_f16)
    ->Name("F32ToF16")
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(BM_Loop, std::uint16_t, float, bf16_to_f32)
    ->Name("Bf16ToF32")
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(BM_Loop, std::uint16_t, float, f16_to_f32)
    ->Name("F16ToF32")
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(BM_Bulk, float, std::uint16_t, f32_to_bf16, f32_to_bf16_n)
    ->Name("F32ToBf16N")
    ->Apply(isa_args);
BENCHMARK_TEMPLATE(BM_Bulk, float, std::uint16_t, f32_to_f16, f32_to_f16_n)
    ->Name("F32ToF16N")
    ->Apply(isa_args);
BENCHMARK_TEMPLATE(BM_Bulk, std::uint16_t, float, bf16_to_f32, bf16_to_f32_n)
    ->Name("Bf16ToF32N")
    ->Apply(isa_args);
BENCHMARK_TEMPLATE(BM_Bulk, std::uint16_t, float, f16_to_f32, f16_to_f32_n)
    ->Name("F16ToF32N")
    ->Apply(isa_args);

}  // namespace
}  // namespace tiermem::bench

BENCHMARK_MAIN();
