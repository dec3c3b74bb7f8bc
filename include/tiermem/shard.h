// tiermem/shard.h — ZeRO shard arithmetic: pure functions over plain numbers (no I/O, no comm).
//
// A module's parameters are flattened into one buffer of `numel` elements, padded with zeros to
// `padded` = a multiple of world_size × alignment, and split into world_size equal shards of
// `shard` = padded / world_size elements; rank r owns [r × shard, (r + 1) × shard) of the padded
// buffer. A rank's shards of all modules sit back to back in its RANK-FLAT space (each module's
// shard starts at a multiple of alignment), which the optimizer state, the gradient shards and
// the working-parameter shards share; that space is stepped in sub-groups.
// (Same scheme as llm.c's multi_gpu_get_shard_offset and DeepSpeed's flat partitions.)
//
// Units: every count and offset is in ELEMENTS. Thread-safety: pure functions; thread-safe.
// Errors: a world_size < 1 or alignment of 0 throws tiermem::Error.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "tiermem/export.h"

namespace tiermem {

// [begin, end) in elements.
struct TIERMEM_API ElemRange {
  std::size_t begin = 0;
  std::size_t end = 0;
  std::size_t size() const { return end - begin; }
  bool operator==(const ElemRange&) const = default;
};

// One module's flat buffer split over world_size ranks.
struct TIERMEM_API ModuleShard {
  std::size_t numel = 0;    // real parameters
  std::size_t padded = 0;   // numel rounded up to a multiple of world_size * alignment
  std::size_t shard = 0;    // padded / world_size
  int world_size = 1;
  // The rank's part of the padded buffer: [rank*shard, (rank+1)*shard).
  ElemRange range(int rank) const;
  // The part of range(rank) that holds real parameters (excludes padding). A rank whose range is
  // all padding gets the empty range {range.begin, range.begin}.
  ElemRange valid(int rank) const;
};

// Pads `numel` to world_size × alignment_elems and splits it.
TIERMEM_API ModuleShard make_module_shard(std::size_t numel, int world_size, std::size_t alignment_elems);

// Every module of a model, and where each module's shard sits in the rank-flat space.
struct TIERMEM_API ShardLayout {
  int world_size = 1;
  std::size_t alignment = 1;
  std::vector<ModuleShard> modules;
  std::vector<std::size_t> flat_offset;  // modules[i]'s shard starts here in the rank-flat space
  std::size_t rank_flat = 0;             // sum of the shard sizes (the same on every rank)
  std::size_t full_flat = 0;             // sum of the padded sizes
};
TIERMEM_API ShardLayout make_shard_layout(std::span<const std::size_t> module_numels, int world_size,
                              std::size_t alignment_elems);

// Splits [0, total) into consecutive sub-groups of at most max_elems elements; every boundary but
// the last is a multiple of alignment_elems. max_elems below alignment_elems is raised to it
// (ZeroEngine rejects such a config first). total == 0 gives no sub-groups.
TIERMEM_API std::vector<ElemRange> make_sub_groups(std::size_t total, std::size_t max_elems,
                                       std::size_t alignment_elems);

// Chunks of a shard for bucketed reduce-scatter: a bucket of bucket_elems elements (all ranks'
// pieces together) carries bucket_elems / world_size elements of every rank's shard, rounded down
// to alignment_elems (at least alignment_elems, at most the shard). Returns shard-local ranges
// covering [0, shard) in order.
TIERMEM_API std::vector<ElemRange> make_reduce_chunks(std::size_t shard, int world_size, std::size_t bucket_elems,
                                          std::size_t alignment_elems);

}  // namespace tiermem
