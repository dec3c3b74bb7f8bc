// EIO on reads of parameter / optimizer state and on-disk corruption, seen through TensorStore:
// the IoError names the tensor, the swap file and the offset of the failing piece; the store
// keeps working and loses nothing (issue 8, "Full disk and I/O errors").
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "fault/fault_util.h"
#include "tiermem/error.h"
#include "tiermem/sim_device.h"
#include "tiermem/swap_space.h"
#include "tiermem/tensor_store.h"

namespace tiermem {
namespace {

// Fails reads (or writes) touching [lo, hi) of the swap file with `err`, `remaining` times
// (-1: always).
class RangeFault : public IoInterceptor {
 public:
  std::atomic<int> err{0};
  std::atomic<int> kind{static_cast<int>(IoOpKind::kRead)};
  std::atomic<std::uint64_t> lo{0}, hi{0};
  std::atomic<int> remaining{-1};
  std::atomic<int> fallocate_err{0};
  std::atomic<int> hits{0};
  Decision before_io(IoOpKind k, const std::string&, std::uint64_t offset,
                     std::uint64_t bytes) override {
    Decision d;
    if (k == IoOpKind::kFallocate) {
      d.fail_errno = fallocate_err.load();
      return d;
    }
    if (err.load() == 0 || static_cast<int>(k) != kind.load()) return d;
    if (offset + bytes <= lo.load() || offset >= hi.load()) return d;
    int n = remaining.load();
    while (n > 0 && !remaining.compare_exchange_weak(n, n - 1)) {
    }
    if (n == 0) return d;
    ++hits;
    d.fail_errno = err.load();
    return d;
  }
};

class StoreFaultTest : public ::testing::Test {
 protected:
  // `device`: the store's device instead of device_ (which is still made).
  void make(bool checksum, std::shared_ptr<Device> device = nullptr) {
    ASSERT_TRUE(dir_.ok());
    fault_ = std::make_shared<RangeFault>();
    IoEngineOptions io;
    io.o_direct = false;  // the bit-flip test edits the file behind the engine's back
    io.block_size_bytes = 16 << 10;
    io.interceptor = fault_;
    engine_ = make_io_engine(io);
    SwapSpaceOptions so;
    so.initial_bytes_per_path = 4 << 20;
    so.checksum = checksum;
    swap_ = std::make_shared<SwapSpace>(so, std::vector<std::string>{dir_.path()}, *engine_);
    device_ = std::make_shared<SimDevice>(SimDeviceOptions{.budget_bytes = 4 << 20});
    TensorStoreOptions o;
    o.device_budget_bytes = 4 << 20;
    o.host_budget_bytes = 4 << 20;
    o.pipeline_chunk_bytes = 64 << 10;
    o.pipeline_chunks = 2;
    o.acquire_timeout = std::chrono::seconds(10);
    store_ = std::make_unique<TensorStore>(o, device ? device : device_, swap_);
    // A parameter shard and an optimizer moment, both homed on NVMe, 3 pipeline chunks each.
    param_ = store_->register_tensor({.name = "layer3.attn.w_qkv", .dtype = DType::kU8,
                                      .shape = {}, .bytes = kBytes, .home = Tier::kNvme,
                                      .initial = fault::make_bytes(1, 0, kBytes)});
    moment_ = store_->register_tensor({.name = "layer3.attn.w_qkv.exp_avg", .dtype = DType::kU8,
                                       .shape = {}, .bytes = kBytes, .home = Tier::kNvme,
                                       .initial = fault::make_bytes(2, 0, kBytes)});
  }
  void TearDown() override {
    store_.reset();
    swap_.reset();
    engine_.reset();
  }
  // The swap-file byte range of tensor `index`'s second chunk: the store registers tensors'
  // chunks in order, so it is found by reading the file for the tensor's pattern.
  std::uint64_t file_offset_of(std::uint32_t index, std::uint64_t byte) {
    int fd = ::open(swap_->file_path(0).c_str(), O_RDONLY);
    EXPECT_GE(fd, 0);
    std::vector<std::uint8_t> want(64);
    for (std::uint64_t i = 0; i < 64; ++i) want[i] = fault::pattern(index, 0, byte + i);
    std::vector<std::uint8_t> page(4096);
    std::uint64_t found = UINT64_MAX;
    for (std::uint64_t off = 0; found == UINT64_MAX && off < (4u << 20); off += 4096) {
      if (::pread(fd, page.data(), page.size(), static_cast<off_t>(off)) != 4096) break;
      if (std::equal(want.begin(), want.end(), page.begin())) found = off;
    }
    ::close(fd);
    return found;
  }

  static constexpr std::uint64_t kBytes = 3 * (64 << 10) - 1000;
  fault::TempDir dir_{"storeio"};
  std::shared_ptr<RangeFault> fault_;
  std::unique_ptr<IoEngine> engine_;
  std::shared_ptr<SwapSpace> swap_;
  std::shared_ptr<SimDevice> device_;
  std::unique_ptr<TensorStore> store_;
  TensorId param_ = kInvalidTensor, moment_ = kInvalidTensor;
};

void expect_names(const IoError& e, const std::string& tensor, const std::string& path,
                  std::uint64_t offset) {
  const std::string what = e.what();
  EXPECT_NE(what.find("tensor '" + tensor + "'"), std::string::npos) << what;
  EXPECT_NE(what.find(path), std::string::npos) << what;
  EXPECT_NE(what.find("offset " + std::to_string(offset)), std::string::npos) << what;
  EXPECT_EQ(e.path(), path);
  EXPECT_EQ(e.offset(), offset);
}

TEST_F(StoreFaultTest, EioReadingParameterAndOptimizerStateNamesTensorPathAndOffset) {
  make(/*checksum=*/false);
  const std::uint64_t chunk1 = file_offset_of(2, 64 << 10);  // moment's second chunk
  ASSERT_NE(chunk1, UINT64_MAX);
  fault_->err = EIO;
  fault_->lo = chunk1;
  fault_->hi = chunk1 + (64 << 10);
  // NVMe -> device (the pipeline), NVMe -> host and read(): each names tensor, file, offset.
  for (int path = 0; path < 3; ++path) {
    try {
      if (path == 0) (void)store_->acquire(moment_, Tier::kDevice);
      if (path == 1) (void)store_->acquire(moment_, Tier::kHost);
      if (path == 2) {
        std::vector<std::byte> out(kBytes);
        store_->read(moment_, out);
      }
      FAIL() << "path " << path << ": no IoError";
    } catch (const IoError& e) {
      EXPECT_EQ(e.err(), EIO);
      // The first failing piece (16 KiB, block_size) is the one named; any of the chunk's may be.
      expect_names(e, "layer3.attn.w_qkv.exp_avg", swap_->file_path(0), e.offset());
      EXPECT_EQ(e.offset() % (16 << 10), 0u);
      EXPECT_GE(e.offset(), chunk1);
      EXPECT_LT(e.offset(), chunk1 + (64 << 10));
    }
  }
  // Nothing else is affected; nothing leaked; once the disk recovers the data is intact.
  { TensorStore::Pin p = store_->acquire(param_, Tier::kDevice);
    EXPECT_EQ(fault::first_mismatch(p.data(), 1, 0, kBytes), kBytes); }
  TensorStoreStats s = store_->stats();
  EXPECT_EQ(s.bounce_chunks_in_use, 0u);
  EXPECT_EQ(s.resident_bytes[static_cast<int>(Tier::kHost)], 0u);  // the failed host copy is freed
  fault_->err = 0;
  TensorStore::Pin p = store_->acquire(moment_, Tier::kDevice);
  EXPECT_EQ(fault::first_mismatch(p.data(), 2, 0, kBytes), kBytes);
}

TEST_F(StoreFaultTest, EioDuringSwapOutKeepsTheDirtyCopyAndARetrySucceeds) {
  make(/*checksum=*/false);
  const std::uint64_t chunk0 = file_offset_of(1, 0);
  ASSERT_NE(chunk0, UINT64_MAX);
  {
    TensorStore::Pin p = store_->acquire(param_, Tier::kDevice);
    fault::fill(p.data(), 1, 1, kBytes);
    p.mark_dirty();
  }
  fault_->kind = static_cast<int>(IoOpKind::kWrite);
  fault_->err = EIO;
  fault_->lo = chunk0;
  fault_->hi = chunk0 + 4096;
  try {
    store_->evict(param_, Tier::kDevice);
    FAIL() << "no IoError";
  } catch (const IoError& e) {
    expect_names(e, "layer3.attn.w_qkv", swap_->file_path(0), chunk0);
    EXPECT_NE(std::string(e.what()).find("device->nvme"), std::string::npos) << e.what();
  }
  std::vector<std::byte> out(kBytes);
  store_->read(param_, out);  // the newest bytes are still on the device
  EXPECT_EQ(fault::first_mismatch(out.data(), 1, 1, kBytes), kBytes);
  fault_->err = 0;
  EXPECT_TRUE(store_->evict(param_, Tier::kDevice));
  store_->read(param_, out);
  EXPECT_EQ(fault::first_mismatch(out.data(), 1, 1, kBytes), kBytes);
}

TEST_F(StoreFaultTest, FailedWriteLeavesThePreviousContentsWhole) {
  make(/*checksum=*/true);
  {  // a dirty cached copy (generation 1) that write() would replace
    TensorStore::Pin p = store_->acquire(param_, Tier::kDevice);
    fault::fill(p.data(), 1, 1, kBytes);
    p.mark_dirty();
  }
  fault_->kind = static_cast<int>(IoOpKind::kWrite);
  fault_->err = ENOSPC;
  fault_->lo = 0;
  fault_->hi = UINT64_MAX;
  fault_->remaining = 1;  // one piece of the new bytes fails, the others land
  auto gen2 = fault::make_bytes(1, 2, kBytes);
  EXPECT_THROW(store_->write(param_, gen2), IoError);
  std::vector<std::byte> out(kBytes);
  store_->read(param_, out);
  EXPECT_EQ(fault::first_mismatch(out.data(), 1, 1, kBytes), kBytes) << "generation 1 was lost";
  store_->flush();  // must not hang: a current copy exists
  EXPECT_TRUE(store_->evict(param_, Tier::kDevice));
  store_->read(param_, out);
  EXPECT_EQ(fault::first_mismatch(out.data(), 1, 1, kBytes), kBytes);
  fault_->err = 0;
  store_->write(param_, gen2);
  store_->read(param_, out);
  EXPECT_EQ(fault::first_mismatch(out.data(), 1, 2, kBytes), kBytes);
  EXPECT_EQ(swap_->stats().extents, 6u);  // 2 tensors x 3 chunks: the failed write's are freed
}

TEST_F(StoreFaultTest, FlippedBitOnDiskIsDetectedAndNamed) {
  ASSERT_TRUE(SwapSpaceOptions{}.checksum) << "checksums must be on by default";
  make(/*checksum=*/SwapSpaceOptions{}.checksum);  // default settings
  const std::uint64_t chunk2 = file_offset_of(1, 2 * (64 << 10));  // param's third chunk
  ASSERT_NE(chunk2, UINT64_MAX);
  int fd = ::open(swap_->file_path(0).c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  std::uint8_t b = 0;
  const off_t at = static_cast<off_t>(chunk2 + 1234);
  ASSERT_EQ(::pread(fd, &b, 1, at), 1);
  b ^= 0x10;
  ASSERT_EQ(::pwrite(fd, &b, 1, at), 1);
  ::close(fd);
  for (Tier t : {Tier::kDevice, Tier::kHost}) {
    try {
      (void)store_->acquire(param_, t);
      FAIL() << "corruption not detected on the way to " << tier_name(t);
    } catch (const IoError& e) {
      expect_names(e, "layer3.attn.w_qkv", swap_->file_path(0), chunk2);
      EXPECT_NE(std::string(e.what()).find("checksum mismatch"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("re-read"), std::string::npos) << e.what();
      EXPECT_TRUE(e.corrupt_data()) << "the tensor prefix must keep the kind: " << e.what();
    }
  }
  // The other tensor is fine; rewriting the damaged one repairs it.
  std::vector<std::byte> out(kBytes);
  store_->read(moment_, out);
  EXPECT_EQ(fault::first_mismatch(out.data(), 2, 0, kBytes), kBytes);
  store_->write(param_, fault::make_bytes(1, 5, kBytes));
  TensorStore::Pin p = store_->acquire(param_, Tier::kDevice);
  EXPECT_EQ(fault::first_mismatch(p.data(), 1, 5, kBytes), kBytes);
}

// A SimDevice whose copies can be refused at submission (a synchronous throw, as a CUDA launch
// error would be): `refuse_h2d` / `refuse_d2h` are how many of the next copies to refuse.
class RefusingDevice final : public Device {
 public:
  explicit RefusingDevice(std::shared_ptr<SimDevice> d) : d_(std::move(d)) {}
  std::atomic<int> refuse_h2d{0}, refuse_d2h{0};
  DeviceKind kind() const noexcept override { return d_->kind(); }
  std::string name() const override { return "refusing " + d_->name(); }
  bool host_addressable() const noexcept override { return d_->host_addressable(); }
  std::uint64_t budget_bytes() const noexcept override { return d_->budget_bytes(); }
  std::uint64_t allocation_size(std::uint64_t b) const noexcept override { return d_->allocation_size(b); }
  void* allocate(std::uint64_t b) override { return d_->allocate(b); }
  void* try_allocate(std::uint64_t b) noexcept override { return d_->try_allocate(b); }
  void free(void* p) noexcept override { d_->free(p); }
  void empty_cache() override { d_->empty_cache(); }
  DeviceEvent copy_h2d_async(void* dst, const void* src, std::uint64_t b) override {
    if (take(refuse_h2d)) throw Error("injected: H2D copy refused at submission");
    return d_->copy_h2d_async(dst, src, b);
  }
  DeviceEvent copy_d2h_async(void* dst, const void* src, std::uint64_t b) override {
    if (take(refuse_d2h)) throw Error("injected: D2H copy refused at submission");
    return d_->copy_d2h_async(dst, src, b);
  }
  DeviceEvent copy_d2d_async(void* dst, const void* src, std::uint64_t b) override {
    return d_->copy_d2d_async(dst, src, b);
  }
  DeviceEvent memset_async(void* dst, int v, std::uint64_t b) override { return d_->memset_async(dst, v, b); }
  void synchronize() override { d_->synchronize(); }
  bool register_host(void* base, std::uint64_t b) override { return d_->register_host(base, b); }
  void unregister_host(void* base) override { d_->unregister_host(base); }
  DeviceStats stats() const override { return d_->stats(); }

 private:
  static bool take(std::atomic<int>& n) {
    int v = n.load();
    while (v > 0 && !n.compare_exchange_weak(v, v - 1)) {
    }
    return v > 0;
  }
  std::shared_ptr<SimDevice> d_;
};

// A device copy refused at submission in the middle of an NVMe <-> device chunk pipeline: the
// acquire fails with that error, every bounce chunk is given back (more failures than the store
// has chunks would otherwise leave the next pipeline waiting forever for one), and the next
// transfers carry the right bytes both ways.
TEST_F(StoreFaultTest, DeviceCopyRefusedMidPipelineReturnsItsBounceChunks) {
  auto dev = std::make_shared<RefusingDevice>(
      std::make_shared<SimDevice>(SimDeviceOptions{.budget_bytes = 4 << 20}));
  make(/*checksum=*/false, dev);
  for (int i = 0; i < 5; ++i) {  // more than pipeline_chunks (2)
    dev->refuse_h2d = 1;
    EXPECT_THROW((void)store_->acquire(param_, Tier::kDevice), Error) << "round " << i;
  }
  {
    TensorStore::Pin p = store_->acquire(param_, Tier::kDevice);
    EXPECT_EQ(fault::first_mismatch(p.data(), 1, 0, kBytes), kBytes);
    std::memcpy(p.data(), fault::make_bytes(1, 9, kBytes).data(), kBytes);
    p.mark_dirty();
  }
  // Device -> NVMe: the write-back refused at its D2H copies; the dirty copy stays, a later
  // eviction writes it down.
  for (int i = 0; i < 5; ++i) {
    dev->refuse_d2h = 1;
    EXPECT_THROW((void)store_->evict(param_, Tier::kDevice), Error) << "round " << i;
  }
  EXPECT_TRUE(store_->evict(param_, Tier::kDevice));
  std::vector<std::byte> out(kBytes);
  store_->read(param_, out);
  EXPECT_EQ(fault::first_mismatch(out.data(), 1, 9, kBytes), kBytes);
}

}  // namespace
}  // namespace tiermem
