// src/train/checkpoint_reshard.cc — a saved ZeRO optimizer state re-partitioned on load
// (tiermem/checkpoint_reshard.h).
#include "tiermem/checkpoint_reshard.h"

#include <algorithm>
#include <fmt/format.h>

#include "tiermem/error.h"

namespace tiermem {

std::vector<ReshardCopy> reshard_copies(const ShardLayout& from, const ShardLayout& to, int to_rank,
                                        ElemRange range) {
  if (from.modules.size() != to.modules.size())
    throw Error(fmt::format("reshard: the saved layout has {} modules, the new one {}",
                            from.modules.size(), to.modules.size()));
  for (std::size_t m = 0; m < to.modules.size(); ++m) {
    if (from.modules[m].numel != to.modules[m].numel)
      throw Error(fmt::format("reshard: module {} has {} elements in the saved layout, {} in the new one",
                              m, from.modules[m].numel, to.modules[m].numel));
  }
  if (to_rank < 0 || to_rank >= to.world_size)
    throw Error(fmt::format("reshard: rank {} is outside the new world of {}", to_rank, to.world_size));
  if (range.begin > range.end || range.end > to.rank_flat)
    throw Error(fmt::format("reshard: range [{}, {}) runs past the new shard's {} elements",
                            range.begin, range.end, to.rank_flat));
  std::vector<ReshardCopy> out;
  // The first module whose shard ends after range.begin (flat offsets increase).
  auto it = std::upper_bound(to.flat_offset.begin(), to.flat_offset.end(), range.begin);
  std::size_t m = it == to.flat_offset.begin() ? 0 : static_cast<std::size_t>(it - to.flat_offset.begin()) - 1;
  for (; m < to.modules.size() && to.flat_offset[m] < range.end; ++m) {
    const ModuleShard& ns = to.modules[m];
    const ModuleShard& os = from.modules[m];
    const std::size_t flat = to.flat_offset[m];
    const std::size_t lo = std::max(range.begin, flat), hi = std::min(range.end, flat + ns.shard);
    if (lo >= hi) continue;
    // The module elements [e0, e1) this piece holds, clipped to the real ones (no padding).
    const std::size_t base = ns.range(to_rank).begin;
    const std::size_t e0 = base + (lo - flat);
    const std::size_t e1 = std::min(base + (hi - flat), ns.numel);
    for (std::size_t e = e0; e < e1;) {
      const std::size_t k = e / os.shard;  // the old rank that held element e
      const std::size_t stop = std::min(e1, (k + 1) * os.shard);
      out.push_back(ReshardCopy{static_cast<int>(k), from.flat_offset[m] + (e - k * os.shard),
                                lo - range.begin + (e - e0), stop - e});
      e = stop;
    }
  }
  return out;
}

OptimizerStateReshard::OptimizerStateReshard(const std::string& dir, int old_world,
                                             OptimizerStateNames names,
                                             std::vector<std::size_t> module_numels,
                                             std::size_t alignment_elems, int new_world,
                                             int new_rank)
    : names_(std::move(names)),
      from_(make_shard_layout(module_numels, old_world, alignment_elems)),
      to_(make_shard_layout(module_numels, new_world, alignment_elems)),
      new_rank_(new_rank) {
  if (new_rank < 0 || new_rank >= new_world)
    throw Error(fmt::format("reshard: rank {} is outside the new world of {}", new_rank, new_world));
  readers_.resize(static_cast<std::size_t>(old_world));
  for (const ReshardCopy& c : reshard_copies(from_, to_, new_rank_, {0, to_.rank_flat})) {
    auto& r = readers_[static_cast<std::size_t>(c.old_rank)];
    if (r) continue;
    r = std::make_unique<CheckpointReader>(dir, c.old_rank);
    // Every byte of what this rank will read is checked before any of it is used.
    const std::uint64_t bytes = from_.rank_flat * 4;
    for (const std::string* name : {&names_.master, &names_.exp_avg, &names_.exp_avg_sq})
      r->verify_tensor(*name, bytes);
  }
}

OptimizerStateReshard::~OptimizerStateReshard() = default;

std::vector<int> OptimizerStateReshard::source_ranks() const {
  std::vector<int> out;
  for (std::size_t k = 0; k < readers_.size(); ++k)
    if (readers_[k]) out.push_back(static_cast<int>(k));
  return out;
}

void OptimizerStateReshard::fill(std::size_t offset, std::size_t n, float* master, float* exp_avg,
                                 float* exp_avg_sq) {
  float* const dst[3] = {master, exp_avg, exp_avg_sq};
  const std::string* const name[3] = {&names_.master, &names_.exp_avg, &names_.exp_avg_sq};
  for (float* d : dst) std::fill(d, d + n, 0.0f);  // padding stays 0, as the engine keeps it
  for (const ReshardCopy& c : reshard_copies(from_, to_, new_rank_, {offset, offset + n})) {
    CheckpointReader& r = *readers_[static_cast<std::size_t>(c.old_rank)];
    for (int i = 0; i < 3; ++i) r.read_part(*name[i], c.old_offset * 4, dst[i] + c.dst, c.n * 4);
  }
}

}  // namespace tiermem
