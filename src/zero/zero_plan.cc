// src/zero/zero_plan.cc — plan_zero (see include/tiermem/zero_plan.h): homes, sub-group size and
// minimum budgets of a ZeroEngine, as pure arithmetic.
#include "tiermem/zero_plan.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <vector>

#include "tiermem/dtype.h"
#include "tiermem/error.h"
#include "tiermem/quantize.h"
#include "tiermem/log.h"
#include "tiermem/shard.h"

namespace tiermem {
namespace {

constexpr std::uint64_t kMiB = 1ull << 20;

std::uint64_t round_up(std::uint64_t x, std::uint64_t a) { return (x + a - 1) / a * a; }
std::uint64_t host_round(std::uint64_t b) { return round_up(std::max<std::uint64_t>(b, 1), 4096); }

}  // namespace

std::uint64_t physical_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(page) : 0;
}

bool address_space_reservable(std::uint64_t bytes) {
  if (bytes == 0) return true;
  void* p = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return false;
  munmap(p, bytes);
  return true;
}

std::string host_budget_refusal(std::uint64_t bytes) {
  constexpr std::uint64_t kMost = std::uint64_t{1} << 62;
  if (bytes <= kMost && address_space_reservable(2 * bytes)) return "";
  return fmt::format("the host pool cannot reserve the {} of address space a budget of {} takes; set it at most "
                     "this machine's memory ({})",
                     format_bytes(2 * std::min(bytes, kMost)), format_bytes(bytes), format_bytes(physical_memory_bytes()));
}

std::string host_budget_warning(std::uint64_t bytes) {
  const std::uint64_t phys = physical_memory_bytes();
  if (phys == 0 || bytes <= phys) return "";
  return fmt::format("{} is more than this machine's memory ({}): it bounds nothing, and the OS may swap or end "
                     "the process before the host pool reaches it; set it below {}",
                     format_bytes(bytes), format_bytes(phys), format_bytes(phys));
}

std::uint64_t default_host_budget_bytes() {
  const std::uint64_t known = physical_memory_bytes();
  const std::uint64_t phys = known > 0 ? known : 4096 * kMiB;
  return std::clamp<std::uint64_t>(phys / 16 / kMiB * kMiB, 256 * kMiB, 1024 * kMiB);
}

void check_sub_group_size(const ZeroConfig& z, std::size_t alignment_elems) {
  if (z.sub_group_size_elems < alignment_elems) {
    throw ConfigError("zero_optimization.sub_group_size", std::to_string(z.sub_group_size_elems),
                      fmt::format("config key 'zero_optimization.sub_group_size' = {} is smaller than the shard "
                                  "alignment of {} elements; use a multiple of it",
                                  z.sub_group_size_elems, alignment_elems));
  }
}

std::string optimizer_type(const Config& config) {
  std::string opt = config.optimizer.type;
  for (auto& c : opt) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return opt;
}

void check_zero_config(const Config& config, std::size_t alignment_elems) {
  const ZeroConfig& z = config.zero;
  if (z.stage < 0 || z.stage > 3) {
    throw ConfigError("zero_optimization.stage", std::to_string(z.stage), "ZeRO stage must be 0, 1, 2 or 3");
  }
  check_sub_group_size(z, alignment_elems);
  const std::string opt = optimizer_type(config);
  if (opt != "adamw" && opt != "adam" && opt != "lion" && opt != "adagrad") {
    throw ConfigError("optimizer.type", config.optimizer.type,
                      "config key 'optimizer.type' = \"" + config.optimizer.type +
                          "\" is not supported by ZeroEngine (Adam, AdamW, Lion, Adagrad)");
  }
  if (opt == "lion" || opt == "adagrad") {
    // The device-resident optimizer (and its share under offload_optimizer.ratio) runs AdamW only.
    if (config.tiermem.device_optimizer == "on") {
      throw ConfigError("tiermem.device_optimizer", "on",
                        "tiermem.device_optimizer \"on\" steps AdamW on the device; optimizer.type \"" + opt +
                            "\" is stepped by the CPU: set device_optimizer to \"auto\" or \"off\"");
    }
    if (z.offload_optimizer.ratio >= 0 && z.offload_optimizer.ratio < 1.0) {
      throw ConfigError("zero_optimization.offload_optimizer.ratio", fmt::format("{}", z.offload_optimizer.ratio),
                        "offload_optimizer.ratio < 1 steps part of the state on the device, which runs AdamW only; "
                        "optimizer.type \"" + opt + "\" needs ratio 1");
    }
  }
  if (z.offload_optimizer.device != OffloadDevice::kNone && z.stage == 0) {
    throw ConfigError("zero_optimization.offload_optimizer.device",
                      std::string(offload_device_name(z.offload_optimizer.device)),
                      "config key 'zero_optimization.offload_optimizer.device' needs stage >= 1");
  }
  if (z.offload_param.device != OffloadDevice::kNone && z.stage != 3) {
    throw ConfigError("zero_optimization.offload_param.device",
                      std::string(offload_device_name(z.offload_param.device)),
                      "config key 'zero_optimization.offload_param.device' needs stage 3");
  }
  for (const auto* o : {&z.offload_optimizer, &z.offload_param}) {
    const char* key = o == &z.offload_param ? "zero_optimization.offload_param" : "zero_optimization.offload_optimizer";
    if (o->device == OffloadDevice::kNvme && o->nvme_path.empty()) {
      throw ConfigError(std::string(key) + ".nvme_path", "", std::string("config key '") + key +
                                                                 ".device' is \"nvme\" but no nvme_path is given");
    }
    if (o->buffer_count < 1) {
      throw ConfigError(std::string(key) + ".buffer_count", std::to_string(o->buffer_count),
                        std::string("config key '") + key + ".buffer_count' must be >= 1");
    }
  }
  if (config.fp16.enabled && config.bf16) {
    throw ConfigError("fp16.enabled", "true", "fp16 and bf16 cannot both be enabled");
  }
}

namespace {

// What plan_zero's steps share besides the plan: the config, the module layout, and the byte
// totals one step finds and a later one prices.
struct Sizing {
  Sizing(const Config& cfg, std::span<const std::size_t> module_numels, const ZeroPlanOptions& options)
      : single_copy_wanted(cfg.tiermem.fp32_single_copy),
        z(cfg.zero),
        o(options),
        numels(module_numels),
        stage(z.stage),
        A(std::max<std::size_t>(1, o.alignment_elems)),
        wsize(cfg.bf16 || cfg.fp16.enabled ? 2 : 4),
        frozen_at_rest(frozen_dtype_of(cfg.tiermem.frozen_dtype,
                                       cfg.bf16 ? DType::kBF16 : cfg.fp16.enabled ? DType::kF16 : DType::kF32)),
        layout(make_shard_layout(numels, stage == 0 ? 1 : std::max(1, o.world_size), A)),
        trainable_numels(trainable_of(numels, o.frozen_modules)),
        trained(make_shard_layout(trainable_numels, stage == 0 ? 1 : std::max(1, o.world_size), A)),
        R(trained.rank_flat) {}

  // The numels of the modules that train (frozen ones have no optimizer state or gradient).
  static std::vector<std::size_t> trainable_of(std::span<const std::size_t> n, const std::vector<bool>& frozen) {
    std::vector<std::size_t> out;
    for (std::size_t i = 0; i < n.size(); ++i) {
      if (i >= frozen.size() || !frozen[i]) out.push_back(n[i]);
    }
    return out;
  }

  bool single_copy_wanted;  // tiermem.fp32_single_copy
  const ZeroConfig& z;
  const ZeroPlanOptions& o;
  std::span<const std::size_t> numels;
  int stage;
  std::size_t A;          // shard alignment (elements)
  std::uint64_t wsize;    // bytes per working-parameter element
  FrozenDtype frozen_at_rest;  // frozen stored shards' format (tiermem.frozen_dtype)
  ShardLayout layout;     // every module: the working shards
  std::vector<std::size_t> trainable_numels;
  ShardLayout trained;    // the modules that train: optimizer state and gradients, in order
  std::size_t R;          // this rank's rank-flat elements (of `trained`)
  // Working-parameter shards by home (plan_param_homes), allocator-rounded.
  std::uint64_t dev_homes = 0, host_homes = 0, nvme_homes = 0;
  std::vector<std::uint64_t> stored_nvme;  // module i's NVMe-homed shard bytes (0: not NVMe-homed)
  std::vector<std::size_t> trained_module;  // trained index -> module index
  std::uint64_t largest_offloaded = 0;  // largest shard not homed on the device
  std::uint64_t largest_padded = 0;     // largest all-gathered module
  std::uint64_t largest_quantized = 0;  // largest frozen module dequantized at gather (padded, working bytes)
  std::uint64_t dev_optim = 0;          // the device-resident optimizer's state (and gradients)
  std::size_t stored_trained_elems = 0;  // rank elements of trained modules stored below the device

  std::uint64_t dev_round(std::uint64_t b) const {
    return round_up(std::max<std::uint64_t>(b, 1), o.device_page_bytes);
  }
  // Device room kept for gather buffers: two all-gathered modules with several ranks; with one,
  // the largest dequantized frozen module (the others are read in place, from the store's share,
  // where the minimum likewise holds one gathered module at a time).
  std::uint64_t gather_reserve() const {
    if (o.world_size > 1) return 2 * dev_round(largest_padded);
    return largest_quantized ? dev_round(largest_quantized) : 0;
  }
  // The device optimizer's scratch (outside the store): one sub-group of gradient, when the
  // gradients are not homed on the device, and one of new working params.
  std::uint64_t step_scratch(const ZeroPlan& p, bool grads_on_device) const {
    return (grads_on_device ? 0 : dev_round(4ull * p.sub_group_elems)) + dev_round(wsize * p.sub_group_elems);
  }
};

// Working params. Stage 3 stores each module's shard in the TensorStore: a module below the
// persistence threshold is kept whole; with one rank that is simply a shard homed on the device
// (never offloaded, as DeepSpeed keeps persistent parameters on the GPU); with several it is
// an engine host buffer (the shard plus the all-gathered copy).
void plan_param_homes(Sizing& s, ZeroPlan& p) {
  const ZeroConfig& z = s.z;
  const int stage = s.stage;
  switch (z.offload_param.device) {
    case OffloadDevice::kNvme: p.param_home = Tier::kNvme; break;
    case OffloadDevice::kCpu: p.param_home = Tier::kHost; break;
    case OffloadDevice::kNone: p.param_home = Tier::kDevice; break;
  }
  const Tier persistent_home = Tier::kDevice;
  std::size_t trained_index = 0;  // module i's index among the modules that train
  s.stored_nvme.assign(s.numels.size(), 0);
  for (std::size_t i = 0; i < s.numels.size(); ++i) {
    const bool frozen = i < s.o.frozen_modules.size() && s.o.frozen_modules[i];
    const std::size_t ti = frozen ? SIZE_MAX : trained_index++;
    if (!frozen) s.trained_module.push_back(i);
    const ModuleShard& m = s.layout.modules[i];
    const bool persistent = stage == 3 && s.numels[i] < z.stage3_param_persistence_threshold_elems;
    const bool stored = stage == 3 && m.shard > 0 && (!persistent || s.o.world_size == 1);
    if (stored) {
      const Tier home = persistent ? persistent_home : p.param_home;
      const std::uint64_t b = at_rest_bytes(frozen ? s.frozen_at_rest : FrozenDtype::kWorking, m.shard, s.wsize);
      // A quantized frozen shard is read from the host tier into its gather buffer (the reserve):
      // it is never pinned on the device unless homed there.
      const bool quantized = frozen && s.frozen_at_rest != FrozenDtype::kWorking;
      if (quantized) s.largest_quantized = std::max<std::uint64_t>(s.largest_quantized, m.padded * s.wsize);
      p.uses_device = true;
      if (ti != SIZE_MAX && home != Tier::kDevice) s.stored_trained_elems += s.trained.modules[ti].shard;
      p.param_store_bytes += b;
      if (frozen) p.frozen_param_bytes += b;
      if (home == Tier::kDevice) s.dev_homes += s.dev_round(b);
      if (home == Tier::kHost) s.host_homes += host_round(b);
      if (home == Tier::kNvme) s.nvme_homes += round_up(b, 4096);
      if (home != Tier::kDevice && !quantized) s.largest_offloaded = std::max(s.largest_offloaded, b);
      if (home == Tier::kNvme) s.stored_nvme[i] = b;
      s.largest_padded = std::max<std::uint64_t>(s.largest_padded, m.padded * s.wsize);
    } else if (stage == 0) {
      p.host_engine_bytes += host_round(m.padded * s.wsize);
    } else {
      p.host_engine_bytes += host_round(m.shard * s.wsize) + host_round(m.padded * s.wsize);
    }
  }
}

// Where the optimizer state and the gradients live, and the engine's own gradient buffers.
void plan_optimizer_and_gradient_homes(const Sizing& s, ZeroPlan& p) {
  const ZeroConfig& z = s.z;
  const int stage = s.stage;
  p.optimizer_home = z.offload_optimizer.device == OffloadDevice::kNvme ? Tier::kNvme : Tier::kHost;
  p.optimizer_on_device = s.o.device_optimizer && stage >= 1 && z.offload_optimizer.device == OffloadDevice::kNone;
  if (p.optimizer_on_device) p.optimizer_home = Tier::kDevice;
  p.optimizer_bytes = 12ull * s.R;
  if (stage >= 2) {
    p.gradient_bytes = 4ull * s.R;
    p.gradient_home = p.optimizer_home == Tier::kNvme && p.gradient_bytes > p.host_budget_bytes / 4 ? Tier::kNvme
                                                                                                   : Tier::kHost;
    if (p.optimizer_on_device && s.o.device_host_addressable) p.gradient_home = Tier::kDevice;
  } else {
    p.gradient_bytes = 4ull * s.trained.full_flat + (stage == 1 ? 4ull * s.R : 0);
    p.host_engine_bytes += p.gradient_bytes;
    p.gradient_home = Tier::kHost;
  }
}

// One fp32 copy (ZeroPlan::fp32_single_copy): decided once every home and the device's share are
// known; the masters that live in the working shards come off the optimizer's bytes (the
// sub-groups' sizes, chosen before, stay: they fit the larger state).
void plan_single_copy(const Sizing& s, ZeroPlan& p) {
  p.fp32_single_copy = s.single_copy_wanted && s.wsize == 4 && s.stage == 3 && p.uses_device &&
                       p.param_home != Tier::kDevice && p.param_home == p.optimizer_home && !p.optimizer_on_device &&
                       p.device_optimizer_elems == 0 && s.o.device_host_addressable && s.stored_trained_elems > 0;
  if (!p.fp32_single_copy) return;
  p.single_copy_elems = s.stored_trained_elems;
  const std::uint64_t saved = 4ull * p.single_copy_elems;
  p.optimizer_bytes -= std::min(p.optimizer_bytes, saved);
  if (p.optimizer_home == Tier::kHost) {
    p.host_home_bytes -= std::min(p.host_home_bytes, saved);
    p.host_min_bytes -= std::min(p.host_min_bytes, saved);
    // The minimum's words were written with the masters counted apart (plan_host_pool).
    p.host_min_why += fmt::format(" - {} of fp32 master weights kept once, in the working shards (tiermem.fp32_single_copy)",
                                  format_bytes(saved));
  }
}

// Reduce-scatter buckets in flight (several ranks, stages 2-3): send (chunk x world) + recv.
void plan_reduce_buckets(const Sizing& s, ZeroPlan& p) {
  const int world = s.o.world_size;
  if (s.stage < 2 || world <= 1) return;
  std::uint64_t chunk = 0;
  for (const ModuleShard& m : s.trained.modules) {
    for (const ElemRange& c : make_reduce_chunks(m.shard, world, s.z.reduce_bucket_size_elems, s.A)) {
      chunk = std::max<std::uint64_t>(chunk, c.size());
    }
  }
  p.host_engine_bytes += 4ull * chunk * static_cast<std::uint64_t>(world + 1) *
                         static_cast<std::uint64_t>(std::max(1, s.o.max_inflight_buckets) + 1);
}

// Host pool: homes, the working shard AdamW writes (stage 3, NVMe-homed params), sub-groups; the
// host minimum and the sub-group size.
void plan_host_pool(const Sizing& s, ZeroPlan& p) {
  const ZeroConfig& z = s.z;
  const std::size_t A = s.A;
  const std::size_t R = s.R;
  p.host_home_bytes += s.host_homes;
  const std::size_t trained = s.trainable_numels.size();
  if (p.optimizer_home == Tier::kHost) p.host_home_bytes += host_round(12ull * R) + 4096 * trained;
  if (s.stage >= 2 && p.gradient_home == Tier::kHost) p.host_home_bytes += host_round(4ull * R) + 4096 * trained;
  p.updates_on_device = p.uses_device && s.o.device_host_addressable;
  std::uint64_t largest_stored = 0;
  for (std::uint64_t b : s.stored_nvme) largest_stored = std::max(largest_stored, b);
  const std::uint64_t step_reserve = largest_stored ? host_round(largest_stored) : 0;
  const std::uint64_t per_elem = (p.optimizer_home == Tier::kNvme ? 12 : 0) +
                                 (s.stage >= 2 && p.gradient_home == Tier::kNvme ? 4 : 0);
  const std::uint64_t B = static_cast<std::uint64_t>(std::max(1, z.offload_optimizer.buffer_count));
  std::size_t largest_shard = 0;
  for (const ModuleShard& m : s.trained.modules) largest_shard = std::max(largest_shard, m.shard);
  const std::size_t sub = std::max<std::size_t>(A, z.sub_group_size_elems / A * A);
  p.host_min_bytes = p.host_home_bytes + step_reserve + 2 * per_elem * A;
  p.host_min_why = fmt::format("{} of host homes + {} for the largest working shard", format_bytes(p.host_home_bytes),
                               format_bytes(step_reserve));
  // The engine shrinks sub-groups to what the budget leaves (below), so at the minimum they are the
  // alignment's size, whatever zero_optimization.sub_group_size asks.
  if (per_elem > 0) {
    p.host_min_why += fmt::format(" + 2 sub-groups in flight at their smallest ({} elements x {} B)", A, per_elem);
  }
  // The sub-group size next to `reserve` bytes of working shard held whole, at most `shard` elements.
  auto sub_group_for = [&](std::uint64_t reserve, std::size_t shard) -> std::size_t {
    std::size_t sub_group = sub;
    if (per_elem > 0) {
      const std::uint64_t used = p.host_home_bytes + reserve;
      const std::uint64_t avail = p.host_budget_bytes > used ? p.host_budget_bytes - used : 0;
      // buffer_count + 1 sub-groups fit the room; with the state on NVMe, 4x as many, so that what
      // the pool cannot keep streams in sub-groups read ahead and written behind while others step —
      // but not below 1 Mi elements for that (12 MiB of state per read: the demo's 13 MiB pool made
      // 26 K-element sub-groups, whose many small requests cost it 15 % of its throughput).
      std::uint64_t fit = avail / (per_elem * (B + 1));
      if (p.optimizer_home == Tier::kNvme) fit = std::max(fit / 4, std::min<std::uint64_t>(fit, 1u << 20));
      fit = fit / A * A;
      sub_group = static_cast<std::size_t>(std::clamp<std::uint64_t>(fit, A, sub));
    }
    return std::min(sub_group, std::max<std::size_t>(A, (shard + A - 1) / A * A));
  };
  // Each module's own: step() holds one module's working shard whole while it steps that module's
  // sub-groups, so a module's sub-groups need only the room its own shard leaves (Llama 1B at 256
  // MiB: the 262 MB embedding leaves 6 MiB, 77,824-element sub-groups; its layers' 46 MB shards
  // leave room for 1 Mi. A 4-layer model of that shape stepped its optimizer phase in 3.1 s with
  // 1 Mi-element sub-groups against 10.0 s with 77,824). With updates_on_device the shard is held
  // on the device instead, and takes no host room at all.
  p.sub_group_elems = A;  // no module trains: the alignment, as before
  p.module_sub_group_elems.assign(s.numels.size(), 0);
  for (std::size_t t = 0; t < s.trained.modules.size(); ++t) {
    const std::size_t i = s.trained_module[t];
    const std::uint64_t own = s.stored_nvme[i] && !p.updates_on_device ? host_round(s.stored_nvme[i]) : 0;
    p.module_sub_group_elems[i] = sub_group_for(own, s.trained.modules[t].shard);
    p.sub_group_elems = std::max(p.sub_group_elems, p.module_sub_group_elems[i]);
  }
}

// A device the CPU cannot address (CUDA): new working params of device-homed shards are
// published through two device-staging sub-groups (host memory), device gradients handed over through a host
// buffer of the largest module, and (several ranks) each all-gather staged through host memory.
void plan_opaque_staging(const Sizing& s, ZeroPlan& p) {
  if (!p.uses_device || s.o.device_host_addressable) return;
  if (s.dev_homes > 0) p.host_engine_bytes += 2 * host_round(p.sub_group_elems * s.wsize);
  std::size_t largest_numel = 0;
  for (std::size_t n : s.trainable_numels) largest_numel = std::max(largest_numel, n);
  p.host_engine_bytes += host_round(4ull * largest_numel);
  if (s.o.world_size > 1) p.host_engine_bytes += host_round(s.largest_padded);
}

// Device-resident optimizer: every sub-group's state (and gradient partition, when homed
// there) is a device allocation of its own; plus the engine's scratch sub-groups.
void plan_device_optimizer(Sizing& s, ZeroPlan& p) {
  if (!p.optimizer_on_device) return;
  for (std::size_t t = 0; t < s.trained.modules.size(); ++t) {
    const ModuleShard& m = s.trained.modules[t];
    const std::size_t pe = std::max<std::size_t>(1, p.module_sub_group_elems[s.trained_module[t]]);
    for (std::size_t b = 0; b < m.shard; b += pe) {
      const std::uint64_t n = std::min(pe, m.shard - b);
      s.dev_optim += s.dev_round(12 * n) + (p.gradient_home == Tier::kDevice ? s.dev_round(4 * n) : 0);
    }
  }
  p.device_scratch_bytes += s.step_scratch(p, p.gradient_home == Tier::kDevice);
}

// The optimizer-state elements offload_optimizer.ratio asks to keep on the device. "auto"
// (kRatioAuto): as many as the device's idle room holds — the store's device budget less the
// working shards kept there (all of them when they fit half of it, as step() then publishes them
// there, else the homed ones and the largest offloaded one), the gather reserve, the step scratch
// and an eighth of the budget for what the store reads ahead; none when the device budget is not
// known yet (ZeroEngine plans again once its device exists).
std::size_t partial_offload_want(const Sizing& s, const ZeroPlan& p) {
  const double ratio = s.z.offload_optimizer.ratio;
  const bool grad_on_device = s.o.device_host_addressable;
  if (ratio < 0 && p.device_budget_bytes > 0 && s.stage == 3 && p.uses_device) {
    const std::uint64_t B = p.device_budget_bytes;
    const std::uint64_t reserve = s.gather_reserve() + s.step_scratch(p, grad_on_device);
    const std::uint64_t store = B > reserve ? B - reserve : 0;
    const std::uint64_t params = p.param_home != Tier::kDevice && p.param_store_bytes <= store / 2
                                     ? p.param_store_bytes
                                     : s.dev_homes + (s.largest_offloaded ? s.dev_round(s.largest_offloaded) : 0);
    const std::uint64_t used = params + store / 8;
    const std::uint64_t room = store > used ? store - used : 0;
    return static_cast<std::size_t>(room / (12 + (grad_on_device ? 4 : 0)));
  }
  if (ratio >= 0 && ratio < 1.0) {
    return static_cast<std::size_t>(std::ceil((1.0 - ratio) * static_cast<double>(s.R)));
  }
  return 0;
}

// Partial offload (offload_optimizer.ratio < 1, stage 3, cpu/nvme): the last sub-groups, whole,
// until `want` elements, are homed on the device with their gradient partitions
// (host-addressable device; else those stay at gradient_home and go up through scratch).
void plan_partial_offload(const Sizing& s, ZeroPlan& p) {
  const double ratio = s.z.offload_optimizer.ratio;
  const bool grad_on_device = s.o.device_host_addressable;
  const std::size_t want = partial_offload_want(s, p);
  if (!(want > 0 && s.o.device_share && s.stage == 3 && p.uses_device && !p.optimizer_on_device &&
        s.z.offload_optimizer.device != OffloadDevice::kNone && s.R > 0)) {
    return;
  }
  // Whole sub-groups from the end: a ratio takes them until it has `want` elements (the last
  // one may pass it), "auto" only those that fit in `want`.
  auto enough = [&](std::size_t n) {
    return ratio < 0 ? p.device_optimizer_elems + n > want : p.device_optimizer_elems >= want;
  };
  std::size_t flat_end = s.R;
  bool more = true;
  for (std::size_t i = s.trained.modules.size(); more && i-- > 0;) {
    const ModuleShard& m = s.trained.modules[i];
    const std::size_t base = flat_end - m.shard;  // modules are consecutive in the rank-flat order
    const auto groups = make_sub_groups(m.shard, p.module_sub_group_elems[s.trained_module[i]], s.A);
    for (std::size_t g = groups.size(); g-- > 0;) {
      const std::uint64_t n = groups[g].size();
      if (enough(n)) {
        more = false;
        break;
      }
      p.device_optimizer_elems += n;
      p.device_optimizer_from = base + groups[g].begin;
      p.device_optimizer_bytes += s.dev_round(12 * n) + (grad_on_device ? s.dev_round(4 * n) : 0);
    }
    flat_end = base;
  }
  const std::uint64_t d = p.device_optimizer_elems;
  p.device_optimizer_grads = grad_on_device && d > 0;
  if (p.optimizer_home == Tier::kHost) {
    p.host_home_bytes -= std::min(p.host_home_bytes, host_round(12 * d));
    p.host_min_bytes -= std::min(p.host_min_bytes, host_round(12 * d));
  }
  if (grad_on_device && p.gradient_home == Tier::kHost) {
    p.host_home_bytes -= std::min(p.host_home_bytes, host_round(4 * d));
    p.host_min_bytes -= std::min(p.host_min_bytes, host_round(4 * d));
  }
  if (d > 0) p.device_scratch_bytes += s.step_scratch(p, grad_on_device);
}

// Device minimum: stored shards (home device) or the largest one at a time; gathered modules;
// the optimizer state homed there.
void plan_device_minimum(const Sizing& s, ZeroPlan& p) {
  const double ratio = s.z.offload_optimizer.ratio;
  if (p.uses_device) {
    p.gather_reserve_bytes = s.gather_reserve();
    const std::uint64_t offloaded = s.largest_offloaded ? s.dev_round(s.largest_offloaded) : 0;
    p.device_min_bytes = s.dev_homes + offloaded + p.gather_reserve_bytes;
    p.device_min_why = fmt::format("{} of working shards homed on the device + the largest offloaded one, {}",
                                   format_bytes(s.dev_homes), format_bytes(offloaded));
    if (p.gather_reserve_bytes) {
      p.device_min_why += fmt::format(" + {} ({})",
                                      s.o.world_size > 1 ? "2 all-gathered modules" : "the largest dequantized frozen module",
                                      format_bytes(p.gather_reserve_bytes));
    }
  }
  if (p.optimizer_on_device) {
    p.device_min_bytes += s.dev_optim + p.device_scratch_bytes;
    p.device_min_why += fmt::format("{}{} of optimizer state{} on the device (offload_optimizer none, "
                                    "tiermem.device_optimizer) + {} of step scratch",
                                    p.device_min_why.empty() ? "" : " + ", format_bytes(s.dev_optim),
                                    p.gradient_home == Tier::kDevice ? " and gradient partitions" : "",
                                    format_bytes(p.device_scratch_bytes));
  }
  if (p.device_optimizer_elems > 0) {
    p.device_min_bytes += p.device_optimizer_bytes + p.device_scratch_bytes;
    p.device_min_why += fmt::format(" + {} of optimizer state{} on the device ({} elements: "
                                    "zero_optimization.offload_optimizer.ratio {}) + {} of step scratch",
                                    format_bytes(p.device_optimizer_bytes),
                                    s.o.device_host_addressable ? " and gradient partitions" : "",
                                    p.device_optimizer_elems, ratio < 0 ? std::string("\"auto\"") : fmt::format("{}", ratio),
                                    format_bytes(p.device_scratch_bytes));
  }
}

// NVMe: the parameter homes and the offloaded optimizer state (and gradients).
void plan_nvme(const Sizing& s, ZeroPlan& p) {
  p.nvme_param_bytes = s.nvme_homes;
  const std::uint64_t offloaded = s.R - p.device_optimizer_elems;
  const std::uint64_t grads_offloaded = s.o.device_host_addressable ? offloaded : s.R;
  if (p.optimizer_home == Tier::kNvme) p.nvme_optimizer_bytes = 12ull * offloaded - 4ull * p.single_copy_elems;
  if (s.stage >= 2 && p.gradient_home == Tier::kNvme) p.nvme_optimizer_bytes += 4ull * grads_offloaded;
  p.nvme_bytes = p.nvme_param_bytes + p.nvme_optimizer_bytes;
}

// fits and why: the host budget against its minimum, and the device's (both named when both are short).
void check_budgets(ZeroPlan& p) {
  const bool device_short = needs_device(p) && p.device_budget_bytes != 0 && p.device_budget_bytes < p.device_min_bytes;
  p.device_budget_short = device_short;
  const std::string device_why =
      device_short ? fmt::format("device budget {} (tiermem.device_budget_bytes) is below the {} this model needs: {}; "
                                 "raise tiermem.device_budget_bytes (tiermem-train --device-budget) to at least {}",
                                 format_bytes(p.device_budget_bytes), format_bytes(p.device_min_bytes), p.device_min_why,
                                 p.device_min_bytes)
                   : std::string();
  if (p.host_budget_bytes < p.host_min_bytes) {
    p.fits = false;
    // The minimum is exact (a budget of it runs): give it in bytes too, and the budget as well
    // when the two read the same rounded.
    const bool same = format_bytes(p.host_budget_bytes) == format_bytes(p.host_min_bytes);
    p.why = fmt::format("host budget {}{} (tiermem.host_budget_bytes) is below the {} ({} bytes) this model needs: {}",
                        format_bytes(p.host_budget_bytes),
                        same ? fmt::format(" ({} bytes)", p.host_budget_bytes) : std::string(),
                        format_bytes(p.host_min_bytes), p.host_min_bytes, p.host_min_why);
    p.why += fmt::format("; raise tiermem.host_budget_bytes (tiermem-train --host-budget) to at least {}", p.host_min_bytes);
    // Only what is homed on the host can move to NVMe (small persistent modules stay: not said).
    std::vector<std::string> what, keys;
    if (p.param_home == Tier::kHost) what.push_back("parameters"), keys.push_back("offload_param");
    if (p.optimizer_home == Tier::kHost) what.push_back("optimizer state"), keys.push_back("offload_optimizer");
    if (!what.empty()) {
      p.why += fmt::format(", or home {} on NVMe ({} device \"nvme\"; --offload nvme)", fmt::join(what, " and "),
                           fmt::join(keys, " and "));
    }
    if (device_short) p.why += "; and the " + device_why;  // both said at once, not one per try
  } else if (device_short) {
    p.fits = false;
    p.why = device_why;
  }
}

}  // namespace

ZeroPlan plan_zero(const Config& cfg, std::span<const std::size_t> numels, const ZeroPlanOptions& o) {
  ZeroPlan p;
  p.host_budget_bytes = cfg.tiermem.host_budget_bytes != 0 ? cfg.tiermem.host_budget_bytes
                                                           : default_host_budget_bytes();
  p.device_budget_bytes = cfg.tiermem.device_budget_bytes != 0 ? cfg.tiermem.device_budget_bytes
                                                               : o.device_budget_bytes;
  Sizing s(cfg, numels, o);
  p.rank_flat_elems = s.R;
  plan_param_homes(s, p);
  plan_optimizer_and_gradient_homes(s, p);
  plan_reduce_buckets(s, p);
  plan_host_pool(s, p);
  plan_opaque_staging(s, p);
  plan_device_optimizer(s, p);
  plan_partial_offload(s, p);
  plan_single_copy(s, p);
  plan_device_minimum(s, p);
  plan_nvme(s, p);
  check_budgets(p);
  return p;
}

}  // namespace tiermem
