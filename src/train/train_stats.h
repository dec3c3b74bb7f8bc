// src/train/train_stats.h — what tiermem-train prints: the live per-step line, eval lines and
// the end-of-run summary, as text (stdout) or, with --json, one JSON object per line.
//
// JSON lines (stdout, one object per line, the summary always the last line printed):
//   {"step":N,"steps":T,"loss":..,"lr":..,"tokens":..,"seconds":..,"tokens_per_s":..,
//    "gflops":..,"moved_bytes":{"nvme->host":..,...},"stall_seconds":..,"stall_pct":..,
//    "eta_seconds":..}
//   {"eval":{"step":N,"loss":..}}
//   {"summary":{"initial_loss":..,"final_loss":..,"steps":..,"param_bytes":..,
//    "optimizer_bytes":..,"param_count":..,"vocab_size":..,"device_budget_bytes":..,
//    "device_peak_bytes":..,"activation_peak_bytes":..,"activation_checkpointing":..,
//    "nvme_bytes_read":..,"nvme_bytes_written":..,"stall_seconds":..,"seconds":.., ...,
//    "step_seconds":..,"step_seconds_mean":..,"compute_share":..,"io_wait_share":..,"communication_share":..,
//    "optimizer_share":..,"shares_of_steps":..,"steady_seconds":..,"plan_inputs":{"batch","grad_accum","seq_len","n_layer","n_head",
//    "d_model","context","vocab"},   (the last three groups: what tiermem-plan --check reads)
//    "last_step_io":{"nvme_read_bytes","nvme_written_bytes","wall_seconds","stall_seconds",
//    "compute_seconds","io_bound_seconds","nvme_read_gbps","nvme_write_gbps"}}}  (StepIo)
// Losses are printed with enough digits to round-trip a double exactly, so two runs' losses can
// be compared bitwise from their output.
//
// Thread-safety: a Reporter is used by one thread (rank 0's main thread).
#pragma once

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>

#include "tiermem/tier.h"

namespace tiermem::train {

// Bytes moved between tiers: bytes[from][to] (Tier numeric values).
struct TierTraffic {
  std::uint64_t bytes[kNumTiers][kNumTiers] = {};
  TierTraffic operator-(const TierTraffic& o) const;
  TierTraffic& operator+=(const TierTraffic& o);
  std::uint64_t total() const;
};

struct StepReport {
  int step = 0, steps = 0;    // 1-based step, total steps
  double loss = 0;            // mean training loss over the step's micro-batches (and ranks)
  double lr = 0;
  double grad_norm = 0;       // global L2 norm of the mean gradient, before clipping (NaN: unknown)
  std::uint64_t tokens = 0;   // tokens processed this step (all ranks)
  double seconds = 0;         // wall time of the step
  double flops = 0;           // model FLOPs this step (all ranks): forward + backward
  TierTraffic moved;          // this step
  double stall_seconds = 0;   // time compute waited on tier moves this step
  double eta_seconds = 0;
};

// The last optimizer step's NVMe traffic against the NVMe's rates (ZeroEngine's
// ZeroStats::last_step_*; all 0 for engines without a store). Seconds, bytes, GB/s (1e9 bytes/s).
struct StepIo {
  std::uint64_t nvme_read_bytes = 0, nvme_written_bytes = 0;
  double wall_seconds = 0;     // the step's wall time, as the engine measured it
  double stall_seconds = 0;    // waits for tier moves within it
  double compute_seconds = 0;  // wall - stall
  double io_bound_seconds = 0; // read / read_gbps + written / write_gbps; 0 when a rate is unknown
  double read_gbps = 0, write_gbps = 0;  // 0: unknown (tiermem.nvme_*_gbps, tiermem.machine_profile)
};

// Time split of the run, seconds (rank 0's view).
struct TimeSplit {
  double compute = 0, io_wait = 0, comm = 0, optimizer = 0, other = 0;
};

struct Summary {
  std::string model;
  int world_size = 1;
  int steps = 0;              // steps run in this process (after a resume: only those)
  int final_step = 0;
  std::uint64_t tokens = 0;
  double seconds = 0;
  double initial_loss = 0, final_loss = 0;
  std::optional<double> final_eval_loss;
  std::uint64_t param_count = 0;       // parameters actually trained (with vocab_size's wte)
  int vocab_size = 0;                  // the vocabulary actually trained
  std::uint64_t param_bytes = 0;       // fp32 (or 16-bit working) parameters, whole model
  std::uint64_t optimizer_bytes = 0;   // fp32 master + Adam m + v, whole model
  std::uint64_t device_budget_bytes = 0, device_peak_bytes = 0;
  std::uint64_t host_budget_bytes = 0, host_peak_bytes = 0;
  // host_peak_bytes by part (EngineStats) plus the model's activations, and what the OS says.
  std::uint64_t host_pool_peak_bytes = 0, host_bounce_bytes = 0, host_engine_peak_bytes = 0;
  std::uint64_t host_grad_buffer_peak_bytes = 0, activation_bytes = 0, host_sim_device_bytes = 0;
  std::uint64_t updates_in_backward = 0;  // modules updated during backward (tiermem.update_in_backward)
  // The model's activation memory: allocated once, so activation_bytes is also its peak. With
  // activation checkpointing, activation_checkpoint_bytes of it are the kept block inputs.
  bool activation_checkpointing = false;
  std::uint64_t activation_checkpoint_bytes = 0;
  std::uint64_t max_rss_bytes = 0;  // getrusage(RUSAGE_SELF).ru_maxrss of this process
  std::uint64_t nvme_peak_bytes = 0;
  std::uint64_t nvme_bytes_read = 0, nvme_bytes_written = 0;
  TierTraffic moved;
  double stall_seconds = 0;
  TimeSplit split;
  double flops = 0;
  std::string param_offload, optimizer_offload, device_kind;
  int zero_stage = 0;
  // What tiermem-plan --check compares (plan.h): the steady step time (the median step after
  // the first; step_seconds_mean: their mean), the time split of those steps as shares (each the
  // median over those steps of the step's own share: steady_shares), and the run's inputs under
  // "plan_inputs".
  double step_seconds = 0, step_seconds_mean = 0;
  // Each part's share of a step, the median over the steps after the first (all of them for a
  // one-step run); steady_seconds their wall time (`split` is the whole run's, first step too).
  TimeSplit steady_shares;
  double steady_seconds = 0;
  StepIo last_step_io;  // the bound line (text) and "last_step_io" (JSON)
  int batch = 0, grad_accum = 0, seq_len = 0;
  struct GptDims {
    int n_layer = 0, n_head = 0, d_model = 0, context = 0, vocab = 0;
  } gpt;
};

class Reporter {
 public:
  // json: JSON lines instead of text. live: overwrite the step line in place (a terminal).
  // out == nullptr: print nothing (ranks other than 0).
  Reporter(bool json, bool live, std::FILE* out = stdout);
  void header(const std::string& text);  // text mode only: printed as is
  void step(const StepReport& r, bool keep_line);
  void eval(int step, double loss);
  // Ends a live (carriage-return) step line so a log line can follow. Text mode only.
  void flush_line();
  void summary(const Summary& s);

 private:
  bool json_, live_;
  std::FILE* out_;
  bool pending_cr_ = false;
};

// "1.23 GB" style (decimal GB = 1e9 bytes, as bandwidths are quoted).
std::string format_gb(std::uint64_t bytes);
// "2m05s".
std::string format_duration(double seconds);
// The summary's "I/O bound" line (with its newline): the last step's NVMe time at the rates
// against its compute and wall time, or, when a rate is unknown, how to measure them.
std::string io_bound_line(const StepIo& io);

}  // namespace tiermem::train
