// tiermem-bench prefetch — replay a training step's access trace against a model of the tiers
// and compare residency policies: lru, deepspeed (ZeRO-Infinity's reuse-distance release and
// stop-at-NVMe prefetch, emulated) and belady (tiermem's Prefetcher). Pure simulation: no I/O.
//
//   cmake --build build --target tiermem-bench
//   build/bin/tiermem-bench prefetch --model gpt2-xl --device-budget-frac 0.25 --json
//   build/bin/tiermem-bench prefetch --trace my.trace --device-budget 2GiB --home host
//
// Trace files: one access per line, `id bytes phase` (see tier_simulator.h). The model of the
// tiers, the metrics and the efficiency definition are documented in include/tiermem/
// tier_simulator.h; docs/benchmarks.md ("Prefetcher") records a run.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "bench/bench.h"
#include "core/cli_checks.h"
#include "tiermem/config.h"
#include "tiermem/error.h"
#include "tiermem/tier_simulator.h"

namespace tiermem::bench {
namespace {

struct PrefetchArgs {
  std::string trace_path;
  std::string model = "gpt2-xl";
  std::string dtype = "bf16";
  double device_budget_frac = 0;  // 0: 0.25, or the trace's largest tensor where that is more
  std::string device_budget;  // bytes; overrides the fraction
  double host_budget_frac = 0.5;
  std::string host_budget;
  std::string home = "nvme";
  double nvme_gbps = 6.0;
  double h2d_gbps = 24.0;
  double compute_gbps = 0;  // 0 = the bottleneck bandwidth (compute matches transfer)
  double backward_factor = 2.0;
  int steps = 3;
  double bucket_elems = 5e7;
  double max_live_elems = 1e9;
  double max_reuse_elems = 1e9;
  std::string nvme_prefetch = "256MiB";
  bool json = false;
};

DType parse_dtype(const std::string& s) {
  if (s == "bf16") return DType::kBF16;
  if (s == "fp16" || s == "f16") return DType::kF16;
  if (s == "fp32" || s == "f32") return DType::kF32;
  throw ConfigError("--dtype", s, "one of bf16, fp16, fp32");
}

int run_prefetch(const PrefetchArgs& a) {
  const DType dtype = parse_dtype(a.dtype);
  std::vector<Access> trace =
      a.trace_path.empty() ? generate_model_trace(a.model, dtype) : load_trace_file(a.trace_path);
  const std::uint64_t all = distinct_bytes(trace);

  TierModel m;
  m.home = a.home == "host" ? Tier::kHost : Tier::kNvme;
  if (a.home != "host" && a.home != "nvme") throw ConfigError("--home", a.home, "nvme or host");
  // The device holds each tensor whole while it is used: a budget below the largest cannot run.
  std::uint64_t largest = 0;
  for (const Access& x : trace) largest = std::max(largest, x.bytes);
  if (!a.device_budget.empty()) {
    m.device_budget_bytes = parse_size(a.device_budget, "--device-budget");
    if (m.device_budget_bytes < largest) {
      throw ConfigError("--device-budget", a.device_budget,
                        "is below the trace's largest tensor (" + format_bytes(largest) + "): give at least that");
    }
  } else {
    const double frac = a.device_budget_frac > 0 ? a.device_budget_frac : 0.25;
    m.device_budget_bytes = static_cast<std::uint64_t>(frac * double(all));
    if (m.device_budget_bytes < largest && a.device_budget_frac > 0) {
      char need[32], given[32];
      std::snprintf(need, sizeof need, "%.3f", std::ceil(1000.0 * double(largest) / double(all)) / 1000.0);
      std::snprintf(given, sizeof given, "%g", a.device_budget_frac);
      throw ConfigError("--device-budget-frac", given,
                        "gives " + format_bytes(m.device_budget_bytes) + ", below the trace's largest tensor (" +
                            format_bytes(largest) + "): give at least " + need + ", or --device-budget");
    }
    m.device_budget_bytes = std::max(m.device_budget_bytes, largest);  // the default: the largest fits
  }
  m.host_budget_bytes = a.host_budget.empty()
                            ? static_cast<std::uint64_t>(a.host_budget_frac * double(all))
                            : parse_size(a.host_budget, "--host-budget");
  m.nvme_to_host_gbps = a.nvme_gbps;
  m.host_to_device_gbps = a.h2d_gbps;
  m.compute_gbps = a.compute_gbps > 0
                       ? a.compute_gbps
                       : (m.home == Tier::kNvme ? std::min(a.nvme_gbps, a.h2d_gbps) : a.h2d_gbps);
  m.backward_factor = a.backward_factor;
  m.steps = a.steps;

  const std::uint64_t es = dtype_size(dtype);
  PrefetcherOptions o;
  o.prefetch_bucket_bytes = static_cast<std::uint64_t>(a.bucket_elems) * es;
  o.max_live_bytes = static_cast<std::uint64_t>(a.max_live_elems) * es;
  o.max_reuse_distance_bytes = static_cast<std::uint64_t>(a.max_reuse_elems) * es;
  o.nvme_prefetch_bytes = parse_size(a.nvme_prefetch, "--nvme-prefetch");

  const std::string source = a.trace_path.empty() ? a.model : a.trace_path;
  std::printf("trace %s: %zu accesses, %s distinct; device %s, host %s (home %s); nvme->host "
              "%.1f GB/s, host->device %.1f GB/s, compute %.1f GB/s (backward x%.1f)\n",
              source.c_str(), trace.size(), format_bytes(all).c_str(),
              format_bytes(m.device_budget_bytes).c_str(), format_bytes(m.host_budget_bytes).c_str(),
              a.home.c_str(), m.nvme_to_host_gbps, m.host_to_device_gbps, m.compute_gbps,
              m.backward_factor);
  std::printf("%-10s %12s %12s %12s %8s %10s %10s %10s %10s\n", "policy", "nvme->host",
              "host->dev", "moved", "hit", "stall s", "step s", "ideal s", "efficiency");
  nlohmann::json out;
  for (SimPolicy p : {SimPolicy::kLru, SimPolicy::kDeepSpeed, SimPolicy::kBelady}) {
    SimResult r = simulate(trace, m, p, o);
    std::printf("%-10s %12s %12s %12s %8.3f %10.4f %10.4f %10.4f %10.3f\n", r.policy.c_str(),
                format_bytes(r.bytes_nvme_to_host).c_str(),
                format_bytes(r.bytes_host_to_device).c_str(), format_bytes(r.bytes_moved).c_str(),
                r.hit_rate, r.stall_seconds, r.step_seconds, r.ideal_seconds, r.efficiency);
    out["policies"][r.policy] = {
        {"bytes_moved", r.bytes_moved},
        {"bytes_nvme_to_host", r.bytes_nvme_to_host},
        {"bytes_host_to_device", r.bytes_host_to_device},
        {"hit_rate", r.hit_rate},
        {"stall_seconds", r.stall_seconds},
        {"step_seconds", r.step_seconds},
        {"compute_seconds", r.compute_seconds},
        {"ideal_seconds", r.ideal_seconds},
        {"efficiency", r.efficiency},
        {"peak_device_bytes", r.peak_device_bytes},
        {"peak_host_bytes", r.peak_host_bytes},
    };
  }
  out["trace"] = source;
  out["accesses"] = trace.size();
  out["distinct_bytes"] = all;
  out["device_budget_bytes"] = m.device_budget_bytes;
  out["host_budget_bytes"] = m.host_budget_bytes;
  if (a.json) std::cout << out.dump() << std::endl;
  return 0;
}

std::function<int()> setup_prefetch(CLI::App& sub) {
  auto a = std::make_shared<PrefetchArgs>();
  sub.add_option("--trace", a->trace_path, "trace file: `id bytes phase` per line");
  sub.add_option("--model", a->model, "generated trace: gpt2-small|gpt2-medium|gpt2-xl|llama-7b|llama-70b");
  sub.add_option("--dtype", a->dtype, "parameter dtype of generated traces and of *_elems: bf16|fp16|fp32");
  sub.add_option("--device-budget-frac", a->device_budget_frac, "device budget as a fraction of the trace's distinct bytes [default: 0.25, or what the largest tensor needs]")->check(tiermem::cli::number_check())->check(tiermem::cli::within(1e-6, 1));
  sub.add_option("--device-budget", a->device_budget, "device budget in bytes (\"2GiB\"); overrides the fraction");
  sub.add_option("--host-budget-frac", a->host_budget_frac, "host cache (NVMe home) as a fraction of distinct bytes")->check(tiermem::cli::number_check())->check(tiermem::cli::within(0, 1));
  sub.add_option("--host-budget", a->host_budget, "host cache in bytes; overrides the fraction");
  sub.add_option("--home", a->home, "where tensors live at rest: nvme|host");
  sub.add_option("--nvme-gbps", a->nvme_gbps, "NVMe->host bandwidth, GB/s")->check(tiermem::cli::number_check())->check(tiermem::cli::within(1e-3, 1e4));
  sub.add_option("--h2d-gbps", a->h2d_gbps, "host->device bandwidth, GB/s")->check(tiermem::cli::number_check())->check(tiermem::cli::within(1e-3, 1e4));
  sub.add_option("--compute-gbps", a->compute_gbps, "parameter bytes computed per second in forward, GB/s (0 = the bottleneck bandwidth)")->check(tiermem::cli::number_check())->check(tiermem::cli::within(0, 1e6));
  sub.add_option("--backward-factor", a->backward_factor, "backward compute time / forward compute time")->check(tiermem::cli::number_check())->check(tiermem::cli::within(0, 100));
  sub.add_option("--steps", a->steps, "simulated steps; metrics from the last")->check(tiermem::cli::whole_number_check())->check(CLI::Range(2, 100));
  sub.add_option("--prefetch-bucket-elems", a->bucket_elems, "stage3_prefetch_bucket_size (elements)")->check(tiermem::cli::number_check())->check(tiermem::cli::within(0, 1e15));
  sub.add_option("--max-live-elems", a->max_live_elems, "stage3_max_live_parameters (elements)")->check(tiermem::cli::number_check())->check(tiermem::cli::within(0, 1e15));
  sub.add_option("--max-reuse-elems", a->max_reuse_elems, "stage3_max_reuse_distance (elements)")->check(tiermem::cli::number_check())->check(tiermem::cli::within(0, 1e15));
  sub.add_option("--nvme-prefetch", a->nvme_prefetch, "tiermem.nvme_prefetch_bytes (bytes)");
  sub.add_flag("--json", a->json, "print one JSON object as the last line");
  return [a] { return run_prefetch(*a); };
}

}  // namespace

TIERMEM_BENCH_COMMAND(prefetch, "prefetch",
                      "simulate residency policies (lru, deepspeed, belady) on an access trace",
                      setup_prefetch);

}  // namespace tiermem::bench
