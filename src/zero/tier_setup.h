// src/zero/tier_setup.h — the tier set-up's NVMe part: the io engine and the swap spaces a plan
// needs, made from the config's nvme_path lists. (The device and the TensorStore are made by
// ZeroEngine::Impl::make_tiers in zero_setup.cc, which calls this first.)
//
// DeepSpeed's meaning of the paths: parameters under offload_param.nvme_path, optimizer state
// (and swapped gradients) under offload_optimizer.nvme_path, either list standing in for the
// other when empty; one swap space when both sections use the same paths. Each space lives in
// <path>/rank<r>, made 0700 when missing and removed with the swap files when made here (the
// <path> itself stays: other ranks and engines share it).
//
// Ownership: the caller owns what is returned; the swap spaces refer to `io` and must go first
// (SwapTier's member order does that when it is destroyed whole). Thread-safety: none needed (set-up, one thread). Errors: ConfigError naming the nvme_path
// key (or the flag that set it) when a filesystem lacks room for the plan's NVMe bytes; IoError
// when a rank directory cannot be made; the swap space's own errors (locks, preallocation).
#pragma once

#include <memory>

#include "tiermem/config.h"
#include "tiermem/io_engine.h"
#include "tiermem/swap_space.h"
#include "tiermem/zero_plan.h"

namespace tiermem::detail {

struct SwapTier {
  std::unique_ptr<IoEngine> io;                       // null when nothing is homed on NVMe
  std::shared_ptr<SwapSpace> param_swap, optim_swap;  // may be the same object, or null
};

// What `plan` homes on NVMe (stored parameter shards, optimizer state and gradient partitions),
// given swap space on this rank's directories; nothing when it homes nothing there.
SwapTier make_swap_tier(const Config& cfg, const ZeroPlan& plan, int rank);

}  // namespace tiermem::detail
