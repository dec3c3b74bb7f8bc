// src/zero/partition_layout.cc — see partition_layout.h.
#include "zero/partition_layout.h"

namespace tiermem::detail {

ModuleLayout layout_module(std::size_t numel, std::size_t flat, const PartitionOptions& o) {
  ModuleLayout m;
  m.shard = make_module_shard(numel, o.opt_world, o.alignment_elems);
  m.flat = flat;
  m.persistent = o.stage == 3 && numel < o.persistence_threshold_elems;
  // One rank: a persistent module is a shard like any other, homed on the device (zero_plan.h).
  m.stored = o.stage == 3 && m.shard.shard > 0 && (!m.persistent || o.world == 1);
  return m;
}

std::vector<SubGroupLayout> layout_sub_groups(const ModuleLayout& m, std::size_t sub_group_elems,
                                              std::size_t alignment_elems, bool all_on_device,
                                              std::size_t device_from) {
  std::vector<SubGroupLayout> out;
  for (const ElemRange& r : make_sub_groups(m.shard.shard, sub_group_elems, alignment_elems)) {
    SubGroupLayout g;
    g.range = r;
    g.flat = m.flat + r.begin;
    g.on_device = all_on_device || g.flat >= device_from;
    out.push_back(g);
  }
  return out;
}

}  // namespace tiermem::detail
