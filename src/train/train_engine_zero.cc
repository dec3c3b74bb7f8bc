// src/train/train_engine_zero.cc — ZeroTrainEngine: tiermem-train over tiermem::ZeroEngine
// and the Communicator (MPI under mpirun), see train_engines.h.
//
// Each GPT module is registered as one ZeroEngine module; a model step gathers it (stage 3: an
// all-gather of the shards) and releases it after; a backward step's gradient is handed to
// reduce_gradients (then the local buffer is zeroed, because the model accumulates into it and
// ZeroEngine takes one micro-batch's gradient per call); step() runs AdamW over the rank's
// optimizer shard (on NVMe through ZeroEngine's swap space with offload_optimizer nvme).
// ZeroEngine divides by ranks × micro-batches itself, clips by the config's gradient_clipping,
// and takes the loop's scheduled learning rate each step (set_learning_rate).
//
// Checkpoints (--save/--resume), as DeepSpeed's per-rank ZeRO checkpoints: each rank writes its
// own optimizer shard to DIR/rank<r>/ (CheckpointWriter's per-rank directory), streamed one
// optimizer sub-group at a time from ZeroEngine::export_optimizer_state, and streams it back
// (checksums verified first) with import_optimizer_state (which also republishes the working
// parameters from the restored master): no shard-sized buffer at any model size. Tensors:
//   zero.master, zero.exp_avg, zero.exp_avg_sq  f32 [shard_numel]  the rank-flat fp32 master
//                                               weights and Adam m, v (tier: nvme or host)
//   zero.partition  i64 [4 + modules]  world size, rank, alignment (elements), module count,
//                                      each module's numel: checked on resume
//   zero.steps      i64 [2]            optimizer steps taken (Adam bias correction), skipped steps
//   zero.loss_scale f64 [1], zero.loss_scaler i64 [3]   fp16 only: the dynamic loss scale;
//                   hysteresis left, scaler iteration, iteration of the last overflow
// The manifest format is unchanged (train_loop.cc writes meta; these are ordinary tensors). A
// resume needs the same model and alignment; the stage (1–3), offload devices and sub_group_size
// may differ. At another world size (or from stage 0 to 1-3 and back) the optimizer state is
// re-partitioned as it loads (checkpoint_reshard.h): each rank reads the elements of its new
// shard from the old ranks' files, verified first, one sub-group at a time.
#include <algorithm>
#include <optional>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <new>
#include <fmt/format.h>
#include <thread>

#include "tiermem/checkpoint.h"
#include "tiermem/checkpoint_reshard.h"
#include "tiermem/error.h"
#include "tiermem/log.h"
#include "tiermem/trace.h"
#include "train/kill_point.h"
#include "train/train_engines.h"

#if defined(TIERMEM_TRAIN_HAVE_ZERO) && defined(TIERMEM_TRAIN_HAVE_COMM)
#include "tiermem/communicator.h"
#include "tiermem/device.h"
#include "tiermem/zero_engine.h"

namespace tiermem::train {
namespace {

using Clock = std::chrono::steady_clock;

// Page-aligned storage, as device allocations are: the CPU kernels' results may depend on the
// alignment of their operands (vector heads peeled), so a module copied down from device memory
// is computed on exactly as it would be in place.
template <typename T>
struct PageAligned {
  using value_type = T;
  PageAligned() = default;
  template <typename U>
  PageAligned(const PageAligned<U>&) {}  // NOLINT: rebinding
  T* allocate(std::size_t n) {
    void* p = std::aligned_alloc(4096, (n * sizeof(T) + 4095) / 4096 * 4096);
    if (p == nullptr) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, std::size_t) noexcept { std::free(p); }
  bool operator==(const PageAligned&) const { return true; }
};

class ZeroTrainEngine final : public TrainEngine {
 public:
  ZeroTrainEngine(const TrainPlan& plan, std::uint64_t device_budget_bytes)
      : cfg_(plan.model), engine_config_(plan.config) {
    engine_config_.tiermem.device_budget_bytes = device_budget_bytes;
    comm_ = make_communicator();
    if (comm_->world_size() != plan.world_size || comm_->rank() != plan.rank) {
      throw CommError(fmt::format("the communicator sees rank {} of {}, the launcher said {} of {}",
                                  comm_->rank(), comm_->world_size(), plan.rank,
                                  plan.world_size));
    }
    if (plan.config.fp16.enabled) {  // before any collective: every rank refuses alike
      throw ConfigError("fp16.enabled", "true",
                        "config key 'fp16.enabled' = true: tiermem-train's CPU model computes in "
                        "fp32 or bf16, not fp16; use bf16.enabled instead");
    }
    // Every module's size up front: the engine plans and checks its budgets and NVMe room now
    // (a ConfigError, exit 2, naming the minimum), then each module is initialised and written
    // to its homes one at a time (the model is never whole in host memory).
    const auto layouts = gpt::module_layouts(cfg_);
    std::vector<std::size_t> numels;
    for (const auto& l : layouts) numels.push_back(static_cast<std::size_t>(l.numel));
    zero_ = std::make_unique<ZeroEngine>(engine_config_, *comm_, numels);
    for (int m = 0; m < static_cast<int>(layouts.size()); ++m) {
      std::vector<float> init(static_cast<std::size_t>(layouts[m].numel));
      gpt::init_module(cfg_, m, plan.seed, init);
      zero_->register_module(layouts[m].name, init);
    }
    grads_.resize(layouts.size());
    gathered_.resize(layouts.size());
    staged_.resize(layouts.size());
    total_params_ = static_cast<std::uint64_t>(gpt::num_params(cfg_));
    // TEST-ONLY (kill_point.h): kill points inside the optimizer step and during swap-out, from a
    // watcher thread (the step itself is library code).
    if (kill_point_armed("swap-out") || kill_point_armed("optimizer")) {
      watch_ = std::thread([this] {
        std::uint64_t last = zero_->nvme_bytes_written();
        while (!stop_watch_.load()) {
          const std::uint64_t now = zero_->nvme_bytes_written();
          if (now != last) kill_point("swap-out");
          if (in_step_.load()) kill_point("optimizer");
          last = now;
          std::this_thread::sleep_for(std::chrono::microseconds(50));
        }
      });
    }
  }

  ~ZeroTrainEngine() override {
    stop_watch_.store(true);
    if (watch_.joinable()) watch_.join();
    gathered_.clear();
  }

  std::string describe() const override {
    const Config& c = zero_->config();
    const ZeroPlan& p = zero_->plan();
    const ZeroStats z = zero_->stats();
    return fmt::format(
        "zero (tiermem::ZeroEngine, stage {}, {} over {} rank{}): params -> {}, optimizer -> {}, "
        "gradients -> {}, compute on {}, working dtype {}, host budget {}, sub-groups of {} "
        "elements",
        c.zero.stage, comm_->backend(), comm_->world_size(), comm_->world_size() == 1 ? "" : "s",
        param_home(), optimizer_home(), c.zero.stage >= 2 ? tier_name(p.gradient_home) : "host",
        device_kind(), dtype_name(zero_->working_dtype()), format_bytes(p.host_budget_bytes),
        z.sub_group_elems);
  }
  std::string param_home() const override {
    const ZeroPlan& p = zero_->plan();
    return p.uses_device ? std::string(tier_name(p.param_home)) : "host";
  }
  std::string optimizer_home() const override {
    return std::string(tier_name(zero_->plan().optimizer_home));
  }
  int zero_stage() const override { return zero_->config().zero.stage; }
  std::string device_kind() const override { return zero_->device_name(); }
  std::uint64_t param_bytes() const override {
    return total_params_ * dtype_size(zero_->working_dtype());
  }
  std::uint64_t optimizer_bytes() const override { return total_params_ * 12; }
  bool clips_gradients() const override { return true; }
  double last_grad_norm() const override { return last_grad_norm_; }

  gpt::ParamView acquire_params(int module, Phase phase) override {
    if (!base_stall_ns_) base_stall_ns_ = zero_->stats().driving_stall_ns;
    const auto t0 = Clock::now();
    auto& g = gathered_.at(static_cast<std::size_t>(module));
    {
      TraceSpan span(fmt::format("gather module {}", module), "allgather");
      g = zero_->gather(module, phase);
    }
    comm_seconds_ += std::chrono::duration<double>(Clock::now() - t0).count();
    if (g.dtype() != DType::kF32 && g.dtype() != DType::kBF16) {
      throw NotSupportedError("tiermem-train's CPU model takes fp32 or bf16 parameters, not fp16");
    }
    if (g.on_device() && !zero_->device()->host_addressable() && zero_->device()->kind() != DeviceKind::kCuda) {
      // The CPU model cannot read this device memory (SimDevice with sim_host_addressable false,
      // the CPU twin of a GPU): copy the module down, as the CUDA backend copies host params up.
      auto& s = staged_.at(static_cast<std::size_t>(module));
      const std::size_t bytes = g.numel() * dtype_size(g.dtype());
      staged_bytes_ -= s.size() * 4;  // acquired again before its release: replaced
      s.resize((bytes + 3) / 4);
      zero_->device()->copy_d2h(s.data(), g.data(), bytes);
      staged_bytes_ += s.size() * 4;
      staged_peak_ = std::max(staged_peak_, staged_bytes_);
      if (g.dtype() == DType::kF32) return gpt::ParamView(std::span<const float>(s.data(), g.numel()));
      return gpt::ParamView::bf16(
          std::span<const std::uint16_t>(reinterpret_cast<const std::uint16_t*>(s.data()), g.numel()));
    }
    if (g.dtype() == DType::kF32) return gpt::ParamView(g.f32());
    if (g.dtype() == DType::kBF16) return gpt::ParamView::bf16(g.half());
    throw NotSupportedError("tiermem-train's CPU model takes fp32 or bf16 parameters, not fp16");
  }
  void release_params(int module) override {
    gathered_.at(static_cast<std::size_t>(module)).release();
    auto& s = staged_.at(static_cast<std::size_t>(module));
    staged_bytes_ -= s.size() * 4;
    std::vector<float, PageAligned<float>>().swap(s);
  }

  // A module's full fp32 gradient buffer lives only from its first backward step to
  // grads_done() (the tied embedding: from the head's backward to the embedding's), so the
  // gradient buffers in host memory are at most two modules, whatever the model's size.
  std::span<float> grads(int module) override {
    auto& g = grads_.at(static_cast<std::size_t>(module));
    if (g.empty()) {
      g = zero_->gradient_buffer(module);  // zeroed; an earlier hand-off's when one is spare
      grad_buffer_bytes_ += g.capacity() * 4;
      grad_buffer_peak_ = std::max(grad_buffer_peak_, grad_buffer_bytes_);
    }
    return g;
  }
  void grads_done(int module) override {
    auto& g = grads_.at(static_cast<std::size_t>(module));
    const auto t0 = Clock::now();
    grad_buffer_bytes_ -= g.capacity() * 4;  // from here the engine holds (and counts) the buffer
    {
      TraceSpan span(fmt::format("reduce-scatter module {}", module), "reduce-scatter");
      zero_->reduce_gradients(module, std::move(g));  // one rank: accumulated while backward goes on
    }
    comm_seconds_ += std::chrono::duration<double>(Clock::now() - t0).count();
    std::vector<float>().swap(g);
  }
  void zero_grad() override {}  // ZeroEngine::step() zeroes its accumulation
  void before_last_micro_batch(double lr) override { zero_->step_in_backward(lr); }  // tiermem.update_in_backward

  void step(const OptimStep& s) override {
    const auto t0 = Clock::now();
    zero_->set_learning_rate(s.lr);  // the loop's schedule (warm-up, cosine decay)
    in_step_.store(true);
    const std::uint64_t stall0 = zero_->stats().driving_stall_ns;
    const ZeroEngine::StepResult r = zero_->step();
    step_stall_ns_ += zero_->stats().driving_stall_ns - stall0;
    in_step_.store(false);
    last_grad_norm_ = r.skipped ? std::nan("") : r.grad_norm;
    optimizer_seconds_ += std::chrono::duration<double>(Clock::now() - t0).count();
    if (r.skipped) TM_LOG_WARN("TRAIN", "step {} skipped (fp16 overflow), loss scale now {}", r.step, r.loss_scale);
  }

  double all_reduce_sum(double value) override {
    if (comm_->world_size() == 1) return value;
    float f = static_cast<float>(value);
    comm_->all_reduce(&f, &f, 1, DType::kF32, ReduceOp::kSum);
    return f;
  }
  int rank() const override { return comm_->rank(); }
  int world_size() const override { return comm_->world_size(); }
  void abort_job(int exit_code) noexcept override {
    if (comm_->world_size() > 1) comm_->abort(exit_code);
  }

  void save(CheckpointWriter& w) override {
    // Streamed one optimizer sub-group at a time: no shard-sized buffer, whatever the model size.
    const std::size_t numel = zero_->shard_numel();
    const Tier tier = zero_->plan().optimizer_home;  // where the state lived (device: the device optimizer)
    const std::int64_t n = static_cast<std::int64_t>(numel);
    const int hm = w.begin_tensor("zero.master", tier, numel * 4, "f32", {n});
    const int hm1 = w.begin_tensor("zero.exp_avg", tier, numel * 4, "f32", {n});
    const int hm2 = w.begin_tensor("zero.exp_avg_sq", tier, numel * 4, "f32", {n});
    const ZeroOptimizerState st = zero_->export_optimizer_state([&](const ZeroStateChunk& c) {
      w.write_part(hm, c.master, c.n * 4);
      w.write_part(hm1, c.exp_avg, c.n * 4);
      w.write_part(hm2, c.exp_avg_sq, c.n * 4);
    });
    std::vector<std::int64_t> part = {st.world_size, st.rank,
                                      static_cast<std::int64_t>(st.alignment_elems),
                                      static_cast<std::int64_t>(st.module_numels.size())};
    for (std::size_t x : st.module_numels) part.push_back(static_cast<std::int64_t>(x));
    w.add_tensor("zero.partition", Tier::kHost, part.data(), part.size() * 8, "i64",
                 {static_cast<std::int64_t>(part.size())});
    const std::int64_t steps[2] = {st.steps, st.skipped_steps};
    w.add_tensor("zero.steps", Tier::kHost, steps, sizeof steps, "i64", {2});
    if (st.loss_scaler) {
      const double scale = st.loss_scaler->scale;
      const std::int64_t c[3] = {st.loss_scaler->hysteresis_left, st.loss_scaler->iter,
                                 st.loss_scaler->last_overflow_iter};
      w.add_tensor("zero.loss_scale", Tier::kHost, &scale, sizeof scale, "f64", {1});
      w.add_tensor("zero.loss_scaler", Tier::kHost, c, sizeof c, "i64", {3});
    }
  }

  void load(CheckpointReader& r) override {
    const std::string& mf = r.manifest_path();
    if (!r.has("zero.master")) {
      throw CheckpointError(fmt::format(
          "checkpoint {}: no tensor 'zero.master' (not written by --engine zero?)", mf));
    }
    ZeroOptimizerState st;
    const std::size_t n = zero_->shard_numel();
    const std::size_t modules = static_cast<std::size_t>(zero_->num_modules());
    std::vector<std::int64_t> part(4 + modules);
    r.read_tensor("zero.partition", part.data(), part.size() * 8);
    st.world_size = static_cast<int>(part[0]);
    st.rank = static_cast<int>(part[1]);
    st.alignment_elems = static_cast<std::size_t>(part[2]);
    for (std::size_t i = 0; i < modules; ++i) {
      st.module_numels.push_back(static_cast<std::size_t>(part[4 + i]));
    }
    if (part[3] != static_cast<std::int64_t>(modules)) {
      throw CheckpointError(fmt::format("checkpoint {}: {} modules saved, the model has {}", mf,
                                        part[3], modules));
    }
    std::int64_t steps[2] = {0, 0};
    r.read_tensor("zero.steps", steps, sizeof steps);
    st.steps = steps[0];
    st.skipped_steps = steps[1];
    if (r.has("zero.loss_scale")) {
      LossScalerState ls;
      std::int64_t c[3] = {0, 0, 0};
      r.read_tensor("zero.loss_scale", &ls.scale, sizeof ls.scale);
      r.read_tensor("zero.loss_scaler", c, sizeof c);
      ls.hysteresis_left = static_cast<int>(c[0]);
      ls.iter = c[1];
      ls.last_overflow_iter = c[2];
      st.loss_scaler = ls;
    }
    // The partition this engine steps: over every rank at stages 1-3, whole on each at stage 0.
    const int parts = zero_stage() == 0 ? 1 : world_size();
    const int part_rank = parts == 1 ? 0 : rank();
    try {
      if (st.world_size == parts) {
        // The shard this rank saved (stage 0: the whole state, any rank's): checksums verified
        // first (bounded reads), then streamed into the engine one optimizer sub-group at a time.
        for (const char* name : {"zero.master", "zero.exp_avg", "zero.exp_avg_sq"}) r.verify_tensor(name, n * 4);
        zero_->import_optimizer_state(st, [&](const ZeroStateChunk& c) {
          r.read_part("zero.master", c.offset * 4, c.master, c.n * 4);
          r.read_part("zero.exp_avg", c.offset * 4, c.exp_avg, c.n * 4);
          r.read_part("zero.exp_avg_sq", c.offset * 4, c.exp_avg_sq, c.n * 4);
        });
      } else {
        // Saved over another number of ranks: this rank's new shard is read element for element
        // from the old ranks' files that hold it (each verified first), one sub-group at a time.
        OptimizerStateReshard source(r.dir(), st.world_size,
                                     {"zero.master", "zero.exp_avg", "zero.exp_avg_sq"},
                                     st.module_numels, st.alignment_elems, parts, part_rank);
        if (rank() == 0) {
          TM_LOG_INFO("TRAIN", "re-partitioning the optimizer state saved over {} rank{} for {}",
                      st.world_size, st.world_size == 1 ? "" : "s", parts);
        }
        st.world_size = parts;
        st.rank = part_rank;
        zero_->import_optimizer_state(st, [&](const ZeroStateChunk& c) {
          source.fill(c.offset, c.n, c.master, c.exp_avg, c.exp_avg_sq);
        });
      }
    } catch (const IoError&) {
      throw;
    } catch (const CommError&) {
      throw;
    } catch (const CheckpointError&) {
      throw;
    } catch (const Error& e) {  // a state that does not fit this engine: name the checkpoint
      throw CheckpointError(fmt::format("checkpoint {}: {}", mf, e.what()));
    }
  }

  EngineStats stats() const override {
    EngineStats e;
    const ZeroStats z = zero_->stats();
    const int dev = static_cast<int>(Tier::kDevice), host = static_cast<int>(Tier::kHost),
              nv = static_cast<int>(Tier::kNvme);
    e.budget_bytes[dev] = z.device_budget_bytes;
    e.peak_bytes[dev] = z.device_peak_bytes;
    e.budget_bytes[host] = z.host_budget_bytes;
    e.host_pool_peak_bytes = z.host_pool_peak_bytes;
    e.host_bounce_bytes = z.host_bounce_bytes;
    e.host_engine_peak_bytes = z.host_engine_peak_bytes + staged_peak_;
    e.host_grad_buffer_peak_bytes = grad_buffer_peak_;
    e.updates_in_backward = z.updates_in_backward;
    // SimDevice memory is host memory too: counted here as well as on the device line.
    const Device* device = zero_->device();
    e.host_sim_device_bytes = device && device->kind() == DeviceKind::kSim ? z.device_peak_bytes : 0;
    e.peak_bytes[host] = z.host_pool_peak_bytes + z.host_bounce_bytes + e.host_engine_peak_bytes +
                         grad_buffer_peak_ + e.host_sim_device_bytes;
    const ZeroPlan& p = zero_->plan();
    e.peak_bytes[nv] = p.nvme_bytes;
    e.moved.bytes[nv][host] = z.nvme_read_bytes;  // NVMe -> host or device (the store's reads)
    e.moved.bytes[host][nv] = z.nvme_written_bytes;
    e.moved.bytes[host][dev] = z.host_to_device_bytes;
    e.moved.bytes[dev][host] = z.device_to_host_bytes;
    e.nvme_read_bytes = z.nvme_read_bytes;
    e.nvme_written_bytes = z.nvme_written_bytes;
    // Exclusive parts of the loop's wall time (the summary's time split). The timed gather and
    // reduce calls hold the deferred optimizer updates a gather applies (optimizer time) and the
    // waits for parameters and gradient partitions (I/O wait); communication is what remains.
    // The waits are the calling thread's (ZeroStats::driving_stall_ns), not the engine's update
    // and gradient threads', which overlap its work; still capped at the calls' wall time. Waits
    // before the first gather (registration) are not the loop's.
    const double deferred = static_cast<double>(z.deferred_update_ns) / 1e9;
    const double calls = std::max(0.0, comm_seconds_ - deferred);
    const std::uint64_t opt_stall = z.deferred_update_stall_ns + step_stall_ns_;
    const std::uint64_t base = base_stall_ns_.value_or(z.driving_stall_ns);
    const double waits =
        static_cast<double>(z.driving_stall_ns - std::min(z.driving_stall_ns, base + opt_stall)) / 1e9;
    e.optimizer_stall_seconds = static_cast<double>(opt_stall) / 1e9;
    e.stall_seconds = std::min(waits, calls) + e.optimizer_stall_seconds;
    e.comm_seconds = calls - std::min(waits, calls);
    e.optimizer_seconds = optimizer_seconds_ + deferred;
    e.last_step_io = {z.last_step_nvme_read_bytes,
                      z.last_step_nvme_written_bytes,
                      static_cast<double>(z.last_step_wall_ns) / 1e9,
                      static_cast<double>(z.last_step_stall_ns) / 1e9,
                      static_cast<double>(z.last_step_compute_ns) / 1e9,
                      static_cast<double>(z.last_step_io_bound_ns) / 1e9,
                      z.nvme_read_gbps,
                      z.nvme_write_gbps};
    return e;
  }

 private:
  gpt::GptConfig cfg_;
  Config engine_config_;  // the plan's, with the device budget the model's backend left
  std::unique_ptr<Communicator> comm_;
  std::unique_ptr<ZeroEngine> zero_;
  std::vector<ZeroEngine::Gathered> gathered_;
  std::vector<std::vector<float>> grads_;  // allocated per module between backward and grads_done
  std::uint64_t grad_buffer_bytes_ = 0, grad_buffer_peak_ = 0;
  // Modules copied down from device memory the CPU model cannot read (opaque SimDevice), from
  // acquire_params to release_params; counted with the engine's host bytes.
  std::vector<std::vector<float, PageAligned<float>>> staged_;
  std::uint64_t staged_bytes_ = 0, staged_peak_ = 0;
  std::optional<std::uint64_t> base_stall_ns_;  // ZeroStats::driving_stall_ns at the first gather
  std::uint64_t step_stall_ns_ = 0;             // ZeroStats::driving_stall_ns inside step()
  std::uint64_t total_params_ = 0;
  std::atomic<bool> stop_watch_{false}, in_step_{false};
  std::thread watch_;  // TEST-ONLY kill points; joined first in the destructor
  double comm_seconds_ = 0, optimizer_seconds_ = 0;
  double last_grad_norm_ = std::nan("");
};

}  // namespace

std::unique_ptr<TrainEngine> make_zero_engine(const TrainPlan& plan, std::uint64_t device_budget_bytes) {
  return std::make_unique<ZeroTrainEngine>(plan, device_budget_bytes);
}

}  // namespace tiermem::train

#else

namespace tiermem::train {
std::unique_ptr<TrainEngine> make_zero_engine(const TrainPlan&, std::uint64_t) {
  throw NotSupportedError(
      "--engine zero (and mpirun) needs tiermem's zero and comm libraries, which this build "
      "lacks");
}
}  // namespace tiermem::train

#endif
