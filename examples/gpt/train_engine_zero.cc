// examples/gpt/train_engine_zero.cc — ZeroTrainEngine: tiermem-train over tiermem::ZeroEngine
// and the Communicator (MPI under mpirun), see train_engines.h.
//
// Each GPT module is registered as one ZeroEngine module; a model step gathers it (stage 3: an
// all-gather of the shards) and releases it after; a backward step's gradient is handed to
// reduce_gradients (then the local buffer is zeroed, because the model accumulates into it and
// ZeroEngine takes one micro-batch's gradient per call); step() runs AdamW over the rank's
// optimizer shard (on NVMe through ZeroEngine's swap space with offload_optimizer nvme).
// ZeroEngine divides by ranks × micro-batches itself, clips by the config's gradient_clipping,
// and takes the loop's scheduled learning rate each step (set_learning_rate). It cannot
// checkpoint Adam moments (ZeroEngine exports master weights only): --save/--resume are refused.
#include <algorithm>
#include <chrono>
#include <fmt/format.h>

#include "checkpoint.h"
#include "tiermem/error.h"
#include "tiermem/log.h"
#include "tiermem/trace.h"
#include "train_engines.h"

#if defined(TIERMEM_TRAIN_HAVE_ZERO) && defined(TIERMEM_TRAIN_HAVE_COMM)
#include "tiermem/communicator.h"
#include "tiermem/zero_engine.h"

namespace tiermem::train {
namespace {

using Clock = std::chrono::steady_clock;

class ZeroTrainEngine final : public TrainEngine {
 public:
  explicit ZeroTrainEngine(const TrainPlan& plan) : cfg_(plan.model), plan_config_(plan.config) {
    comm_ = make_communicator();
    if (comm_->world_size() != plan.world_size || comm_->rank() != plan.rank) {
      throw CommError(fmt::format("the communicator sees rank {} of {}, the launcher said {} of {}",
                                  comm_->rank(), comm_->world_size(), plan.rank,
                                  plan.world_size));
    }
    zero_ = std::make_unique<ZeroEngine>(plan.config, *comm_);
    const auto layouts = gpt::module_layouts(cfg_);
    for (int m = 0; m < static_cast<int>(layouts.size()); ++m) {
      std::vector<float> init(static_cast<std::size_t>(layouts[m].numel));
      gpt::init_module(cfg_, m, plan.seed, init);
      zero_->register_module(layouts[m].name, init);
      grads_.emplace_back(init.size(), 0.0f);
    }
    gathered_.resize(layouts.size());
    total_params_ = static_cast<std::uint64_t>(gpt::num_params(cfg_));
  }

  std::string describe() const override {
    const Config& c = zero_->config();
    return fmt::format(
        "zero (tiermem::ZeroEngine, stage {}, {} over {} rank{}): params -> {}, optimizer -> {}, "
        "working dtype {}",
        c.zero.stage, comm_->backend(), comm_->world_size(), comm_->world_size() == 1 ? "" : "s",
        param_home(), optimizer_home(), dtype_name(zero_->working_dtype()));
  }
  std::string param_home() const override {
    return std::string(offload_device_name(zero_->config().zero.offload_param.device));
  }
  std::string optimizer_home() const override {
    return std::string(offload_device_name(zero_->config().zero.offload_optimizer.device));
  }
  int zero_stage() const override { return zero_->config().zero.stage; }
  std::string device_kind() const override { return "host"; }
  std::uint64_t param_bytes() const override {
    return total_params_ * dtype_size(zero_->working_dtype());
  }
  std::uint64_t optimizer_bytes() const override { return total_params_ * 12; }
  bool clips_gradients() const override { return true; }
  double last_grad_norm() const override { return last_grad_norm_; }

  gpt::ParamView acquire_params(int module, Phase) override {
    const auto t0 = Clock::now();
    auto& g = gathered_.at(static_cast<std::size_t>(module));
    {
      TraceSpan span(fmt::format("all-gather module {}", module), "allgather");
      g = zero_->gather(module);
    }
    comm_seconds_ += std::chrono::duration<double>(Clock::now() - t0).count();
    if (g.dtype() == DType::kF32) return gpt::ParamView(g.f32());
    if (g.dtype() == DType::kBF16) return gpt::ParamView::bf16(g.half());
    throw NotSupportedError("tiermem-train's CPU model takes fp32 or bf16 parameters, not fp16");
  }
  void release_params(int module) override { gathered_.at(static_cast<std::size_t>(module)).release(); }

  std::span<float> grads(int module) override { return grads_.at(static_cast<std::size_t>(module)); }
  void grads_done(int module) override {
    auto& g = grads_.at(static_cast<std::size_t>(module));
    const auto t0 = Clock::now();
    {
      TraceSpan span(fmt::format("reduce-scatter module {}", module), "reduce-scatter");
      zero_->reduce_gradients(module, g);
    }
    comm_seconds_ += std::chrono::duration<double>(Clock::now() - t0).count();
    std::fill(g.begin(), g.end(), 0.0f);
  }
  void zero_grad() override {}  // ZeroEngine::step() zeroes its accumulation

  void step(const OptimStep& s) override {
    const auto t0 = Clock::now();
    zero_->set_learning_rate(s.lr);  // the loop's schedule (warm-up, cosine decay)
    const ZeroEngine::StepResult r = zero_->step();
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

  void save(CheckpointWriter&) override {
    throw NotSupportedError(
        "checkpoints with --engine zero: ZeroEngine has no API to export/import Adam moments "
        "(only export_master); use --engine store for --save/--resume");
  }
  void load(CheckpointReader&) override {
    throw NotSupportedError(
        "--resume with --engine zero: ZeroEngine has no API to import Adam moments; use "
        "--engine store");
  }

  EngineStats stats() const override {
    EngineStats e;
    const ZeroStats z = zero_->stats();
    const int host = static_cast<int>(Tier::kHost), nv = static_cast<int>(Tier::kNvme);
    e.peak_bytes[host] = z.optimizer_host_bytes + z.gradient_bytes + z.working_param_bytes +
                         z.gathered_bytes_peak;
    e.peak_bytes[nv] = z.optimizer_nvme_bytes;
    e.comm_seconds = comm_seconds_;
    e.optimizer_seconds = optimizer_seconds_;
    return e;
  }

 private:
  gpt::GptConfig cfg_;
  Config plan_config_;
  std::unique_ptr<Communicator> comm_;
  std::unique_ptr<ZeroEngine> zero_;
  std::vector<ZeroEngine::Gathered> gathered_;
  std::vector<std::vector<float>> grads_;
  std::uint64_t total_params_ = 0;
  double comm_seconds_ = 0, optimizer_seconds_ = 0;
  double last_grad_norm_ = std::nan("");
};

}  // namespace

std::unique_ptr<TrainEngine> make_zero_engine(const TrainPlan& plan) {
  return std::make_unique<ZeroTrainEngine>(plan);
}

}  // namespace tiermem::train

#else

namespace tiermem::train {
std::unique_ptr<TrainEngine> make_zero_engine(const TrainPlan&) {
  throw NotSupportedError(
      "--engine zero (and mpirun) needs tiermem's zero and comm libraries, which this build "
      "lacks");
}
}  // namespace tiermem::train

#endif
