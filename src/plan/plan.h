// src/plan/plan.h — tiermem-plan's model of a run: bytes per tier, minimum budgets, the
// largest model that fits, and the step time split by resource, predicted from a machine profile
// before anything is allocated; and the comparison of a prediction with a tiermem-train summary.
//
// Bytes come from plan_zero (tiermem/zero_plan.h), the function ZeroEngine itself calls, so the
// planner and the engine agree on homes, sub-group size and minimum budgets by construction.
// Peaks add what the engine and the trainer allocate around that state (bounce chunks, gradient
// buffers, activations, SimDevice memory), each from the same formulas the code uses.
//
// Time (one rank, one optimizer step), from the profile's measured rates:
//   compute    model FLOPs of the step (gpt::flops_per_token, or a given model's) / compute_gflops
//   params     stage 3 with offloaded parameters: the step's module accesses replayed by the tier
//              simulator (tiermem/tier_simulator.h, Belady policy, the engine's budgets) give the
//              NVMe->host and host->device bytes and the stall not hidden behind compute
//   gradients  each micro-batch's fp32 gradients handed to the engine (world 1: what the profile
//              measured the hand-off to add to the model's backward, grad_handoff_seconds(), else
//              a host copy at d2h_gbps; several ranks: a reduce-scatter at comm_gbps)
//   gather     stage 3, several ranks: all-gather of each module, forward and backward
//   optimizer  sub-groups pipelined: max(the step at optimizer_params_per_s — else Adam at
//              cpu_adam_params_per_s plus the new working parameters' copy —, the optimizer
//              state's NVMe read + write) + what the working parameters' home adds (NVMe writes)
//              (the overlapped step: each module's update at its gather, or at one rank on a SimDevice
//              running ahead beside the previous module's compute: update_replay.h)
// step = forward/backward (compute + stall) + gradients + gather + optimizer. The bottleneck is
// the largest of compute, the NVMe link, the host->device link, communication and Adam.
//
// Units: *_bytes bytes, *_gbps 1e9 bytes/s, *_s seconds, FLOP counts as multiply-add = 2.
// Thread-safety: plain values and pure functions (load_profile reads a file); reentrant.
// Errors: ConfigError naming the key path ("<file>: <key>") and value for a bad profile or
// summary; gpt::GptConfig errors for bad model dimensions.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "gpt/model.h"
#include "tiermem/config.h"
#include "tiermem/device.h"
#include "tiermem/zero_plan.h"

namespace tiermem::plan {

// The run to price, in plain values: what tiermem-train resolves for a run (train::TrainPlan,
// which tools/tiermem-plan copies these from), reduced to what the planner reads. The planner
// does not depend on the trainer.
struct RunShape {
  gpt::GptConfig model;  // dimensions (vocabulary as the run makes it)
  int batch = 0;         // micro-batch per rank (sequences)
  int grad_accum = 1;    // micro-batches per optimizer step
  int seq_len = 0;       // tokens per sequence
  int world_size = 1;    // ranks
  Config config;         // the effective config (budgets 0: resolved for the machine)
  // A model tiermem-train does not build (a PyTorch model trained through tiermem.torch), as the
  // engine and the step see it: its engine modules (units) in registration order, which of them
  // are frozen, its FLOPs per token and whether its output head gathers the first module again
  // (a tied embedding). numels empty: tiermem-train's GPT of `model` (embedding, blocks, final
  // norm). Given, `model` keeps only the width the profile's rates are read at (d_model) and the
  // layers (n_layer: one layer's bytes are the total's less the first and last modules', over
  // it); the model's activations and gradients are its framework's memory, not the engine's or a
  // trainer's, so no host or device peak counts them.
  struct Modules {
    std::vector<std::size_t> numels;
    std::vector<bool> frozen;     // empty: none
    double flops_per_token = 0;   // forward + backward, multiply-add = 2 (0: gpt::flops_per_token)
    bool head_tied = true;
    bool given() const { return !numels.empty(); }
  } modules;
};

// What a machine can do, measured (tiermem-bench profile --json) or written from published
// figures (profiles/*.json, each figure's source in `sources`).
struct MachineProfile {
  std::string name;
  DeviceKind device = DeviceKind::kSim; // what the model computes on: sim (CPU kernels) | cuda
  std::string cpu_isa;                  // Adam kernel ISA the figures were measured with
  int gpus = 1;                         // devices (ranks) in the machine
  double compute_gflops = 0;            // model FLOP/s of one rank's compute backend (GFLOP/s)
  // Optional: the model's measured rate by d_model (tiermem-bench profile) for micro-batches of
  // 512 tokens and (_128) of 128 tokens; the rate of a run is interpolated linearly in
  // log(d_model), then in log(tokens per micro-batch) between the two, clamped at the ends.
  std::vector<std::pair<int, double>> compute_gflops_by_width, compute_gflops_by_width_128;
  double cpu_adam_params_per_s = 0;     // CPU AdamW, all the machine's cores (ranks share it)
  // Optional (tiermem-bench profile): the engine's own work at world 1, measured through
  // ZeroEngine as tiermem-train drives it.
  // grad_handoff_gbps_by_width, grad_handoff_pass_gbps_by_width: what handing each module's fp32
  // gradient to reduce_gradients (the copy into the partition with the folded norm, on the
  // gradient thread) adds to the model's own backward pass, by d_model: per backward pass, one
  // block's and the embedding's gradient bytes per second added at its end (the last block's
  // and the embedding's hand-offs, which no backward hides; 0: none), and the other modules'
  // bytes per second added (per byte). Interpolated in log(d_model), clamped.
  // grad_handoff_gbps_by_module_elems (profiles written before the hand-off was measured
  // against the model's own backward): the whole hand-off per byte
  // against one GEMM per module, by module size (elements), interpolated in log(elements) by the
  // run's largest module; used only without the _by_width figures. grad_handoff_gbps: the
  // per-byte figure at the largest size, the fallback of either.
  // optimizer_params_per_s: ZeroEngine::step() with the state in host memory (AdamW, the norm,
  // the new working parameters written to their home), also by module size.
  // Absent (written profiles): the hand-off is priced as a copy at d2h_gbps and the step as Adam
  // at cpu_adam_params_per_s plus the working parameters' copy.
  double grad_handoff_gbps = 0, optimizer_params_per_s = 0;
  std::vector<std::pair<int, double>> grad_handoff_gbps_by_width, grad_handoff_pass_gbps_by_width,
      grad_handoff_gbps_by_module_elems, optimizer_params_per_s_by_module_elems;
  // Optional (tiermem-bench profile): XXH3-64 GB/s on one thread from memory, what each NVMe
  // read and write costs in CPU with tiermem.checksum on. Priced only on the simulated device,
  // whose compute shares those cores (absent: not priced).
  double checksum_gbps = 0;
  int threads = 0;                      // optional: the threads the compute figures used (0: unknown)
  double h2d_gbps = 0, d2h_gbps = 0;    // host <-> device, one rank
  double nvme_read_gbps = 0, nvme_write_gbps = 0;  // all drives together (ranks share them)
  // Optional: the read rate while as many bytes of writes are in flight (the overlapped optimizer
  // step's reads beside its write-backs). Absent (0): the planner prices them one after another.
  double nvme_read_beside_writes_gbps = 0;
  double comm_gbps = 0;                 // per-rank collective bus bandwidth (0: unknown)
  std::uint64_t host_memory_bytes = 0;  // physical host memory (all ranks share it)
  std::uint64_t device_memory_bytes = 0;  // per device (sim: 0, its budget is host memory)
  std::uint64_t nvme_free_bytes = 0;    // free space under the swap paths
  std::map<std::string, std::string> sources;  // field -> where the figure comes from
};

// Reads a profile. Required: compute_gflops, cpu_adam_params_per_s, h2d_gbps, nvme_read_gbps,
// nvme_write_gbps, host_memory_bytes (numbers > 0). Throws ConfigError("<path>: <key>", value,
// why) for a missing file, bad JSON, a missing or non-positive required key, or a wrong type.
MachineProfile parse_profile(const nlohmann::json& j, const std::string& source);
MachineProfile load_profile(const std::string& path);

// The compute rate (GFLOP/s) for a model of width `d_model` in micro-batches of `tokens` on `m`.
double compute_gflops(const MachineProfile& m, int d_model, double tokens = 512);

// The engine's optimizer step rate for modules of `module_elems` elements on `m` (parameters/s;
// 0: not in the profile).
double optimizer_params_per_s(const MachineProfile& m, std::size_t module_elems);

// Seconds one rank's gradient hand-off adds to a step of `run` at world 1 on `m`: `grad_bytes`
// of fp32 gradient (all micro-batches) over `passes` backward passes (micro-batches). With the
// profile's _by_width figures: passes x (one layer's and the first module's bytes) at the per-pass
// rate (exposed at each backward's end) and the rest at the per-byte rate (a per-pass rate of 0:
// all per byte); else grad_bytes at the by-module-size rate of the largest module; else one copy
// at d2h_gbps (h2d_gbps when absent).
// `from` (optional): which of `m`'s figures priced it, in words for the table and the JSON
// ("gradient_handoff_from"), a fallback to one copy said as such. `exposed_s` (optional): the
// part priced at the per-pass rate (the last hand-offs, which backward's end waits for; 0 without
// a per-pass figure).
double grad_handoff_seconds(const MachineProfile& m, const RunShape& run, double grad_bytes, int passes,
                            std::string* from = nullptr, double* exposed_s = nullptr);

// The host and device budgets a run gets when the config leaves them 0, on `m` (as the engine
// resolves them on that machine: host 1/16 of memory in [256 MiB, 1 GiB]; device sim 1 GiB,
// cuda 95 % of device memory). Returns `cfg` with both filled.
Config with_machine_budgets(Config cfg, const MachineProfile& m);

struct TimePrediction {
  double compute_s = 0;        // model FLOPs / compute rate
  double stall_s = 0;          // forward/backward waiting for parameters (not hidden)
  double checksum_s = 0;       // simulated device: the NVMe checksums' CPU time taken from compute (in compute_s)
  double nvme_s = 0;           // NVMe busy time (reads + writes of the step)
  double h2d_s = 0;            // host->device busy time
  double d2h_s = 0;            // device->host / gradient hand-off busy time
  // World 1, as tiermem-train times it: the hand-off's copies run on the gradient thread and take
  // their CPU time from the compute's cores (compute), and the last hand-offs are waited for at
  // backward's end (a wait for a helper thread: I/O wait). Their sum is d2h_s.
  double handoff_compute_s = 0, handoff_wait_s = 0;
  std::string handoff_from;    // world 1: the figures grad_handoff_seconds() priced it from; else empty
  bool optimizer_deferred = false;  // the overlapped step: AdamW runs inside the forward (in optimizer_s)
  // ... each update running ahead of its gather beside the previous module's compute (one rank,
  // host-addressable memory): optimizer_s is then only what of the updates the forward waited for.
  bool optimizer_ahead = false;
  // The overlapped step with optimizer state streamed from NVMe: how its reads were priced
  // (beside the write-backs, or in turn with them); else empty.
  std::string io_wait_from;
  double comm_s = 0;           // collectives (none at world 1: the hand-off is handoff_*_s)
  double adam_s = 0;           // CPU Adam over the rank's shard (or the engine's measured step)
  bool adam_measured_step = false;  // adam_s is the profile's optimizer_params_per_s (whole step)
  double optimizer_s = 0;      // the optimizer phase: max(Adam, its NVMe traffic) + publish
  // The overlapped step: the deferred updates' waits for their state's reads (part of
  // optimizer_s, as tiermem-train counts them; not in stall_s).
  double optimizer_wait_s = 0;
  double step_s = 0;
  std::string bottleneck;      // compute | nvme | host->device | communication | optimizer
};

struct Prediction {
  ZeroPlan zero;               // plan_zero's answer for this run (homes, minimum budgets, fits)
  std::uint64_t params = 0;
  std::uint64_t tokens_per_step = 0;  // all ranks
  double flops_per_step = 0;          // all ranks
  // Peaks, bytes, one rank, as tiermem-train's summary counts them.
  std::uint64_t device_peak_bytes = 0;
  std::uint64_t host_peak_bytes = 0;  // = the parts below
  std::uint64_t host_pool_peak_bytes = 0, host_bounce_bytes = 0, host_engine_bytes = 0;
  std::uint64_t grad_buffer_peak_bytes = 0, activation_bytes = 0, sim_device_bytes = 0;
  std::uint64_t nvme_peak_bytes = 0;
  std::uint64_t device_activation_bytes = 0;  // CUDA backend: activations + workspace (in the device peak)
  // Traffic of one steady-state step, bytes.
  std::uint64_t nvme_read_bytes = 0, nvme_write_bytes = 0, h2d_bytes = 0, comm_bytes = 0;
  TimePrediction time;
  double tokens_per_s = 0, tflops = 0;
  bool fits = true;
  std::string why;   // when !fits: what does not fit, with the numbers
  std::string fix;   // when !fits: the smallest change that makes it run
};

// Predicts `run` (tiermem-train's resolved run: model, batch, seq_len, grad_accum, world size,
// config) on `m`. Budgets left 0 in the config are resolved for `m` (with_machine_budgets).
Prediction predict(const RunShape& run, const MachineProfile& m);

// The largest model of the same width, heads, vocabulary and sequence length (more or fewer
// layers) that fits `m` at this configuration: budgets at their minimum, NVMe state within the
// free space, host peak within host memory, device peak within device memory. n_layer 0 when
// not even one layer fits. `limit` names what stops the next size.
struct LargestModel {
  int n_layer = 0;
  std::uint64_t params = 0;
  std::string limit;
};
LargestModel largest_model(const RunShape& run, const MachineProfile& m);

// Activation bytes gpt::Model allocates for a micro-batch of `batch` x `seq_len`
// (gpt::activation_bytes, without activation checkpointing).
std::uint64_t activation_bytes(const gpt::GptConfig& cfg, int batch, int seq_len);

// The fields --check compares: step_seconds, the four time shares and the three tier peaks.
struct CheckRow {
  std::string field;
  double predicted = 0, measured = 0, rel_error = 0;  // rel_error = |p - m| / m (0 when both 0)
};
// Measured values from a summary object (tiermem-train --json's "summary"). Throws ConfigError
// naming the summary key when a field is missing or not a number.
std::vector<CheckRow> check_against(const Prediction& p, const nlohmann::json& summary,
                                    const std::string& source);

// JSON of a prediction (the --json object of tiermem-plan).
nlohmann::json prediction_json(const Prediction& p);

}  // namespace tiermem::plan
