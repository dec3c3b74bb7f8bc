// The gradient reducer's bucket packing (src/zero/reduce_bucket.h): each rank's part of a bucket
// is its shard's chunk, padding zero; summed over ranks, the buckets give each rank the sum of
// every rank's gradient on its shard (what the reduce-scatter delivers).
#include "zero/reduce_bucket.h"

#include <gtest/gtest.h>

#include <vector>

namespace tiermem::detail {
namespace {

TEST(ReduceBucket, EachRanksPartIsItsShardsChunk) {
  const ModuleShard s = make_module_shard(10, 3, 2);  // padded 12, shard 4
  ASSERT_EQ(s.shard, 4u);
  std::vector<float> grad(10);
  for (std::size_t i = 0; i < grad.size(); ++i) grad[i] = static_cast<float>(i + 1);
  const std::vector<float> first = pack_reduce_bucket(grad, s, 3, ElemRange{0, 2});
  EXPECT_EQ(first, (std::vector<float>{1, 2, 5, 6, 9, 10}));
  const std::vector<float> second = pack_reduce_bucket(grad, s, 3, ElemRange{2, 4});
  EXPECT_EQ(second, (std::vector<float>{3, 4, 7, 8, 0, 0}));  // elements 10, 11: padding
}

TEST(ReduceBucket, BucketsSummedOverRanksAreTheReduceScatter) {
  for (int world : {1, 2, 3, 4}) {
    const std::size_t numel = 37;
    const ModuleShard s = make_module_shard(numel, world, 4);
    // Rank q's gradient: element i is q * 100 + i.
    std::vector<std::vector<float>> grads(static_cast<std::size_t>(world), std::vector<float>(numel));
    for (int q = 0; q < world; ++q) {
      for (std::size_t i = 0; i < numel; ++i) grads[static_cast<std::size_t>(q)][i] = static_cast<float>(q * 100 + i);
    }
    for (const ElemRange& c : make_reduce_chunks(s.shard, world, 8 * static_cast<std::size_t>(world), 4)) {
      std::vector<std::vector<float>> sends;
      for (const auto& g : grads) sends.push_back(pack_reduce_bucket(g, s, world, c));
      for (int r = 0; r < world; ++r) {  // what rank r receives
        for (std::size_t k = 0; k < c.size(); ++k) {
          float got = 0;
          for (const auto& send : sends) got += send[static_cast<std::size_t>(r) * c.size() + k];
          const std::size_t i = static_cast<std::size_t>(r) * s.shard + c.begin + k;  // module element
          float want = 0;
          for (int q = 0; q < world && i < numel; ++q) want += static_cast<float>(q * 100 + i);
          ASSERT_EQ(got, want) << "world " << world << " rank " << r << " element " << i;
        }
      }
    }
  }
}

}  // namespace
}  // namespace tiermem::detail
