// tiermem/tier_simulator.h — replay an access trace against a model of the tiers, per policy.
//
// The model behind `tiermem-bench prefetch`: every tensor lives at rest on its home tier (NVMe or
// host); computing an access needs it on the device. Device and host (the cache of NVMe-homed
// tensors) have byte budgets that are never exceeded (space is reserved when a copy is issued).
// Each tier pair is one FIFO copy engine with a bandwidth (NVMe→host, host→device); a
// host→device copy of an NVMe-homed tensor starts once its host copy has arrived, and the host
// copy cannot be evicted before the device copy has read it. Compute is one stream: an access
// takes bytes / compute bandwidth seconds (× backward_factor in the backward phase) and waits
// (stalls) until its tensor is on the device. Tensors are clean (parameters): evicting one moves
// no bytes. The policy is called exactly as TensorStore calls it (residency_policy.h): on_access
// before the demand load, hints issued after it, choose_victim among resident, unpinned,
// not-in-flight tensors, keep_on_release after the compute.
//
// Policies: kLru (no prefetch, keep on release, evict least recently used); kDeepSpeed (an
// emulation of ZeRO-Infinity's stage-3 coordinator: keep on release only under the reuse-distance
// threshold, device prefetch of the bucket that stops at the first tensor not yet on the host,
// NVMe→host reads only for that bucket, LRU when the budget forces an eviction); kBelady (our
// Prefetcher). All three get the same byte options.
//
// Metrics are those of the last simulated step (steady state; the first step records the trace).
// efficiency = ideal_seconds / step_seconds. ideal_seconds is the same for every policy: the
// larger of the step's total compute and, for each tier pair, the bytes that MUST cross it in a
// steady-state step (all distinct bytes minus what the receiving tiers can hold at the step's
// start) at that pair's bandwidth — i.e. the step time with perfect caching and perfect overlap.
// Read it beside bytes_moved (the cache's quality) and stall_seconds (the look-ahead's).
//
// Thread-safety: pure functions over their arguments; thread-safe. Errors: simulate() throws
// OutOfMemoryError when a tensor is larger than a tier's budget, ConfigError on non-positive
// bandwidths; load_trace_file()/parse_trace() throw ConfigError naming file and line.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tiermem/access_trace.h"
#include "tiermem/dtype.h"
#include "tiermem/export.h"
#include "tiermem/prefetcher.h"
#include "tiermem/tier.h"

namespace tiermem {

struct TIERMEM_API TierModel {
  std::uint64_t device_budget_bytes = 1ull << 30;
  std::uint64_t host_budget_bytes = 4ull << 30;  // host cache of NVMe-homed tensors
  Tier home = Tier::kNvme;                       // kNvme or kHost (then host holds everything)
  double nvme_to_host_gbps = 6.0;                // GB/s = 1e9 bytes/s
  double host_to_device_gbps = 24.0;
  double compute_gbps = 6.0;                     // parameter bytes consumed per second, forward
  double backward_factor = 2.0;                  // a backward access computes this much longer
  int steps = 3;                                 // simulated steps; metrics from the last one
};

enum class SimPolicy { kLru, kDeepSpeed, kBelady };
TIERMEM_API std::string_view sim_policy_name(SimPolicy p);  // "lru", "deepspeed", "belady"

struct TIERMEM_API SimResult {
  std::string policy;
  std::uint64_t bytes_nvme_to_host = 0;
  std::uint64_t bytes_host_to_device = 0;
  std::uint64_t bytes_moved = 0;  // sum over tier pairs
  std::uint64_t accesses = 0;
  std::uint64_t device_hits = 0;  // accesses whose tensor was already on the device
  double hit_rate = 0;
  double compute_seconds = 0;
  double stall_seconds = 0;       // compute waiting for data
  double step_seconds = 0;        // end of the previous step's last compute to this one's
  double ideal_seconds = 0;
  double efficiency = 0;
  std::uint64_t peak_device_bytes = 0;  // over the whole run (≤ device budget)
  std::uint64_t peak_host_bytes = 0;    // host cache, over the whole run (≤ host budget)
  std::uint64_t trace_invalidations = 0;
};

// Replays `trace` model.steps times under `policy` (see above). `trace` ids may be any values.
TIERMEM_API SimResult simulate(std::span<const Access> trace, const TierModel& model,
                               SimPolicy policy, const PrefetcherOptions& options);

// Sum of the bytes of the distinct tensors of a trace (each at its first access's size).
TIERMEM_API std::uint64_t distinct_bytes(std::span<const Access> trace);

// One training step of a real model: per layer forward, then backward in reverse; parameter sizes
// of the published architectures (GPT-2 small/medium/xl with tied embeddings, LLaMA 7B and 70B
// with GQA), one access per parameter tensor, `dtype` bytes per element. Tier kDevice.
// Throws ConfigError (key "--model") for an unknown name.
TIERMEM_API std::vector<Access> generate_model_trace(std::string_view model,
                                                     DType dtype = DType::kBF16);
TIERMEM_API std::vector<std::string> model_names();

// Text traces: one access per line, `id bytes phase`. id: any token without blanks (names are
// mapped to dense ids in order of appearance); bytes: a size ("4096", "64MiB"); phase: forward |
// backward | optimizer | other (or fwd | bwd | opt). Blank lines and `#` comments are skipped.
// A bad line throws ConfigError("<source>:<line>", the line, what is wrong).
TIERMEM_API std::vector<Access> parse_trace(std::string_view text, std::string_view source);
TIERMEM_API std::vector<Access> load_trace_file(const std::string& path);

}  // namespace tiermem
