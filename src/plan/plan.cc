// src/plan/plan.cc — tiermem-plan's model (plan.h): bytes per tier through plan_zero, the step's
// time through the tier simulator and the profile's rates, and the largest model that fits. The
// profile is read in profile.cc; the comparison with a run's summary and the JSON are in
// plan_report.cc.
#include "plan/plan.h"
#include "plan/update_replay.h"

#include <algorithm>
#include <cmath>
#include <fmt/format.h>
#include <numeric>
#include <string_view>

#include "gpt/backend.h"
#include "gpt/model.h"
#include "tiermem/device_choice.h"
#include "tiermem/error.h"
#include "tiermem/prefetcher.h"
#include "tiermem/shard.h"
#include "tiermem/tier_simulator.h"

namespace tiermem::plan {
namespace {

using detail::forward_compute_shares;
using detail::gated_read_wait;

constexpr std::uint64_t kMiB = 1ull << 20;
constexpr std::size_t kAlignment = 1024;  // ZeroEngineOptions::alignment_elems (the default)
constexpr int kMaxInflightBuckets = 4;    // ZeroEngineOptions::max_inflight_buckets

std::uint64_t round_up(std::uint64_t x, std::uint64_t a) { return (x + a - 1) / a * a; }
std::uint64_t page_round(std::uint64_t b) { return round_up(std::max<std::uint64_t>(b, 1), 4096); }  // host and device blocks

// Every module's element count, in registration order: embed, block.0 .. block.{L-1}, ln_f. The
// blocks are alike, so the layouts of a one-layer model give them all (the largest-model search
// plans tens of thousands of layers).
std::vector<std::size_t> module_numels(const gpt::GptConfig& g) {
  gpt::GptConfig one = g;
  one.n_layer = 1;
  const std::vector<gpt::ModuleLayout> l = gpt::module_layouts(one);
  std::vector<std::size_t> n;
  n.reserve(static_cast<std::size_t>(g.n_layer) + 2);
  n.push_back(static_cast<std::size_t>(l.at(0).numel));
  n.insert(n.end(), static_cast<std::size_t>(g.n_layer), static_cast<std::size_t>(l.at(1).numel));
  n.push_back(static_cast<std::size_t>(l.at(2).numel));
  return n;
}

std::uint64_t param_count(const std::vector<std::size_t>& numels) {
  return std::accumulate(numels.begin(), numels.end(), std::uint64_t{0});
}

// The run's engine modules: a model given by its modules (RunShape::modules), else tiermem-train's GPT.
std::vector<std::size_t> run_numels(const RunShape& run) {
  return run.modules.given() ? run.modules.numels : module_numels(run.model);
}

// The trained modules' element counts (a frozen module's 0): what gradients and AdamW see.
std::vector<std::size_t> trained_numels(const RunShape& run, std::vector<std::size_t> numels) {
  const std::vector<bool>& frozen = run.modules.frozen;
  for (std::size_t i = 0; i < numels.size() && i < frozen.size(); ++i) numels[i] = frozen[i] ? 0 : numels[i];
  return numels;
}

// The store's device budget as tiermem-train sizes it: the device budget less the room kept for
// all-gathered modules.
std::uint64_t store_device_budget(const ZeroPlan& z) {
  return z.device_budget_bytes > z.gather_reserve_bytes ? z.device_budget_bytes - z.gather_reserve_bytes : 0;
}

// tiermem.device on `m`: auto is the profile's device.
bool device_is_sim(const Config& cfg, const MachineProfile& m) {
  const DeviceChoice asked = parse_device_choice(cfg.tiermem.device, "tiermem.device");
  return resolve_device_kind(asked, m.device == DeviceKind::kCuda) == DeviceKind::kSim;
}

ZeroPlanOptions plan_options(const Config& cfg, const MachineProfile& m, int world) {
  ZeroPlanOptions po;
  po.world_size = world;
  po.alignment_elems = kAlignment;
  po.max_inflight_buckets = kMaxInflightBuckets;
  po.device_host_addressable = device_is_sim(cfg, m) && cfg.tiermem.sim_host_addressable;
  return po;
}

// The configuration the engine gets on `m`: budgets the config leaves 0 resolved for the machine
// and, with the CUDA backend, the device budget less the model's activations and workspace (as
// tiermem-train's make_model_backend does). *backend_bytes: those bytes (0 on a SimDevice);
// *too_small: they fill the device budget (tiermem-train refuses that run).
Config engine_config(const RunShape& run, const MachineProfile& m, std::uint64_t* backend_bytes,
                     bool* too_small) {
  Config cfg = with_machine_budgets(run.config, m);
  *backend_bytes = 0;
  *too_small = false;
  if (!device_is_sim(cfg, m)) {
    // tiermem-train's CUDA model takes its activations and workspace from the device budget; a
    // model given by its modules (a PyTorch model) has its framework's allocator beside the engine.
    *backend_bytes = run.modules.given() ? 0 : gpt::cuda_backend_bytes(run.model, run.batch, run.seq_len);
    std::uint64_t& budget = cfg.tiermem.device_budget_bytes;
    *too_small = *backend_bytes >= budget;
    budget = *too_small ? 4096 : budget - *backend_bytes;
  }
  return cfg;
}

// Per module: frozen and read in place from its host home, never copied to the device
// (DeviceStaging::gather_tier: offload_param cpu on a device the CPU addresses).
std::vector<bool> frozen_in_place(const RunShape& run, const Config& cfg, const MachineProfile& m, const ZeroPlan& z) {
  const bool in_place = z.param_home == Tier::kHost && device_is_sim(cfg, m) && cfg.tiermem.sim_host_addressable;
  return in_place ? run.modules.frozen : std::vector<bool>(run.modules.frozen.size(), false);
}

// Memory of a run (no time): fills the plan and the peaks of `p`.
void predict_memory(const RunShape& run, const Config& cfg, const MachineProfile& m,
                    Prediction& p) {
  const std::vector<std::size_t> numels = run_numels(run);
  ZeroPlanOptions po = plan_options(cfg, m, run.world_size);
  po.frozen_modules = run.modules.frozen;
  p.zero = plan_zero(cfg, numels, po);
  const ZeroPlan& z = p.zero;
  const int stage = cfg.zero.stage;
  const std::uint64_t wsize = cfg.bf16 || cfg.fp16.enabled ? 2 : 4;
  p.params = param_count(numels);

  // Device: the stored working shards homed there, else the store's cache of offloaded ones up
  // to its budget (the device budget less the room kept for all-gathered modules).
  // The pool caches the NVMe-homed working shards, but a frozen module's only while it is written
  // at registration (the engine evicts it then: zero_setup.cc), so of those the largest counts.
  const ShardLayout layout = make_shard_layout(numels, stage == 0 ? 1 : run.world_size, kAlignment);
  const std::vector<bool> in_place = frozen_in_place(run, cfg, m, z);
  std::uint64_t dev_all = 0, host_cache = 0, frozen_cache = 0;
  for (std::size_t i = 0; i < numels.size(); ++i) {
    const bool persistent = stage == 3 && numels[i] < cfg.zero.stage3_param_persistence_threshold_elems;
    const bool stored = stage == 3 && layout.modules[i].shard > 0 && (!persistent || run.world_size == 1);
    if (!stored) continue;
    if (!persistent && i < in_place.size() && in_place[i]) continue;  // read at its host home
    dev_all += page_round(layout.modules[i].shard * wsize);
    if (persistent || z.param_home != Tier::kNvme) continue;
    const std::uint64_t bytes = page_round(layout.modules[i].shard * wsize);
    const bool frozen = i < run.modules.frozen.size() && run.modules.frozen[i];
    if (frozen) {
      frozen_cache = std::max(frozen_cache, bytes);
    } else {
      host_cache += bytes;
    }
  }
  host_cache += frozen_cache;
  if (z.uses_device) {
    const std::uint64_t store_budget = store_device_budget(z);
    // Several ranks: the engine reserves room for two all-gathered modules (the minimum budget),
    // but tiermem-train holds one at a time (acquire, compute, release): the largest one counts.
    std::uint64_t gathered = 0;
    if (run.world_size > 1) {
      for (std::size_t i = 0; i < numels.size(); ++i) {
        const bool persistent = numels[i] < cfg.zero.stage3_param_persistence_threshold_elems;
        if (layout.modules[i].shard > 0 && !persistent) gathered = std::max<std::uint64_t>(gathered, layout.modules[i].padded * wsize);
      }
    }
    // offload_optimizer.ratio < 1: the device's share of the optimizer state (and its gradient
    // partitions) lives there for good, beside the working shards.
    p.device_peak_bytes = std::min(dev_all + z.device_optimizer_bytes, store_budget) + gathered;
  }
  p.sim_device_bytes = device_is_sim(cfg, m) ? p.device_peak_bytes : 0;

  // Host: the store's pool (homes; NVMe-homed working shards and optimizer sub-groups cached
  // while the budget allows), bounce chunks, engine buffers, the trainer's gradient buffers (the
  // tied embedding's plus the largest other module's, fp32) and the model's activations.
  // The pool is a write-back cache of the NVMe-homed state: it fills with all of it (working
  // shards, optimizer state, swapped gradients) up to the budget.
  // offload_optimizer.ratio < 1: the device's share (and its gradient partitions, when homed
  // there) is not cached in the pool.
  const std::uint64_t offloaded = z.rank_flat_elems - z.device_optimizer_elems;
  const std::uint64_t pool = z.host_home_bytes + host_cache + (z.optimizer_home == Tier::kNvme ? 12 * offloaded - 4 * z.single_copy_elems : 0) +
                             (stage >= 2 && z.gradient_home == Tier::kNvme
                                  ? 4 * (z.device_optimizer_grads ? offloaded : z.rank_flat_elems)
                                  : 0);
  p.host_pool_peak_bytes = std::min(pool, z.host_budget_bytes);
  // Bounce chunks are committed at the first NVMe<->device copy: none without NVMe homes or a copy.
  const bool nvme = z.param_home == Tier::kNvme || z.optimizer_home == Tier::kNvme || (stage >= 2 && z.gradient_home == Tier::kNvme);
  const bool direct = device_is_sim(cfg, m) && cfg.tiermem.sim_host_addressable && cfg.tiermem.sim_h2d_gbps == 0 && cfg.tiermem.sim_d2h_gbps == 0;
  p.host_bounce_bytes = nvme && !direct ? cfg.tiermem.pipeline_chunk_bytes * static_cast<std::uint64_t>(cfg.tiermem.pipeline_chunks) : 0;
  p.host_engine_bytes = z.host_engine_bytes;
  // Reduce-scatter buckets (several ranks, stages 2-3): plan_zero counts the most that can be in
  // flight, max_inflight_buckets + 1 of the largest, for the minimum budget. Without overlap_comm
  // (the default) each completes before the next is made: one at a time.
  if (stage >= 2 && run.world_size > 1 && !cfg.zero.overlap_comm) {
    std::uint64_t chunk = 0;
    for (const ModuleShard& s : layout.modules) {
      for (const ElemRange& c : make_reduce_chunks(s.shard, run.world_size, cfg.zero.reduce_bucket_size_elems, kAlignment)) {
        chunk = std::max<std::uint64_t>(chunk, c.size());
      }
    }
    const std::uint64_t bucket = 4ull * chunk * static_cast<std::uint64_t>(run.world_size + 1);
    p.host_engine_bytes -= std::min(p.host_engine_bytes, bucket * static_cast<std::uint64_t>(kMaxInflightBuckets + 1));
    p.host_engine_bytes += bucket;
  }
  std::size_t largest_other = 0;
  for (std::size_t i = 1; i < numels.size(); ++i) largest_other = std::max(largest_other, numels[i]);
  p.grad_buffer_peak_bytes = 4ull * (numels.empty() ? 0 : numels[0] + largest_other);
  // The model's activations: host memory (the CPU backend, SimDevice), or device memory (the CUDA
  // backend: activations and workspace, taken out of the device budget before the engine's share).
  // A model given by its modules: its framework's gradients and activations, not counted.
  if (run.modules.given()) {
    p.grad_buffer_peak_bytes = 0;
  } else if (device_is_sim(cfg, m)) {
    p.activation_bytes = gpt::activation_bytes(run.model, run.batch, run.seq_len);
  } else {
    p.device_activation_bytes = gpt::cuda_backend_bytes(run.model, run.batch, run.seq_len);
    p.device_peak_bytes += p.device_activation_bytes;
  }
  p.host_peak_bytes = p.host_pool_peak_bytes + p.host_bounce_bytes + p.host_engine_bytes +
                      p.grad_buffer_peak_bytes + p.activation_bytes + p.sim_device_bytes;
  p.nvme_peak_bytes = z.nvme_bytes;
}

// What does not fit the machine (beyond the budgets plan_zero checks), and the smallest fix.
void check_fit(const RunShape& run, const Config& cfg, const MachineProfile& m, Prediction& p) {
  const ZeroPlan& z = p.zero;
  const bool sim = device_is_sim(cfg, m);
  if (!z.fits) {
    p.fits = false;
    p.why = z.why;
    const std::uint64_t dev_mem = sim ? m.host_memory_bytes : m.device_memory_bytes;
    const std::string device_fix =
        dev_mem == 0 || z.device_min_bytes <= dev_mem
            ? fmt::format("raise the device budget to {} (--device-budget {} or tiermem.device_budget_bytes)",
                          format_bytes(z.device_min_bytes), z.device_min_bytes)
            : std::string("offload the parameters (--offload nvme, or offload_param.device cpu|nvme)");
    if (z.host_budget_bytes < z.host_min_bytes) {
      if (z.host_min_bytes + p.host_peak_bytes - p.host_pool_peak_bytes <= m.host_memory_bytes) {
        p.fix = fmt::format("raise the host budget to {} (--host-budget {} or tiermem.host_budget_bytes)",
                            format_bytes(z.host_min_bytes), z.host_min_bytes);
      } else if (z.optimizer_home != Tier::kNvme) {
        p.fix = "offload the optimizer state to NVMe (--offload nvme or offload_optimizer.device nvme): the host "
                "cannot hold it";
      } else if (z.param_home != Tier::kNvme && z.param_home != Tier::kDevice) {
        p.fix = "offload the parameters to NVMe too (--offload nvme or offload_param.device nvme): the host "
                "cannot hold them";
      } else {
        // Everything that can go to NVMe is there: what is left is the working set the host must
        // hold at once (the largest working shard, sub-groups in flight).
        const std::uint64_t rest = p.host_peak_bytes - p.host_pool_peak_bytes;
        p.fix = fmt::format("nothing more can move to NVMe: the host pool's minimum {} and the rest of the host peak "
                            "{} (bounce, gradient buffers, activations{}) exceed the machine's {} of memory; split "
                            "the largest module over more ranks (--world-size) or use a narrower model",
                            format_bytes(z.host_min_bytes), format_bytes(rest), sim ? ", the simulated device" : "",
                            format_bytes(m.host_memory_bytes));
      }
      if (z.device_budget_short) p.fix += "; and " + device_fix;
    } else {
      p.fix = device_fix;
    }
    return;
  }
  const int per_node = std::clamp(run.world_size, 1, std::max(1, m.gpus));  // ranks sharing the machine
  const std::uint64_t nvme_need = p.nvme_peak_bytes * static_cast<std::uint64_t>(per_node);
  if (m.nvme_free_bytes && nvme_need > m.nvme_free_bytes) {
    p.fits = false;
    p.why = fmt::format("the NVMe state needs {} ({} x {} rank(s) per machine) but the profile has {} free",
                        format_bytes(nvme_need), format_bytes(p.nvme_peak_bytes), per_node,
                        format_bytes(m.nvme_free_bytes));
    p.fix = fmt::format("add nvme_path entries on other drives with {} more free space, or offload less "
                        "(offload_optimizer.device cpu when the host has room)",
                        format_bytes(nvme_need - m.nvme_free_bytes));
  } else if (p.host_peak_bytes * per_node > m.host_memory_bytes) {
    p.fits = false;
    p.why = fmt::format("the host peak {} x {} rank(s) per machine exceeds the machine's {} of memory "
                        "(activations {}, pool {})",
                        format_bytes(p.host_peak_bytes), per_node, format_bytes(m.host_memory_bytes),
                        format_bytes(p.activation_bytes), format_bytes(p.host_pool_peak_bytes));
    // tiermem-train keeps every activation of a micro-batch (no activation checkpointing).
    if (p.activation_bytes > p.host_peak_bytes / 2 && run.batch > 1) {
      p.fix = fmt::format("a smaller micro-batch (--batch {}) with more accumulation (--grad-accum {})",
                          run.batch / 2, run.grad_accum * 2);
    } else if (p.activation_bytes > p.host_peak_bytes / 2) {
      p.fix = fmt::format("shorter sequences (--seq-len {}): the activations of one sequence do not fit",
                          std::max(1, run.seq_len / 2));
    } else {
      p.fix = "offload to NVMe (--offload nvme) with a smaller host budget";
    }
  } else if (!sim && m.device_memory_bytes && p.device_peak_bytes > m.device_memory_bytes) {
    p.fits = false;
    p.why = fmt::format("the device peak {} exceeds the device's {}", format_bytes(p.device_peak_bytes),
                        format_bytes(m.device_memory_bytes));
    p.fix = "offload the parameters (--offload nvme) or lower tiermem.device_budget_bytes";
  }
}

// One step's parameter accesses (stored modules only), as the trainer makes them: per
// micro-batch, forward 0..n-1 then (`head_tied`) the tied head (module 0), backward head,
// n-1..0.
std::vector<Access> step_trace(const std::vector<std::size_t>& numels, const ShardLayout& layout,
                               const Config& cfg, std::uint64_t wsize, int micro_batches, bool head_tied,
                               const std::vector<bool>& in_place, std::uint64_t& in_place_bytes) {
  std::vector<bool> offloaded(numels.size());
  for (std::size_t i = 0; i < numels.size(); ++i) {
    const bool persistent = numels[i] < cfg.zero.stage3_param_persistence_threshold_elems;
    const bool read_in_place = i < in_place.size() && in_place[i];  // moves nowhere: not in the trace
    offloaded[i] = layout.modules[i].shard > 0 && !persistent && !read_in_place;
    if (read_in_place && !persistent) in_place_bytes += layout.modules[i].shard * wsize;
  }
  std::vector<Access> t;
  auto add = [&](std::size_t i, Phase ph) {
    if (offloaded[i]) t.push_back({static_cast<TensorId>(i), layout.modules[i].shard * wsize, ph, Tier::kDevice});
  };
  for (int mb = 0; mb < micro_batches; ++mb) {
    for (std::size_t i = 0; i < numels.size(); ++i) add(i, Phase::kForward);
    if (head_tied) {
      add(0, Phase::kForward);
      add(0, Phase::kBackward);
    }
    for (std::size_t i = numels.size(); i-- > 0;) add(i, Phase::kBackward);
  }
  return t;
}

void predict_time(const RunShape& run, const Config& cfg, const MachineProfile& machine, Prediction& p) {
  const ZeroPlan& z = p.zero;
  // The ranks of one machine share its drives: each gets 1 / ranks-per-machine of the NVMe rates.
  MachineProfile m = machine;
  const int per_node = std::clamp(run.world_size, 1, std::max(1, machine.gpus));
  m.nvme_read_gbps /= per_node;
  m.nvme_write_gbps /= per_node;
  m.nvme_read_beside_writes_gbps /= per_node;
  m.cpu_adam_params_per_s /= per_node;  // and its CPUs
  TimePrediction& t = p.time;
  const int stage = cfg.zero.stage;
  const int W = std::max(1, run.world_size);
  const std::uint64_t wsize = cfg.bf16 || cfg.fp16.enabled ? 2 : 4;
  const double R = static_cast<double>(z.rank_flat_elems);
  const double P = static_cast<double>(p.params);
  p.tokens_per_step = static_cast<std::uint64_t>(run.batch) * run.seq_len * run.grad_accum * W;
  const double flops_per_token =
      run.modules.flops_per_token > 0 ? run.modules.flops_per_token : gpt::flops_per_token(run.model, run.seq_len);
  p.flops_per_step = flops_per_token * static_cast<double>(p.tokens_per_step);
  const double mb_tokens = static_cast<double>(run.batch) * run.seq_len;
  t.compute_s = p.flops_per_step / W / (compute_gflops(m, run.model.d_model, mb_tokens) * 1e9);

  // NVMe-homed state lives in the host pool's write-back cache, in what the homes leave of the
  // budget; what does not fit streams from NVMe and back every step. The optimizer state, touched
  // once per step, is what falls out first; the parameters keep the rest.
  // Parameters the device keeps for good (the engine publishes new working shards there) never
  // come through the pool. The pool's planned room keeps back what the Prefetcher's host plan
  // does (host_plan_margin, prefetcher.h): 1/32 of the room or two of the largest host-tier
  // tensors (a sub-group's 12-byte-per-element optimizer state), whichever is more.
  const bool host_addressable = device_is_sim(cfg, m) && cfg.tiermem.sim_host_addressable;
  const bool params_on_device = publishes_working_on_device(z, host_addressable, store_device_budget(z));
  const std::vector<std::size_t> numels = run_numels(run);
  const std::vector<std::size_t> trained = trained_numels(run, numels);
  const std::size_t largest_module = *std::max_element(trained.begin(), trained.end());  // with optimizer state
  const std::uint64_t room_bytes = z.host_budget_bytes > z.host_home_bytes ? z.host_budget_bytes - z.host_home_bytes : 0;
  const double slack = static_cast<double>(host_plan_margin(room_bytes, 12ull * std::min(z.sub_group_elems, largest_module)));
  const double room = static_cast<double>(room_bytes);
  const double param_nvme = static_cast<double>(z.nvme_param_bytes), opt_nvme = static_cast<double>(z.nvme_optimizer_bytes);
  // The overlapped optimizer step (below) on memory the CPU addresses writes each module's new
  // working shard where its gather reads it, the device (UpdateScheduler: gather_tier). The
  // parameters then live at the device: its cache keeps those it has room for, and writes each one
  // it evicts, updated, straight to NVMe (TensorStore: no host copy is resident by then). Their
  // host copies are transient: a parameter has no host-tier access in the step's trace, so the
  // host plan (Prefetcher, Belady's MIN over the host-tier accesses) counts it as never used again
  // and evicts it first. So the parameters take no pool room, and the whole pool caches optimizer
  // state and gradient partitions; each parameter the device misses is read from NVMe (the
  // simulator below, with no host room for them) and written back. (Until December 2026 the
  // planner counted every NVMe-homed parameter as held in the pool and streamed all the optimizer
  // state: gpt2-medium --offload nvme --seq-len 64 --batch 1 read 3.95 GB a step planned against
  // 2.96-3.38 measured; docs/notes/2026-12-05-planner-second-step-and-torch-runs.md.)
  const bool overlap = defers_optimizer_step(z, cfg, params_on_device || host_addressable, /*norm_folded=*/!cfg.fp16.enabled);
  const bool params_at_device = params_on_device || (overlap && host_addressable && z.uses_device);
  const double pool_param = params_at_device ? 0.0 : param_nvme;
  const double opt_miss =
      pool_param + opt_nvme > room ? std::min(opt_nvme, pool_param + opt_nvme - std::max(0.0, room - slack)) : 0.0;
  const double param_room = std::max(0.0, room - (opt_nvme - opt_miss));
  // Parameters through the tiers: the tier simulator over the step's accesses.
  double nvme_read = 0, nvme_write = 0, h2d = 0;
  if (z.uses_device && z.param_home != Tier::kDevice) {
    const ShardLayout layout = make_shard_layout(numels, W, kAlignment);
    std::uint64_t in_place_bytes = 0;  // frozen modules read at their host home
    const std::vector<Access> trace = step_trace(numels, layout, cfg, wsize, run.grad_accum, run.modules.head_tied,
                                                 frozen_in_place(run, cfg, m, z), in_place_bytes);
    if (!trace.empty()) {
      TierModel tm;
      tm.device_budget_bytes = store_device_budget(z);
      tm.host_budget_bytes = z.param_home != Tier::kNvme ? z.host_budget_bytes
                             : params_at_device       ? 0
                                                      : static_cast<std::uint64_t>(param_room);
      // A shard larger than the pool's room goes NVMe -> bounce buffers -> device without a host
      // slot of its own (TensorStore's streamed path): simulated as the room holding that one shard.
      for (const Access& a : trace) tm.host_budget_bytes = std::max<std::uint64_t>(tm.host_budget_bytes, a.bytes);
      tm.home = z.param_home == Tier::kNvme ? Tier::kNvme : Tier::kHost;
      tm.nvme_to_host_gbps = m.nvme_read_gbps;
      tm.host_to_device_gbps = m.h2d_gbps;
      double fwd_bytes = 0;
      for (const Access& a : trace) fwd_bytes += a.phase == Phase::kForward ? static_cast<double>(a.bytes) : 0;
      // Forward is a third of the compute, backward two thirds (backward_factor 2).
      tm.compute_gbps = std::max(1e-9, fwd_bytes / (t.compute_s / 3.0) / 1e9);
      tm.backward_factor = 2.0;
      tm.steps = 3;
      const SimResult s = simulate(trace, tm, SimPolicy::kBelady,
                                   PrefetcherOptions::from_config(cfg, wsize == 2 ? DType::kBF16 : DType::kF32));
      nvme_read += static_cast<double>(s.bytes_nvme_to_host);
      // Each step publishes new working shards, so the device's copies are fetched again.
      h2d += std::max(static_cast<double>(s.bytes_host_to_device),
                      static_cast<double>(z.param_store_bytes - std::min(z.param_store_bytes, in_place_bytes)));
      t.stall_s = s.stall_seconds;
    }
  }
  // Gradients: world 1 hands each micro-batch's fp32 gradients to the engine (a host copy);
  // several ranks reduce-scatter them (stages 2-3) or all-reduce them (0-1), and stage 3
  // all-gathers each module forward and backward.
  const double grad_bytes = 4.0 * static_cast<double>(param_count(trained)) * run.grad_accum;
  if (W == 1) {
    // The measured hand-off (what the copies into the partitions add to the backward pass), else
    // one copy at the device->host rate.
    double exposed_s = 0;
    t.d2h_s = grad_handoff_seconds(m, run, grad_bytes, run.grad_accum, &t.handoff_from, &exposed_s);
    // No collective: tiermem-train's communication is the time inside its gather and reduce calls
    // that is no wait (train_engine_zero.cc: the driving thread's waits, for the store and for the
    // engine's helper threads, are I/O wait), next to nothing at one rank. The hand-off adds its
    // copies' CPU time to the compute (they run on the gradient thread, on the compute's cores)
    // and the last hand-offs' time to the I/O wait (backward's end waits for them).
    t.handoff_wait_s = std::min(exposed_s, t.d2h_s);
    t.handoff_compute_s = t.d2h_s - t.handoff_wait_s;
    t.comm_s = 0;
  } else {
    const double frac = static_cast<double>(W - 1) / W;
    double bytes = (stage >= 2 ? 1.0 : 2.0) * frac * grad_bytes;
    if (stage == 3) bytes += 2.0 * frac * P * static_cast<double>(wsize) * run.grad_accum;
    p.comm_bytes = static_cast<std::uint64_t>(bytes);
    t.comm_s = m.comm_gbps > 0 ? bytes / (m.comm_gbps * 1e9) : 0;
  }
  // Optimizer: sub-groups pipelined (read i+1, step i, write i-1), then the new working params.
  // The measured step (ZeroEngine::step() with host state: AdamW, the norm and the new working
  // parameters written into the Device's memory) includes that copy where the home is host
  // memory or SimDevice memory; else Adam alone, and the copy priced below.
  const double step_rate = optimizer_params_per_s(m, largest_module) / per_node;
  const bool step_measured = step_rate > 0 && device_is_sim(cfg, m);
  t.adam_s = R / (step_measured ? step_rate : m.cpu_adam_params_per_s);
  t.adam_measured_step = step_measured;
  // Optimizer state that does not stay cached is read and written back once per step.
  const double opt_read = opt_miss, opt_write = opt_miss;
  const double opt_io_s = opt_read / (m.nvme_read_gbps * 1e9) + opt_write / (m.nvme_write_gbps * 1e9);
  double publish_s = 0;
  if (z.uses_device) {
    const double b = static_cast<double>(z.param_store_bytes);
    if (z.param_home == Tier::kNvme && !params_on_device) {
      // Written back, dirty: what the pool cannot keep, or, with the parameters at the device (the
      // overlapped step's updates write there), each one the device evicts and reads again, as
      // often as the simulator reads it (an updated shard is dirty when evicted).
      const double evicted = params_at_device ? nvme_read : std::max(0.0, param_nvme - param_room);
      nvme_write += evicted;
      publish_s = evicted / (m.nvme_write_gbps * 1e9) +
                  (step_measured ? 0.0 : (b - std::min(b, evicted)) / (m.d2h_gbps > 0 ? m.d2h_gbps : m.h2d_gbps) / 1e9);
    } else {
      h2d += z.param_home == Tier::kDevice ? b : 0;
      publish_s = step_measured ? 0.0 : b / (m.h2d_gbps * 1e9);
    }
  }
  nvme_read += opt_read;
  nvme_write += opt_write;
  t.optimizer_s = std::max(t.adam_s, opt_io_s) + publish_s;
  // The overlapped optimizer step (tiermem.overlap_optimizer_step, zero_step.cc): step() defers
  // each stored module's AdamW to its next gather, so the updates run on the compute thread inside
  // the forward pass, whose window is then the forward compute and the updates, or the reads of the
  // state that does not stay cached if longer; the write-backs run beside the backward pass.
  // tiermem-train times the updates inside those gathers as optimizer time, the rest of the
  // gathers as communication (their waits also as I/O wait).
  double overlap_step_s = 0;
  if (overlap) {
    // The forward's reads share the drive with the write-backs of updated state. A profile that
    // measured reads beside writes (nvme_read_beside_writes_gbps) gives their rate there, and the
    // write-backs then take none of the reads' time; else each write-back is priced between two
    // reads at the write rate (the earlier model; the development VM's drive kept reading beside
    // writes, at 0.9-1.1 GB/s through the IoEngine against 1.4-1.7 alone, and that model
    // over-predicted gpt2's wait at the default budgets by ~0.15 s a step;
    // docs/notes/2026-12-02-planner-reads-beside-writes.md).
    const bool beside = m.nvme_read_beside_writes_gbps > 0;
    const double stream_read_gbps = beside ? m.nvme_read_beside_writes_gbps : m.nvme_read_gbps;
    if (opt_read > 0) {  // only where optimizer state streams (plan.h: else empty)
      t.io_wait_from = beside ? "reads at nvme_read_beside_writes_gbps, beside the write-backs"
                              : "reads and write-backs in turn (the profile has no nvme_read_beside_writes_gbps)";
    }
    const double read_s = opt_read / (stream_read_gbps * 1e9), write_s = opt_write / (m.nvme_write_gbps * 1e9);
    // One rank on memory the CPU addresses, with the host optimizer: each update runs ahead of its
    // gather on the engine's update thread, beside the previous module's forward compute
    // (UpdateScheduler::start_ahead), so the forward waits only for what of the updates (their
    // reads and AdamW) that compute did not hide; else each runs at its gather, on the forward's
    // own thread.
    const bool ahead = W == 1 && host_addressable && !z.optimizer_on_device;
    const double fwd_compute = t.compute_s / 3.0;
    const double fwd = fwd_compute + (ahead ? 0.0 : t.adam_s), bwd = 2.0 * t.compute_s / 3.0 + (W == 1 ? t.d2h_s : t.comm_s);
    const double pool_grads = stage >= 2 && z.gradient_home == Tier::kNvme ? 4.0 * R : 0.0;
    auto gated = [&](double miss) {
      return gated_read_wait(trained, forward_compute_shares(numels), miss, opt_nvme, pool_grads, slack,
                             fwd_compute / std::max(1, run.grad_accum), t.adam_s, stream_read_gbps,
                             beside ? 0.0 : m.nvme_write_gbps,
                             opt_nvme > 0 ? (opt_nvme - std::min(opt_nvme, pool_grads)) / opt_nvme : 1.0, ahead);
    };
    // Ahead: the forward's whole wait for the updates, of which the reads' share is what it
    // adds to the wait with every module's state in the pool (AdamW's part not hidden).
    const double update_wait = std::max(std::max(0.0, read_s - fwd), gated(opt_read));
    const double read_wait = ahead ? std::max(0.0, update_wait - gated(0.0)) : update_wait;
    const double write_wait = std::max(0.0, write_s - bwd);
    overlap_step_s = fwd + update_wait + bwd + write_wait + publish_s + t.stall_s;  // + parameter stalls
    // tiermem-train counts a deferred update applied inside a gather (or the wait for one that ran
    // ahead), its waits for the state's reads included, as optimizer time (train_loop.cc
    // time_split), not I/O wait or communication.
    t.optimizer_wait_s = read_wait;
    t.optimizer_s = publish_s + (ahead ? update_wait : t.adam_s + read_wait);
    t.optimizer_ahead = ahead;
    t.optimizer_deferred = true;
  }
  // On the simulated device the model computes on the host's cores, and each NVMe byte's checksum
  // (hashed on a write, verified on a read, by the engine's threads) takes its CPU time from them:
  // spread over the cores, as the offloaded step's CPU time adds up to the resident step's and
  // the I/O-alone step's (docs/benchmarks.md, "tiermem-train: overlap of NVMe traffic with compute").
  if (cfg.tiermem.checksum && m.checksum_gbps > 0 && device_is_sim(cfg, m)) {
    t.checksum_s = (nvme_read + nvme_write) / (m.checksum_gbps * 1e9) / std::max(1, m.threads);
    t.compute_s += t.checksum_s;
    if (overlap) overlap_step_s += t.checksum_s;
  }
  t.nvme_s = nvme_read / (m.nvme_read_gbps * 1e9) + nvme_write / (m.nvme_write_gbps * 1e9);
  t.h2d_s = h2d / (m.h2d_gbps * 1e9);
  p.nvme_read_bytes = static_cast<std::uint64_t>(nvme_read);
  p.nvme_write_bytes = static_cast<std::uint64_t>(nvme_write);
  p.h2d_bytes = static_cast<std::uint64_t>(h2d);
  const double comm_extra = W == 1 ? t.d2h_s : t.comm_s;  // world 1: the stall is already counted
  t.step_s = overlap ? overlap_step_s : t.compute_s + t.stall_s + comm_extra + t.optimizer_s;
  const std::pair<double, const char*> parts[] = {{t.compute_s, "compute"},
                                                  {t.nvme_s, "nvme"},
                                                  {t.h2d_s, "host->device"},
                                                  {W == 1 ? t.d2h_s : t.comm_s, "communication"},
                                                  {t.adam_s, "optimizer"}};
  t.bottleneck = std::max_element(std::begin(parts), std::end(parts))->second;
  p.tokens_per_s = t.step_s > 0 ? static_cast<double>(p.tokens_per_step) / t.step_s : 0;
  p.tflops = t.step_s > 0 ? p.flops_per_step / t.step_s / 1e12 : 0;
}

}  // namespace

namespace {
// A figure keyed by size, interpolated linearly in log(size), clamped at the ends.
double by_size(const std::vector<std::pair<int, double>>& w, double size, double fallback) {
  if (w.empty()) return fallback;
  if (size <= w.front().first) return w.front().second;
  if (size >= w.back().first) return w.back().second;
  for (std::size_t i = 1; i < w.size(); ++i) {
    if (size <= w[i].first) {
      const double f = std::log(size / w[i - 1].first) /
                       std::log(static_cast<double>(w[i].first) / w[i - 1].first);
      return w[i - 1].second + f * (w[i].second - w[i - 1].second);
    }
  }
  return w.back().second;
}
}  // namespace

double compute_gflops(const MachineProfile& m, int d_model, double tokens) {
  const double at512 = by_size(m.compute_gflops_by_width, d_model, m.compute_gflops);
  if (m.compute_gflops_by_width_128.empty()) return at512;
  const double at128 = by_size(m.compute_gflops_by_width_128, d_model, at512);
  const double f = std::clamp(std::log(std::max(tokens, 1.0) / 128.0) / std::log(4.0), 0.0, 1.0);
  return at128 + f * (at512 - at128);
}

double grad_handoff_seconds(const MachineProfile& m, const RunShape& run, double grad_bytes, int passes,
                            std::string* from, double* exposed_s) {
  auto said = [from](const char* what) {
    if (from) *from = what;
  };
  if (exposed_s) *exposed_s = 0;
  const gpt::GptConfig& model = run.model;
  const std::vector<std::size_t> numels = trained_numels(run, run_numels(run));
  if (!m.grad_handoff_gbps_by_width.empty()) {
    said(m.grad_handoff_pass_gbps_by_width.empty() ? "grad_handoff_gbps_by_width"
                                                   : "grad_handoff_gbps_by_width + grad_handoff_pass_gbps_by_width");
    const double per_byte = by_size(m.grad_handoff_gbps_by_width, model.d_model, m.grad_handoff_gbps);
    const double per_pass = by_size(m.grad_handoff_pass_gbps_by_width, model.d_model, 0.0);
    // The last layer's and the first module's (the embedding's) hand-offs, exposed at the end of
    // each backward pass; a layer is the modules between the first and the last over n_layer
    // (tiermem-train's GPT: one block).
    const double between = numels.size() > 2 ? static_cast<double>(param_count(numels) - numels.front() - numels.back()) : 0.0;
    const double pass_bytes = 4.0 * (static_cast<double>(numels[0]) + (model.n_layer > 0 ? between / model.n_layer : 0.0));
    const double exposed = per_pass > 0 ? std::min(grad_bytes, std::max(1, passes) * pass_bytes) : 0.0;
    if (exposed_s && exposed > 0) *exposed_s = exposed / (per_pass * 1e9);
    return (grad_bytes - exposed) / (per_byte * 1e9) + (exposed > 0 ? exposed / (per_pass * 1e9) : 0.0);
  }
  const double largest = static_cast<double>(*std::max_element(numels.begin(), numels.end()));
  const double rate = by_size(m.grad_handoff_gbps_by_module_elems, largest, m.grad_handoff_gbps);
  said(!m.grad_handoff_gbps_by_module_elems.empty() ? "grad_handoff_gbps_by_module_elems"
       : rate > 0                                   ? "grad_handoff_gbps"
       : m.d2h_gbps > 0 ? "one copy at d2h_gbps (the profile has no grad_handoff_* figure)"
                        : "one copy at h2d_gbps (the profile has no grad_handoff_* or d2h_gbps figure)");
  return grad_bytes / ((rate > 0 ? rate : m.d2h_gbps > 0 ? m.d2h_gbps : m.h2d_gbps) * 1e9);
}

double optimizer_params_per_s(const MachineProfile& m, std::size_t module_elems) {
  return by_size(m.optimizer_params_per_s_by_module_elems, static_cast<double>(module_elems),
                  m.optimizer_params_per_s);
}

Config with_machine_budgets(Config cfg, const MachineProfile& m) {
  if (cfg.tiermem.host_budget_bytes == 0) {
    cfg.tiermem.host_budget_bytes = std::clamp<std::uint64_t>(m.host_memory_bytes / 16 / kMiB * kMiB, 256 * kMiB, 1024 * kMiB);
  }
  if (cfg.tiermem.device_budget_bytes == 0) {
    cfg.tiermem.device_budget_bytes = device_is_sim(cfg, m) ? 1024 * kMiB
                                                            : m.device_memory_bytes / 100 * 95;
  }
  return cfg;
}

std::uint64_t activation_bytes(const gpt::GptConfig& g, int batch, int seq_len) {
  return gpt::activation_bytes(g, batch, seq_len);
}

Prediction predict(const RunShape& run, const MachineProfile& m) {
  check_zero_config(run.config, kAlignment);  // what ZeroEngine refuses at construction
  Prediction p;
  std::uint64_t backend = 0;
  bool too_small = false;
  const Config cfg = engine_config(run, m, &backend, &too_small);
  predict_memory(run, cfg, m, p);
  check_fit(run, cfg, m, p);
  if (too_small) {
    const std::uint64_t budget = with_machine_budgets(run.config, m).tiermem.device_budget_bytes;
    p.fits = false;
    p.why = fmt::format("the device budget {} does not hold the CUDA model's activations and workspace ({}) and "
                        "leave room for parameters",
                        format_bytes(budget), format_bytes(backend));
    const std::uint64_t least = gpt::cuda_backend_bytes(run.model, 1, 1);  // one token: the fixed part
    if (least >= budget) {
      p.fix = fmt::format("none at this width and depth: the CUDA model's fixed part (a module's parameters and "
                          "gradient staged in fp32, and the rest that does not shrink with the batch) is {} alone; a "
                          "device with more memory, or a smaller model",
                          format_bytes(least));
      return p;
    }
    p.fix = run.batch > 1 ? fmt::format("a smaller micro-batch (--batch {}) with more accumulation (--grad-accum {})",
                                        run.batch / 2, run.grad_accum * 2)
                          : fmt::format("shorter sequences (--seq-len {})", std::max(1, run.seq_len / 2));
    return p;
  }
  // Time needs rates (a memory-only profile has none).
  if (p.zero.fits && compute_gflops(m, run.model.d_model) > 0 && m.cpu_adam_params_per_s > 0) {
    predict_time(run, cfg, m, p);
  }
  return p;
}

LargestModel largest_model(const RunShape& run, const MachineProfile& m) {
  LargestModel out;
  auto try_layers = [&](int L, std::string* why) {
    RunShape r = run;
    r.model.n_layer = L;
    Prediction p;
    std::uint64_t backend = 0;
    bool too_small = false;
    Config cfg = engine_config(r, m, &backend, &too_small);
    if (too_small) {
      if (why) *why = fmt::format("the CUDA model's activations and workspace ({}) fill the device budget",
                                  format_bytes(backend));
      return std::uint64_t{0};
    }
    predict_memory(r, cfg, m, p);
    // Budgets at their minimum (a user would raise them): what the machine itself can hold.
    if (!p.zero.fits) {
      cfg.tiermem.host_budget_bytes = std::max(cfg.tiermem.host_budget_bytes, p.zero.host_min_bytes);
      cfg.tiermem.device_budget_bytes = std::max(cfg.tiermem.device_budget_bytes, p.zero.device_min_bytes);
      p = Prediction{};
      predict_memory(r, cfg, m, p);
    }
    check_fit(r, cfg, m, p);
    if (why) *why = p.why;
    return p.fits ? p.params : 0;
  };
  int lo = 0, hi = 1;
  const int kMaxLayers = 4096;  // tiermem-train's --layers limit: a deeper model is not a run it makes
  while (hi <= kMaxLayers && try_layers(hi, nullptr) > 0) {
    lo = hi;
    hi *= 2;
  }
  if (hi > kMaxLayers) {
    out.n_layer = lo;
    out.params = try_layers(lo, nullptr);
    out.limit = fmt::format("tiermem-train's limit of {} layers; deeper would fit", kMaxLayers);
    return out;
  }
  while (hi - lo > 1) {
    const int mid = lo + (hi - lo) / 2;
    (try_layers(mid, nullptr) > 0 ? lo : hi) = mid;
  }
  out.n_layer = lo;
  out.params = lo > 0 ? try_layers(lo, nullptr) : 0;
  try_layers(hi, &out.limit);
  return out;
}

}  // namespace tiermem::plan
