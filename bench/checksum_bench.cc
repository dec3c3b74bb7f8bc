// bench/checksum_bench.cc — Google Benchmark micro-bench of the extent checksum (XXH3-64): the
// build SwapSpace uses (AVX2 where cpuid has it) and libxxhash's portable build, one thread, on
// 64 MiB (memory-bound) and 1 MiB (cache-resident) inputs, against a same-run STREAM triad.
//
//   cmake --build build/default --target tiermem-checksum-bench
//   build/default/bench/tiermem-checksum-bench --benchmark_min_time=0.5
//
// Bytes per byte hashed (counter bytes_per_elem, element = one byte): 1 read. The two builds
// must agree on the value before timing.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <vector>

#include "bench/triad.h"
#include "nvme/checksum.h"

namespace tiermem::bench {
namespace {

void BM_Checksum(benchmark::State& state) {
  const bool fast = state.range(0) != 0;
  const auto bytes = static_cast<std::size_t>(state.range(1));
  if (fast && !detail::extent_checksum_has_avx2()) {
    state.SkipWithError("no AVX2 on this CPU");
    return;
  }
  std::vector<std::uint8_t> data(bytes);
  for (std::size_t i = 0; i < bytes; ++i) data[i] = static_cast<std::uint8_t>(i * 131 + 7);
  if (detail::extent_checksum(data.data(), bytes) != detail::extent_checksum_portable(data.data(), bytes)) {
    state.SkipWithError("the two builds disagree");
    return;
  }
  std::uint64_t h = 0;
  for (auto _ : state) {
    h ^= fast ? detail::extent_checksum(data.data(), bytes)
              : detail::extent_checksum_portable(data.data(), bytes);
    benchmark::DoNotOptimize(h);
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * static_cast<std::int64_t>(bytes));
  state.counters["bytes_per_elem"] = 1;
  state.SetLabel(fast ? "dispatched" : "portable");
}

BENCHMARK(BM_Checksum)
    ->ArgsProduct({{1, 0}, {64 << 20, 1 << 20}})
    ->ArgNames({"fast", "bytes"})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace tiermem::bench

BENCHMARK_MAIN();
