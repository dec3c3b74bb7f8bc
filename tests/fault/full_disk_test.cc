// Full disk (issue 8): SwapSpace and TensorStore on a nearly full filesystem. ENOSPC while the
// swap file grows gives OutOfMemoryError naming the swap file and the sizes; ENOSPC while
// swapping out gives IoError naming tensor, path and offset; in both cases everything already
// stored stays readable. Two ways to fill a disk:
//   - a real one: a loop-mounted 12 MiB ext4 image (needs root and mount; else GTEST_SKIP, loudly);
//   - an injected one: IoInterceptor returns ENOSPC for fallocate / writes (runs everywhere).
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <unistd.h>

#include <cstdlib>
#include <memory>
#include <string>

#include "fault/fault_util.h"
#include "tiermem/error.h"
#include "tiermem/sim_device.h"
#include "tiermem/swap_space.h"
#include "tiermem/tensor_store.h"

namespace tiermem {
namespace {

// A small ext4 filesystem mounted on a temp directory for the test's lifetime.
class LoopFs {
 public:
  explicit LoopFs(int mib) {
    if (!base_.ok()) return;
    image_ = base_.path() + "/fs.img";
    mnt_ = base_.path() + "/mnt";
    std::string cmd = "truncate -s " + std::to_string(mib) + "M " + image_ +
                      " && mkfs.ext4 -q -F " + image_ + " >/dev/null 2>&1 && mkdir -p " + mnt_ +
                      " && mount -o loop " + image_ + " " + mnt_ + " >/dev/null 2>&1";
    if (::geteuid() != 0) {
      why_ = "not root";
    } else if (std::system(cmd.c_str()) != 0) {
      why_ = "mkfs.ext4 or mount -o loop failed";
    } else {
      mounted_ = true;
    }
  }
  ~LoopFs() {
    if (mounted_) ::umount2(mnt_.c_str(), MNT_DETACH);
  }
  bool ok() const { return mounted_; }
  const std::string& why() const { return why_; }
  const std::string& dir() const { return mnt_; }

 private:
  fault::TempDir base_{"loopfs"};
  std::string image_, mnt_, why_;
  bool mounted_ = false;
};

TEST(FullDisk, LoopMountedFilesystemFillsWithAClearErrorAndNothingLost) {
  LoopFs fs(12);
  if (!fs.ok()) GTEST_SKIP() << "SKIPPED: no loop-mounted filesystem (" << fs.why() << ")";
  auto engine = make_io_engine(IoEngineOptions{});
  SwapSpaceOptions so;
  so.initial_bytes_per_path = 1 << 20;
  so.stripe_bytes = 1 << 20;
  SwapSpace swap(so, {fs.dir()}, *engine);
  std::vector<SwapExtent> exts;
  std::vector<std::vector<std::byte>> data;
  const std::uint64_t kBytes = 700 << 10;
  bool full = false;
  for (int i = 0; i < 100 && !full; ++i) {
    try {
      exts.push_back(swap.allocate(kBytes));
    } catch (const OutOfMemoryError& e) {
      full = true;
      const std::string what = e.what();
      EXPECT_EQ(e.tier(), Tier::kNvme);
      EXPECT_EQ(e.requested(), kBytes);
      EXPECT_NE(what.find(swap.file_path(0)), std::string::npos) << what;
      EXPECT_NE(what.find("No space left"), std::string::npos) << what;
      EXPECT_NE(what.find(std::to_string(kBytes)), std::string::npos) << what;
      break;
    }
    data.push_back(fault::make_bytes(static_cast<std::uint32_t>(i), 0, kBytes));
    swap.write(exts.back(), data.back().data(), kBytes).wait();
  }
  ASSERT_TRUE(full) << "a 12 MiB filesystem never filled";
  EXPECT_GE(exts.size(), 5u);
  for (std::size_t i = 0; i < exts.size(); ++i) {
    std::vector<std::byte> r(kBytes);
    swap.read(exts[i], r.data(), kBytes).wait();
    EXPECT_EQ(fault::first_mismatch(r.data(), static_cast<std::uint32_t>(i), 0, kBytes), kBytes)
        << "extent " << i;
  }
  // Freeing makes room again.
  swap.free(exts.back());
  exts.pop_back();
  SwapExtent again = swap.allocate(kBytes);
  swap.free(again);
  for (auto& e : exts) swap.free(e);
}

TEST(FullDisk, TensorStoreOnAFullLoopFilesystemNamesTheTensor) {
  LoopFs fs(12);
  if (!fs.ok()) GTEST_SKIP() << "SKIPPED: no loop-mounted filesystem (" << fs.why() << ")";
  auto engine = make_io_engine(IoEngineOptions{});
  SwapSpaceOptions so;
  so.initial_bytes_per_path = 1 << 20;
  auto swap = std::make_shared<SwapSpace>(so, std::vector<std::string>{fs.dir()}, *engine);
  auto device = std::make_shared<SimDevice>(SimDeviceOptions{.budget_bytes = 8 << 20});
  TensorStoreOptions o;
  o.device_budget_bytes = 8 << 20;
  o.host_budget_bytes = 4 << 20;
  o.pipeline_chunk_bytes = 256 << 10;
  TensorStore store(o, device, swap);
  const std::uint64_t kBytes = 1 << 20;
  std::vector<TensorId> ids;
  std::string error;
  for (int i = 0; i < 40 && error.empty(); ++i) {
    try {
      ids.push_back(store.register_tensor({.name = "opt.master." + std::to_string(i),
                                           .dtype = DType::kF32, .shape = {},
                                           .bytes = kBytes, .home = Tier::kNvme,
                                           .initial = fault::make_bytes(i, 0, kBytes)}));
    } catch (const OutOfMemoryError& e) {
      error = e.what();
      EXPECT_NE(error.find("opt.master." + std::to_string(i)), std::string::npos) << error;
      EXPECT_NE(error.find(swap->file_path(0)), std::string::npos) << error;
    }
  }
  ASSERT_FALSE(error.empty()) << "the filesystem never filled";
  for (std::size_t i = 0; i < ids.size(); ++i) {
    std::vector<std::byte> r(kBytes);
    store.read(ids[i], r);
    EXPECT_EQ(fault::first_mismatch(r.data(), static_cast<std::uint32_t>(i), 0, kBytes), kBytes);
  }
}

// Injected: the same promises where no filesystem can be mounted.
class InjectedFullDisk : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(dir_.ok());
    faults_ = std::make_shared<fault::RandomFaults>(1);
    IoEngineOptions io;
    io.o_direct = false;
    io.interceptor = faults_;
    engine_ = make_io_engine(io);
    SwapSpaceOptions so;
    so.initial_bytes_per_path = 1 << 20;
    swap_ = std::make_shared<SwapSpace>(so, std::vector<std::string>{dir_.path()}, *engine_);
  }
  fault::TempDir dir_{"enospc"};
  std::shared_ptr<fault::RandomFaults> faults_;
  std::unique_ptr<IoEngine> engine_;
  std::shared_ptr<SwapSpace> swap_;
};

TEST_F(InjectedFullDisk, GrowthHittingEnospcIsOutOfMemoryNamingFileAndSizes) {
  SwapExtent a = swap_->allocate(512 << 10);
  auto d = fault::make_bytes(7, 0, 512 << 10);
  swap_->write(a, d.data(), d.size()).wait();
  faults_->fallocate_ppm = 1000000;
  faults_->enabled = true;
  try {
    (void)swap_->allocate(2 << 20);
    FAIL() << "no OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    const std::string what = e.what();
    EXPECT_EQ(e.requested(), 2u << 20);
    EXPECT_NE(what.find(swap_->file_path(0)), std::string::npos) << what;
    EXPECT_NE(what.find("2097152"), std::string::npos) << what;
    EXPECT_NE(what.find("No space left"), std::string::npos) << what;
  }
  EXPECT_GT(faults_->fallocate_enospc.load(), 0u);
  faults_->enabled = false;
  std::vector<std::byte> r(d.size());
  swap_->read(a, r.data(), r.size()).wait();
  EXPECT_EQ(r, d);
  EXPECT_EQ(swap_->stats().extents, 1u);
}

// Occurrences of `needle` in `hay`.
int count_of(const std::string& hay, const std::string& needle) {
  int n = 0;
  for (auto at = hay.find(needle); at != std::string::npos; at = hay.find(needle, at + 1)) ++n;
  return n;
}

// The error of a tensor that cannot get its NVMe home says "out of nvme memory" once, whatever
// layers (fallocate, swap space, store) it came through, and still names each layer's part.
TEST_F(InjectedFullDisk, NoRoomForATensorsHomeSaysEachClauseOnce) {
  auto device = std::make_shared<SimDevice>(SimDeviceOptions{.budget_bytes = 4 << 20});
  TensorStoreOptions o;
  o.device_budget_bytes = 4 << 20;
  o.host_budget_bytes = 4 << 20;
  o.pipeline_chunk_bytes = 64 << 10;
  TensorStore store(o, device, swap_);
  faults_->fallocate_ppm = 1000000;
  faults_->enabled = true;
  const std::uint64_t kBytes = 2 << 20;  // more than the 1 MiB swap file: it must grow
  try {
    (void)store.register_tensor({.name = "zero.optim.block.3.0", .dtype = DType::kU8, .shape = {},
                                 .bytes = kBytes, .home = Tier::kNvme,
                                 .initial = fault::make_bytes(5, 0, kBytes)});
    FAIL() << "no OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    const std::string what = e.what();
    EXPECT_EQ(count_of(what, "out of nvme memory"), 1) << what;
    EXPECT_EQ(count_of(what, "No space left"), 1) << what;
    EXPECT_EQ(count_of(what, "zero.optim.block.3.0"), 1) << what;
    EXPECT_NE(what.find(swap_->file_path(0)), std::string::npos) << what;
    EXPECT_NE(what.find("fallocate"), std::string::npos) << what;
  }
}

TEST_F(InjectedFullDisk, EnospcDuringSwapOutIsAnIoErrorAndTheNewestBytesStay) {
  auto device = std::make_shared<SimDevice>(SimDeviceOptions{.budget_bytes = 1 << 20});
  TensorStoreOptions o;
  o.device_budget_bytes = 1 << 20;
  o.host_budget_bytes = 1 << 20;
  o.pipeline_chunk_bytes = 64 << 10;
  TensorStore store(o, device, swap_);
  const std::uint64_t kBytes = 200 << 10;
  TensorId w = store.register_tensor({.name = "layer0.mlp.w_fc", .dtype = DType::kU8, .shape = {},
                                      .bytes = kBytes, .home = Tier::kNvme,
                                      .initial = fault::make_bytes(3, 0, kBytes)});
  {
    TensorStore::Pin p = store.acquire(w, Tier::kDevice);
    fault::fill(p.data(), 3, 1, kBytes);
    p.mark_dirty();
  }
  faults_->enospc_ppm = 1000000;  // every write piece
  faults_->enabled = true;
  try {
    store.flush();
    FAIL() << "no IoError";
  } catch (const IoError& e) {
    const std::string what = e.what();
    EXPECT_EQ(e.err(), ENOSPC);
    EXPECT_EQ(e.path(), swap_->file_path(0));
    EXPECT_NE(what.find("tensor 'layer0.mlp.w_fc'"), std::string::npos) << what;
    EXPECT_NE(what.find("offset " + std::to_string(e.offset())), std::string::npos) << what;
  }
  faults_->enabled = false;
  std::vector<std::byte> r(kBytes);
  store.read(w, r);
  EXPECT_EQ(fault::first_mismatch(r.data(), 3, 1, kBytes), kBytes);
  store.flush();
  EXPECT_TRUE(store.evict(w, Tier::kDevice));
  store.read(w, r);
  EXPECT_EQ(fault::first_mismatch(r.data(), 3, 1, kBytes), kBytes);
}

}  // namespace
}  // namespace tiermem
