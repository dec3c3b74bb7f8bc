// The engine's all-gathers (src/zero/gatherer.h): buffers counted live from their start and
// freed on every path (taken, trimmed, dropped, failed), the gathered module in place, counters.
#include "zero/gatherer.h"

#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "tiermem/error.h"
#include "unit/zero_parts_fakes.h"

namespace tiermem::detail {
namespace {

// Rank 1 of 2; modules of 10, 6 and 20 fp32 elements, each shard a host store tensor holding
// its elements' values 100 x module + i.
struct Fixture {
  EngineShape shape;
  std::vector<ZeroModule> mods;
  std::vector<SubGroup> sub_groups;
  testing::FakeComm comm{1, 2};
  std::shared_ptr<Device> device;  // none: buffers in host memory
  std::unique_ptr<TensorStore> store;
  std::unique_ptr<Gatherer> gatherer;

  Fixture() {
    shape.rank = shape.opt_rank = 1;
    shape.world = shape.opt_world = 2;
    shape.stage = 3;
    TensorStoreOptions o;
    o.host_budget_bytes = 1 << 20;
    o.pipeline_chunk_bytes = 64 << 10;
    o.pipeline_chunks = 1;
    store = std::make_unique<TensorStore>(o, nullptr);
    for (std::size_t numel : {10, 6, 20}) {
      testing::add_module(mods, sub_groups, shape, numel, 1 << 10);
      ZeroModule& m = mods.back();
      m.param = store->register_tensor({.name = m.name, .dtype = DType::kF32,
                                        .shape = {static_cast<std::int64_t>(m.shard.shard)}});
      TensorStore::Pin pin = store->acquire_for_overwrite(m.param, Tier::kHost);
      for (std::size_t i = 0; i < m.shard.shard; ++i) pin.as<float>()[i] = 100.0f * (mods.size() - 1) + i;
      pin.mark_dirty();
    }
    gatherer = std::make_unique<Gatherer>(comm, shape, mods, device);
  }
  TensorStore::Pin shard(int m) { return store->acquire(mods[static_cast<std::size_t>(m)].param, Tier::kHost); }
  std::uint64_t bytes(int m) const { return mods[static_cast<std::size_t>(m)].shard.padded * 4; }
  ZeroStats stats() const {
    ZeroStats s;
    gatherer->add_stats(s);
    return s;
  }
};

TEST(Gatherer, GathersTheModuleAndCountsItsBuffer) {
  Fixture f;
  const Gatherer::Buffer b = f.gatherer->gather(0, f.shard(0));
  ASSERT_NE(b.data, nullptr);
  EXPECT_FALSE(b.on_device);
  EXPECT_EQ(f.gatherer->live_bytes(), f.bytes(0));
  const float* x = static_cast<const float*>(b.data);
  for (std::size_t i = 0; i < 5; ++i) EXPECT_EQ(x[5 + i], static_cast<float>(i));  // this rank's shard at its place
  std::uint32_t other;
  std::memcpy(&other, x, 4);
  EXPECT_EQ(other, 0x01010101u);  // rank 0's part, as the fake sent it
  f.gatherer->free(0, b);
  EXPECT_EQ(f.gatherer->live_bytes(), 0u);
  const ZeroStats s = f.stats();
  EXPECT_EQ(s.all_gather_calls, 1u);
  EXPECT_EQ(s.gathered_bytes_peak, f.bytes(0));
  EXPECT_EQ(s.all_gathers_prefetched, 0u);
}

TEST(Gatherer, PendingGathersAreCountedFromTheirStart) {
  Fixture f;
  f.gatherer->prefetch(0, f.shard(0));
  f.gatherer->prefetch(2, f.shard(2));
  EXPECT_EQ(f.gatherer->pending_count(), 2u);
  EXPECT_TRUE(f.gatherer->pending(2));
  EXPECT_FALSE(f.gatherer->pending(1));
  EXPECT_EQ(f.gatherer->live_bytes(), f.bytes(0) + f.bytes(2));
  EXPECT_FALSE(f.gatherer->take(1).has_value());
  std::optional<Gatherer::Buffer> b = f.gatherer->take(2);
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(static_cast<const float*>(b->data)[10 + 3], 203.0f);
  EXPECT_EQ(f.gatherer->pending_count(), 1u);
  EXPECT_EQ(f.gatherer->live_bytes(), f.bytes(0) + f.bytes(2));  // taken: the caller's until freed
  f.gatherer->free(2, *b);
  EXPECT_EQ(f.gatherer->live_bytes(), f.bytes(0));
  const ZeroStats s = f.stats();
  EXPECT_EQ(s.all_gather_calls, 2u);
  EXPECT_EQ(s.all_gathers_prefetched, 2u);
  EXPECT_EQ(s.gathered_bytes_peak, f.bytes(0) + f.bytes(2));
}

TEST(Gatherer, DropAndTrimFreeWhatIsPending) {
  Fixture f;
  f.gatherer->prefetch(0, f.shard(0));
  f.gatherer->prefetch(1, f.shard(1));
  f.gatherer->trim(2);  // the oldest goes: fewer than two left
  EXPECT_EQ(f.gatherer->pending_count(), 1u);
  EXPECT_FALSE(f.gatherer->pending(0));
  EXPECT_EQ(f.gatherer->live_bytes(), f.bytes(1));
  f.gatherer->prefetch(2, f.shard(2));
  f.gatherer->drop_pending();
  EXPECT_EQ(f.gatherer->pending_count(), 0u);
  EXPECT_EQ(f.gatherer->live_bytes(), 0u);
}

TEST(Gatherer, AFailedCollectiveFreesItsBuffer) {
  Fixture f;
  f.comm.fail_next = 1;
  EXPECT_THROW(f.gatherer->gather(0, f.shard(0)), CommError);
  EXPECT_EQ(f.gatherer->live_bytes(), 0u);
  // Pending: the failure surfaces at take, its buffer already freed.
  f.comm.fail_next = 1;
  f.gatherer->prefetch(1, f.shard(1));
  EXPECT_EQ(f.gatherer->live_bytes(), f.bytes(1));
  EXPECT_THROW(f.gatherer->take(1), CommError);
  EXPECT_EQ(f.gatherer->live_bytes(), 0u);
  EXPECT_EQ(f.gatherer->pending_count(), 0u);
  // drop_pending frees every one, then rethrows the failure.
  f.gatherer->prefetch(0, f.shard(0));
  f.comm.fail_next = 1;
  f.gatherer->prefetch(2, f.shard(2));
  EXPECT_THROW(f.gatherer->drop_pending(), CommError);
  EXPECT_EQ(f.gatherer->live_bytes(), 0u);
  EXPECT_EQ(f.gatherer->pending_count(), 0u);
}

TEST(Gatherer, AdoptedBuffersAreCountedAsGathers) {
  Fixture f;
  f.gatherer->adopt(2);
  EXPECT_EQ(f.gatherer->live_bytes(), f.bytes(2));
  EXPECT_EQ(f.stats().all_gather_calls, 1u);
  f.gatherer->free(2, {std::aligned_alloc(4096, 4096), false});  // the adopted one, freed as gathered
  EXPECT_EQ(f.gatherer->live_bytes(), 0u);
  ZeroStats s;
  s.all_gather_calls = 3;  // the engine's own (whole-module publishes)
  f.gatherer->add_stats(s);
  EXPECT_EQ(s.all_gather_calls, 4u);
}

}  // namespace
}  // namespace tiermem::detail
