// bench/quantize_bench.cc — Google Benchmark of a frozen base's gather cost at rest
// (tiermem/quantize.h): read_at_rest of one module's shard into the working dtype (int8 per-128
// absmax -> f32 per ISA, bf16 -> f32, int8 -> bf16) beside a plain memcpy of the same module's
// fp32 bytes (what a gather into a buffer costs without conversion), single-threaded, 8 Mi
// elements (a 32 MB fp32 module, about a 1 B Llama MLP matrix). Every output is checked against
// the scalar twin before timing.
//
//   cmake --build build/default --target tiermem-quantize-bench
//   build/default/bench/tiermem-quantize-bench --benchmark_min_time=0.5 --benchmark_repetitions=3
//
// Counter elems_per_s: elements written per second; bytes read per element: 4 (memcpy), 1.03
// (int8), 2 (bf16).
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "tiermem/quantize.h"

namespace tiermem::bench {
namespace {

constexpr std::size_t kElems = 8 << 20;

std::vector<float> values() {
  std::vector<float> x(kElems);
  for (std::size_t i = 0; i < kElems; ++i) x[i] = std::sin(static_cast<float>(i) * 0.001f) * 0.05f;
  return x;
}

void count(benchmark::State& state) {
  state.counters["elems_per_s"] = benchmark::Counter(static_cast<double>(state.iterations()) * kElems,
                                                     benchmark::Counter::kIsRate);
}

void BM_MemcpyF32(benchmark::State& state) {
  const std::vector<float> src = values();
  std::vector<float> dst(kElems);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), kElems * sizeof(float));
    benchmark::ClobberMemory();
  }
  count(state);
}

// read_at_rest of format state.range(0) into dtype state.range(1), ISA state.range(2).
void BM_ReadAtRest(benchmark::State& state) {
  const auto d = static_cast<FrozenDtype>(state.range(0));
  const auto w = static_cast<DType>(state.range(1));
  const auto isa = static_cast<CastIsa>(state.range(2));
  state.SetLabel(std::string(frozen_dtype_name(d)) + "->" + std::string(dtype_name(w)) + " " +
                 std::string(cast_isa_name(isa)));
  if (!cast_isa_supported(isa)) {
    state.SkipWithError("not supported by this CPU");
    return;
  }
  const std::vector<float> src = values();
  std::vector<std::byte> rest(at_rest_bytes(d, kElems, 4));
  write_at_rest(d, src.data(), 0, kElems, kElems, rest.data());
  std::vector<std::byte> out(kElems * dtype_size(w)), want(out.size());
  read_at_rest(d, rest.data(), kElems, w, out.data(), isa);
  read_at_rest(d, rest.data(), kElems, w, want.data(), CastIsa::kScalar);
  if (out != want) {
    state.SkipWithError("output differs from the scalar twin");
    return;
  }
  for (auto _ : state) {
    read_at_rest(d, rest.data(), kElems, w, out.data(), isa);
    benchmark::ClobberMemory();
  }
  count(state);
}

void cases(benchmark::internal::Benchmark* b) {
  const auto i8 = static_cast<std::int64_t>(FrozenDtype::kInt8), b16 = static_cast<std::int64_t>(FrozenDtype::kBF16);
  const auto f32 = static_cast<std::int64_t>(DType::kF32), bf = static_cast<std::int64_t>(DType::kBF16);
  for (CastIsa isa : {CastIsa::kScalar, CastIsa::kAvx512}) {
    const auto k = static_cast<std::int64_t>(isa);
    b->Args({i8, f32, k})->Args({b16, f32, k})->Args({i8, bf, k});
  }
  b->UseRealTime()->Unit(benchmark::kMillisecond);
}

BENCHMARK(BM_MemcpyF32)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_ReadAtRest)->Apply(cases);

}  // namespace
}  // namespace tiermem::bench

BENCHMARK_MAIN();
