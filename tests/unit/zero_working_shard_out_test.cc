// Where new working params go (src/zero/working_shard_out.h): engine buffers in place, a stored
// shard pinned for overwrite once per module and released dirty, and on a device the CPU cannot
// address, host staging sub-groups copied up before finish() returns.
#include "zero/working_shard_out.h"

#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "tiermem/sim_device.h"
#include "unit/zero_parts_fakes.h"

namespace tiermem::detail {
namespace {

struct Fixture {
  EngineShape shape;
  std::vector<ZeroModule> mods;
  std::vector<SubGroup> sub_groups;
  testing::FakeComm comm{0, 1};
  std::shared_ptr<Device> device;
  std::unique_ptr<TensorStore> store;
  std::unique_ptr<DeviceStaging> staging;

  // Modules of 10 and 6 fp32 elements in sub-groups of 4, stored with their shards homed at
  // `home` on a SimDevice (host-addressable or not).
  Fixture(Tier home, bool addressable) {
    shape.stage = 3;
    shape.opaque = !addressable;
    shape.compute_tier = Tier::kDevice;
    device = std::make_shared<SimDevice>(SimDeviceOptions{.budget_bytes = 1 << 20, .host_addressable = addressable});
    TensorStoreOptions so;
    so.host_budget_bytes = 1 << 20;
    so.device_budget_bytes = 1 << 20;
    so.pipeline_chunk_bytes = 64 << 10;
    so.pipeline_chunks = 1;
    store = std::make_unique<TensorStore>(so, device);
    for (std::size_t n : {10, 6}) {
      testing::add_module(mods, sub_groups, shape, n, 4);
      ZeroModule& m = mods.back();
      m.home = home;
      m.param = store->register_tensor({.name = m.name, .dtype = DType::kF32,
                                        .shape = {static_cast<std::int64_t>(m.shard.shard)}, .home = home});
    }
    staging = std::make_unique<DeviceStaging>(comm, shape, device, [](std::uint64_t) {});
  }
  WorkingShardOut out() { return {mods, store, shape, *staging, 4}; }
  // Every sub-group in order, element i of module m written as 100 m + i.
  void publish_all() {
    WorkingShardOut w = out();
    for (const SubGroup& p : sub_groups) {
      float* d = reinterpret_cast<float*>(w.dest(p));
      for (std::size_t i = p.begin; i < p.end; ++i) d[i - p.begin] = 100.0f * p.module + i;
    }
    w.finish();
  }
  std::vector<float> shard(int m) {
    std::vector<float> v(mods[static_cast<std::size_t>(m)].shard.shard);
    store->read(mods[static_cast<std::size_t>(m)].param, std::as_writable_bytes(std::span<float>(v)));
    return v;
  }
};

void expect_published(Fixture& f) {
  for (int m = 0; m < 2; ++m) {
    const std::vector<float> v = f.shard(m);
    for (std::size_t i = 0; i < v.size(); ++i) EXPECT_EQ(v[i], 100.0f * m + i) << m << " " << i;
  }
}

TEST(WorkingShardOut, StoredShardsAreWrittenInPlace) {
  Fixture f(Tier::kHost, true);
  f.publish_all();
  expect_published(f);
  EXPECT_EQ(f.staging->host_bytes(), 0u);  // nothing staged
}

TEST(WorkingShardOut, OpaqueDeviceShardsAreStagedAndCopiedUp) {
  Fixture f(Tier::kDevice, false);
  f.publish_all();
  expect_published(f);
  EXPECT_EQ(f.staging->host_bytes(), 2 * 16u);  // two publish buffers of one sub-group
  ZeroStats s;
  f.staging->add_stats(s);
  EXPECT_EQ(s.host_to_device_bytes, 16u * 4);  // every real byte, once
}

TEST(WorkingShardOut, DeviceDestinationsOnlyForDeviceTierPins) {
  Fixture host(Tier::kHost, true);
  {
    WorkingShardOut w = host.out();
    EXPECT_EQ(w.device_dest(host.sub_groups[0]), nullptr);  // pinned at the publish tier: the host
    w.finish();
  }
  Fixture dev(Tier::kDevice, true);
  WorkingShardOut w = dev.out();
  std::byte* d = w.device_dest(dev.sub_groups[1]);
  ASSERT_NE(d, nullptr);
  EXPECT_EQ(w.device_dest(dev.sub_groups[0]) + 4 * sizeof(float), d);  // the same pin, one sub-group on
  w.finish();
}

TEST(WorkingShardOut, EngineBuffersAreWrittenDirectly) {
  Fixture f(Tier::kHost, true);
  f.mods[1].stored = false;
  f.mods[1].mem_shard = AlignedBuf(6 * sizeof(float));
  WorkingShardOut w = f.out();
  const SubGroup& p = f.sub_groups[f.mods[1].sub_groups[1]];
  EXPECT_EQ(w.dest(p), f.mods[1].mem_shard.b() + p.begin * sizeof(float));
  w.finish();
}

}  // namespace
}  // namespace tiermem::detail
