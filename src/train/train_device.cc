// src/train/train_device.cc — decide_device (train_device.h).
#include "train/train_device.h"

#include <fmt/format.h>

#include "tiermem/env.h"
#include "tiermem/log.h"

namespace tiermem::train {

DeviceDecision decide_device(DeviceChoice asked, const std::string& key, const CudaProbe& probe) {
  DeviceDecision d;
  d.kind = resolve_device_kind(asked, probe.usable());
  d.cuda_devices = probe.device_count;
  if (asked == DeviceChoice::kSim) return d;
  if (asked == DeviceChoice::kCuda && !probe.usable()) {
    throw UsageError(key, "cuda",
                     fmt::format("no usable CUDA device for 'cuda': {}; use --device sim (or "
                                 "auto) to run on the CPU",
                                 probe.reason.empty() ? "none found" : probe.reason));
  }
  if (d.kind == DeviceKind::kSim) {  // auto, no GPU
    d.note = fmt::format("device sim ({} auto picked sim: {}); the model computes on the CPU", key,
                         probe.reason.empty() ? "no CUDA device" : probe.reason);
    return d;
  }
  const std::string gpu = fmt::format(
      "cuda:0 ({}{})", probe.device0_name.empty() ? "CUDA device" : probe.device0_name,
      probe.device_count > 1 ? fmt::format(", 1 of {} visible", probe.device_count) : std::string());
  d.note = asked == DeviceChoice::kCuda
               ? fmt::format("device {} ({} cuda): the model computes on the GPU", gpu, key)
               : fmt::format("device {} ({} auto picked cuda: a CUDA device is visible)", gpu, key);
  return d;
}

int local_rank_from_env() { return local_rank_from(env_param); }

int local_rank_from(const std::function<std::optional<std::string>(std::string_view)>& lookup) {
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "LOCAL_RANK"}) {
    const auto v = lookup(name);
    if (!v) continue;
    try {
      std::size_t used = 0;
      const int r = std::stoi(*v, &used);
      if (used == v->size() && r >= 0) return r;
    } catch (const std::exception&) {
    }
    throw ConfigError(name, *v, "expected a rank >= 0");
  }
  return 0;
}

std::uint64_t engine_device_budget(std::uint64_t budget_bytes, std::uint64_t backend_bytes,
                                   const std::string& key) {
  if (budget_bytes == 0) return 0;
  if (backend_bytes >= budget_bytes) {
    throw UsageError(key, format_bytes(budget_bytes),
                     fmt::format("device budget {} does not hold the CUDA model's activations and "
                                 "workspace ({}, for this --batch and --seq-len) and leave room for "
                                 "parameters: give more, or a smaller --batch / --seq-len",
                                 format_bytes(budget_bytes), format_bytes(backend_bytes)));
  }
  return budget_bytes - backend_bytes;
}

ModelOnDevice make_model_backend(const TrainPlan& plan, const DeviceDecision& device,
                                 const std::string& budget_key) {
  const std::uint64_t given = plan.config.tiermem.device_budget_bytes;
  if (device.kind != DeviceKind::kCuda) {
    gpt::ModelOptions options;
    options.checkpoint_blocks = plan.config.activation_checkpointing.enabled;
    return {gpt::make_cpu_backend(plan.model, plan.batch, plan.seq_len, options), given};
  }
  if (plan.config.activation_checkpointing.enabled && plan.rank == 0) {
    TM_LOG_WARN("TRAIN", "activation checkpointing is not implemented by the CUDA model backend: "
                "every block's activations are kept in device memory (turn it off to silence this)");
  }
  const std::uint64_t need = gpt::cuda_backend_bytes(plan.model, plan.batch, plan.seq_len);
  const std::uint64_t budget = engine_device_budget(given, need, budget_key);
  const int ordinal = cuda_ordinal_for(local_rank_from_env(), device.cuda_devices);
  auto backend = gpt::make_cuda_backend(plan.model, plan.batch, plan.seq_len, ordinal);
  if (plan.rank == 0) {
    TM_LOG_INFO("TRAIN", "model on {}: activations and workspace {} of device memory{}",
                backend->name(), format_bytes(backend->activation_bytes()),
                given ? fmt::format(", the engine keeps {} of the {} device budget",
                                    format_bytes(budget), format_bytes(given))
                      : std::string());
  }
  return {std::move(backend), budget};
}

}  // namespace tiermem::train
