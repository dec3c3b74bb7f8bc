// tiermem/checkpoint_reshard.h — re-partitions a ZeRO optimizer state saved at one world size
// for another, as it loads: each rank reads the elements of its new shard straight from the old
// ranks' checkpoint files (tiermem/checkpoint.h) that hold them. Used by tiermem-train
// (ZeroTrainEngine::load) and by tiermem.torch's load_checkpoint (through the binding in
// python/src/train_state.cc); the library is tiermem::train_state (src/train/checkpoint_reshard.cc).
//
// The state is three fp32 tensors per old rank (master weights and the two Adam moments), each
// that rank's RANK-FLAT shard as tiermem/shard.h lays it out: every module padded to a multiple
// of world_size × alignment and split evenly, a rank's shards back to back. An element keeps its
// module and its index in the module; only which rank holds it, and where in that rank's flat
// space, changes. Padding elements (past a module's numel) are 0 in the new shard.
//
// Streaming: fill() reads one sub-group's elements directly into the caller's buffers (pread
// into the destination, no staging), so a rank never holds more than the engine's own sub-group
// buffers; nothing model-sized is ever in memory.
//
// Units: every count and offset is in ELEMENTS (fp32) unless the name ends in _bytes.
// Ownership: fill() writes the caller's three buffers during the call only; an
// OptimizerStateReshard owns the old ranks' readers (files open until it is destroyed).
// Thread-safety: reshard_copies is pure (thread-safe); an OptimizerStateReshard is used by one
// thread at a time. Errors: CheckpointError naming the file and what is wrong (an old rank's directory or
// manifest missing, a tensor of another size, a checksum mismatch); tiermem::Error for arguments
// that do not fit together (module lists of different lengths, a range past the shard).
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "tiermem/export.h"
#include "tiermem/shard.h"
#include "tiermem/checkpoint.h"

namespace tiermem {

// One contiguous run of elements to copy: `n` elements at `old_offset` of old rank `old_rank`'s
// rank-flat shard go to `dst` elements into the requested range of the new shard.
struct TIERMEM_API ReshardCopy {
  int old_rank = 0;
  std::size_t old_offset = 0;
  std::size_t dst = 0;
  std::size_t n = 0;
  bool operator==(const ReshardCopy&) const = default;
};

// Where the elements of new rank `to_rank`'s rank-flat range `range` (of layout `to`) were in
// layout `from`: the copies in increasing dst, each as long as possible. Elements of the range no
// copy covers are padding. `from` and `to` must describe the same modules (same count and
// numels); throws tiermem::Error otherwise, or when the range runs past to.rank_flat.
TIERMEM_API std::vector<ReshardCopy> reshard_copies(const ShardLayout& from, const ShardLayout& to,
                                                    int to_rank, ElemRange range);

// Names of the three fp32 tensors of the state in each rank's checkpoint.
struct TIERMEM_API OptimizerStateNames {
  std::string master, exp_avg, exp_avg_sq;
};

// This rank's new shard, read from the old ranks' checkpoints in `dir` (dir/rank<k>/ for every
// old rank k that holds an element of it). The constructor opens those ranks' checkpoints and
// verifies the three tensors of each (exact size, XXH64, read in bounded chunks) before any
// element is used; fill() then reads without further checks.
class TIERMEM_API OptimizerStateReshard {
 public:
  // old_world: the ranks the saved state is split over (1: whole on rank 0, as ZeRO stage 0
  // saves it); module_numels and alignment_elems: the saved partition's, which the new one shares;
  // new_world / new_rank: the partition to fill (new_rank < new_world).
  OptimizerStateReshard(const std::string& dir, int old_world, OptimizerStateNames names,
                        std::vector<std::size_t> module_numels, std::size_t alignment_elems,
                        int new_world, int new_rank);
  ~OptimizerStateReshard();
  OptimizerStateReshard(const OptimizerStateReshard&) = delete;
  OptimizerStateReshard& operator=(const OptimizerStateReshard&) = delete;

  // Fills elements [offset, offset + n) of the new shard: n floats at each of the three pointers
  // (caller-owned, written during the call only). Padding elements are set to 0.
  void fill(std::size_t offset, std::size_t n, float* master, float* exp_avg, float* exp_avg_sq);

  std::size_t shard_numel() const { return to_.rank_flat; }  // of the new shard
  // The old ranks this rank reads (each one verified), in increasing order.
  std::vector<int> source_ranks() const;

 private:
  OptimizerStateNames names_;
  ShardLayout from_, to_;
  int new_rank_ = 0;
  std::vector<std::unique_ptr<CheckpointReader>> readers_;  // by old rank; null = not needed
};

}  // namespace tiermem
