// src/train/train_engines.h — choosing tiermem-train's engine from the plan and the effective
// configuration, and finding this process's rank.
//
//   --engine auto (default): stage 0 without offload on one rank   -> resident
//                            otherwise (any stage, offload, world size) -> zero
//   zero      ZeroTrainEngine (train_engine_zero.cc): tiermem::ZeroEngine over the
//             Communicator (single-rank, or MPI under mpirun): every module's working params,
//             fp32 gradient partitions, master weights and Adam moments are tensors of the
//             engine's TensorStore, homed per offload_param / offload_optimizer, paged under
//             the host and device budgets (SimDevice without a GPU), with the reuse-distance
//             Prefetcher. ("store", the former one-rank engine, is accepted as a synonym.)
//   resident  ResidentEngine (train_engine.h): plain host memory, the reference.
//
// Thread-safety: called once from the main thread.
#pragma once

#include <cstdint>
#include <memory>

#include "train/train_engine.h"
#include "train/train_loop.h"
#include "train/train_options.h"

namespace tiermem::train {

// Steps of the default (no-argument) demo run of the `mini` model: measured to take about three
// minutes on two CPU cores (docs/benchmarks.md).
inline constexpr int kMiniDemoSteps = 150;

struct RankInfo {
  int rank = 0;
  int world_size = 1;
};

// From the launcher's environment: OMPI_COMM_WORLD_RANK/SIZE (mpirun), PMI_RANK/PMI_SIZE, or
// RANK/WORLD_SIZE; one rank otherwise.
RankInfo detect_ranks();

// The tiered engine (train_engine_zero.cc) on the plan's config with tiermem.device_budget_bytes
// `device_budget_bytes` (what the model's backend left: make_model_backend); NotSupportedError
// when the libraries it needs are not in this build.
std::unique_ptr<TrainEngine> make_zero_engine(const TrainPlan& plan, std::uint64_t device_budget_bytes);

// Builds the engine the plan's configuration asks for, with the device budget the model's backend
// left it (make_model_backend; the plan's own when the model is on the CPU). Throws
// Error/ConfigError/NotSupportedError.
std::unique_ptr<TrainEngine> make_engine(const TrainPlan& plan, const TrainOptions& opts,
                                         std::uint64_t device_budget_bytes);

}  // namespace tiermem::train
