// TensorStore on SimDevice + a SwapSpace in a temp directory: residency, write-back, budgets,
// the pipeline, pins and timeouts, a concurrent property test against a reference model.
#include "tiermem/tensor_store.h"
#include "tiermem/pinned_host_pool.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <future>
#include <thread>

#include "tiermem/error.h"
#include "tiermem/io_engine.h"
#include "tiermem/lru_policy.h"
#include "tiermem/sim_device.h"
#include "tiermem/swap_space.h"
#include "tiermem/trace.h"

namespace tiermem {
namespace {

namespace fs = std::filesystem;

// Deterministic contents: byte i of (tensor, generation) .
std::uint8_t pattern(std::uint32_t tensor, std::uint32_t gen, std::uint64_t i) {
  std::uint64_t x = (i * 0x9E3779B97F4A7C15ull) ^ (std::uint64_t{tensor} << 40) ^ (std::uint64_t{gen} << 20);
  return static_cast<std::uint8_t>(x >> 56);
}
std::vector<std::byte> make_bytes(std::uint32_t tensor, std::uint32_t gen, std::uint64_t n) {
  std::vector<std::byte> v(n);
  for (std::uint64_t i = 0; i < n; ++i) v[i] = std::byte{pattern(tensor, gen, i)};
  return v;
}
bool matches(const void* p, std::uint32_t tensor, std::uint32_t gen, std::uint64_t n) {
  const auto* b = static_cast<const std::uint8_t*>(p);
  for (std::uint64_t i = 0; i < n; ++i) {
    if (b[i] != pattern(tensor, gen, i)) return false;
  }
  return true;
}

// A SimDevice, an IoEngine and a SwapSpace in a fresh temp directory.
class StoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("tiermem-store-" + std::to_string(getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    IoEngineOptions io;
    io.o_direct = false;  // temp dirs may be tmpfs; the pipeline logic is the same
    io.block_size_bytes = 256 << 10;
    engine_ = make_io_engine(io);
    SwapSpaceOptions so;
    so.initial_bytes_per_path = 4 << 20;
    swap_ = std::make_shared<SwapSpace>(so, std::vector<std::string>{dir_.string()}, *engine_);
  }
  void TearDown() override {
    store_.reset();
    swap_.reset();
    engine_.reset();
    fs::remove_all(dir_);
  }
  TensorStore& make(std::uint64_t device_budget, std::uint64_t host_budget,
                    std::uint64_t chunk = 64 << 10, double timeout_s = 10,
                    std::unique_ptr<ResidencyPolicy> policy = nullptr) {
    TensorStoreOptions o;
    o.device_budget_bytes = device_budget;
    o.host_budget_bytes = host_budget;
    o.pipeline_chunk_bytes = chunk;
    o.pipeline_chunks = 3;
    o.acquire_timeout = std::chrono::duration<double>(timeout_s);
    o.demote_to_host = demote_;
    device_ = std::make_shared<SimDevice>(
        SimDeviceOptions{.budget_bytes = device_budget, .h2d_gbps = sim_gbps_, .d2h_gbps = sim_gbps_});
    store_ = std::make_unique<TensorStore>(o, device_, swap_, std::move(policy));
    return *store_;
  }

  bool demote_ = true;    // TensorStoreOptions::demote_to_host
  double sim_gbps_ = 0;  // the SimDevice's copy throttle (0: unthrottled, Device::storage_direct)
  fs::path dir_;
  std::unique_ptr<IoEngine> engine_;
  std::shared_ptr<SwapSpace> swap_;
  std::shared_ptr<SimDevice> device_;
  std::unique_ptr<TensorStore> store_;

  void check_nvme_device_round_trip();  // NvmeHomeThroughPipelineBothWays, on one device
};

TEST_F(StoreTest, RegisterValidatesAndFinds) {
  TensorStore& s = make(1 << 20, 1 << 20);
  TensorId a = s.register_tensor({.name = "a", .dtype = DType::kF32, .shape = {3, 5}, .home = Tier::kHost});
  EXPECT_EQ(s.info(a).bytes, 60u);
  EXPECT_EQ(s.find("a"), a);
  EXPECT_EQ(s.find("nope"), kInvalidTensor);
  EXPECT_THROW(s.register_tensor({.name = "a", .bytes = 4}), Error);
  EXPECT_THROW(s.register_tensor({.name = "b", .dtype = DType::kF32, .shape = {2}, .bytes = 7}), Error);
  std::vector<std::byte> zeros(60);
  std::vector<std::byte> out(60, std::byte{1});
  s.read(a, out);
  EXPECT_EQ(out, zeros);  // zero-initialised
  EXPECT_THROW(s.acquire(a, Tier::kNvme), Error);  // below home
}

TEST_F(StoreTest, DeviceCopyWrittenBackToHostHomeOnEvict) {
  TensorStore& s = make(1 << 20, 1 << 20);
  auto init = make_bytes(1, 0, 10000);
  TensorId t = s.register_tensor({.name = "t", .bytes = 10000, .home = Tier::kHost, .initial = init});
  {
    TensorStore::Pin p = s.acquire(t, Tier::kDevice);
    ASSERT_TRUE(matches(p.data(), 1, 0, 10000));
    auto next = make_bytes(1, 1, 10000);
    std::memcpy(p.data(), next.data(), 10000);  // SimDevice memory is host-addressable
    p.mark_dirty();
  }
  EXPECT_TRUE(s.evict(t, Tier::kDevice));
  std::vector<std::byte> out(10000);
  s.read(t, out);
  EXPECT_EQ(out, make_bytes(1, 1, 10000));
  TensorStoreStats st = s.stats();
  EXPECT_EQ(st.moves[1][0], 1u);
  EXPECT_EQ(st.moves[0][1], 1u);
  EXPECT_EQ(st.writebacks[0], 1u);
  EXPECT_EQ(st.resident_bytes[0], 0u);
  EXPECT_EQ(st.bounce_chunks_committed, 0u) << "nothing moved to or from NVMe: no bounce chunk committed";
}

// Both ways between NVMe and the device: through the bounce chunks when the device's memory is
// reached only by its copies (a throttled SimDevice, as a GPU), straight when it is the CPU's own
// (Device::storage_direct: no device copy made).
TEST_F(StoreTest, NvmeHomeThroughPipelineBothWays) {
  for (double gbps : {1000.0, 0.0}) {
    SCOPED_TRACE(gbps);
    store_.reset();
    sim_gbps_ = gbps;
    check_nvme_device_round_trip();
    const DeviceStats ds = device_->stats();
    EXPECT_EQ(device_->storage_direct(), gbps == 0);
    const std::uint64_t committed = store_->stats().bounce_chunks_committed;
    EXPECT_LE(committed, 3u) << "at most pipeline_chunks";
    if (gbps == 0) {
      EXPECT_EQ(ds.h2d_copies + ds.d2h_copies, 0u);
    } else {
      EXPECT_GE(ds.h2d_copies, 16u);  // one per 64 KiB chunk each way
      EXPECT_GE(ds.d2h_copies, 16u);
      EXPECT_GE(committed, 1u) << "the copies went through bounce chunks, committed at their first use";
    }
  }
}

// A read-in-place tensor (a frozen weight) with a current host copy is pinned there by an acquire
// at the device tier when the device's memory is the CPU's: no device copy, host and device never
// both hold it. Through a device reached by copies (throttled) it is copied as any other tensor.
TEST_F(StoreTest, AReadInPlaceTensorIsPinnedWhereItsHostCopyIsWhenTheDeviceIsTheCpusMemory) {
  for (double gbps : {0.0, 1000.0}) {
    SCOPED_TRACE(gbps);
    store_.reset();
    sim_gbps_ = gbps;
    TensorStore& s = make(1 << 20, 1 << 20);
    const auto init = make_bytes(7, 0, 100000);
    const TensorId w = s.register_tensor(
        {.name = "w", .bytes = 100000, .home = Tier::kNvme, .initial = init, .read_in_place = true});
    const TensorId t = s.register_tensor({.name = "t", .bytes = 100000, .home = Tier::kNvme, .initial = init});
    s.fetch(w, Tier::kHost).get();
    s.fetch(t, Tier::kHost).get();
    const std::uint64_t h2d_before = device_->stats().h2d_copies;
    {
      TensorStore::Pin pw = s.acquire(w, Tier::kDevice);
      TensorStore::Pin pt = s.acquire(t, Tier::kDevice);
      ASSERT_TRUE(matches(pw.data(), 7, 0, 100000));
      ASSERT_TRUE(matches(pt.data(), 7, 0, 100000));
      EXPECT_EQ(pt.tier(), Tier::kDevice) << "not read in place: copied to the device";
      EXPECT_EQ(pw.tier(), gbps == 0 ? Tier::kHost : Tier::kDevice);
      if (gbps == 0) {
        EXPECT_FALSE(s.evict(w, Tier::kHost)) << "the pinned host copy stays while it is read";
      }
    }
    const TensorStoreStats st = s.stats();
    if (gbps == 0) {
      EXPECT_LT(st.resident_bytes[0], 150000u) << "device: t's copy only";
    } else {
      EXPECT_GE(st.resident_bytes[0], 200000u) << "device: t's copy and w's";
    }
    EXPECT_EQ(st.moves[1][0], gbps == 0 ? 1u : 2u) << "host -> device moves";
    if (gbps != 0) {
      EXPECT_GT(device_->stats().h2d_copies, h2d_before);
    }
    // Not in host memory: loaded from NVMe to where it is asked for, as before.
    ASSERT_TRUE(s.evict(w, Tier::kHost));
    TensorStore::Pin pw = s.acquire(w, Tier::kDevice);
    EXPECT_EQ(pw.tier(), Tier::kDevice);
    EXPECT_TRUE(matches(pw.data(), 7, 0, 100000));
  }
}

// A read-in-place tensor's host copy pushed out of host memory for room moves to the device
// when the device has free room (host and device cache it as one), instead of being dropped and
// read from NVMe again. It never evicts a device copy to get there; an explicit evict() drops it;
// other tensors are dropped as before.
TEST_F(StoreTest, AReadInPlaceHostCopyPushedOutMovesToFreeDeviceRoom) {
  const std::uint64_t n = 400000;  // the host budget holds two, the device one
  TensorStore& s = make(600000, 1 << 20);
  ASSERT_TRUE(device_->storage_direct());
  auto reg = [&](const char* name, int seed, bool in_place) {
    return s.register_tensor({.name = name, .bytes = n, .home = Tier::kNvme, .initial = make_bytes(seed, 0, n),
                              .read_in_place = in_place});
  };
  const TensorId a = reg("a", 1, true), b = reg("b", 2, true), c = reg("c", 3, true), t = reg("t", 4, false);
  s.fetch(a, Tier::kHost).get();
  s.fetch(b, Tier::kHost).get();
  s.fetch(c, Tier::kHost).get();  // pushes a (least recently used) out of host memory
  TensorStoreStats st = s.stats();
  EXPECT_EQ(st.promotions, 1u);
  EXPECT_EQ(st.moves[1][0], 1u) << "a went host -> device";
  EXPECT_EQ(st.moves[2][1], 3u) << "three NVMe reads";
  {
    TensorStore::Pin pa = s.acquire(a, Tier::kDevice);
    EXPECT_EQ(pa.tier(), Tier::kDevice);
    EXPECT_TRUE(matches(pa.data(), 1, 0, n));
  }
  EXPECT_EQ(s.stats().moves[2][0], 0u) << "a was not read from NVMe again";
  // The device is full (a): b, pushed out next, is dropped; a stays.
  s.fetch(t, Tier::kHost).get();
  st = s.stats();
  EXPECT_EQ(st.promotions, 1u);
  EXPECT_EQ(st.evictions[0], 0u) << "nothing was evicted from the device for b";
  EXPECT_GE(st.resident_bytes[0], n);
  // An explicit evict drops; a tensor not read in place is dropped even with device room free.
  ASSERT_TRUE(s.evict(a, Tier::kDevice));
  ASSERT_TRUE(s.evict(c, Tier::kHost));
  EXPECT_EQ(s.stats().promotions, 1u);
  s.fetch(a, Tier::kHost).get();
  s.fetch(b, Tier::kHost).get();  // pushes t out
  st = s.stats();
  EXPECT_EQ(st.promotions, 1u);
  EXPECT_EQ(st.resident_bytes[0], 0u);
  TensorStore::Pin pt = s.acquire(t, Tier::kDevice);
  EXPECT_TRUE(matches(pt.data(), 4, 0, n));
}

// A host read-ahead of a read-in-place tensor whose device copy is current does nothing: its
// reader gathers the device copy, and a host copy beside it would read NVMe a second time (the
// look-ahead hints the same weight to the device and, further on, to the host). A tensor not
// read in place is read into host memory as before.
TEST_F(StoreTest, AHostReadAheadOfAReadInPlaceTensorOnTheDeviceReadsNothing) {
  const std::uint64_t n = 4096;
  TensorStore& s = make(1 << 20, 1 << 20);
  ASSERT_TRUE(device_->storage_direct());
  auto reg = [&](const char* name, int seed, bool in_place) {
    return s.register_tensor({.name = name, .bytes = n, .home = Tier::kNvme, .initial = make_bytes(seed, 0, n),
                              .read_in_place = in_place});
  };
  const TensorId a = reg("a", 1, true), t = reg("t", 2, false);
  { TensorStore::Pin pa = s.acquire(a, Tier::kDevice); }
  { TensorStore::Pin pt = s.acquire(t, Tier::kDevice); }
  ASSERT_EQ(s.stats().moves[2][0], 2u);
  const TensorId ids[] = {a, t};
  s.prefetch(ids, Tier::kHost);
  s.drain();
  const TensorStoreStats st = s.stats();
  EXPECT_EQ(st.moves[2][1], 1u) << "t read into host memory; a not";
  EXPECT_EQ(st.prefetches_dropped, 0u);
  TensorStore::Pin pa = s.acquire(a, Tier::kDevice);
  EXPECT_EQ(pa.tier(), Tier::kDevice);
  EXPECT_TRUE(matches(pa.data(), 1, 0, n));
  EXPECT_EQ(s.stats().moves[2][0], 2u) << "a read from NVMe once";
}

// Two calls wait for device room for the same tensor x, which fills the device once loaded: an
// acquire (x is nobody's victim while it waits) and a fetch. Whichever gets the room loads x; the
// other must then find x there, not wait for room that only evicting x could give (it timed out:
// the 1.1 B LoRA in a memory cgroup, acquiring lm_head while a prefetch loaded it, 4 runs of 5).
TEST_F(StoreTest, TwoCallsWaitingForRoomForOneTensorBothGetIt) {
  const std::uint64_t n = 600000;
  TensorStore& s = make(700000, 1 << 21, 64 << 10, /*timeout_s=*/3);
  auto reg = [&](const char* name, int seed) {
    return s.register_tensor({.name = name, .bytes = n, .home = Tier::kNvme, .initial = make_bytes(seed, 0, n)});
  };
  const TensorId x = reg("x", 1), y = reg("y", 2);
  TensorStore::Pin py = s.acquire(y, Tier::kDevice);  // the device is full until it is released
  std::future<void> f = s.fetch(x, Tier::kDevice);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the fetch waits for room
  std::exception_ptr err;
  bool matched = false;
  std::thread b([&] {
    try {
      TensorStore::Pin px = s.acquire(x, Tier::kDevice);
      matched = matches(px.data(), 1, 0, n);
    } catch (...) {
      err = std::current_exception();
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // so does the acquire
  py.release();
  EXPECT_NO_THROW(f.get());
  b.join();
  EXPECT_FALSE(err) << "the acquire timed out";
  EXPECT_TRUE(matched);
  EXPECT_EQ(s.stats().moves[2][0], 2u) << "x read once, y once";
}

// A device load that evicts demotes its victim to the host, whose own eviction must not move a
// host copy up into the room that load is freeing: each would push the other out again, forever.
TEST_F(StoreTest, AHostCopyIsNotMovedIntoDeviceRoomALoadIsFreeing) {
  const std::uint64_t n = 400000;
  TensorStore& s = make(1 << 20, 1 << 20);  // each holds two of n, or n and nothing beside y
  auto reg = [&](const char* name, int seed, std::uint64_t bytes) {
    return s.register_tensor({.name = name, .bytes = bytes, .home = Tier::kNvme,
                              .initial = make_bytes(seed, 0, bytes), .read_in_place = true});
  };
  const TensorId x = reg("x", 1, n), a = reg("a", 2, n), b = reg("b", 3, n), y = reg("y", 4, 700000);
  { TensorStore::Pin px = s.acquire(x, Tier::kDevice); }  // NVMe -> device
  s.fetch(a, Tier::kHost).get();
  s.fetch(b, Tier::kHost).get();
  ASSERT_EQ(s.stats().promotions, 0u);
  // y needs x's room: x goes down to the host, which pushes a (or b) out; that one stays out of
  // the device's room y is waiting for.
  TensorStore::Pin py = s.acquire(y, Tier::kDevice);
  EXPECT_TRUE(matches(py.data(), 4, 0, 700000));
  const TensorStoreStats st = s.stats();
  EXPECT_EQ(st.promotions, 0u);
  EXPECT_EQ(st.demotions, 1u);
  EXPECT_LT(st.resident_bytes[0], 700000u + n) << "the device holds y alone";
}

// The look-ahead's host read of a read-in-place weight and the device's ask for the same weight
// (a prefetch hint, the gather) meet while that read is in flight: the one NVMe read serves both,
// the device pin is the host copy. Reads are held at a gate so the meeting is certain.
TEST_F(StoreTest, AReadInPlaceTensorIsReadFromNvmeOnceWhenItsHostLoadIsInFlight) {
  struct Gate : IoInterceptor {
    std::mutex mu;
    std::condition_variable cv;
    bool open = true;
    std::atomic<std::uint64_t> read_bytes{0};
    std::atomic<int> held{0};
    Decision before_io(IoOpKind kind, const std::string&, std::uint64_t, std::uint64_t bytes) override {
      if (kind != IoOpKind::kRead) return {};
      read_bytes += bytes;
      std::unique_lock l(mu);
      ++held;
      cv.wait(l, [&] { return open; });
      return {};
    }
    void set(bool o) {
      {
        std::lock_guard l(mu);
        open = o;
      }
      cv.notify_all();
    }
  };
  auto gate = std::make_shared<Gate>();
  store_.reset();
  swap_.reset();
  IoEngineOptions io;
  io.o_direct = false;
  io.block_size_bytes = 256 << 10;
  io.interceptor = gate;
  engine_ = make_io_engine(io);
  SwapSpaceOptions so;
  so.initial_bytes_per_path = 4 << 20;
  swap_ = std::make_shared<SwapSpace>(so, std::vector<std::string>{dir_.string()}, *engine_);
  TensorStore& s = make(1 << 20, 1 << 20);
  const std::uint64_t n = 100000;
  const TensorId w = s.register_tensor(
      {.name = "w", .bytes = n, .home = Tier::kNvme, .initial = make_bytes(7, 0, n), .read_in_place = true});
  gate->set(false);
  auto host = s.fetch(w, Tier::kHost);
  for (int i = 0; i < 1000 && gate->held == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_GT(gate->held, 0) << "the host load never reached the disk";
  s.prefetch({{w}}, Tier::kDevice);  // the device hint: the host load serves it
  Tier pinned_at = Tier::kNvme;
  bool ok = false;
  std::thread reader([&] {
    TensorStore::Pin p = s.acquire(w, Tier::kDevice);
    pinned_at = p.tier();
    ok = matches(p.data(), 7, 0, n);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  gate->set(true);
  reader.join();
  host.get();
  s.drain();
  EXPECT_TRUE(ok);
  EXPECT_EQ(pinned_at, Tier::kHost) << "the device pin is the host copy, read in place";
  EXPECT_LT(gate->read_bytes.load(), 2 * n) << "w was read from NVMe " << gate->read_bytes << " bytes (" << n << " each)";
  EXPECT_EQ(s.stats().moves[2][0], 0u) << "no NVMe -> device read";
}

void StoreTest::check_nvme_device_round_trip() {
  TensorStore& s = make(4 << 20, 1 << 20, 64 << 10);
  const std::uint64_t n = 1'000'003;  // 15.3 chunks, odd size
  auto init = make_bytes(2, 0, n);
  TensorId t = s.register_tensor({.name = "big", .bytes = n, .home = Tier::kNvme, .initial = init});
  {
    TensorStore::Pin p = s.acquire(t, Tier::kDevice);
    ASSERT_TRUE(matches(p.data(), 2, 0, n));
    auto next = make_bytes(2, 1, n);
    std::memcpy(p.data(), next.data(), n);
    p.mark_dirty();
  }
  s.flush();  // device -> nvme
  EXPECT_TRUE(s.evict(t, Tier::kDevice));  // clean now: dropped
  TensorStoreStats st = s.stats();
  EXPECT_EQ(st.moves[2][0], 1u);
  EXPECT_EQ(st.moves[0][2], 1u);
  EXPECT_EQ(st.writebacks[0], 1u);
  TensorStore::Pin h = s.acquire(t, Tier::kHost);
  EXPECT_TRUE(matches(h.data(), 2, 1, n));
}

// A consumed tensor (a gradient partition after AdamW): discard drops its dirty host copy with no
// write to NVMe, prefetches skip it while its contents are undefined, and an overwrite makes it
// an ordinary tensor again (written down when evicted, loadable).
TEST_F(StoreTest, DiscardDropsDirtyCopiesWithoutWriteBackAndPrefetchSkipsIt) {
  TensorStore& s = make(1 << 20, 1 << 20);
  const std::uint64_t n = 200'000;
  TensorId t = s.register_tensor({.name = "grad", .bytes = n, .home = Tier::kNvme, .initial = make_bytes(3, 0, n)});
  auto fill = [&](std::uint32_t gen) {
    TensorStore::Pin p = s.acquire_for_overwrite(t, Tier::kHost);
    auto b = make_bytes(3, gen, n);
    std::memcpy(p.data(), b.data(), n);
    p.mark_dirty();
  };
  fill(1);
  const TensorStoreStats before = s.stats();
  {
    TensorStore::Pin p = s.acquire(t, Tier::kHost);
    EXPECT_THROW(s.discard(t), Error);  // pinned: nothing happens
  }
  s.discard(t);
  TensorStoreStats st = s.stats();
  EXPECT_EQ(st.discards, 1u);
  EXPECT_EQ(st.discarded_dirty_bytes, n);
  EXPECT_EQ(st.resident_bytes[1], before.resident_bytes[1] - PinnedHostPool::allocation_size(n));
  EXPECT_EQ(st.bytes_moved[1][2], before.bytes_moved[1][2]);  // no write-back
  const TensorId ids[] = {t};
  s.prefetch(ids, Tier::kHost);
  s.drain();
  st = s.stats();
  EXPECT_EQ(st.prefetches_issued, before.prefetches_issued);  // undefined bytes are never loaded
  EXPECT_EQ(st.bytes_moved[2][1], before.bytes_moved[2][1]);
  s.flush();
  EXPECT_EQ(s.stats().bytes_moved[1][2], before.bytes_moved[1][2]);  // nothing dirty to flush
  // Written again: an ordinary tensor (evicted with a write-back, read back intact).
  fill(2);
  EXPECT_TRUE(s.evict(t, Tier::kHost));
  EXPECT_EQ(s.stats().bytes_moved[1][2], before.bytes_moved[1][2] + n);
  std::vector<std::byte> out(n);
  s.read(t, out);
  EXPECT_EQ(out, make_bytes(3, 2, n));
  s.prefetch(ids, Tier::kHost);
  s.drain();
  EXPECT_EQ(s.stats().prefetches_issued, before.prefetches_issued + 1);
}

// stats().phases: NVMe bytes go to the phase current when their transfer was issued (the latest
// acquire's), an acquire's stall to its own phase, an acquire_for_overwrite's (here: room made by
// writing a dirty copy down) to the current phase; busy time only to phases with I/O in flight;
// summed over the phases each figure is the store's total.
TEST_F(StoreTest, PhaseSplitOfNvmeTrafficAndStallsSumsToTheTotals) {
  const std::uint64_t n = 200'000;  // 200704 bytes allocated: two fit the host budget, not three
  TensorStore& s = make(1 << 20, 512 << 10);
  auto nvme_tensor = [&](const char* name, std::uint32_t tag) {
    return s.register_tensor({.name = name, .bytes = n, .home = Tier::kNvme, .initial = make_bytes(tag, 0, n)});
  };
  const TensorId a = nvme_tensor("a", 1), b = nvme_tensor("b", 2), c = nvme_tensor("c", 3);
  const auto ph = [](const TensorStoreStats& st, Phase p) { return st.phases[static_cast<int>(p)]; };

  { TensorStore::Pin p = s.acquire(a, Tier::kHost, Phase::kForward); }  // read in forward
  TensorStoreStats st = s.stats();
  EXPECT_EQ(ph(st, Phase::kForward).nvme_read_bytes, n);
  EXPECT_GT(ph(st, Phase::kForward).stall_ns, 0u);
  EXPECT_GT(ph(st, Phase::kForward).io_busy_ns, 0u);
  {
    TensorStore::Pin p = s.acquire(b, Tier::kHost, Phase::kBackward);  // read in backward
    std::memcpy(p.data(), make_bytes(2, 1, n).data(), n);
    p.mark_dirty();
  }
  EXPECT_TRUE(s.evict(b, Tier::kHost));  // written in backward: the latest acquire's phase
  EXPECT_TRUE(s.evict(a, Tier::kHost));  // clean: no I/O
  st = s.stats();
  EXPECT_EQ(ph(st, Phase::kBackward).nvme_read_bytes, n);
  EXPECT_EQ(ph(st, Phase::kBackward).nvme_written_bytes, n);
  EXPECT_EQ(ph(st, Phase::kForward).nvme_written_bytes, 0u);

  // Optimizer: a and b read again, b dirtied and left cached; with a pinned, the overwrite of c
  // must write b down to make room: its stall and b's write go to the optimizer phase.
  {
    TensorStore::Pin p = s.acquire(b, Tier::kHost, Phase::kOptimizer);
    std::memcpy(p.data(), make_bytes(2, 2, n).data(), n);
    p.mark_dirty();
  }
  TensorStore::Pin pa = s.acquire(a, Tier::kHost, Phase::kOptimizer);
  const std::uint64_t opt_stall = ph(s.stats(), Phase::kOptimizer).stall_ns;
  {
    TensorStore::Pin pc = s.acquire_for_overwrite(c, Tier::kHost);
    std::memset(pc.data(), 7, n);
    pc.mark_dirty();
  }
  pa.release();
  st = s.stats();
  EXPECT_EQ(ph(st, Phase::kOptimizer).nvme_read_bytes, 2 * n);
  EXPECT_EQ(ph(st, Phase::kOptimizer).nvme_written_bytes, n);
  EXPECT_GT(ph(st, Phase::kOptimizer).stall_ns, opt_stall);  // the overwrite waited for b's write
  std::vector<std::byte> out(n);
  s.read(b, out);
  EXPECT_EQ(out, make_bytes(2, 2, n));

  s.flush();  // c's write: the optimizer's too (still the current phase)
  st = s.stats();
  EXPECT_EQ(ph(st, Phase::kOptimizer).nvme_written_bytes, 2 * n);
  const int d = 0, h = 1, v = 2;
  std::uint64_t read = 0, written = 0, stall = 0;
  for (const PhaseIoStats& p : st.phases) {
    read += p.nvme_read_bytes;
    written += p.nvme_written_bytes;
    stall += p.stall_ns;
    EXPECT_LE(p.hidden_io_ns(), p.io_busy_ns);
  }
  EXPECT_EQ(read, st.bytes_moved[v][h] + st.bytes_moved[v][d]);
  EXPECT_EQ(written, st.bytes_moved[h][v] + st.bytes_moved[d][v]);
  EXPECT_EQ(stall, st.stall_ns);
  EXPECT_GT(s.stall_ns(), 0u);
  EXPECT_EQ(s.stall_ns(), st.stall_ns);  // the cheap accessor reads the same counter
  for (Phase quiet : {Phase::kOther, Phase::kOutsideStep}) {
    EXPECT_EQ(ph(st, quiet).nvme_read_bytes + ph(st, quiet).nvme_written_bytes, 0u);
    EXPECT_EQ(ph(st, quiet).stall_ns, 0u);
    EXPECT_EQ(ph(st, quiet).io_busy_ns, 0u);
  }
  EXPECT_GT(ph(st, Phase::kBackward).io_busy_ns, 0u);
  EXPECT_GT(ph(st, Phase::kOptimizer).io_busy_ns, 0u);
}

// A helper thread's waits (a TensorStore::HelperThread scope on it) count in helper_stall_ns as
// well as stall_ns; the driving thread's count in stall_ns only; the scope ends with the thread's.
TEST_F(StoreTest, AHelperThreadsStallsAreCountedApart) {
  const std::uint64_t n = 200'000;
  TensorStore& s = make(1 << 20, 512 << 10);
  auto nvme_tensor = [&](const char* name, std::uint32_t tag) {
    return s.register_tensor({.name = name, .bytes = n, .home = Tier::kNvme, .initial = make_bytes(tag, 0, n)});
  };
  const TensorId a = nvme_tensor("a", 1), b = nvme_tensor("b", 2);
  { TensorStore::Pin p = s.acquire(a, Tier::kHost, Phase::kForward); }  // the driving thread's miss
  const std::uint64_t driver_stall = s.stall_ns();
  EXPECT_GT(driver_stall, 0u);
  EXPECT_EQ(s.helper_stall_ns(), 0u);
  std::thread([&] {
    const TensorStore::HelperThread helper;
    TensorStore::Pin p = s.acquire(b, Tier::kHost, Phase::kOptimizer);  // a miss on a helper thread
  }).join();
  const std::uint64_t helper_stall = s.helper_stall_ns();
  EXPECT_GT(helper_stall, 0u);
  EXPECT_EQ(s.stall_ns(), driver_stall + helper_stall);  // both in the total
  EXPECT_EQ(s.stats().helper_stall_ns, helper_stall);
  // By phase: the helper's load counts to its access's phase (optimizer), though the driving
  // thread's latest phase is forward, and its stall as a helper's there, hidden from the driver.
  {
    const TensorStoreStats st = s.stats();
    const PhaseIoStats& fwd = st.phases[static_cast<int>(Phase::kForward)];
    const PhaseIoStats& opt = st.phases[static_cast<int>(Phase::kOptimizer)];
    EXPECT_EQ(fwd.nvme_read_bytes, n);
    EXPECT_EQ(opt.nvme_read_bytes, n);
    EXPECT_EQ(fwd.helper_stall_ns, 0u);
    EXPECT_EQ(opt.helper_stall_ns, helper_stall);
    EXPECT_EQ(opt.stall_ns, helper_stall);
    EXPECT_GT(opt.io_busy_ns, 0u);
    EXPECT_EQ(opt.hidden_io_ns(), opt.io_busy_ns);  // nothing of it held up the driving thread
  }
  EXPECT_TRUE(s.evict(a, Tier::kHost));
  {
    const TensorStore::HelperThread helper;  // a scope on this thread, ended before the miss below
  }
  { TensorStore::Pin p = s.acquire(a, Tier::kHost, Phase::kForward); }
  EXPECT_GT(s.stall_ns(), driver_stall + helper_stall);
  EXPECT_EQ(s.helper_stall_ns(), helper_stall);
}

// In a trace, a miss's wait span names its phase and each phase change is a "store phase" sample.
TEST_F(StoreTest, TraceMissSpansCarryThePhase) {
  TensorStore& s = make(1 << 20, 512 << 10);
  const TensorId a = s.register_tensor({.name = "a", .bytes = 10000, .home = Tier::kNvme});
  const std::string path = (dir_ / "trace.json").string();
  Trace::global().start(path, "test");
  { TensorStore::Pin p = s.acquire(a, Tier::kHost, Phase::kBackward); }
  ASSERT_TRUE(Trace::global().stop());
  std::ifstream in(path);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find(R"("phase":"backward")"), std::string::npos) << text;
  EXPECT_NE(text.find(R"("name":"store phase")"), std::string::npos) << text;
}

TEST_F(StoreTest, BudgetEvictsLruAndPeakStaysUnderBudget) {
  TensorStore& s = make(256 << 10, 1 << 20);
  std::vector<TensorId> ids;
  for (std::uint32_t i = 0; i < 6; ++i) {
    auto init = make_bytes(i, 0, 100000);
    ids.push_back(s.register_tensor({.name = "t" + std::to_string(i), .bytes = 100000, .home = Tier::kHost, .initial = init}));
  }
  for (int round = 0; round < 3; ++round) {
    for (std::uint32_t i = 0; i < 6; ++i) {
      TensorStore::Pin p = s.acquire(ids[i], Tier::kDevice);
      ASSERT_TRUE(matches(p.data(), i, 0, 100000));
    }
  }
  TensorStoreStats st = s.stats();
  EXPECT_LE(st.peak_resident_bytes[0], 256u << 10);
  EXPECT_GT(st.evictions[0], 0u);
  EXPECT_EQ(st.writebacks[0], 0u);  // clean copies are dropped without write-back
}

TEST_F(StoreTest, EverythingPinnedWaitsThenOutOfMemoryWithNumbers) {
  TensorStore& s = make(256 << 10, 1 << 20, 64 << 10, /*timeout_s=*/0.2);
  TensorId a = s.register_tensor({.name = "a", .bytes = 200000, .home = Tier::kHost});
  TensorId b = s.register_tensor({.name = "b", .bytes = 200000, .home = Tier::kHost});
  TensorStore::Pin pa = s.acquire(a, Tier::kDevice);
  auto t0 = std::chrono::steady_clock::now();
  try {
    s.acquire(b, Tier::kDevice);
    FAIL() << "expected OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    EXPECT_EQ(e.tier(), Tier::kDevice);
    EXPECT_EQ(e.requested(), 200704u);  // rounded to 4 KiB
    EXPECT_EQ(e.available(), (256u << 10) - 200704u);
    std::string msg = e.what();
    EXPECT_NE(msg.find("pinned"), std::string::npos) << msg;
    EXPECT_NE(msg.find("196.0 KiB"), std::string::npos) << msg;  // the pinned bytes
  }
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(150));  // it waited
  EXPECT_EQ(s.stats().oom_errors, 1u);
  // A release lets a waiting acquire through.
  std::thread releaser([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    pa.release();
  });
  TensorStore::Pin pb = s.acquire(b, Tier::kDevice);
  releaser.join();
  EXPECT_TRUE(pb.valid());
}

TEST_F(StoreTest, FetchAndPrefetchAreAsynchronousAndBestEffort) {
  TensorStore& s = make(512 << 10, 1 << 20);
  std::vector<TensorId> ids;
  for (std::uint32_t i = 0; i < 4; ++i) {
    auto init = make_bytes(i, 0, 100000);
    ids.push_back(s.register_tensor({.name = "p" + std::to_string(i), .bytes = 100000, .home = Tier::kNvme, .initial = init}));
  }
  s.fetch(ids[0], Tier::kDevice).get();
  s.prefetch(std::span<const TensorId>(ids).subspan(1), Tier::kDevice);
  s.drain();
  std::uint64_t misses_before = s.stats().misses;
  for (std::uint32_t i = 0; i < 4; ++i) {
    TensorStore::Pin p = s.acquire(ids[i], Tier::kDevice);
    EXPECT_TRUE(matches(p.data(), i, 0, 100000));
  }
  EXPECT_EQ(s.stats().misses, misses_before);  // all four were already there
  EXPECT_EQ(s.stats().prefetches_issued, 3u);
  // Prefetch that cannot fit without waiting (everything pinned) is dropped, not waited for.
  std::vector<TensorStore::Pin> pins;
  for (std::uint32_t i = 0; i < 4; ++i) pins.push_back(s.acquire(ids[i], Tier::kDevice));
  TensorId extra = s.register_tensor({.name = "extra", .bytes = 200000, .home = Tier::kNvme});
  s.prefetch(std::span<const TensorId>(&extra, 1), Tier::kDevice);
  s.drain();
  EXPECT_EQ(s.stats().prefetches_dropped, 1u);
  // A fetch that can never fit reports OutOfMemoryError through its future.
  TensorId huge = s.register_tensor({.name = "huge", .bytes = 600 << 10, .home = Tier::kNvme});
  EXPECT_THROW(s.fetch(huge, Tier::kDevice).get(), OutOfMemoryError);
}

// A policy that records what TensorStore tells it and asks for a prefetch of id+1.
class RecordingPolicy : public ResidencyPolicy {
 public:
  std::vector<PrefetchHint> on_access(TensorId id, std::uint64_t, Tier tier, Phase,
                                      const ResidencyView& v) override {
    ++accesses;
    budget_seen = v.budget_bytes[0];
    return {{id + 1, tier}};
  }
  bool keep_on_release(TensorId, Tier, const ResidencyView&) override {
    ++releases;
    return false;  // drop right away
  }
  TensorId choose_victim(Tier, std::span<const TensorId> c) override { return c.back(); }
  void begin_step() override { ++steps; }
  int accesses = 0, releases = 0, steps = 0;
  std::uint64_t budget_seen = 0;
};

TEST_F(StoreTest, PolicyIsConsultedAndItsHintsIssued) {
  auto policy = std::make_unique<RecordingPolicy>();
  RecordingPolicy* rp = policy.get();
  TensorStore& s = make(1 << 20, 1 << 20, 64 << 10, 10, std::move(policy));
  TensorId a = s.register_tensor({.name = "a", .bytes = 5000, .home = Tier::kHost});
  TensorId b = s.register_tensor({.name = "b", .bytes = 5000, .home = Tier::kHost});
  s.begin_step();
  { TensorStore::Pin p = s.acquire(a, Tier::kDevice); }
  s.drain();
  TensorStoreStats st = s.stats();
  EXPECT_EQ(st.prefetches_issued, 1u);  // hint for b (id 1); the hint for id 2 is ignored
  EXPECT_EQ(rp->accesses, 1);
  EXPECT_EQ(rp->releases, 1);
  EXPECT_EQ(rp->steps, 1);
  EXPECT_EQ(rp->budget_seen, 1u << 20);
  EXPECT_GE(st.evictions[0], 1u);  // a dropped at release (keep_on_release false)
  EXPECT_EQ(st.moves[1][0], 2u);   // a, and b by the hint
  TensorStore::Pin pb = s.acquire(b, Tier::kDevice);
  EXPECT_EQ(s.stats().hits, 1u);
}

// Thousands of round trips through all three tiers with odd sizes and a tight device budget.
TEST_F(StoreTest, IntegrityAfterThousandsOfRoundTrips) {
  TensorStore& s = make(160 << 10, 256 << 10, 16 << 10);
  const std::uint64_t sizes[] = {1, 4095, 4097, 16384, 16385, 33333, 65537};
  std::vector<TensorId> ids;
  std::vector<std::uint32_t> gen;
  for (std::uint32_t i = 0; i < 7; ++i) {
    auto init = make_bytes(i, 0, sizes[i]);
    ids.push_back(s.register_tensor({.name = "r" + std::to_string(i), .bytes = sizes[i],
                                     .home = i % 2 ? Tier::kNvme : Tier::kHost, .initial = init}));
    gen.push_back(0);
  }
  std::mt19937 rng(11);
  for (int it = 0; it < 2000; ++it) {
    std::uint32_t i = rng() % 7;
    Tier t = (rng() % 3 == 0 && s.info(ids[i]).home == Tier::kNvme) ? Tier::kHost : Tier::kDevice;
    TensorStore::Pin p = s.acquire(ids[i], t);
    ASSERT_TRUE(matches(p.data(), i, gen[i], sizes[i])) << "iteration " << it << " tensor " << i;
    if (rng() % 2) {
      auto next = make_bytes(i, ++gen[i], sizes[i]);
      std::memcpy(p.data(), next.data(), sizes[i]);
      p.mark_dirty();
    }
    if (rng() % 5 == 0) {
      p.release();
      s.evict(ids[i], Tier::kDevice);
      s.evict(ids[i], Tier::kHost);
    }
  }
  s.flush();
  for (std::uint32_t i = 0; i < 7; ++i) {
    s.evict(ids[i], Tier::kDevice);
    s.evict(ids[i], Tier::kHost);
    std::vector<std::byte> out(sizes[i]);
    s.read(ids[i], out);
    EXPECT_TRUE(matches(out.data(), i, gen[i], sizes[i])) << "tensor " << i;
  }
  TensorStoreStats st = s.stats();
  EXPECT_LE(st.peak_resident_bytes[0], 160u << 10);
  EXPECT_LE(st.peak_resident_bytes[1], 256u << 10);
  EXPECT_GT(st.moves[2][0] + st.moves[2][1], 100u);
  EXPECT_GT(st.writebacks[0], 100u);
}

// Several threads, random operations, one reference model. Each thread owns a disjoint set of
// tensors for writes (so the expected contents are known) and reads every tensor's home via
// read() only when it owns it; all threads compete for the same budgets.
TEST_F(StoreTest, ConcurrentRandomOperationsMatchReferenceModel) {
  TensorStore& s = make(192 << 10, 384 << 10, 16 << 10, /*timeout_s=*/20);
  constexpr int kThreads = 4, kPerThread = 5, kOps = 400;
  std::vector<TensorId> ids;
  std::vector<std::uint64_t> sizes;
  for (int i = 0; i < kThreads * kPerThread; ++i) {
    std::uint64_t n = 3000 + static_cast<std::uint64_t>(i) * 2011;
    auto init = make_bytes(static_cast<std::uint32_t>(i), 0, n);
    ids.push_back(s.register_tensor({.name = "c" + std::to_string(i), .bytes = n,
                                     .home = i % 3 == 0 ? Tier::kHost : Tier::kNvme, .initial = init}));
    sizes.push_back(n);
  }
  std::atomic<int> failures{0};
  std::atomic<int> ooms{0};
  std::vector<std::thread> threads;
  for (int th = 0; th < kThreads; ++th) {
    threads.emplace_back([&, th] {
      std::mt19937 rng(100 + th);
      std::vector<std::uint32_t> gen(kPerThread, 0);
      for (int op = 0; op < kOps; ++op) {
        int k = static_cast<int>(rng() % kPerThread);
        std::uint32_t i = static_cast<std::uint32_t>(th * kPerThread + k);
        try {
          switch (rng() % 6) {
            case 0:
            case 1: {  // acquire on the device, check, maybe write
              TensorStore::Pin p = s.acquire(ids[i], Tier::kDevice);
              if (!matches(p.data(), i, gen[k], sizes[i])) ++failures;
              if (rng() % 2) {
                auto next = make_bytes(i, ++gen[k], sizes[i]);
                std::memcpy(p.data(), next.data(), sizes[i]);
                p.mark_dirty();
              }
              break;
            }
            case 2: {  // acquire on the host
              TensorStore::Pin p = s.acquire(ids[i], Tier::kHost);
              if (!matches(p.data(), i, gen[k], sizes[i])) ++failures;
              break;
            }
            case 3:
              s.fetch(ids[i], Tier::kDevice).get();
              break;
            case 4: {
              std::uint32_t other = static_cast<std::uint32_t>(rng() % ids.size());
              s.prefetch(std::span<const TensorId>(&ids[other], 1), Tier::kDevice);
              s.evict(ids[i], rng() % 2 ? Tier::kDevice : Tier::kHost);
              break;
            }
            case 5: {
              std::vector<std::byte> out(sizes[i]);
              s.read(ids[i], out);
              if (!matches(out.data(), i, gen[k], sizes[i])) ++failures;
              break;
            }
          }
        } catch (const OutOfMemoryError&) {
          ++ooms;  // allowed only if a budget really was exhausted by pins; counted below
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  s.drain();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(ooms.load(), 0);  // each thread pins at most one tensor at a time: always fits
  TensorStoreStats st = s.stats();
  EXPECT_LE(st.peak_resident_bytes[0], 192u << 10);
  EXPECT_LE(st.peak_resident_bytes[1], 384u << 10);
  EXPECT_LE(device_->stats().peak_reserved_bytes, 192u << 10);
}

// A policy that keeps everything on release, picks the lowest id as victim and refuses, for a
// prefetch, to evict the ids in `refuse` (recording every question).
class GatePolicy : public ResidencyPolicy {
 public:
  std::vector<PrefetchHint> on_access(TensorId, std::uint64_t, Tier, Phase,
                                      const ResidencyView&) override {
    return {};
  }
  bool keep_on_release(TensorId, Tier, const ResidencyView&) override { return true; }
  TensorId choose_victim(Tier, std::span<const TensorId> c) override {
    return *std::min_element(c.begin(), c.end());
  }
  bool evict_for_prefetch(Tier tier, TensorId incoming, TensorId victim) override {
    asked.push_back({incoming, victim});
    EXPECT_EQ(tier, Tier::kDevice);
    return std::find(refuse.begin(), refuse.end(), victim) == refuse.end();
  }
  std::vector<TensorId> refuse;
  std::vector<std::pair<TensorId, TensorId>> asked;  // (incoming, victim)
};

// A prefetch that needs room asks evict_for_prefetch once per planned victim and evicts none
// unless every one is accepted; demand loads never ask.
// NVMe-homed tensors through a device that holds three of them and a host that holds four: what the
// device evicts for room goes down to the host (demote_to_host), so using it again reads host
// memory, not NVMe; with the option off it is read again. A host copy whose device copy is
// resident goes first when the host needs room.
TEST_F(StoreTest, DeviceEvictionsGoDownToTheHostInsteadOfBeingReadAgain) {
  for (bool demote : {true, false}) {
    SCOPED_TRACE(demote);
    store_.reset();
    demote_ = demote;
    TensorStore& s = make(3 * 81920, 4 * 81920);
    std::vector<TensorId> ids;
    for (std::uint32_t i = 0; i < 6; ++i) {
      auto init = make_bytes(i, 0, 80000);
      ids.push_back(s.register_tensor({.name = "t" + std::to_string(i), .bytes = 80000, .home = Tier::kNvme, .initial = init}));
    }
    for (std::uint32_t i = 0; i < 6; ++i) {  // t0..t2 leave the device for t3..t5
      TensorStore::Pin p = s.acquire(ids[i], Tier::kDevice);
      ASSERT_TRUE(matches(p.data(), i, 0, 80000));
    }
    TensorStoreStats st = s.stats();
    EXPECT_EQ(st.moves[2][0], 6u);  // each read from NVMe once
    EXPECT_EQ(st.demotions, demote ? 3u : 0u);
    EXPECT_EQ(st.moves[0][1], demote ? 3u : 0u);
    EXPECT_EQ(st.writebacks[0], 0u);  // clean: copied down, never written to NVMe
    EXPECT_LE(st.peak_resident_bytes[1], 4u * 81920u);
    {
      TensorStore::Pin p = s.acquire(ids[0], Tier::kDevice);  // evicts t3 for room
      EXPECT_TRUE(matches(p.data(), 0, 0, 80000));
    }
    st = s.stats();
    EXPECT_EQ(st.moves[2][0], demote ? 6u : 7u);  // from host memory, or NVMe again
    EXPECT_EQ(st.moves[1][0], demote ? 1u : 0u);
    if (!demote) continue;
    // The host holds t0 (also on the device now), t1, t2 and t3 (just demoted): t4's demotion
    // needs room, and the duplicate t0 goes, not t1 or t2.
    { TensorStore::Pin p = s.acquire(ids[1], Tier::kDevice); }  // evicts t4 from the device
    st = s.stats();
    EXPECT_EQ(st.moves[2][0], 6u);
    EXPECT_EQ(st.demotions, 5u);
    for (std::uint32_t i : {2u, 3u, 4u}) {
      TensorStore::Pin p = s.acquire(ids[i], Tier::kHost);
      EXPECT_TRUE(matches(p.data(), i, 0, 80000));
    }
    EXPECT_EQ(s.stats().moves[2][1], 0u);  // t2, t3, t4 were in host memory
  }
}

// Keeps everything on release, evicts the lowest id, accepts every prefetch eviction, and says when
// an access to the device tier has reached it (the acquire is about to look for room).
class AcceptAllPolicy : public ResidencyPolicy {
 public:
  std::vector<PrefetchHint> on_access(TensorId, std::uint64_t, Tier tier, Phase,
                                      const ResidencyView&) override {
    if (tier == Tier::kDevice) device_access.store(true);
    return {};
  }
  bool keep_on_release(TensorId, Tier, const ResidencyView&) override { return true; }
  TensorId choose_victim(Tier, std::span<const TensorId> c) override {
    return *std::min_element(c.begin(), c.end());
  }
  std::atomic<bool> device_access{false};
};

// An acquire's tensor is no prefetch's victim while the acquire waits: here x's acquire at the
// device waits for room (z is pinned there) with x's source, its host copy, in hand. A prefetch
// of y to the host, which holds one tensor, finds no victim and is dropped; x then comes from host
// memory. (Before Entry::acquiring, the prefetch evicted x's host copy, the policy ranking it
// furthest, and the acquire read x from NVMe again: in a forward-only pass at the 7 B demo's
// budgets, a tenth of the base a pass.)
TEST_F(StoreTest, APrefetchDoesNotEvictTheCopyAnAcquireWaitsFor) {
  demote_ = false;
  auto policy = std::make_unique<AcceptAllPolicy>();
  AcceptAllPolicy* ap = policy.get();
  TensorStore& s = make(81920, 81920, 64 << 10, 10, std::move(policy));
  std::vector<TensorId> ids;  // x, y, z: x has the lowest id, the policy's victim
  for (std::uint32_t i = 0; i < 3; ++i) {
    const auto init = make_bytes(i, 0, 80000);
    ids.push_back(s.register_tensor({.name = std::string(1, "xyz"[i]), .bytes = 80000, .home = Tier::kNvme, .initial = init}));
  }
  const TensorId x = ids[0], y = ids[1], z = ids[2];
  s.acquire(x, Tier::kHost);  // x in host memory, unpinned
  std::optional<TensorStore::Pin> pz(s.acquire(z, Tier::kDevice));  // the device is full
  ap->device_access.store(false);
  std::atomic<bool> ok{false};
  std::thread a([&] {
    TensorStore::Pin px = s.acquire(x, Tier::kDevice);  // waits for room until z is released
    ok.store(matches(px.data(), 0, 0, 80000));
  });
  while (!ap->device_access.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // a's acquire is waiting for room now
  s.prefetch(std::span<const TensorId>(&y, 1), Tier::kHost);
  s.drain();
  const TensorStoreStats mid = s.stats();
  pz.reset();  // room on the device: a's acquire goes on
  a.join();
  EXPECT_TRUE(ok.load());
  const TensorStoreStats st = s.stats();
  EXPECT_EQ(mid.prefetches_dropped, 1u) << "no victim for y: x is being acquired";
  EXPECT_EQ(st.moves[2][1], 1u) << "NVMe -> host: x once, y never";
  EXPECT_EQ(st.moves[1][0], 1u) << "x went to the device from host memory";
  EXPECT_EQ(st.moves[2][0], 1u) << "NVMe -> device: z only, x not read again";
}

TEST_F(StoreTest, PrefetchEvictsOnlyWhenPolicyAcceptsEveryVictim) {
  auto policy = std::make_unique<GatePolicy>();
  GatePolicy* gp = policy.get();
  // 256 KiB device: three 80000-byte tensors (80 KiB each, rounded) fit; "big" (148 KiB) needs
  // two of them gone.
  TensorStore& s = make(256 << 10, 1 << 20, 64 << 10, 10, std::move(policy));
  std::vector<TensorId> small;
  for (std::uint32_t i = 0; i < 3; ++i) {
    auto init = make_bytes(i, 0, 80000);
    small.push_back(s.register_tensor(
        {.name = "s" + std::to_string(i), .bytes = 80000, .home = Tier::kHost, .initial = init}));
  }
  auto big_init = make_bytes(9, 0, 150000);
  TensorId big = s.register_tensor({.name = "big", .bytes = 150000, .home = Tier::kHost, .initial = big_init});
  for (TensorId id : small) s.acquire(id, Tier::kDevice);  // resident, unpinned, kept
  ASSERT_EQ(s.stats().resident_bytes[0], 3u * 81920u);
  EXPECT_TRUE(gp->asked.empty());  // demand loads never ask

  // The second planned victim (s1) is refused: nothing is evicted, the prefetch is dropped.
  gp->refuse = {small[1]};
  s.prefetch(std::span<const TensorId>(&big, 1), Tier::kDevice);
  s.drain();
  ASSERT_EQ(gp->asked.size(), 2u);
  EXPECT_EQ(gp->asked[0], std::make_pair(big, small[0]));
  EXPECT_EQ(gp->asked[1], std::make_pair(big, small[1]));
  TensorStoreStats st = s.stats();
  EXPECT_EQ(st.prefetches_dropped, 1u);
  EXPECT_EQ(st.evictions[0], 0u);
  EXPECT_EQ(st.resident_bytes[0], 3u * 81920u);
  const std::uint64_t hits = st.hits;
  for (std::uint32_t i = 0; i < 3; ++i) {
    TensorStore::Pin p = s.acquire(small[i], Tier::kDevice);
    EXPECT_TRUE(matches(p.data(), i, 0, 80000));
  }
  EXPECT_EQ(s.stats().hits, hits + 3);  // all three stayed resident

  // Both accepted: exactly the two planned victims go, the third stays, big lands.
  gp->refuse.clear();
  gp->asked.clear();
  s.prefetch(std::span<const TensorId>(&big, 1), Tier::kDevice);
  s.drain();
  EXPECT_EQ(gp->asked.size(), 2u);
  st = s.stats();
  EXPECT_EQ(st.prefetches_dropped, 1u);
  EXPECT_EQ(st.evictions[0], 2u);
  EXPECT_EQ(st.resident_bytes[0], 81920u + 151552u);
  const std::uint64_t misses = st.misses;
  {
    TensorStore::Pin p = s.acquire(big, Tier::kDevice);
    EXPECT_TRUE(matches(p.data(), 9, 0, 150000));
  }
  { TensorStore::Pin p = s.acquire(small[2], Tier::kDevice); }
  EXPECT_EQ(s.stats().misses, misses);  // big and s2 were resident
}

}  // namespace
}  // namespace tiermem
