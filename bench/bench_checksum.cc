// tiermem-bench checksum — what the swap checksums cost: hash throughput of the extent checksum
// (XXH3-64, the AVX2 build when the CPU has it) against libxxhash's XXH3 and XXH64 (what
// SwapSpace used before issue 17) and a memcpy of the same buffer (the roofline: a pass that
// reads the bytes once).
//
//   cmake --build --preset cpu --target tiermem-bench
//   build/cpu/bin/tiermem-bench checksum --size 8M --reps 20
//   build/cpu/bin/tiermem-bench checksum --size 1M --reps 50 --json
//
// Each rep times every kind once, in a rotating order (interleaved, so load on a shared machine
// hits all kinds alike); it prints the median GB/s (1e9 B/s) per kind and the checksum's cost in
// CPU seconds per GB swapped (one hash on write + one on read). The buffer is hashed warm (in
// cache when it fits), as SwapSpace hashes a chunk just written from or read into memory.
#include <xxhash.h>

#include <cstring>
#include <iostream>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "bench/bench.h"
#include "core/cli_checks.h"
#include "nvme/checksum.h"
#include "tiermem/config.h"
#include "tiermem/error.h"

namespace tiermem::bench {
namespace {

struct ChecksumOptions {
  std::string size = "8M";
  int reps = 20;
  bool json = false;
};

int run_checksum(const ChecksumOptions& o) {
  const std::uint64_t bytes = parse_size_within(o.size, "--size", "4K", "4G");  // two buffers of it
  std::vector<char> src(bytes), dst(bytes);
  for (std::uint64_t i = 0; i < bytes; ++i) src[i] = static_cast<char>(i * 2654435761u >> 13);
  std::memcpy(dst.data(), src.data(), bytes);  // prefault
  volatile std::uint64_t sink = 0;
  struct Kind {
    const char* name;
    std::function<void()> run;
    std::vector<double> gbps;
  };
  std::vector<Kind> kinds = {
      {"xxh3 (tiermem)", [&] { sink = sink + detail::extent_checksum(src.data(), bytes); }, {}},
      {"xxh3 (libxxhash)",
       [&] { sink = sink + detail::extent_checksum_portable(src.data(), bytes); },
       {}},
      {"xxh64 (before)", [&] { sink = sink + XXH64(src.data(), bytes, 0); }, {}},
      {"memcpy", [&] { std::memcpy(dst.data(), src.data(), bytes); }, {}},
  };
  for (int r = 0; r < o.reps; ++r) {
    for (std::size_t k = 0; k < kinds.size(); ++k) {
      Kind& kind = kinds[(k + static_cast<std::size_t>(r)) % kinds.size()];
      const double t0 = now_s();
      kind.run();
      kind.gbps.push_back(static_cast<double>(bytes) / (now_s() - t0) / 1e9);
    }
  }
  nlohmann::json out = {{"bench", "checksum"}, {"bytes", bytes}, {"reps", o.reps},
                        {"avx2", detail::extent_checksum_has_avx2()}};
  std::cout << fmt::format("checksum throughput, {} buffer, {} interleaved reps (median GB/s)\n",
                           format_bytes(bytes), o.reps);
  for (const Kind& k : kinds) {
    const double g = median(k.gbps);
    out["gbps"][k.name] = g;
    // Swapping a GB costs one hash on write and one on read.
    const std::string cost =
        std::strcmp(k.name, "memcpy") == 0
            ? ""
            : fmt::format("  ({:.3f} CPU s per GB written + read back)", 2 / g);
    std::cout << fmt::format("  {:<18} {:7.2f} GB/s{}\n", k.name, g, cost);
  }
  if (o.json) std::cout << out.dump() << "\n";
  return 0;
}

TIERMEM_BENCH_COMMAND(checksum, "checksum", "hash throughput of the swap checksums (XXH3 vs XXH64)",
                      [](CLI::App& sub) -> std::function<int()> {
                        auto o = std::make_shared<ChecksumOptions>();
                        sub.add_option("--size", o->size, "buffer size (e.g. 8M, 1M)");
                        sub.add_option("--reps", o->reps, "interleaved repetitions")
                            ->check(tiermem::cli::whole_number_check())
                            ->check(CLI::Range(1, 100000));
                        sub.add_flag("--json", o->json, "one JSON line at the end");
                        return [o] { return run_checksum(*o); };
                      });

}  // namespace
}  // namespace tiermem::bench
