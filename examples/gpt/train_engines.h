// examples/gpt/train_engines.h — choosing tiermem-train's engine from the plan and the effective
// configuration, and finding this process's rank.
//
//   --engine auto (default): several ranks                       -> zero
//                            stage 0 and no offload                -> resident
//                            otherwise                             -> store
//   store     StoreEngine (train_engine_store.cc): one rank's ZeRO-3 over TensorStore: every
//             module's fp32 parameters and Adam moments are tensors whose home is the offload
//             tier (nvme: the swap space; cpu: the host pool; none: the device), paged to a
//             budgeted device (SimDevice without a GPU) for compute, to host for AdamW, with
//             the reuse-distance Prefetcher as TensorStore's policy.
//   zero      ZeroTrainEngine (train_engine_zero.cc): tiermem::ZeroEngine over the
//             Communicator (MPI with mpirun): sharded parameters, gradients and optimizer state,
//             optimizer state (and stage-3 parameter shards) on NVMe through its SwapSpace.
//   resident  ResidentEngine (train_engine.h): plain host memory, the reference.
//
// Thread-safety: called once from the main thread.
#pragma once

#include <memory>

#include "train_engine.h"
#include "train_loop.h"
#include "train_options.h"

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

// The tiered engines (train_engine_store.cc, train_engine_zero.cc); NotSupportedError when the
// libraries they need are not in this build.
std::unique_ptr<TrainEngine> make_store_engine(const TrainPlan& plan);
std::unique_ptr<TrainEngine> make_zero_engine(const TrainPlan& plan);

// Builds the engine the plan's configuration asks for. Throws Error/ConfigError/NotSupportedError.
std::unique_ptr<TrainEngine> make_engine(const TrainPlan& plan, const TrainOptions& opts);

}  // namespace tiermem::train
