// tiermem/zero_plan.h — where ZeroEngine puts each kind of training state and the least memory
// each tier needs: pure arithmetic over the config and the module sizes (no I/O, no allocation),
// used by the engine to size its optimizer sub-groups and refuse a budget that cannot work before
// anything is written, and by programs to print the same numbers before a run.
//
// What the engine keeps where (one rank; R = the rank's shard elements, rank_flat):
//   working params   stage 3, modules >= stage3_param_persistence_threshold: a TensorStore tensor
//                    per module shard, home offload_param.device (nvme: swap space, cpu: host
//                    pool, none: the device); compute reads it at the device tier.
//                    stages 0-2 and persistent modules: engine host buffers (host_engine_bytes).
//   optimizer state  fp32 [master | exp_avg | exp_avg_sq] per sub-group (a module's
//                    shard split in sub-groups of sub_group_elems), home offload_optimizer.device
//                    (nvme: swap space; cpu: host pool; none: the device when
//                    options.device_optimizer — stages 1-3, see tiermem.device_optimizer —
//                    else the host pool). 12 bytes per element.
//                    With offload_optimizer.ratio < 1 at stage 3 (cpu/nvme), the last sub-groups,
//                    (1 - ratio) of the elements, are homed on the device instead (see
//                    device_optimizer_from).
//   gradients        stages 2-3: one fp32 partition tensor per sub-group, home host, or nvme when
//                    offload_optimizer is nvme and 4 R bytes exceed a quarter of the host budget
//                    (DeepSpeed also swaps gradients then), or the device with the optimizer
//                    state when that is on the device and the device is host-addressable (the
//                    engine adds host gradients in place; on an opaque device they stay at the
//                    host and each sub-group's goes up once per step). Stages 0-1: full fp32
//                    gradients in engine host buffers (every rank accumulates them whole, as in
//                    DeepSpeed).
//
// The host budget holds the host homes, the caches of NVMe-homed tensors, and the step's
// sub-groups in flight. Each module's sub-groups (module_sub_group_elems) are the largest (<=
// sub_group_size, a multiple of the alignment) of which (buffer_count + 1) fit next to the homes
// and that module's own working shard, the one the step holds whole while it steps them;
// sub_group_elems is the largest of those.
//
// Units: *_bytes are bytes (allocator-rounded: host 4 KiB, device pages of device_page_bytes);
// *_elems are elements. Thread-safety: pure; thread-safe. Errors: none (a plan that cannot run
// says so in fits/why; ZeroEngine throws the ConfigError).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "tiermem/config.h"
#include "tiermem/export.h"
#include "tiermem/tier.h"

namespace tiermem {

struct TIERMEM_API ZeroPlanOptions {
  int world_size = 1;
  std::size_t alignment_elems = 1024;     // ZeroEngineOptions::alignment_elems
  // SimDevice: the CPU reads device memory in place. false (CudaDevice, or SimDevice with
  // tiermem.sim_host_addressable false): the engine's host staging for device memory (publication
  // sub-groups, gradient hand-over, all-gather staging) is added to host_engine_bytes.
  bool device_host_addressable = true;
  std::uint64_t device_page_bytes = 4096; // device allocator granularity
  int max_inflight_buckets = 4;           // ZeroEngineOptions::max_inflight_buckets
  // Home the optimizer state (offload_optimizer none, stages 1-3) on the device and step it there
  // (Device::adam_step_async). The engine decides (tiermem.device_optimizer).
  bool device_optimizer = false;
  // The device's budget when tiermem.device_budget_bytes is 0 (the device's own default; 0 =
  // unknown): offload_optimizer.ratio "auto" sizes the device's share from it.
  std::uint64_t device_budget_bytes = 0;
  // Module i (in module_numels' order) is frozen (ZeroEngineOptions::frozen_modules): its working
  // shard is placed as any module's, but it has no fp32 master, gradient or optimizer state, so it
  // adds nothing to R, optimizer_bytes or gradient_bytes. Empty, or shorter than the module
  // list: the modules past its end train.
  std::vector<bool> frozen_modules;
  // false: no sub-group's state is homed on the device under offload_optimizer.ratio (the
  // engine's optimizer type is one the device does not step: Lion, Adagrad).
  bool device_share = true;
};

struct TIERMEM_API ZeroPlan {
  // Resolved budgets (config value, or the default when 0): host = default_host_budget_bytes();
  // device = tiermem.device_budget_bytes (0 = the device's own default).
  std::uint64_t host_budget_bytes = 0;
  std::uint64_t device_budget_bytes = 0;

  Tier param_home = Tier::kHost;      // of the stage-3 stored module shards
  Tier optimizer_home = Tier::kHost;
  Tier gradient_home = Tier::kHost;   // stages 2-3 (stages 0-1: engine host buffers)
  bool uses_device = false;           // stage 3 with at least one stored module
  // The optimizer state is homed on the device (optimizer_home kDevice) and stepped there; the
  // engine then makes a device at every stage.
  bool optimizer_on_device = false;
  // offload_optimizer.ratio < 1 (stage 3, offload_optimizer cpu/nvme; DeepSpeed's partial
  // offload): the sub-groups from rank-flat offset device_optimizer_from to the end — whole
  // sub-groups, at least (1 - ratio) x R elements — are homed on the device with their gradient
  // partitions (on a host-addressable device) and stepped there as the device-resident optimizer
  // steps; the others live at optimizer_home. device_optimizer_from == SIZE_MAX: none.
  std::size_t device_optimizer_from = static_cast<std::size_t>(-1);
  std::size_t device_optimizer_elems = 0;
  std::uint64_t device_optimizer_bytes = 0;  // their device bytes (state + gradient partitions)
  bool device_optimizer_grads = false;       // their gradient partitions are homed there too
  // Device bytes the engine allocates outside the store for the device optimizer: one sub-group
  // of fp32 gradient (when the gradients are not homed on the device) and one of working params
  // (when some new working params go to host memory). Kept out of the store's device budget.
  std::uint64_t device_scratch_bytes = 0;
  std::size_t sub_group_elems = 0;        // the largest optimizer sub-group of any module (elements)
  // Module i's sub-group size (elements; every module, in registration order; 0 for frozen ones).
  // A module whose own working shard leaves the host pool more room gets larger sub-groups, so a
  // model with one huge tensor (Llama 1B's 262 MB embedding at a 256 MiB budget) does not step every
  // module in the small sub-groups that tensor's room allows.
  std::vector<std::size_t> module_sub_group_elems;
  // Every update of a stored module (step(), a deferred update, a checkpoint's export and import)
  // holds its working shard at the device tier, not in the host pool: stage 3 on a device the CPU
  // addresses (SimDevice), where AdamW writes device memory directly and the next gather reads it
  // there. Its sub-groups then need no host room beside their module's shard (Llama 1B at 256 MiB:
  // the embedding's and head's 1 Mi elements instead of 77,824).
  bool updates_on_device = false;
  std::size_t rank_flat_elems = 0;    // R: this rank's optimizer-shard elements (trainable modules)
  // One fp32 copy (tiermem.fp32_single_copy): fp32 working params, stage 3, parameters homed with
  // the optimizer state (host or NVMe), stepped by the CPU on host-addressable memory, no
  // sub-group on the device. Then every stored, trained module not kept whole on the device keeps
  // its master in its working shard: single_copy_elems of R (optimizer_bytes 4 B less each).
  bool fp32_single_copy = false;
  std::size_t single_copy_elems = 0;

  // Bytes by home (this rank).
  std::uint64_t param_store_bytes = 0;     // stored working shards (wsize each; frozen ones at
                                           // tiermem.frozen_dtype's at_rest_bytes: quantize.h)
  std::uint64_t frozen_param_bytes = 0;    // ... of which frozen modules' (never written back)
  std::uint64_t optimizer_bytes = 0;       // 12 R (less 4 x single_copy_elems)
  std::uint64_t gradient_bytes = 0;        // 4 R (stages 2-3) or 4 x full padded (stages 0-1)
  std::uint64_t host_home_bytes = 0;       // what lives in the host pool for good
  std::uint64_t host_engine_bytes = 0;     // engine buffers outside the pool (see above) + buckets
  std::uint64_t nvme_bytes = 0;            // swap space needed (params + optimizer + gradients)
  std::uint64_t nvme_param_bytes = 0, nvme_optimizer_bytes = 0;  // by nvme_path section

  // The least budgets that run, and why (one line each, naming the parts).
  std::uint64_t host_min_bytes = 0;
  std::string host_min_why;
  std::uint64_t device_min_bytes = 0;
  std::string device_min_why;
  std::uint64_t gather_reserve_bytes = 0;  // device room kept for all-gathered modules (world > 1),
                                           // or with one rank for the largest dequantized
                                           // frozen one (tiermem.frozen_dtype)

  bool fits = true;  // both budgets >= their minimum
  bool device_budget_short = false;  // the device budget (one is needed) is below device_min_bytes
  std::string why;   // when !fits: one line naming each short budget's key, its value and the minimum
};

// The resolved default host budget (bytes) when tiermem.host_budget_bytes is 0: 1/16 of the
// machine's physical memory, at least 256 MiB and at most 1 GiB (the pool is mapped, and with
// NVMe offload registered with io_uring, which pins every page of it, at start). Fixed for the
// machine, never a function of the model.
TIERMEM_API std::uint64_t default_host_budget_bytes();
// This machine's physical memory in bytes (sysconf), 0 when the OS does not say.
TIERMEM_API std::uint64_t physical_memory_bytes();

// Whether `bytes` of address space can be reserved now (an inaccessible, unbacked mapping made and
// dropped at once): the host pool reserves twice its budget per slot size (PinnedHostPool), so a
// budget the address space cannot hold fails here rather than at the first allocation. True for
// 0 bytes. No errors thrown.
TIERMEM_API bool address_space_reservable(std::uint64_t bytes);

// What is wrong with a host budget of `bytes`, as the engine and tiermem-plan say it (the caller
// names the key or flag):
//   host_budget_refusal: why it cannot be used at all — the host pool reserves twice its budget of
//     address space (pinned_host_pool.cc), and that reservation fails (or the budget is over 2^62
//     bytes) — or "" when it can;
//   host_budget_warning: that it is more than this machine's physical memory (so it bounds
//     nothing), or "" when it is not or the OS does not say.
// Both end with what to give instead. No errors thrown.
TIERMEM_API std::string host_budget_refusal(std::uint64_t bytes);
TIERMEM_API std::string host_budget_warning(std::uint64_t bytes);

// Where ZeroEngine::step() writes the new working shards of stage-3 modules homed below the device
// (offload_param cpu/nvme): at the device tier — no host copy; nothing written down while the
// device keeps them, so a model whose parameters fit the device pages only its optimizer state —
// when the device is host-addressable (SimDevice: the CPU AdamW writes there) and all stored
// shards take at most half of `store_device_budget` (the store's device budget: the device budget
// less the gather reserve); else at the host tier, written down when evicted.
inline bool publishes_working_on_device(const ZeroPlan& p, bool device_host_addressable,
                                        std::uint64_t store_device_budget) {
  return p.uses_device && device_host_addressable && p.param_home != Tier::kDevice &&
         p.param_store_bytes <= store_device_budget / 2;
}

// Whether ZeroEngine::step() defers each stored module's AdamW update to that module's next gather
// (tiermem.overlap_optimizer_step; "auto": on when the optimizer state streams from NVMe and a
// deferred update writes the module's shard where its gather reads it, `at_gather_tier`: the
// working params are published on the device (publishes_working_on_device), or the device is
// host-addressable, where the update at a gather writes the shard at the gather's tier):
// stage 3 with stored modules, the clipping norm folded into gradient accumulation
// (`norm_folded`: no fp16 loss scaler, every module's norm ready), the state not on the device.
// The engine decides with it and tiermem-plan predicts with it.
inline bool defers_optimizer_step(const ZeroPlan& p, const Config& config, bool at_gather_tier, bool norm_folded) {
  return config.zero.stage == 3 && p.uses_device && norm_folded && !p.optimizer_on_device &&
         config.tiermem.overlap_optimizer_step.value_or(p.optimizer_home == Tier::kNvme && at_gather_tier);
}

// Whether the engine needs a device at all: stage-3 stored shards or device-resident optimizer.
inline bool needs_device(const ZeroPlan& p) { return p.uses_device || p.optimizer_on_device; }

// Throws ConfigError (naming zero_optimization.sub_group_size) when a sub-group is smaller than
// the shard alignment `alignment_elems`: what ZeroEngine refuses at construction, and tiermem-plan
// with it.
TIERMEM_API void check_sub_group_size(const ZeroConfig& z, std::size_t alignment_elems);

// Throws ConfigError naming the key and value for a configuration ZeroEngine cannot run,
// whatever the model: a ZeRO stage outside 0-3, a sub-group below `alignment_elems`
// (check_sub_group_size), an optimizer.type other than Adam, AdamW, Lion or Adagrad, Lion or
// Adagrad with tiermem.device_optimizer "on" or offload_optimizer.ratio < 1 (the device steps
// AdamW only), an offload below its stage (optimizer: stage >= 1, parameters: stage 3), an nvme
// offload without nvme_path, a buffer_count below 1, fp16 with bf16. ZeroEngine's constructor
// calls it, and tiermem-plan with it, so both refuse the same configurations.
TIERMEM_API void check_zero_config(const Config& config, std::size_t alignment_elems);

// optimizer.type in lower case ("adamw", "adam", "lion", "adagrad" once check_zero_config passed;
// a Config built in code may spell it "AdamW").
TIERMEM_API std::string optimizer_type(const Config& config);

// Plans `module_numels` (every module's element count, in registration order) under `config`.
TIERMEM_API ZeroPlan plan_zero(const Config& config, std::span<const std::size_t> module_numels,
                               const ZeroPlanOptions& options = {});

}  // namespace tiermem
