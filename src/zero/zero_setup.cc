// src/zero/zero_setup.cc — ZeroEngine's set-up: the plan (homes, sub-group size, minimum
// budgets), the tiers (device, io engine, swap spaces, one TensorStore with the Prefetcher) and
// each module's tensors, written to their homes as the module is registered.
#include <algorithm>
#include <fmt/format.h>

#include "tiermem/log.h"
#include "tiermem/prefetcher.h"
#include "zero/zero_impl.h"

namespace tiermem {
namespace {

// Where a tensor is filled in place for its home: NVMe homes through the host tier.
Tier fill_tier_of(Tier home) { return home == Tier::kNvme ? Tier::kHost : home; }

// Copies shard elements [a, b) of the initial values `init` (zero beyond it) to dst as fp32.
void copy_shard_init(std::span<const float> init, std::size_t a, std::size_t b, float* dst) {
  const std::size_t v = std::min(b, std::max(a, init.size()));
  if (v > a) std::copy(init.begin() + static_cast<std::ptrdiff_t>(a), init.begin() + static_cast<std::ptrdiff_t>(v), dst);
  std::fill(dst + (v - a), dst + (b - a), 0.0f);
}

// A frozen base stored in fewer bytes is dequantized at gather by the CPU (tiermem/quantize.h):
// a device the CPU cannot address has no such kernel yet, so it is refused, naming the key.
void refuse_opaque_at_rest(const Config& cfg, const detail::EngineShape& shape, const ZeroEngineOptions& opts,
                           const Device& device) {
  if (!shape.opaque || shape.frozen_at_rest == FrozenDtype::kWorking) return;
  if (std::none_of(opts.frozen_modules.begin(), opts.frozen_modules.end(), [](bool f) { return f; })) return;
  const char* ds_key = "zero_optimization.zero_quantized_nontrainable_weights";
  const char* key = cfg.given(ds_key) && !cfg.given("tiermem.frozen_dtype") ? ds_key : "tiermem.frozen_dtype";
  throw ConfigError(key, cfg.tiermem.frozen_dtype,
                    fmt::format("config key '{}' (frozen weights at rest in {}) needs a device the CPU can address "
                                "(SimDevice): the dequantize at gather runs on the CPU, and this device ({}) is not "
                                "host-addressable; leave the frozen weights in the working dtype (\"auto\")",
                                key, cfg.tiermem.frozen_dtype,
                                device.kind() == DeviceKind::kSim ? "sim, tiermem.sim_host_addressable false" : "cuda"));
}

}  // namespace


void ZeroEngine::Impl::make_plan(std::span<const std::size_t> numels) {
  ZeroPlanOptions po;
  po.world_size = shape.world;
  po.alignment_elems = opts.alignment_elems;
  po.max_inflight_buckets = opts.max_inflight_buckets;
  po.frozen_modules = opts.frozen_modules;
  // The device is made only when the plan needs one, but its kind (and so its addressability) is
  // known now: tiermem.device resolved once, here.
  plan_in.device_choice = resolve_device(DeviceOptions::from_config(cfg).choice);
  const bool gpu = plan_in.device_choice.kind == DeviceKind::kCuda;
  po.device_host_addressable = !gpu && cfg.tiermem.sim_host_addressable;
  // tiermem.device_optimizer: on = the device-resident optimizer on any device (SimDevice: its
  // CPU twin); auto = when the device will be a GPU; off = never. It applies to offload_optimizer
  // none at stages 1-3 (plan_zero checks those).
  const std::string& want = cfg.tiermem.device_optimizer;
  const bool adamw = shape.optimizer == detail::OptimizerKind::kAdamW;  // the device steps AdamW only
  po.device_optimizer = adamw && (want == "on" || (want == "auto" && gpu));
  po.device_share = adamw;
  if (want == "on" && cfg.zero.offload_optimizer.device != OffloadDevice::kNone) {
    throw ConfigError("tiermem.device_optimizer", want,
                      fmt::format("tiermem.device_optimizer \"on\" keeps the optimizer state on the device, "
                                  "but zero_optimization.offload_optimizer.device is \"{}\": set it to "
                                  "\"none\", or device_optimizer to \"auto\"/\"off\"",
                                  offload_device_name(cfg.zero.offload_optimizer.device)));
  }
  if (want == "on" && shape.stage == 0) {
    throw ConfigError("tiermem.device_optimizer", want,
                      "tiermem.device_optimizer \"on\" needs zero_optimization.stage 1, 2 or 3 (stage 0 "
                      "keeps its unpartitioned optimizer state in host memory)");
  }
  plan_in.opts = po;
  plan_in.numels.assign(numels.begin(), numels.end());
  plan = plan_zero(cfg, numels, po);
  if (!plan.fits && plan.optimizer_on_device && want == "auto" && plan.host_budget_bytes >= plan.host_min_bytes) {
    fall_back_to_host_optimizer();  // the device budget cannot hold the state: the host pool does
  }
  if (!plan.fits) {
    const bool host = plan.host_budget_bytes < plan.host_min_bytes;
    throw ConfigError(host ? "tiermem.host_budget_bytes" : "tiermem.device_budget_bytes",
                      std::to_string(host ? plan.host_budget_bytes : plan.device_budget_bytes), plan.why);
  }
  plan_in.planned = true;
  make_tiers();
}

// tiermem.device_optimizer auto, and the state does not fit the device budget: it is homed in the
// host pool and stepped by the CPU instead, said once (a GPU user's offload_optimizer none
// still starts, as DeepSpeed's would on a GPU with room).
void ZeroEngine::Impl::fall_back_to_host_optimizer() {
  TM_LOG_WARN("ZERO",
              "offload_optimizer none: the optimizer state does not fit the device budget {} "
              "(tiermem.device_budget_bytes; {} needed: {}): it stays in host memory and is stepped by "
              "the CPU (set tiermem.device_optimizer \"off\" or offload_optimizer \"cpu\" to silence this)",
              format_bytes(plan.device_budget_bytes), format_bytes(plan.device_min_bytes), plan.device_min_why);
  plan_in.opts.device_optimizer = false;
  plan = plan_zero(cfg, plan_in.numels, plan_in.opts);
}

namespace {

// Whether all of `modules` modules are frozen (past the end of `frozen`, a module trains). A
// forward-only engine's passes loop over weights that are only read: under MIN, with more of them
// than the budgets hold, no prefetch may evict anything and each weight is read when its module
// needs it (a 6-layer Llama-7B slice at 1 + 0.5 GiB budgets: every read a demand miss), so its
// Prefetcher prefetches aggressively by default (tiermem.prefetch_eviction "auto").
bool all_frozen(const std::vector<bool>& frozen, std::size_t modules) {
  return modules > 0 && frozen.size() >= modules &&
         std::all_of(frozen.begin(), frozen.begin() + static_cast<std::ptrdiff_t>(modules), [](bool f) { return f; });
}

}  // namespace

void ZeroEngine::Impl::make_tiers() {
  const ZeroConfig& z = cfg.zero;
  const bool ratio_auto = z.offload_optimizer.ratio < 0;  // "auto": sized from the device's budget
  swaps = detail::make_swap_tier(cfg, plan, shape.rank);  // tier_setup.h
  if (needs_device(plan)) {
    DeviceOptions dopt = DeviceOptions::from_config(cfg);
    dopt.sim_adam_kernel = &detail::device_adam_kernel;  // the host optimizer's kernel: bit for bit
    device = make_device(dopt, plan_in.device_choice);
    if (const std::uint64_t phys = physical_memory_bytes();
        device->kind() == DeviceKind::kSim && phys > 0 && device->budget_bytes() > phys) {
      // The simulated device's memory is this machine's: a budget beyond it bounds nothing.
      TM_LOG_WARN("ZERO",
                  "tiermem.device_budget_bytes = {} is more than this machine's memory ({}), which is what the "
                  "simulated device allocates from: it bounds nothing; set it below {}",
                  format_bytes(device->budget_bytes()), format_bytes(phys), format_bytes(phys));
    }
    // Gathers land in device memory on every device. One the CPU cannot address (CudaDevice,
    // SimDevice with sim_host_addressable false) is only ever reached through its copy API
    // (zero_device.cc): staged all-gathers, publication of new params, gradient hand-over.
    if (plan.uses_device) shape.compute_tier = Tier::kDevice;
    shape.opaque = !device->host_addressable();
    refuse_opaque_at_rest(cfg, shape, opts, *device);
    if (ratio_auto && plan_in.opts.device_budget_bytes == 0) {
      // ratio "auto" sizes the device's share from its real budget (CUDA: measured as it is made)
      plan_in.opts.device_budget_bytes = device->budget_bytes();
      plan = plan_zero(cfg, plan_in.numels, plan_in.opts);
    }
    // The device optimizer needs the device's real budget (0 in the config: the device's own).
    if (plan.optimizer_on_device && device->budget_bytes() < plan.device_min_bytes &&
        cfg.tiermem.device_optimizer == "auto") {
      plan.device_budget_bytes = device->budget_bytes();  // for the message
      fall_back_to_host_optimizer();
      if (!needs_device(plan)) {
        device.reset();
        shape.opaque = false;
      }
    }
  }
  TensorStoreOptions so = TensorStoreOptions::from_config(cfg);
  so.host_budget_bytes = plan.host_budget_bytes;
  // Refused now, naming the key, rather than at the first allocation (zero_plan.h).
  if (const std::string why = host_budget_refusal(plan.host_budget_bytes); !why.empty()) {
    throw ConfigError("tiermem.host_budget_bytes", std::to_string(plan.host_budget_bytes),
                      fmt::format("{}, or 0 for the default ({})", why, format_bytes(default_host_budget_bytes())));
  }
  if (const std::string why = host_budget_warning(plan.host_budget_bytes); !why.empty()) {
    TM_LOG_WARN("ZERO", "tiermem.host_budget_bytes = {} (0 picks {})", why, format_bytes(default_host_budget_bytes()));
  }
  so.device_budget_bytes = 0;
  if (device) {
    const std::uint64_t dev = device->budget_bytes();
    if (dev < plan.device_min_bytes) {
      throw ConfigError("tiermem.device_budget_bytes", std::to_string(dev),
                        fmt::format("device budget {} ({}) is below the {} this model needs: {}", format_bytes(dev),
                                    device->name(), format_bytes(plan.device_min_bytes), plan.device_min_why));
    }
    so.device_budget_bytes = dev - plan.gather_reserve_bytes - plan.device_scratch_bytes;
    if (plan.updates_on_device) {  // covers publishes_working_on_device: a host-addressable device in use
      shape.publish_tier = Tier::kDevice;
    }
  }
  so.pin_memory = z.offload_param.pin_memory || z.offload_optimizer.pin_memory;
  shape.forward_only = all_frozen(opts.frozen_modules, plan_in.numels.size());
  const PrefetcherOptions prefetch = PrefetcherOptions::from_config(cfg, shape.wdtype, shape.forward_only);
  st.aggressive_prefetch = prefetch.aggressive_prefetch;  // ZeroStats: the resolved prefetch_eviction
  std::unique_ptr<ResidencyPolicy> policy = std::make_unique<Prefetcher>(prefetch);
  store = std::make_unique<TensorStore>(so, device, swaps.optim_swap ? swaps.optim_swap : swaps.param_swap, std::move(policy));
  shape.grad_tier = plan.gradient_home == Tier::kDevice ? Tier::kDevice : Tier::kHost;
  if (ratio_auto && plan.device_optimizer_elems == 0 && !plan.optimizer_on_device) {
    TM_LOG_INFO("ZERO", "offload_optimizer.ratio \"auto\": {}; all of the optimizer state is offloaded",
                shape.stage == 3 && plan.uses_device && cfg.zero.offload_optimizer.device != OffloadDevice::kNone
                    ? "the device budget has no idle room for a sub-group"
                    : "it applies at stage 3 with offload_optimizer cpu/nvme");
  } else if (cfg.zero.offload_optimizer.ratio < 1.0 && plan.device_optimizer_elems == 0 && !plan.optimizer_on_device) {
    TM_LOG_WARN("ZERO",
                "zero_optimization.offload_optimizer.ratio {} is not used: it keeps part of the optimizer state "
                "on the device at stage 3 with offload_optimizer cpu/nvme and a stage-3 device tier (stage {}, "
                "offload_optimizer {})",
                cfg.zero.offload_optimizer.ratio, shape.stage, offload_device_name(cfg.zero.offload_optimizer.device));
  } else if (plan.device_optimizer_elems > 0) {
    TM_LOG_INFO("ZERO",
                "offload_optimizer.ratio {}: {} of {} optimizer-state elements ({}) are homed on the device and "
                "stepped there",
                ratio_auto ? std::string("\"auto\"") : fmt::format("{}", cfg.zero.offload_optimizer.ratio),
                plan.device_optimizer_elems, plan.rank_flat_elems,
                format_bytes(plan.device_optimizer_bytes));
  }
  st.host_pinned = z.offload_param.pin_memory || z.offload_optimizer.pin_memory;
  TM_LOG_INFO("ZERO",
              "stage {}, rank {} of {}: {} elements of optimizer state ({} in sub-groups of {} elements, {}); "
              "params {}, gradients {}; host budget {}, device {}",
              shape.stage, shape.rank, shape.world, plan.rank_flat_elems, format_bytes(plan.optimizer_bytes), plan.sub_group_elems,
              tier_name(plan.optimizer_home), plan.uses_device ? tier_name(plan.param_home) : "engine host buffers",
              shape.stage >= 2 ? tier_name(plan.gradient_home) : "engine host buffers", format_bytes(plan.host_budget_bytes),
              device ? format_bytes(device->budget_bytes()) : std::string("unused"));
}

// Layout bookkeeping of the next module (no I/O).
void ZeroEngine::Impl::add_module(const std::string& name, std::size_t numel) {
  detail::PartitionOptions po;
  po.stage = shape.stage;
  po.world = shape.world;
  po.opt_world = shape.opt_world;
  po.alignment_elems = opts.alignment_elems;
  po.persistence_threshold_elems = cfg.zero.stage3_param_persistence_threshold_elems;
  // A frozen module takes no room in the rank-flat optimizer shard.
  const std::size_t flat = mods.empty() ? 0 : mods.back().flat + (mods.back().frozen ? 0 : mods.back().shard.shard);
  const detail::ModuleLayout l = detail::layout_module(numel, flat, po);
  detail::ZeroModule m;
  m.name = name;
  m.frozen = mods.size() < opts.frozen_modules.size() && opts.frozen_modules[mods.size()];
  m.numel = numel;
  m.shard = l.shard;
  m.flat = l.flat;
  m.persistent = l.persistent;
  m.stored = l.stored;
  if (m.frozen && m.stored) m.at_rest = shape.frozen_at_rest;
  mods.push_back(std::move(m));
  updates.resize(mods.size());
  norm.resize(mods.size());
}

// Writes module i's tensors to their homes from its fp32 initial shard: `init` holds the first
// init.size() elements of the shard, the rest (padding) is zero. Each tensor is filled in place
// through the store (acquired for overwrite at its home, or at the host tier for NVMe homes, and
// written back by the store), so initialisation needs no host memory outside the budgets.
void ZeroEngine::Impl::write_module(int i, std::span<const float> init) {
  detail::ZeroModule& m = mods[static_cast<std::size_t>(i)];
  const std::size_t n = m.shard.shard;
  auto copy_init = [&](std::size_t a, std::size_t b, float* dst) { copy_shard_init(init, a, b, dst); };
  // Optimizer sub-groups (and gradient partitions): the module's shard in sub-groups; none when frozen.
  const detail::ModuleLayout layout{m.shard, m.flat, m.persistent, m.stored};
  const std::vector<detail::SubGroupLayout> groups =
      m.frozen ? std::vector<detail::SubGroupLayout>{}
               : detail::layout_sub_groups(layout, plan.module_sub_group_elems.at(static_cast<std::size_t>(i)),
                                           opts.alignment_elems, plan.optimizer_on_device, plan.device_optimizer_from);
  // One fp32 copy (tiermem.fp32_single_copy): the working shard is the master where it is homed
  // with the optimizer state and the CPU steps it in place (ZeroModule::shared_master).
  // The plan decides (ZeroPlan::fp32_single_copy, zero_plan.h) and prices it; a module kept whole
  // on the device keeps its master in its state.
  const Tier param_home = m.persistent ? shape.compute_tier : plan.param_home;
  m.shared_master = plan.fp32_single_copy && m.stored && !m.frozen && param_home == plan.param_home &&
                    std::none_of(groups.begin(), groups.end(), [](const detail::SubGroupLayout& g) { return g.on_device; });
  const std::size_t slots = m.shared_master ? 2 : 3;  // [master |] exp_avg | exp_avg_sq
  for (const detail::SubGroupLayout& g : groups) {
    const ElemRange& r = g.range;
    detail::SubGroup p;
    p.module = i;
    p.begin = r.begin;
    p.end = r.end;
    p.flat = g.flat;
    p.on_device = g.on_device;
    TensorSpec os;
    os.name = fmt::format("zero.optim.{}.{}", m.name, r.begin);
    os.dtype = DType::kF32;
    os.shape = {static_cast<std::int64_t>(slots), static_cast<std::int64_t>(r.size())};
    os.home = p.on_device ? Tier::kDevice : plan.optimizer_home;
    os.swap = swaps.optim_swap.get();
    os.zero_fill = false;
    os.group = detail::kGroupOptimizer;
    p.optim = store->register_tensor(os);
    {
      TensorStore::Pin pin = store->acquire_for_overwrite(p.optim, fill_tier_of(os.home));
      pin.mark_dirty();
      if (shape.opaque && pin.tier() == Tier::kDevice) {  // device-resident optimizer on an opaque device
        std::vector<float> tmp(3 * r.size(), 0.0f);
        copy_init(r.begin, r.end, tmp.data());
        staging.upload(pin, 0, tmp.data(), tmp.size() * sizeof(float));
      } else {
        float* s = pin.as<float>();
        float* moments = s + (slots - 2) * r.size();  // the master, when here, is slot 0
        if (!m.shared_master) copy_init(r.begin, r.end, s);  // else write_working writes it
        std::fill(moments, moments + 2 * r.size(), 0.0f);      // exp_avg, exp_avg_sq
        if (shape.optimizer == detail::OptimizerKind::kAdagrad) {  // its sum starts there (slot 2)
          std::fill(moments + r.size(), moments + 2 * r.size(),
                    static_cast<float>(cfg.optimizer.initial_accumulator_value));
        }
      }
    }
    if (shape.stage >= 2) {
      TensorSpec gs;
      gs.name = fmt::format("zero.grad.{}.{}", m.name, r.begin);
      gs.dtype = DType::kF32;
      gs.shape = {static_cast<std::int64_t>(r.size())};
      // A device-homed sub-group's gradient lives beside it when the CPU can add into it in place.
      gs.home = p.on_device && !shape.opaque ? Tier::kDevice : plan.gradient_home;
      p.gtier = gs.home == Tier::kDevice ? Tier::kDevice : Tier::kHost;
      gs.swap = swaps.optim_swap.get();
      gs.zero_fill = false;  // always overwritten first (acquire_for_overwrite)
      gs.group = detail::kGroupGradient;
      p.grad = store->register_tensor(gs);
    }
    m.sub_groups.push_back(static_cast<int>(sub_groups.size()));
    sub_groups.push_back(p);
  }
  write_working(i, init);
  if (shape.stage <= 1 && !m.frozen) m.full_grad.assign(m.shard.padded, 0.0f);
  if (shape.stage == 1 && !m.frozen) m.shard_grad.assign(n, 0.0f);
  m.registered = true;
}

// Module i's working params from `init` (the first init.size() elements of its fp32 shard, the
// rest zero), at registration or rewritten later (a frozen module's set_module_params): a stored
// shard is acquired for overwrite at its home and written back by the store; otherwise the
// engine's buffer, all-gathered into the full copy where the module keeps one.
void ZeroEngine::Impl::write_working(int i, std::span<const float> init) {
  detail::ZeroModule& m = mods[static_cast<std::size_t>(i)];
  const std::size_t n = m.shard.shard;
  auto copy_init = [&](std::size_t a, std::size_t b, float* dst) { copy_shard_init(init, a, b, dst); };
  // Working params, converted piecewise (bounded temporaries) into the pinned shard (copied up
  // when it is device memory the CPU cannot address).
  // pin: the destination when it is a store tensor (null: `dst` is an engine host buffer).
  // A quantized frozen module (tiermem.frozen_dtype) is written in its at-rest format instead.
  auto to_work = [&](std::byte* dst, const TensorStore::Pin* pin) {
    std::vector<float> tmp;
    std::vector<std::byte> out;
    const bool staged = pin != nullptr && shape.opaque && pin->tier() == Tier::kDevice;
    constexpr std::size_t kStep = 1 << 20;  // a multiple of kInt8GroupElems
    for (std::size_t a = 0; a < n; a += kStep) {
      const std::size_t b = std::min(n, a + kStep);
      tmp.resize(b - a);
      copy_init(a, b, tmp.data());
      if (m.quantized()) {
        write_at_rest(m.at_rest, tmp.data(), a, b, n, dst);
        continue;
      }
      if (!staged) {
        stepper.to_working(tmp.data(), dst + a * shape.wsize, b - a);
        continue;
      }
      out.resize((b - a) * shape.wsize);
      stepper.to_working(tmp.data(), out.data(), b - a);
      staging.upload(*pin, a * shape.wsize, out.data(), out.size());
    }
  };
  if (m.stored) {
    if (m.param == kInvalidTensor) {
      TensorSpec ps;
      ps.name = "zero.param." + m.name;
      ps.dtype = m.quantized() ? DType::kU8 : shape.wdtype;
      ps.shape = {static_cast<std::int64_t>(m.quantized() ? at_rest_bytes(m.at_rest, n, shape.wsize) : n)};
      m.home = m.persistent ? shape.compute_tier : plan.param_home;
      ps.home = m.home;
      ps.swap = swaps.param_swap.get();
      ps.zero_fill = false;
      ps.group = m.frozen ? detail::kGroupFrozen : detail::kGroupTrainable;
      ps.read_in_place = m.frozen && !m.quantized();  // never written through a gather
      m.param = store->register_tensor(ps);
    }
    TensorStore::Pin pin = store->acquire_for_overwrite(m.param, fill_tier_of(m.home));
    to_work(pin.as<std::byte>(), &pin);
    pin.mark_dirty();
    if (m.frozen && m.home == Tier::kNvme) {
      // Stored now, once: written to its home and dropped from the host pool (a frozen base need
      // not sit in the cache until an eviction writes it at some later step).
      pin.release();
      store->evict(m.param, Tier::kHost);
    }
  } else {
    if (m.mem_shard.p == nullptr) m.mem_shard = detail::AlignedBuf(n * shape.wsize);
    to_work(m.mem_shard.b(), nullptr);
    if (shape.stage == 1 || shape.stage == 2 || m.persistent) {
      if (m.full.p == nullptr) m.full = detail::AlignedBuf(m.shard.padded * shape.wsize);
      comm.all_gather(m.mem_shard.p, m.full.p, n, shape.comm_dtype);
      ++st.all_gather_calls;
    }
  }
}

// Every module is registered: plan (deferred registration) and write what is still in memory.
void ZeroEngine::Impl::finalize() {
  updates.join();  // every call but a forward gather's own compute waits for it (update_scheduler.h)
  if (plan_in.finalized) return;
  if (!plan_in.expected_numels.empty() && mods.size() != plan_in.expected_numels.size()) {
    throw Error(fmt::format("ZeroEngine: {} modules were announced at construction but {} registered",
                            plan_in.expected_numels.size(), mods.size()));
  }
  if (!plan_in.planned) {
    std::vector<std::size_t> numels;
    for (const auto& m : mods) numels.push_back(m.numel);
    make_plan(numels);
  }
  for (std::size_t i = 0; i < mods.size(); ++i) {
    if (mods[i].registered) continue;
    write_module(static_cast<int>(i), mods[i].init_shard);
    mods[i].init_shard.clear();
    mods[i].init_shard.shrink_to_fit();
  }
  plan_in.finalized = true;
  store->begin_step();  // the Prefetcher records the first step's accesses
  // ... reading ahead meanwhile along the order the modules were registered in: each stored
  // module's gather forward, then (an engine that trains) backward in reverse. A model registers
  // its modules in about the order its forward runs them; where it does not, the Prefetcher skips
  // what the order does not have, and drops it when nothing matches (Prefetcher::expect_order).
  std::vector<Access> order;
  for (const detail::ZeroModule& m : mods) {
    if (m.stored) order.push_back({m.param, store->info(m.param).bytes, Phase::kForward, staging.gather_tier(m)});
  }
  if (!shape.forward_only) {
    for (std::size_t i = order.size(); i-- > 0;) order.push_back({order[i].id, order[i].bytes, Phase::kBackward, order[i].tier});
  }
  store->expect_order(order);
}

std::uint64_t ZeroEngine::Impl::engine_host_bytes() const {
  std::uint64_t b = 0;
  for (const auto& m : mods) {
    b += m.mem_shard.bytes + m.full.bytes + 4 * (m.full_grad.size() + m.shard_grad.size() + m.init_shard.size());
  }
  return b + reducer.host_bytes() + staging.host_bytes();
}

}  // namespace tiermem
