// The engine's gradient reduce path (src/zero/gradient_reducer.h): by stage and world, over a
// one-rank store and a fake communicator — partitions hold the sum of the reduce calls, buckets
// complete in order (the folded norm is usable and equals the direct sum), the hand-off adds on its
// thread and hands its buffer back zeroed, and a failed collective surfaces at sync().
#include "zero/gradient_reducer.h"

#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <vector>

#include "tiermem/error.h"
#include "unit/zero_parts_fakes.h"

namespace tiermem::detail {
namespace {

struct Fixture {
  EngineShape shape;
  std::vector<ZeroModule> mods;
  std::vector<SubGroup> sub_groups;
  std::unique_ptr<testing::FakeComm> comm;
  std::unique_ptr<TensorStore> store;
  std::unique_ptr<NormTracker> norm;
  std::unique_ptr<GradientReducer> reducer;
  int peak_samples = 0;

  // Rank `rank` of `world` at `stage`; modules of these sizes in sub-groups of `sub_group_elems`.
  Fixture(int stage, int rank, int world, std::vector<std::size_t> numels, std::size_t sub_group_elems,
          GradientReducer::Options o = {}) {
    shape.stage = stage;
    shape.rank = rank;
    shape.world = world;
    shape.opt_rank = stage == 0 ? 0 : rank;
    shape.opt_world = stage == 0 ? 1 : world;
    comm = std::make_unique<testing::FakeComm>(rank, world);
    TensorStoreOptions so;
    so.host_budget_bytes = 4 << 20;
    so.pipeline_chunk_bytes = 64 << 10;
    so.pipeline_chunks = 1;
    store = std::make_unique<TensorStore>(so, nullptr);
    for (std::size_t n : numels) {
      testing::add_module(mods, sub_groups, shape, n, sub_group_elems);
      ZeroModule& m = mods.back();
      if (stage <= 1) m.full_grad.assign(m.shard.padded, 0.0f);
      if (stage == 1) m.shard_grad.assign(m.shard.shard, 0.0f);
    }
    for (SubGroup& p : sub_groups) {
      if (stage < 2) continue;
      p.grad = store->register_tensor({.name = "g" + std::to_string(p.flat), .dtype = DType::kF32,
                                       .shape = {static_cast<std::int64_t>(p.size())}});
    }
    norm = std::make_unique<NormTracker>(*comm, shape, mods, sub_groups);
    norm->resize(mods.size());
    reducer = std::make_unique<GradientReducer>(*comm, shape, o, mods, sub_groups, store, *norm,
                                                [this](std::uint64_t) { ++peak_samples; });
  }
  // Module m's shard as accumulated in its gradient partitions (read through the store).
  std::vector<float> partition(int mi) {
    std::vector<float> out;
    for (int pi : mods[static_cast<std::size_t>(mi)].sub_groups) {
      const SubGroup& p = sub_groups[static_cast<std::size_t>(pi)];
      TensorStore::Pin pin = store->acquire(p.grad, Tier::kHost);
      out.insert(out.end(), pin.as<float>(), pin.as<float>() + p.size());
    }
    return out;
  }
};

std::vector<float> random_grad(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> dist(-64, 64);  // small integers: every sum is exact
  std::vector<float> g(n);
  for (float& x : g) x = static_cast<float>(dist(rng)) / 8.0f;
  return g;
}

TEST(GradientReducer, OneRankAccumulatesIntoThePartitions) {
  Fixture f(2, 0, 1, {1000, 37}, 256);
  const std::vector<float> a = random_grad(1000, 1), b = random_grad(1000, 2);
  f.reducer->reduce(0, a);
  f.reducer->reduce(0, b);
  f.reducer->sync();
  const std::vector<float> got = f.partition(0);
  for (std::size_t i = 0; i < 1000; ++i) ASSERT_EQ(got[i], a[i] + b[i]) << i;
  // The fold followed the last call, sub-group by sub-group in order: the direct sum over its partitions.
  double folded = 0;
  ASSERT_TRUE(f.norm->folded_sumsq(folded));
  NormTracker::Sum direct;
  for (int pi : f.mods[0].sub_groups) {
    TensorStore::Pin pin = f.store->acquire(f.sub_groups[static_cast<std::size_t>(pi)].grad, Tier::kHost);
    f.norm->add(direct, static_cast<std::size_t>(pi), pin.as<float>());
  }
  EXPECT_EQ(folded, direct.total);
  EXPECT_EQ(f.reducer->host_bytes(), 0u);
}

TEST(GradientReducer, BucketsCompleteInOrderAndSum) {
  // Rank 1 of 3; buckets of 40 elements over the ranks, at most two in flight.
  GradientReducer::Options o;
  o.bucket_elems = 40;
  o.max_inflight = 2;
  Fixture f(3, 1, 3, {600}, 64, o);
  const std::vector<float> g = random_grad(600, 3);
  f.reducer->reduce(0, g);
  EXPECT_GT(f.reducer->host_bytes(), 0u);  // buckets still in flight
  f.reducer->sync();
  EXPECT_EQ(f.reducer->host_bytes(), 0u);
  const std::vector<float> got = f.partition(0);
  const ElemRange r = f.mods[0].shard.range(1);
  for (std::size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], 3.0f * g[r.begin + i]) << i;
  ZeroStats s;
  f.reducer->add_stats(s);
  EXPECT_EQ(s.reduce_scatter_calls, static_cast<std::uint64_t>(f.comm->reduce_scatters));
  EXPECT_EQ(s.reduce_scatter_calls, make_reduce_chunks(f.mods[0].shard.shard, 3, 40, 1).size());
  EXPECT_GT(s.reduce_scatter_calls, 2u);  // more buckets than may be in flight
  EXPECT_EQ(f.peak_samples, f.comm->reduce_scatters);  // the footprint sampled at each bucket
  double folded = 0;
  EXPECT_TRUE(f.norm->folded_sumsq(folded));  // every sub-group completed, in order
}

TEST(GradientReducer, AFailedBucketSurfacesAtSync) {
  GradientReducer::Options o;
  o.bucket_elems = 1000;  // one bucket, left in flight
  Fixture f(2, 0, 2, {100}, 64, o);
  f.comm->fail_next = 1;
  f.reducer->reduce(0, random_grad(100, 4));
  EXPECT_THROW(f.reducer->sync(), CommError);
}

TEST(GradientReducer, HandOffAddsOnItsThreadAndReturnsTheBufferZeroed) {
  Fixture f(2, 0, 1, {500}, 128);
  const std::vector<float> a = random_grad(500, 5), b = random_grad(500, 6);
  std::vector<float> buf = f.reducer->buffer(500);
  buf = a;
  f.reducer->hand_off(0, std::move(buf));
  EXPECT_EQ(f.reducer->host_bytes(), 500 * sizeof(float));  // the hand-off's buffer
  f.reducer->wait_hand_off();
  std::vector<float> again = f.reducer->buffer(500);  // the spare, zeroed
  ASSERT_EQ(again.size(), 500u);
  for (float x : again) ASSERT_EQ(x, 0.0f);
  std::copy(b.begin(), b.end(), again.begin());
  f.reducer->hand_off(0, std::move(again));
  f.reducer->sync();
  const std::vector<float> got = f.partition(0);
  for (std::size_t i = 0; i < 500; ++i) ASSERT_EQ(got[i], a[i] + b[i]) << i;
  EXPECT_EQ(f.reducer->host_bytes(), 500 * sizeof(float));  // the spare
  f.reducer->drop_spare();
  EXPECT_EQ(f.reducer->host_bytes(), 0u);
}

TEST(GradientReducer, StagesZeroAndOneReduceAtTheStep) {
  for (int stage : {0, 1}) {
    Fixture f(stage, 1, 2, {10, 7}, 64);
    const std::vector<float> a = random_grad(10, 7), b = random_grad(7, 8);
    f.reducer->reduce(0, a);
    f.reducer->reduce(0, a);
    f.reducer->reduce(1, b);
    f.mods[0].grad_calls = 2;
    f.mods[1].grad_calls = 1;
    EXPECT_EQ(f.reducer->finish_step(), 2);  // the micro-batch count
    const ZeroModule& m = f.mods[0];
    if (stage == 0) {  // all-reduced in place: both ranks' (equal) sums
      for (std::size_t i = 0; i < 10; ++i) EXPECT_EQ(m.full_grad[i], 2.0f * 2.0f * a[i]);
    } else {  // reduce-scattered into this rank's shard
      const ElemRange r = m.shard.range(1);
      for (std::size_t i = 0; i < m.shard.shard; ++i) EXPECT_EQ(m.shard_grad[i], 2.0f * 2.0f * a[r.begin + i]);
    }
    ZeroStats s;
    f.reducer->add_stats(s);
    EXPECT_EQ(s.reduce_scatter_calls, stage == 1 ? 2u : 0u);
  }
}

}  // namespace
}  // namespace tiermem::detail
