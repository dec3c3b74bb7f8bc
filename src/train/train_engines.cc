// src/train/train_engines.cc — engine choice and rank detection (train_engines.h).
#include "train/train_engines.h"

#include <cstdlib>

#include "tiermem/env.h"
#include "tiermem/error.h"
#include "tiermem/log.h"

namespace tiermem::train {
namespace {

int env_int(const char* name, int fallback) {
  auto v = env_param(name);
  if (!v) return fallback;
  try {
    return std::stoi(*v);
  } catch (const std::exception&) {
    throw ConfigError(name, *v, "expected an integer");
  }
}

}  // namespace

RankInfo detect_ranks() {
  RankInfo r;
  if (env_param("OMPI_COMM_WORLD_SIZE")) {
    r.rank = env_int("OMPI_COMM_WORLD_RANK", 0);
    r.world_size = env_int("OMPI_COMM_WORLD_SIZE", 1);
  } else if (env_param("PMI_SIZE")) {
    r.rank = env_int("PMI_RANK", 0);
    r.world_size = env_int("PMI_SIZE", 1);
  } else {
    r.rank = env_int("RANK", 0);
    r.world_size = env_int("WORLD_SIZE", 1);
  }
  return r;
}

std::unique_ptr<TrainEngine> make_engine(const TrainPlan& plan, const TrainOptions& opts,
                                         std::uint64_t device_budget_bytes) {
  const Config& c = plan.config;
  const bool offload = c.zero.offload_param.device != OffloadDevice::kNone ||
                       c.zero.offload_optimizer.device != OffloadDevice::kNone;
  // A budget the user set (--host-budget, --device-budget or their tiermem keys) is one only
  // ZeroEngine honours: the resident engine holds everything in plain host memory.
  const bool budgeted = c.tiermem.host_budget_bytes != 0 || c.tiermem.device_budget_bytes != 0;
  std::string kind = opts.engine.empty() ? "auto" : opts.engine;
  if (kind == "auto") {
    if (plan.world_size > 1 || budgeted) {
      kind = "zero";
    } else if (c.zero.stage == 0 && !offload) {
      kind = "resident";
    } else {
      kind = "zero";
    }
  }
  if (kind == "store") {  // the one-rank engine of earlier versions: ZeroEngine does its work now
    TM_LOG_WARN("TRAIN", "--engine store is gone: tiermem::ZeroEngine pages every tier at every "
                "world size; using --engine zero");
    kind = "zero";
  }
  if (kind == "resident" && (c.bf16 || c.fp16.enabled)) {
    TM_LOG_WARN("TRAIN", "{}.enabled is ignored by --engine resident: it trains in fp32 (only "
                "--engine zero keeps bf16 working parameters)", c.bf16 ? "bf16" : "fp16");
  }
  if (kind == "resident" && budgeted) {
    TM_LOG_WARN("TRAIN", "--engine resident ignores the host and device budgets (tiermem.host_budget_bytes "
                "{}, tiermem.device_budget_bytes {}): it holds every tensor in plain host memory; drop "
                "--engine resident to have ZeroEngine keep them",
                c.tiermem.host_budget_bytes, c.tiermem.device_budget_bytes);
  }
  if (kind == "resident") {
    // The resident engine has no NVMe traffic to price, but a profile the config names is read
    // all the same, so a bad one is the same ConfigError whichever engine runs.
    (void)resolve_nvme_rates(c);
    if (plan.world_size > 1)
      throw NotSupportedError("--engine resident runs one rank; use --engine zero with mpirun");
    return std::make_unique<ResidentEngine>(plan.model, plan.seed);
  }
  if (kind == "zero") return make_zero_engine(plan, device_budget_bytes);
  throw ConfigError("--engine", kind, "expected auto, resident or zero");
}
}  // namespace tiermem::train
