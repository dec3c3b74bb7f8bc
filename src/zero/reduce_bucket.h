// src/zero/reduce_bucket.h — one reduce bucket's send buffer, the gradient reducer's pure part
// (stages 2-3, several ranks; DeepSpeed's reduce_bucket_size). The buckets' chunks are
// make_reduce_chunks' (tiermem/shard.h); the GradientReducer (gradient_reducer.h) packs each chunk
// with pack_reduce_bucket, starts the reduce-scatter and accumulates the received part into the
// gradient partitions later, at most max_inflight_buckets in flight.
//
// Units: elements. Ownership: the returned buffer is the caller's. Thread-safety: a pure
// function; thread-safe.
#pragma once

#include <span>
#include <vector>

#include "tiermem/shard.h"

namespace tiermem::detail {

// The send buffer of the reduce-scatter of chunk `chunk` (shard-local) of a module whose full
// gradient is `grad` (its numel elements, unpadded): world x chunk.size() elements, rank r's part
// [r x chunk.size(), (r + 1) x chunk.size()) holding the module's elements
// r x shard.shard + chunk (zero past the module's end: the padding).
std::vector<float> pack_reduce_bucket(std::span<const float> grad, const ModuleShard& shard, int world, ElemRange chunk);

}  // namespace tiermem::detail
