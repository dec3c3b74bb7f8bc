// src/zero/shard.cc — ZeRO shard arithmetic (see include/tiermem/shard.h).
#include "tiermem/shard.h"

#include <algorithm>
#include <string>

#include "tiermem/error.h"

namespace tiermem {
namespace {
void check(int world_size, std::size_t alignment) {
  if (world_size < 1) throw Error("shard: world_size " + std::to_string(world_size) + " must be >= 1");
  if (alignment == 0) throw Error("shard: alignment must be >= 1 element");
}
std::size_t round_up(std::size_t x, std::size_t m) { return (x + m - 1) / m * m; }
}  // namespace

ElemRange ModuleShard::range(int rank) const {
  std::size_t b = static_cast<std::size_t>(rank) * shard;
  return {b, b + shard};
}

ElemRange ModuleShard::valid(int rank) const {
  ElemRange r = range(rank);
  if (r.begin >= numel) return {r.begin, r.begin};  // all padding
  r.end = std::min(r.end, numel);
  return r;
}

ModuleShard make_module_shard(std::size_t numel, int world_size, std::size_t alignment_elems) {
  check(world_size, alignment_elems);
  ModuleShard s;
  s.numel = numel;
  s.world_size = world_size;
  s.padded = round_up(numel, static_cast<std::size_t>(world_size) * alignment_elems);
  s.shard = s.padded / static_cast<std::size_t>(world_size);
  return s;
}

ShardLayout make_shard_layout(std::span<const std::size_t> module_numels, int world_size,
                              std::size_t alignment_elems) {
  check(world_size, alignment_elems);
  ShardLayout l;
  l.world_size = world_size;
  l.alignment = alignment_elems;
  for (std::size_t n : module_numels) {
    l.modules.push_back(make_module_shard(n, world_size, alignment_elems));
    l.flat_offset.push_back(l.rank_flat);
    l.rank_flat += l.modules.back().shard;
    l.full_flat += l.modules.back().padded;
  }
  return l;
}

std::vector<ElemRange> make_sub_groups(std::size_t total, std::size_t max_elems,
                                       std::size_t alignment_elems) {
  check(1, alignment_elems);
  std::size_t step = std::max(max_elems, alignment_elems) / alignment_elems * alignment_elems;
  std::vector<ElemRange> out;
  for (std::size_t b = 0; b < total; b += step) out.push_back({b, std::min(total, b + step)});
  return out;
}

std::vector<ElemRange> make_reduce_chunks(std::size_t shard, int world_size, std::size_t bucket_elems,
                                          std::size_t alignment_elems) {
  check(world_size, alignment_elems);
  std::size_t per_rank = bucket_elems / static_cast<std::size_t>(world_size);
  return make_sub_groups(shard, std::max(per_rank, alignment_elems), alignment_elems);
}

}  // namespace tiermem
