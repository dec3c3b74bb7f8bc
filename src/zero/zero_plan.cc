// src/zero/zero_plan.cc — plan_zero (see include/tiermem/zero_plan.h): homes, sub-group size and
// minimum budgets of a ZeroEngine, as pure arithmetic.
#include "tiermem/zero_plan.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <fmt/format.h>
#include <vector>

#include "tiermem/dtype.h"
#include "tiermem/error.h"
#include "tiermem/log.h"
#include "tiermem/shard.h"

namespace tiermem {
namespace {

constexpr std::uint64_t kMiB = 1ull << 20;

std::uint64_t round_up(std::uint64_t x, std::uint64_t a) { return (x + a - 1) / a * a; }
std::uint64_t host_round(std::uint64_t b) { return round_up(std::max<std::uint64_t>(b, 1), 4096); }

}  // namespace

std::uint64_t default_host_budget_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGESIZE);
  std::uint64_t phys = pages > 0 && page > 0 ? static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(page)
                                             : 4096 * kMiB;
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

ZeroPlan plan_zero(const Config& cfg, std::span<const std::size_t> numels, const ZeroPlanOptions& o) {
  const ZeroConfig& z = cfg.zero;
  ZeroPlan p;
  const int stage = z.stage;
  const int opt_world = stage == 0 ? 1 : std::max(1, o.world_size);
  const std::size_t A = std::max<std::size_t>(1, o.alignment_elems);
  const std::uint64_t wsize = cfg.bf16 || cfg.fp16.enabled ? 2 : 4;
  auto dev_round = [&](std::uint64_t b) { return round_up(std::max<std::uint64_t>(b, 1), o.device_page_bytes); };

  p.host_budget_bytes = cfg.tiermem.host_budget_bytes != 0 ? cfg.tiermem.host_budget_bytes
                                                           : default_host_budget_bytes();
  p.device_budget_bytes = cfg.tiermem.device_budget_bytes != 0 ? cfg.tiermem.device_budget_bytes
                                                               : o.device_budget_bytes;

  const ShardLayout layout = make_shard_layout(numels, opt_world, A);
  const std::size_t R = layout.rank_flat;
  p.rank_flat_elems = R;

  // Working params. Stage 3 stores each module's shard in the TensorStore: a module below the
  // persistence threshold is kept whole; with one rank that is simply a shard homed on the device
  // (never offloaded, as DeepSpeed keeps persistent parameters on the GPU); with several it is
  // an engine host buffer (the shard plus the all-gathered copy).
  switch (z.offload_param.device) {
    case OffloadDevice::kNvme: p.param_home = Tier::kNvme; break;
    case OffloadDevice::kCpu: p.param_home = Tier::kHost; break;
    case OffloadDevice::kNone: p.param_home = Tier::kDevice; break;
  }
  const Tier persistent_home = Tier::kDevice;
  std::uint64_t largest_stored = 0, largest_padded = 0, dev_homes = 0, host_homes = 0, nvme_homes = 0;
  std::uint64_t largest_offloaded = 0;
  for (std::size_t i = 0; i < numels.size(); ++i) {
    const ModuleShard& s = layout.modules[i];
    const bool persistent = stage == 3 && numels[i] < z.stage3_param_persistence_threshold_elems;
    const bool stored = stage == 3 && s.shard > 0 && (!persistent || o.world_size == 1);
    if (stored) {
      const Tier home = persistent ? persistent_home : p.param_home;
      const std::uint64_t b = s.shard * wsize;
      p.uses_device = true;
      p.param_store_bytes += b;
      if (home == Tier::kDevice) dev_homes += dev_round(b);
      if (home == Tier::kHost) host_homes += host_round(b);
      if (home == Tier::kNvme) nvme_homes += round_up(b, 4096);
      if (home != Tier::kDevice) largest_offloaded = std::max(largest_offloaded, b);
      if (home == Tier::kNvme) largest_stored = std::max(largest_stored, b);
      largest_padded = std::max<std::uint64_t>(largest_padded, s.padded * wsize);
    } else if (stage == 0) {
      p.host_engine_bytes += host_round(s.padded * wsize);
    } else {
      p.host_engine_bytes += host_round(s.shard * wsize) + host_round(s.padded * wsize);
    }
  }
  p.optimizer_home = z.offload_optimizer.device == OffloadDevice::kNvme ? Tier::kNvme : Tier::kHost;
  p.optimizer_on_device = o.device_optimizer && stage >= 1 && z.offload_optimizer.device == OffloadDevice::kNone;
  if (p.optimizer_on_device) p.optimizer_home = Tier::kDevice;
  p.optimizer_bytes = 12ull * R;
  if (stage >= 2) {
    p.gradient_bytes = 4ull * R;
    p.gradient_home = p.optimizer_home == Tier::kNvme && p.gradient_bytes > p.host_budget_bytes / 4 ? Tier::kNvme
                                                                                                   : Tier::kHost;
    if (p.optimizer_on_device && o.device_host_addressable) p.gradient_home = Tier::kDevice;
  } else {
    p.gradient_bytes = 4ull * layout.full_flat + (stage == 1 ? 4ull * R : 0);
    p.host_engine_bytes += p.gradient_bytes;
    p.gradient_home = Tier::kHost;
  }
  // Reduce-scatter buckets in flight (several ranks, stages 2-3): send (chunk x world) + recv.
  if (stage >= 2 && o.world_size > 1) {
    std::uint64_t chunk = 0;
    for (const ModuleShard& s : layout.modules) {
      for (const ElemRange& c : make_reduce_chunks(s.shard, o.world_size, z.reduce_bucket_size_elems, A)) {
        chunk = std::max<std::uint64_t>(chunk, c.size());
      }
    }
    p.host_engine_bytes += 4ull * chunk * static_cast<std::uint64_t>(o.world_size + 1) *
                           static_cast<std::uint64_t>(std::max(1, o.max_inflight_buckets) + 1);
  }

  // Host pool: homes, the working shard AdamW writes (stage 3, NVMe-homed params), sub-groups.
  p.host_home_bytes += host_homes;
  if (p.optimizer_home == Tier::kHost) p.host_home_bytes += host_round(12ull * R) + 4096 * numels.size();
  if (stage >= 2 && p.gradient_home == Tier::kHost) p.host_home_bytes += host_round(4ull * R) + 4096 * numels.size();
  const std::uint64_t step_reserve = largest_stored ? host_round(largest_stored) : 0;
  const std::uint64_t per_elem = (p.optimizer_home == Tier::kNvme ? 12 : 0) +
                                 (stage >= 2 && p.gradient_home == Tier::kNvme ? 4 : 0);
  const std::uint64_t B = static_cast<std::uint64_t>(std::max(1, z.offload_optimizer.buffer_count));
  std::size_t largest_shard = 0;
  for (const ModuleShard& s : layout.modules) largest_shard = std::max(largest_shard, s.shard);
  const std::size_t sub = std::max<std::size_t>(A, z.sub_group_size_elems / A * A);
  p.host_min_bytes = p.host_home_bytes + step_reserve + 2 * per_elem * A;
  p.host_min_why = fmt::format("{} of host homes + {} for the largest working shard", format_bytes(p.host_home_bytes),
                               format_bytes(step_reserve));
  // The engine shrinks sub-groups to what the budget leaves (below), so at the minimum they are the
  // alignment's size, whatever zero_optimization.sub_group_size asks.
  if (per_elem > 0) {
    p.host_min_why += fmt::format(" + 2 sub-groups in flight at their smallest ({} elements x {} B)", A, per_elem);
  }
  if (per_elem == 0) {
    p.piece_elems = sub;
  } else {
    const std::uint64_t used = p.host_home_bytes + step_reserve;
    const std::uint64_t avail = p.host_budget_bytes > used ? p.host_budget_bytes - used : 0;
    // buffer_count + 1 sub-groups fit the room; with the state on NVMe, 4x as many, so that what
    // the pool cannot keep streams in pieces read ahead and written behind while others step —
    // but not below 1 Mi elements for that (12 MiB of state per read: the demo's 13 MiB pool made
    // 26 K-element sub-groups, whose many small requests cost it 15 % of its throughput).
    std::uint64_t fit = avail / (per_elem * (B + 1));
    if (p.optimizer_home == Tier::kNvme) fit = std::max(fit / 4, std::min<std::uint64_t>(fit, 1u << 20));
    fit = fit / A * A;
    p.piece_elems = static_cast<std::size_t>(std::clamp<std::uint64_t>(fit, A, sub));
  }
  p.piece_elems = std::min(p.piece_elems, std::max<std::size_t>(A, (largest_shard + A - 1) / A * A));

  // A device the CPU cannot address (CUDA): new working params of device-homed shards are
  // published through two host staging sub-groups, device gradients handed over through a host
  // buffer of the largest module, and (several ranks) each all-gather staged through host memory.
  if (p.uses_device && !o.device_host_addressable) {
    if (dev_homes > 0) p.host_engine_bytes += 2 * host_round(p.piece_elems * wsize);
    std::size_t largest_numel = 0;
    for (std::size_t n : numels) largest_numel = std::max(largest_numel, n);
    p.host_engine_bytes += host_round(4ull * largest_numel);
    if (o.world_size > 1) p.host_engine_bytes += host_round(largest_padded);
  }

  // The device optimizer's scratch (outside the store): one sub-group of gradient, when the
  // gradients are not homed on the device, and one of new working params.
  auto step_scratch = [&](bool grads_on_device) {
    return (grads_on_device ? 0 : dev_round(4ull * p.piece_elems)) + dev_round(wsize * p.piece_elems);
  };

  // Device-resident optimizer: every sub-group's state (and gradient partition, when homed
  // there) is a device allocation of its own; plus the engine's scratch sub-groups.
  std::uint64_t dev_optim = 0;
  if (p.optimizer_on_device) {
    const std::size_t pe = p.piece_elems;
    for (const ModuleShard& s : layout.modules) {
      for (std::size_t b = 0; b < s.shard; b += pe) {
        const std::uint64_t n = std::min(pe, s.shard - b);
        dev_optim += dev_round(12 * n) + (p.gradient_home == Tier::kDevice ? dev_round(4 * n) : 0);
      }
    }
    p.device_scratch_bytes += step_scratch(p.gradient_home == Tier::kDevice);
  }

  // Partial offload (offload_optimizer.ratio < 1, stage 3, cpu/nvme): the last sub-groups, whole,
  // until (1 - ratio) of the elements, are homed on the device with their gradient partitions
  // (host-addressable device; else those stay at gradient_home and go up through scratch).
  // "auto" (kRatioAuto): as many as the device's idle room holds — the store's device budget less
  // the working shards kept there (all of them when they fit half of it, as step() then publishes
  // them there, else the homed ones and the largest offloaded one), the gather reserve, the step
  // scratch and an eighth of the budget for what the store reads ahead; none when the device
  // budget is not known yet (ZeroEngine plans again once its device exists).
  const double ratio = z.offload_optimizer.ratio;
  const bool grad_on_device = o.device_host_addressable;
  std::size_t want = 0;
  if (ratio < 0 && p.device_budget_bytes > 0 && stage == 3 && p.uses_device) {
    const std::uint64_t B = p.device_budget_bytes;
    const std::uint64_t reserve = (o.world_size > 1 ? 2 * dev_round(largest_padded) : 0) + step_scratch(grad_on_device);
    const std::uint64_t store = B > reserve ? B - reserve : 0;
    const std::uint64_t params = p.param_home != Tier::kDevice && p.param_store_bytes <= store / 2
                                     ? p.param_store_bytes
                                     : dev_homes + (largest_offloaded ? dev_round(largest_offloaded) : 0);
    const std::uint64_t used = params + store / 8;
    const std::uint64_t room = store > used ? store - used : 0;
    want = static_cast<std::size_t>(room / (12 + (grad_on_device ? 4 : 0)));
  } else if (ratio >= 0 && ratio < 1.0) {
    want = static_cast<std::size_t>(std::ceil((1.0 - ratio) * static_cast<double>(R)));
  }
  if (want > 0 && stage == 3 && p.uses_device && !p.optimizer_on_device &&
      z.offload_optimizer.device != OffloadDevice::kNone && R > 0) {
    // Whole sub-groups from the end: a ratio takes them until it has `want` elements (the last
    // one may pass it), "auto" only those that fit in `want`.
    auto enough = [&](std::size_t n) {
      return ratio < 0 ? p.device_optimizer_elems + n > want : p.device_optimizer_elems >= want;
    };
    std::size_t flat_end = R;
    bool more = true;
    for (std::size_t i = layout.modules.size(); more && i-- > 0;) {
      const ModuleShard& s = layout.modules[i];
      const std::size_t base = flat_end - s.shard;  // modules are consecutive in the rank-flat order
      const auto groups = make_sub_groups(s.shard, p.piece_elems, A);
      for (std::size_t g = groups.size(); g-- > 0;) {
        const std::uint64_t n = groups[g].size();
        if (enough(n)) {
          more = false;
          break;
        }
        p.device_optimizer_elems += n;
        p.device_optimizer_from = base + groups[g].begin;
        p.device_optimizer_bytes += dev_round(12 * n) + (grad_on_device ? dev_round(4 * n) : 0);
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
    if (d > 0) p.device_scratch_bytes += step_scratch(grad_on_device);
  }

  // Device: stored shards (home device) or the largest one at a time; gathered modules.
  if (p.uses_device) {
    if (o.world_size > 1) p.gather_reserve_bytes = 2 * dev_round(largest_padded);
    const std::uint64_t params = dev_homes + (largest_offloaded ? dev_round(largest_offloaded) : 0);
    p.device_min_bytes = params + p.gather_reserve_bytes;
    p.device_min_why = fmt::format("{} of working shards homed on the device + the largest offloaded one, {}",
                                   format_bytes(dev_homes), format_bytes(largest_offloaded ? dev_round(largest_offloaded) : 0));
    if (p.gather_reserve_bytes) {
      p.device_min_why += fmt::format(" + 2 all-gathered modules ({})", format_bytes(p.gather_reserve_bytes));
    }
  }
  if (p.optimizer_on_device) {
    p.device_min_bytes += dev_optim + p.device_scratch_bytes;
    p.device_min_why += fmt::format("{}{} of optimizer state{} on the device (offload_optimizer none, "
                                    "tiermem.device_optimizer) + {} of step scratch",
                                    p.device_min_why.empty() ? "" : " + ", format_bytes(dev_optim),
                                    p.gradient_home == Tier::kDevice ? " and gradient partitions" : "",
                                    format_bytes(p.device_scratch_bytes));
  }

  if (p.device_optimizer_elems > 0) {
    p.device_min_bytes += p.device_optimizer_bytes + p.device_scratch_bytes;
    p.device_min_why += fmt::format(" + {} of optimizer state{} on the device ({} elements: "
                                    "zero_optimization.offload_optimizer.ratio {}) + {} of step scratch",
                                    format_bytes(p.device_optimizer_bytes),
                                    o.device_host_addressable ? " and gradient partitions" : "",
                                    p.device_optimizer_elems, ratio < 0 ? std::string("\"auto\"") : fmt::format("{}", ratio),
                                    format_bytes(p.device_scratch_bytes));
  }

  // NVMe.
  p.nvme_param_bytes = nvme_homes;
  const std::uint64_t offloaded = R - p.device_optimizer_elems;
  const std::uint64_t grads_offloaded = o.device_host_addressable ? offloaded : R;
  if (p.optimizer_home == Tier::kNvme) p.nvme_optimizer_bytes = 12ull * offloaded;
  if (stage >= 2 && p.gradient_home == Tier::kNvme) p.nvme_optimizer_bytes += 4ull * grads_offloaded;
  p.nvme_bytes = p.nvme_param_bytes + p.nvme_optimizer_bytes;

  if (p.host_budget_bytes < p.host_min_bytes) {
    p.fits = false;
    // The minimum is exact (a budget of it runs): give it in bytes too, and the budget as well
    // when the two read the same rounded.
    const bool same = format_bytes(p.host_budget_bytes) == format_bytes(p.host_min_bytes);
    p.why = fmt::format("host budget {}{} (tiermem.host_budget_bytes) is below the {} ({} bytes) this model needs: {}",
                        format_bytes(p.host_budget_bytes),
                        same ? fmt::format(" ({} bytes)", p.host_budget_bytes) : std::string(),
                        format_bytes(p.host_min_bytes), p.host_min_bytes, p.host_min_why);
  } else if (needs_device(p) && p.device_budget_bytes != 0 && p.device_budget_bytes < p.device_min_bytes) {
    p.fits = false;
    p.why = fmt::format("device budget {} (tiermem.device_budget_bytes) is below the {} this model needs: {}",
                        format_bytes(p.device_budget_bytes), format_bytes(p.device_min_bytes), p.device_min_why);
  }
  return p;
}

}  // namespace tiermem
