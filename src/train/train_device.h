// src/train/train_device.h — which device tiermem-train computes on, decided once before
// anything is built, and the one line that says so.
//
//   --device sim   SimDevice (host memory behind a budget); the model runs the CPU kernels.
//   --device cuda  CudaDevice and the CUDA model backend. With no usable GPU (a build without
//                  CUDA, no driver, no visible device) the run is refused: UsageError, which
//                  run_training prints as one line and exits 2. Never a silent CPU run.
//   --device auto  cuda when a CUDA device is visible, else sim; either way one line says which
//                  and why (the probe's reason when it is sim).
// The flag wins over the config's tiermem.device; the error names whichever gave the value.
// The choice itself is resolved by its one owner, tiermem/device_choice.h (resolve_device_kind,
// with tiermem-train's CUDA probe); this file adds what tiermem-train does with it.
//
// Thread-safety: pure functions over their arguments.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "gpt/backend.h"
#include "tiermem/device.h"
#include "tiermem/device_choice.h"
#include "train/train_loop.h"
#include "train/train_options.h"

namespace tiermem::train {

struct DeviceDecision {
  DeviceKind kind = DeviceKind::kSim;  // what the run computes on (tiermem.device is then its name)
  int cuda_devices = 0;  // visible CUDA devices (the probe's count; 0 when it did not look)
  std::string note;  // one line for the log: what was picked and why ("" for an explicit sim)
};

// `asked` is the parsed --device or tiermem.device (parse_device_choice, tiermem/device_choice.h);
// `key` names where it came from ("--device" or "tiermem.device"), for the error; `probe` what a
// look for CUDA found (the caller need not look for an explicit sim). Throws UsageError(key,
// "cuda", why) for cuda without a usable device.
DeviceDecision decide_device(DeviceChoice asked, const std::string& key, const CudaProbe& probe);

// This process's rank on its node (OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID or LOCAL_RANK;
// 0 without a launcher), and the GPU it computes on: one GPU per rank, local_rank % devices.
// Throws ConfigError for a malformed value. local_rank_from reads the variables through `lookup`
// (env_param in local_rank_from_env; a map in tests, since env_param reads each name once).
int local_rank_from(const std::function<std::optional<std::string>(std::string_view)>& lookup);
int local_rank_from_env();
inline int cuda_ordinal_for(int local_rank, int device_count) {
  return device_count > 0 ? local_rank % device_count : 0;
}

// The device budget left to the engine when the CUDA backend's activations and workspace
// (`backend_bytes`, device memory) come out of `budget_bytes` (0: the device's own default, which
// CudaDevice measures after the backend has allocated: returns 0). Throws UsageError(key, ...)
// naming both sizes when the backend alone takes the whole budget.
std::uint64_t engine_device_budget(std::uint64_t budget_bytes, std::uint64_t backend_bytes,
                                   const std::string& key);

// The model's backend on the decided device, and the device budget that leaves the engine.
struct ModelOnDevice {
  std::unique_ptr<gpt::ModelBackend> backend;
  std::uint64_t engine_device_budget_bytes = 0;  // for the engine's tiermem.device_budget_bytes
};

// The CUDA backend for kCuda on GPU cuda_ordinal_for(local rank, device.cuda_devices), its device bytes
// taken out of the plan's tiermem.device_budget_bytes (engine_device_budget); the CPU backend
// otherwise, the budget unchanged. The plan is read, not changed: the caller hands the budget to
// the engine. Call before the engine is built. `budget_key` names the budget's source for errors
// ("--device-budget" or "tiermem.device_budget_bytes").
ModelOnDevice make_model_backend(const TrainPlan& plan, const DeviceDecision& device,
                                 const std::string& budget_key);

}  // namespace tiermem::train
