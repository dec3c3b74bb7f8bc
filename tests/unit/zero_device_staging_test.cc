// The engine's own host <-> device copies (src/zero/device_staging.h) on a SimDevice the CPU
// cannot address: staged all-gathers, gradients down, publication up, a checkpoint's staging and
// the device optimizer's scratch — contents, byte counters, the host footprint and its samples.
#include "zero/device_staging.h"

#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "tiermem/error.h"
#include "tiermem/sim_device.h"
#include "unit/zero_parts_fakes.h"

namespace tiermem::detail {
namespace {

struct Fixture {
  EngineShape shape;
  std::vector<ZeroModule> mods;
  std::vector<SubGroup> sub_groups;
  testing::FakeComm comm{0, 2};
  std::shared_ptr<Device> device;
  std::unique_ptr<TensorStore> store;
  std::unique_ptr<DeviceStaging> staging;
  std::vector<std::uint64_t> samples;  // host_bytes() at each sample

  Fixture() {
    shape.world = shape.opt_world = 2;
    shape.stage = 3;
    shape.opaque = true;
    shape.compute_tier = Tier::kDevice;
    device = std::make_shared<SimDevice>(SimDeviceOptions{.budget_bytes = 1 << 20, .host_addressable = false});
    TensorStoreOptions so;
    so.host_budget_bytes = 1 << 20;
    so.pipeline_chunk_bytes = 64 << 10;
    so.pipeline_chunks = 1;
    store = std::make_unique<TensorStore>(so, nullptr);
    testing::add_module(mods, sub_groups, shape, 12, 64);
    staging = std::make_unique<DeviceStaging>(comm, shape, device,
                                              [this](std::uint64_t) { samples.push_back(staging->host_bytes()); });
  }
  std::vector<float> down(const void* dev, std::size_t n) {
    std::vector<float> out(n);
    device->copy_d2h(out.data(), dev, 4 * n);
    return out;
  }
  ZeroStats stats() const {
    ZeroStats s;
    staging->add_stats(s);
    return s;
  }
};

TEST(DeviceStaging, GatherTierSkipsTheCopyDownForShardsHomedBelowTheDevice) {
  Fixture f;
  f.mods[0].home = Tier::kHost;
  EXPECT_EQ(f.staging->gather_tier(f.mods[0]), Tier::kHost);  // staged through host memory anyway
  f.mods[0].home = Tier::kDevice;
  EXPECT_EQ(f.staging->gather_tier(f.mods[0]), Tier::kDevice);
  f.shape.opaque = false;
  f.mods[0].home = Tier::kHost;
  EXPECT_EQ(f.staging->gather_tier(f.mods[0]), Tier::kDevice);
}

TEST(DeviceStaging, AllGatherToDeviceStagesThroughHostMemory) {
  Fixture f;
  const ZeroModule& m = f.mods[0];  // 12 elements: shards of 6
  const TensorId id = f.store->register_tensor({.name = "p", .dtype = DType::kF32, .shape = {6}});
  {
    TensorStore::Pin w = f.store->acquire_for_overwrite(id, Tier::kHost);
    for (int i = 0; i < 6; ++i) w.as<float>()[i] = static_cast<float>(i + 1);
    w.mark_dirty();
  }
  TensorStore::Pin pin = f.store->acquire(id, Tier::kHost);
  void* buf = f.staging->all_gather_to_device(m, pin);
  EXPECT_FALSE(pin.valid());  // released once copied
  const std::vector<float> got = f.down(buf, 12);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(got[static_cast<std::size_t>(i)], static_cast<float>(i + 1));
  std::uint32_t other;
  std::memcpy(&other, &got[6], 4);
  EXPECT_EQ(other, 0x02020202u);  // rank 1's part, as the fake sent it
  f.device->free(buf);
  EXPECT_EQ(f.stats().host_to_device_bytes, 48u);  // the whole module up once
  EXPECT_EQ(f.staging->host_bytes(), 0u);          // the staging buffer is gone
  ASSERT_EQ(f.samples.size(), 1u);
  EXPECT_GE(f.samples[0], 48u);  // sampled while it was live
}

TEST(DeviceStaging, AFailedAllGatherFreesItsDeviceBuffer) {
  Fixture f;
  const TensorId id = f.store->register_tensor({.name = "p", .dtype = DType::kF32, .shape = {6}});
  { f.store->acquire_for_overwrite(id, Tier::kHost).mark_dirty(); }
  TensorStore::Pin pin = f.store->acquire(id, Tier::kHost);
  f.comm.fail_next = 1;
  EXPECT_THROW(f.staging->all_gather_to_device(f.mods[0], pin), CommError);
  EXPECT_EQ(f.device->stats().allocated_bytes, 0u);
  EXPECT_EQ(f.staging->host_bytes(), 0u);
}

TEST(DeviceStaging, GradientsComeDownIntoOneKeptBuffer) {
  Fixture f;
  std::vector<float> g = {1, 2, 3, 4, 5};
  void* dev = f.device->allocate(20);
  f.device->copy_h2d(dev, g.data(), 20);
  const float* host = f.staging->stage_gradient(static_cast<const float*>(dev), 5, 100);
  EXPECT_EQ(std::vector<float>(host, host + 5), g);
  EXPECT_EQ(f.staging->host_bytes(), 400u);  // made for the largest module, kept
  EXPECT_EQ(f.stats().device_to_host_bytes, 20u);
  f.staging->stage_gradient(static_cast<const float*>(dev), 5, 100);
  EXPECT_EQ(f.samples.size(), 1u);  // grown once
  f.device->free(dev);
}

TEST(DeviceStaging, PublishBuffersGoUpAndStayAtMostTwo) {
  Fixture f;
  void* dst = f.device->allocate(64);
  std::byte* b0 = f.staging->publish_buffer(0, 16, 32);
  for (int i = 0; i < 4; ++i) reinterpret_cast<float*>(b0)[i] = 10.0f + i;
  f.staging->publish_async(dst, 0, 16).wait();
  EXPECT_EQ(f.down(dst, 4), (std::vector<float>{10, 11, 12, 13}));
  f.staging->publish_buffer(1, 8, 32);
  EXPECT_EQ(f.staging->host_bytes(), 64u);  // two buffers of max(bytes, min_bytes)
  f.staging->publish_buffer(0, 48, 32);     // grown: the old one freed first
  EXPECT_EQ(f.staging->host_bytes(), 80u);
  EXPECT_EQ(f.stats().host_to_device_bytes, 16u);
  f.device->free(dst);
}

TEST(DeviceStaging, StateStagingIsCountedUntilDone) {
  Fixture f;
  AlignedBuf buf;
  float* s = f.staging->state_buffer(buf, 120);
  EXPECT_EQ(s, buf.f());
  EXPECT_EQ(f.staging->host_bytes(), 120u);
  EXPECT_EQ(f.staging->state_buffer(buf, 120), s);  // made once
  f.staging->state_done();
  EXPECT_EQ(f.staging->host_bytes(), 0u);
}

TEST(DeviceStaging, DeviceOptimizerScratch) {
  Fixture f;
  const std::vector<float> g = {4, 3, 2, 1};
  const float* dev = f.staging->gradient_to_scratch(g.data(), 4, 16);
  EXPECT_EQ(f.down(dev, 4), g);
  void* out = f.staging->out_scratch(32);
  f.device->copy_h2d(out, g.data(), 16);
  std::vector<float> back(4);
  f.staging->copy_down(back.data(), out, 16);
  EXPECT_EQ(back, g);
  EXPECT_EQ(f.staging->device_scratch_bytes(), f.device->allocation_size(64) + f.device->allocation_size(32));
  const ZeroStats s = f.stats();
  EXPECT_EQ(s.host_to_device_bytes, 16u);
  EXPECT_EQ(s.device_to_host_bytes, 16u);
}

}  // namespace
}  // namespace tiermem::detail
