// src/zero/partition_layout.h — ZeroEngine's partition layout: where each module's shard sits in
// the rank-flat space, which modules are kept whole or stored, and the optimizer sub-groups
// each module's shard is stepped in. Pure functions over plain numbers (the shard
// arithmetic itself is tiermem/shard.h); ZeroEngine::Impl keeps the results in its modules and
// sub-groups.
//
// Units: every count and offset is in ELEMENTS. Thread-safety: pure functions; thread-safe.
// Errors: a world size < 1 or an alignment of 0 throws tiermem::Error (make_module_shard).
#pragma once

#include <cstddef>
#include <vector>

#include "tiermem/shard.h"

namespace tiermem::detail {

struct PartitionOptions {
  int stage = 0;
  int world = 1;      // ranks training together
  int opt_world = 1;  // ranks the optimizer state is split over (stage 0: 1)
  std::size_t alignment_elems = 1;
  std::size_t persistence_threshold_elems = 0;  // stage 3: smaller modules are kept whole
};

struct ModuleLayout {
  ModuleShard shard;        // the module split over opt_world ranks
  std::size_t flat = 0;     // rank-flat offset of its shard (the previous module's end)
  bool persistent = false;  // stage 3, below the persistence threshold: kept whole
  bool stored = false;      // stage 3: its working shard is a TensorStore tensor
};

// The next module's layout: `numel` elements, its shard placed at rank-flat offset `flat`.
ModuleLayout layout_module(std::size_t numel, std::size_t flat, const PartitionOptions& o);

// One optimizer sub-group of a module's shard.
struct SubGroupLayout {
  ElemRange range;         // within the module's shard
  std::size_t flat = 0;    // rank-flat offset of range.begin
  bool on_device = false;  // its state is homed on the device and stepped there
};

// The module's shard in sub-groups of at most `sub_group_elems` (boundaries on alignment_elems).
// State is on the device for every sub-group when `all_on_device` (the device-resident
// optimizer), else for those whose rank-flat offset is at or past `device_from` (the device's
// share under offload_optimizer.ratio < 1; ZeroPlan::device_optimizer_from).
std::vector<SubGroupLayout> layout_sub_groups(const ModuleLayout& m, std::size_t sub_group_elems,
                                              std::size_t alignment_elems, bool all_on_device,
                                              std::size_t device_from);

}  // namespace tiermem::detail
