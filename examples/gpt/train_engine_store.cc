// examples/gpt/train_engine_store.cc — StoreEngine: one rank's ZeRO-3 over tiermem's TensorStore
// (see train_engines.h).
//
// Per module m (gpt/model.h's modules: embed, block.0.., ln_f) three TensorStore tensors, fp32:
//   "<module>.param"   home = offload_param.device   (nvme: swap space; cpu: host; none: device)
//   "<module>.adam_m"  home = offload_optimizer.device (nvme or host)
//   "<module>.adam_v"
// The parameters are the fp32 master weights (no separate 16-bit working copy). A model step
// acquires its module's parameters at the compute tier (the device: SimDevice memory is
// host-addressable, so the CPU kernels read it in place) and releases them after; the
// Prefetcher, as TensorStore's policy, records the first step's accesses and from then on
// prefetches ahead (NVMe->device within the device budget, NVMe->host further ahead) and evicts
// by furthest next use. The optimizer step acquires each module's param, m and v at the host
// tier, runs AdamW (the same kernel and order as ResidentEngine, so losses match bit for bit),
// marks them dirty (written back to NVMe when evicted or flushed) and prefetches the next
// module's state while it computes. Gradients are fp32 host buffers (not tiered).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fmt/format.h>
#include <thread>

#include "checkpoint.h"
#include "kill_point.h"
#include "tiermem/error.h"
#include "tiermem/log.h"
#include "train_engines.h"

#if defined(TIERMEM_TRAIN_HAVE_RUNTIME) && defined(TIERMEM_TRAIN_HAVE_GPU) && \
    defined(TIERMEM_TRAIN_HAVE_NVME)
#include "tiermem/device.h"
#include "tiermem/io_engine.h"
#include "tiermem/swap_space.h"
#include "tiermem/tensor_store.h"
#if defined(TIERMEM_TRAIN_HAVE_PREFETCH)
#include "tiermem/prefetcher.h"
#endif

namespace tiermem::train {
namespace {

using Clock = std::chrono::steady_clock;

Tier home_of(OffloadDevice d) {
  switch (d) {
    case OffloadDevice::kNvme: return Tier::kNvme;
    case OffloadDevice::kCpu: return Tier::kHost;
    case OffloadDevice::kNone: return Tier::kDevice;
  }
  return Tier::kHost;
}

std::uint64_t round_up(std::uint64_t x, std::uint64_t a) { return (x + a - 1) / a * a; }

class StoreEngine final : public TrainEngine {
 public:
  explicit StoreEngine(const TrainPlan& plan) : cfg_(plan.model), stage_(plan.config.zero.stage) {
    const Config& c = plan.config;
    layouts_ = gpt::module_layouts(cfg_);
    const int n = static_cast<int>(layouts_.size());
    std::uint64_t largest = 0;
    for (const auto& l : layouts_) largest = std::max<std::uint64_t>(largest, l.numel * 4);
    total_params_ = static_cast<std::uint64_t>(gpt::num_params(cfg_));

    param_home_ = home_of(c.zero.offload_param.device);
    opt_home_ = home_of(c.zero.offload_optimizer.device);
    if (opt_home_ == Tier::kDevice) opt_home_ = Tier::kHost;  // AdamW runs on the CPU
    if (c.zero.offload_param.device != OffloadDevice::kNone && c.zero.stage != 3) {
      throw ConfigError("zero_optimization.offload_param.device",
                        std::string(offload_device_name(c.zero.offload_param.device)),
                        fmt::format("offloading parameters needs stage 3 (stage is {})",
                                    c.zero.stage));
    }

    // Device: the budget is --device-budget / tiermem.device_budget_bytes, else 1/8 of the
    // parameters + optimizer state (at least what the largest module needs).
    const std::uint64_t state = param_bytes() + optimizer_bytes();
    DeviceOptions dopt = DeviceOptions::from_config(c);
    std::uint64_t budget = c.tiermem.device_budget_bytes;
    if (budget == 0) {
      budget = param_home_ == Tier::kDevice ? round_up(param_bytes() + param_bytes() / 4, 1 << 20)
                                            : round_up(state / 8, 4096);
      const std::uint64_t need = round_up(largest + largest / 4 + 65536, 4096);
      if (budget < need) {
        TM_LOG_WARN("TRAIN",
                    "the default device budget, {} (1/8 of the state), leaves no room to prefetch "
                    "next to the largest module ({}): using {} (--device-budget sets it; the "
                    "least that runs is one largest module in 4 KiB pages)",
                    format_bytes(budget), format_bytes(largest), format_bytes(need));
        budget = need;
      }
    }
    dopt.budget_bytes = budget;
    device_ = make_device(dopt);
    compute_tier_ = device_->host_addressable() ? Tier::kDevice : Tier::kHost;
    if (param_home_ == Tier::kDevice && !device_->host_addressable()) {
      // The CPU model and CPU AdamW cannot touch device memory: keep the parameters' home on
      // the host instead (what offload_param cpu would do).
      TM_LOG_WARN("TRAIN", "{}: parameters stay on the host tier (the CPU model and AdamW cannot "
                  "address device memory); set zero_optimization.offload_param to silence this",
                  device_->name());
      param_home_ = Tier::kHost;
    }
    // AdamW (CPU) updates the parameters where they live when that is host-addressable device
    // memory (the SimDevice, params not offloaded), else on the host tier.
    param_step_tier_ = param_home_ == Tier::kDevice ? Tier::kDevice : Tier::kHost;
    if (compute_tier_ == Tier::kHost) {
      TM_LOG_WARN("TRAIN", "{}: device memory is not host-addressable and the GPT kernels of "
                  "tiermem-train run on the CPU: parameters are computed on from the host tier",
                  device_->name());
    }

    // NVMe: one swap space for this rank under <nvme_path>/rank0.
    if (param_home_ == Tier::kNvme || opt_home_ == Tier::kNvme) {
      std::vector<std::string> dirs;
      const auto& paths = opt_home_ == Tier::kNvme ? c.zero.offload_optimizer.nvme_path
                                                   : c.zero.offload_param.nvme_path;
      for (const auto& p : paths) {
        const std::string d = (std::filesystem::path(p) / fmt::format("rank{}", plan.rank)).string();
        std::error_code ec;
        std::filesystem::create_directories(d, ec);
        if (ec) throw IoError(d, 0, 0, ec.value(), "mkdir", "swap directory");
        dirs.push_back(d);
      }
      swap_dirs_ = dirs;
      io_ = make_io_engine(c);
      swap_ = std::make_shared<SwapSpace>(c, dirs, *io_);
    }

    // Host tier: tiermem.host_budget_bytes, else 1/4 of the state (at least 4 of the largest
    // module's tensors, so param + m + v of one module and a prefetch fit) as a cache ...
    TensorStoreOptions sopt = TensorStoreOptions::from_config(c);
    if (c.tiermem.host_budget_bytes == 0) {
      // ... plus the home copies of whatever lives on the host (offload cpu).
      const std::uint64_t host_homes = (param_home_ == Tier::kHost ? param_bytes() : 0) +
                                        (opt_home_ == Tier::kHost ? optimizer_bytes() : 0);
      const std::uint64_t per_tensor_slack = 4096 * 3 * layouts_.size();
      sopt.host_budget_bytes =
          round_up(host_homes + per_tensor_slack + std::max(state / 4, 4 * largest), 64 << 10);
    }
    sopt.pipeline_chunk_bytes = std::min<std::uint64_t>(sopt.pipeline_chunk_bytes,
                                                        round_up(std::max<std::uint64_t>(largest / 4, 4096), 4096));
    std::unique_ptr<ResidencyPolicy> policy;
#if defined(TIERMEM_TRAIN_HAVE_PREFETCH)
    policy = std::make_unique<Prefetcher>(PrefetcherOptions::from_config(c, DType::kF32));
    policy_name_ = "reuse-distance Prefetcher (Belady)";
#else
    policy_name_ = "LRU";
#endif
    store_ = std::make_unique<TensorStore>(sopt, device_, swap_, std::move(policy));

    // Register every module's tensors with their initial values.
    std::vector<float> zeros;
    for (int m = 0; m < n; ++m) {
      const auto& l = layouts_[static_cast<std::size_t>(m)];
      std::vector<float> init(static_cast<std::size_t>(l.numel));
      gpt::init_module(cfg_, m, plan.seed, init);
      zeros.assign(init.size(), 0.0f);
      auto spec = [&](const std::string& suffix, Tier home, const std::vector<float>& v) {
        TensorSpec s;
        s.name = l.name + suffix;
        s.dtype = DType::kF32;
        s.shape = {l.numel};
        s.home = home;
        s.initial = std::as_bytes(std::span<const float>(v));
        return s;
      };
      const std::uint64_t bytes = static_cast<std::uint64_t>(l.numel) * 4;
      nvme_home_bytes_ += (param_home_ == Tier::kNvme ? bytes : 0) +
                          (opt_home_ == Tier::kNvme ? 2 * bytes : 0);
      p_.push_back(store_->register_tensor(spec(".param", param_home_, init)));
      m_.push_back(store_->register_tensor(spec(".adam_m", opt_home_, zeros)));
      v_.push_back(store_->register_tensor(spec(".adam_v", opt_home_, zeros)));
      grads_.emplace_back(init.size(), 0.0f);
    }
    pins_.resize(static_cast<std::size_t>(n));
    base_ = store_->stats();
    // TEST-ONLY (kill_point.h): count growth of the bytes written to NVMe as swap-out passes.
    if (kill_point_armed("swap-out")) {
      swap_watch_ = std::thread([this] {
        auto written = [this] {
          const TensorStoreStats st = store_->stats();
          const int nv = static_cast<int>(Tier::kNvme);
          return st.bytes_moved[0][nv] + st.bytes_moved[1][nv];
        };
        std::uint64_t last = written();
        while (!stop_watch_.load()) {
          const std::uint64_t now = written();
          if (now != last) kill_point("swap-out");
          last = now;
          std::this_thread::sleep_for(std::chrono::microseconds(50));
        }
      });
    }
  }

  ~StoreEngine() override {
    stop_watch_.store(true);
    if (swap_watch_.joinable()) swap_watch_.join();
    for (auto& p : pins_) p.release();
    store_.reset();  // before the swap space and the device it uses
  }

  std::string describe() const override {
    // One rank has nothing to partition: every stage pages the same way here.
    return fmt::format(
        "store ({}): params -> {}, Adam state -> {}, compute on {} [{}], policy {}{}",
        stage_ == 3 ? std::string("one-rank ZeRO-3 over TensorStore")
                    : fmt::format("one rank over TensorStore; ZeRO stage {} has nothing to "
                                  "partition on one rank", stage_),
        tier_name(param_home_), tier_name(opt_home_), device_->name(),
        tier_name(compute_tier_), policy_name_,
        swap_dirs_.empty() ? std::string() : fmt::format(", swap {}", fmt::join(swap_dirs_, ",")));
  }
  std::string param_home() const override { return std::string(tier_name(param_home_)); }
  std::string optimizer_home() const override { return std::string(tier_name(opt_home_)); }
  int zero_stage() const override { return stage_; }
  std::string device_kind() const override {
    return device_->kind() == DeviceKind::kSim ? "sim" : "cuda";
  }
  std::uint64_t param_bytes() const override { return total_params_ * 4; }
  std::uint64_t optimizer_bytes() const override { return total_params_ * 8; }

  void begin_step() override { store_->begin_step(); }
  void end_step() override { store_->end_step(); }

  gpt::ParamView acquire_params(int module, Phase phase) override {
    auto& pin = pins_.at(static_cast<std::size_t>(module));
    pin = store_->acquire(p_[static_cast<std::size_t>(module)], compute_tier_, phase);
    return gpt::ParamView(std::span<const float>(pin.as<const float>(), pin.bytes() / 4));
  }
  void release_params(int module) override { pins_.at(static_cast<std::size_t>(module)).release(); }

  std::span<float> grads(int module) override { return grads_.at(static_cast<std::size_t>(module)); }
  void zero_grad() override {
    for (auto& g : grads_) std::fill(g.begin(), g.end(), 0.0f);
  }

  void step(const OptimStep& s) override {
    const auto t0 = Clock::now();
    const std::uint64_t stall0 = store_->stats().stall_ns;
    const std::size_t n = p_.size();
    for (std::size_t i = 0; i < n; ++i) {
      // Read the next module's state from NVMe while this one is stepped.
      if (i + 1 < n) {
        const TensorId next_p[] = {p_[i + 1]};
        const TensorId next_state[] = {m_[i + 1], v_[i + 1]};
        store_->prefetch(next_p, param_step_tier_);
        store_->prefetch(next_state, Tier::kHost);
      }
      TensorStore::Pin p = store_->acquire(p_[i], param_step_tier_, Phase::kOptimizer);
      TensorStore::Pin m = store_->acquire(m_[i], Tier::kHost, Phase::kOptimizer);
      TensorStore::Pin v = store_->acquire(v_[i], Tier::kHost, Phase::kOptimizer);
      adamw_update(s, p.as<float>(), grads_[i].data(), m.as<float>(), v.as<float>(),
                   grads_[i].size());
      p.mark_dirty();
      m.mark_dirty();
      v.mark_dirty();
      kill_point("optimizer");  // TEST-ONLY (kill_point.h)
    }
    optimizer_seconds_ += std::chrono::duration<double>(Clock::now() - t0).count();
    optimizer_stall_ns_ += store_->stats().stall_ns - stall0;
  }

  void save(CheckpointWriter& w) override {
    store_->flush();
    std::vector<float> buf;
    for (std::size_t i = 0; i < p_.size(); ++i) {
      for (auto [id, home] : {std::pair{p_[i], param_home_}, std::pair{m_[i], opt_home_},
                              std::pair{v_[i], opt_home_}}) {
        const TensorInfo info = store_->info(id);
        buf.resize(info.bytes / 4);
        store_->read(id, std::as_writable_bytes(std::span<float>(buf)));
        w.add_tensor(info.name, home, buf.data(), info.bytes, "f32", info.shape);
      }
    }
  }
  void load(CheckpointReader& r) override {
    std::vector<float> buf;
    for (std::size_t i = 0; i < p_.size(); ++i) {
      for (TensorId id : {p_[i], m_[i], v_[i]}) {
        const TensorInfo info = store_->info(id);
        buf.resize(info.bytes / 4);
        r.read_tensor(info.name, buf.data(), info.bytes);
        store_->write(id, std::as_bytes(std::span<const float>(buf)));
      }
    }
  }

  EngineStats stats() const override {
    const TensorStoreStats st = store_->stats();
    const DeviceStats ds = device_->stats();
    EngineStats e;
    for (int a = 0; a < kNumTiers; ++a) {
      for (int b = 0; b < kNumTiers; ++b) e.moved.bytes[a][b] = st.bytes_moved[a][b] - base_.bytes_moved[a][b];
      e.peak_bytes[a] = st.peak_resident_bytes[a];
      e.budget_bytes[a] = st.budget_bytes[a];
    }
    // The device allocator's own peak (allocated + cached) bounds what the store accounts.
    e.peak_bytes[0] = std::max(e.peak_bytes[0], ds.peak_reserved_bytes);
    e.budget_bytes[0] = device_->budget_bytes();
    const int nv = static_cast<int>(Tier::kNvme);
    // NVMe holds the home copy of every tensor homed there (the swap space's extents).
    e.peak_bytes[nv] = nvme_home_bytes_;
    e.nvme_read_bytes = e.moved.bytes[nv][0] + e.moved.bytes[nv][1];
    e.nvme_written_bytes = e.moved.bytes[0][nv] + e.moved.bytes[1][nv];
    e.stall_seconds = static_cast<double>(st.stall_ns - base_.stall_ns) / 1e9;
    e.optimizer_seconds = optimizer_seconds_;
    e.optimizer_stall_seconds = static_cast<double>(optimizer_stall_ns_) / 1e9;
    return e;
  }

 private:
  gpt::GptConfig cfg_;
  std::vector<gpt::ModuleLayout> layouts_;
  std::uint64_t total_params_ = 0;
  Tier param_home_ = Tier::kNvme, opt_home_ = Tier::kNvme, compute_tier_ = Tier::kDevice;
  int stage_ = 3;  // the config's zero_optimization.stage (reported; paging is the same)
  Tier param_step_tier_ = Tier::kHost;  // where AdamW updates the parameters
  std::string policy_name_;
  std::vector<std::string> swap_dirs_;
  // Destruction order: store_ first (explicitly), then swap_, io_, device_.
  std::shared_ptr<Device> device_;
  std::unique_ptr<IoEngine> io_;
  std::shared_ptr<SwapSpace> swap_;
  std::unique_ptr<TensorStore> store_;
  std::vector<TensorId> p_, m_, v_;
  std::vector<std::vector<float>> grads_;
  std::vector<TensorStore::Pin> pins_;
  TensorStoreStats base_;
  double optimizer_seconds_ = 0;
  std::uint64_t nvme_home_bytes_ = 0;
  std::uint64_t optimizer_stall_ns_ = 0;
  std::atomic<bool> stop_watch_{false};
  std::thread swap_watch_;  // TEST-ONLY swap-out kill point; joined first in the destructor
};

}  // namespace

std::unique_ptr<TrainEngine> make_store_engine(const TrainPlan& plan) {
  return std::make_unique<StoreEngine>(plan);
}

}  // namespace tiermem::train

#else  // the runtime, device or NVMe library is missing from this build

namespace tiermem::train {
std::unique_ptr<TrainEngine> make_store_engine(const TrainPlan&) {
  throw NotSupportedError(
      "--engine store needs tiermem's runtime, gpu and nvme libraries, which this build lacks");
}
}  // namespace tiermem::train

#endif
