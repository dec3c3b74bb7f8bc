// Injected faults through IoInterceptor, under every engine configuration: EIO on read and on
// write, short reads and writes, ENOSPC (write and fallocate), EAGAIN storms. Each gives the
// documented result and no other extent's data changes.
#include <gtest/gtest.h>

#include <atomic>
#include <mutex>

#include "unit/nvme_test_util.h"
#include "tiermem/error.h"
#include "tiermem/swap_space.h"

namespace tiermem {
namespace {

using test::TempDir;

// Fails or shortens operations that touch [lo, hi) of files whose path contains `match`.
class Injector : public IoInterceptor {
 public:
  std::atomic<int> fail_errno{0};
  std::atomic<int> fail_kind{-1};   // IoOpKind or -1 for any
  std::atomic<std::uint64_t> lo{0}, hi{UINT64_MAX};
  std::atomic<std::uint64_t> max_bytes{UINT64_MAX};  // short transfers
  std::atomic<int> fail_first_n{-1};  // >= 0: only the first n matching operations fail
  std::atomic<int> fallocate_errno{0};
  std::atomic<int> hits{0};

  Decision before_io(IoOpKind kind, const std::string&, std::uint64_t offset,
                     std::uint64_t bytes) override {
    Decision d;
    if (kind == IoOpKind::kOpen) return d;
    if (kind == IoOpKind::kFallocate) {
      d.fail_errno = fallocate_errno.load();
      return d;
    }
    if (fail_kind.load() >= 0 && static_cast<int>(kind) != fail_kind.load()) return d;
    if (offset + bytes <= lo.load() || offset >= hi.load()) return d;
    ++hits;
    if (fail_errno.load() != 0) {
      int n = fail_first_n.load();
      while (n > 0 && !fail_first_n.compare_exchange_weak(n, n - 1)) {
      }
      if (n != 0) d.fail_errno = fail_errno.load();  // n < 0: always; n > 0: one of the first n
    }
    d.max_bytes = max_bytes.load();
    return d;
  }
  void reset() {
    fail_errno = 0;
    fail_kind = -1;
    lo = 0;
    hi = UINT64_MAX;
    max_bytes = UINT64_MAX;
    fail_first_n = -1;
    fallocate_errno = 0;
    hits = 0;
  }
};

class FaultTest : public ::testing::TestWithParam<test::EngineConfig> {
 protected:
  void SetUp() override {
    ASSERT_TRUE(dir_.ok());
    inj_ = std::make_shared<Injector>();
    IoEngineOptions o = test::options_for(GetParam());
    o.block_size_bytes = 64 << 10;
    o.interceptor = inj_;
    try {
      engine_ = make_io_engine(o);
    } catch (const NotSupportedError& e) {
      GTEST_SKIP() << "io_uring not available here: " << e.what();
    }
    SwapSpaceOptions so;
    so.stripe_bytes = 64 << 10;
    so.initial_bytes_per_path = 8 << 20;
    so.max_bytes_per_path = 8 << 20;
    swap_ = std::make_unique<SwapSpace>(so, std::vector<std::string>{dir_.path()}, *engine_);
    // Ten extents of 300 KiB with known data.
    for (int i = 0; i < 10; ++i) {
      exts_.push_back(swap_->allocate(300 << 10));
      data_.emplace_back(300 << 10);
      test::fill_pattern(data_.back().data(), data_.back().size(), static_cast<std::uint64_t>(i));
      swap_->write(exts_.back(), data_.back().data(), data_.back().size()).wait();
    }
  }
  void TearDown() override {
    swap_.reset();
    engine_.reset();
  }
  // Every extent except `skip` still reads back its data (with no faults injected).
  void expect_others_intact(int skip) {
    inj_->reset();
    for (int i = 0; i < 10; ++i) {
      if (i == skip) continue;
      std::vector<char> r(data_[i].size());
      swap_->read(exts_[i], r.data(), r.size()).wait();
      ASSERT_TRUE(r == data_[i]) << "extent " << i << " changed";
    }
  }
  void target(int i) {
    inj_->lo = exts_[i].pieces.front().offset;
    inj_->hi = exts_[i].pieces.front().offset + exts_[i].pieces.front().bytes;
  }

  TempDir dir_;
  std::shared_ptr<Injector> inj_;
  std::unique_ptr<IoEngine> engine_;
  std::unique_ptr<SwapSpace> swap_;
  std::vector<SwapExtent> exts_;
  std::vector<std::vector<char>> data_;
};

TEST_P(FaultTest, EioOnReadFailsThatRequestOnly) {
  target(3);
  inj_->fail_kind = static_cast<int>(IoOpKind::kRead);
  inj_->fail_errno = EIO;
  std::vector<char> r(data_[3].size());
  IoRequest bad = swap_->read(exts_[3], r.data(), r.size());
  std::vector<char> r4(data_[4].size());
  IoRequest good = swap_->read(exts_[4], r4.data(), r4.size());
  try {
    bad.wait();
    FAIL() << "expected IoError";
  } catch (const IoError& e) {
    EXPECT_EQ(e.err(), EIO);
    EXPECT_EQ(e.path(), swap_->file_path(0));
    EXPECT_GE(e.offset(), exts_[3].pieces.front().offset);
    EXPECT_LT(e.offset(), exts_[3].pieces.front().offset + (300 << 10));
    EXPECT_NE(std::string(e.what()).find("read failed"), std::string::npos) << e.what();
  }
  good.wait();
  EXPECT_EQ(r4, data_[4]);
  expect_others_intact(-1);  // a failed read changes nothing, not even extent 3
}

TEST_P(FaultTest, EioOnWriteFailsThatRequestAndLeavesOthersIntact) {
  target(5);
  inj_->fail_kind = static_cast<int>(IoOpKind::kWrite);
  inj_->fail_errno = EIO;
  std::vector<char> w(data_[5].size(), 'x');
  try {
    swap_->write(exts_[5], w.data(), w.size()).wait();
    FAIL() << "expected IoError";
  } catch (const IoError& e) {
    EXPECT_EQ(e.err(), EIO);
    EXPECT_NE(std::string(e.what()).find("write failed"), std::string::npos);
  }
  expect_others_intact(5);
}

TEST_P(FaultTest, ShortReadsAndWritesAreCompleted) {
  inj_->max_bytes = 8192;  // every piece transfers at most 8 KiB per call
  std::vector<char> w(data_[2].size());
  test::fill_pattern(w.data(), w.size(), 777);
  swap_->write(exts_[2], w.data(), w.size()).wait();
  std::vector<char> r(w.size());
  swap_->read(exts_[2], r.data(), r.size()).wait();
  EXPECT_EQ(r, w);
  EXPECT_GT(engine_->stats().short_transfers, 0u);
  data_[2] = w;
  expect_others_intact(-1);
}

TEST_P(FaultTest, EnospcOnWriteIsAnIoErrorAndOnGrowthAnOutOfMemoryError) {
  target(7);
  inj_->fail_kind = static_cast<int>(IoOpKind::kWrite);
  inj_->fail_errno = ENOSPC;
  std::vector<char> w(data_[7].size(), 'y');
  try {
    swap_->write(exts_[7], w.data(), w.size()).wait();
    FAIL();
  } catch (const IoError& e) {
    EXPECT_EQ(e.err(), ENOSPC);
  }
  inj_->reset();
  // Growing past the initial 8 MiB is refused by max_bytes; with an unlimited max, a failing
  // fallocate (ENOSPC) is an OutOfMemoryError for the nvme tier.
  TempDir other;
  SwapSpaceOptions so;
  so.initial_bytes_per_path = 1 << 20;
  SwapSpace grow(so, {other.path()}, *engine_);
  inj_->fallocate_errno = ENOSPC;
  try {
    grow.allocate(4 << 20);
    FAIL() << "expected OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    EXPECT_EQ(e.tier(), Tier::kNvme);
    EXPECT_EQ(e.requested(), 4u << 20);
    EXPECT_NE(std::string(e.what()).find(other.path()), std::string::npos) << e.what();
  }
  inj_->fallocate_errno = 0;
  SwapExtent ok = grow.allocate(4 << 20);  // the same request works once space is back
  grow.free(ok);
  expect_others_intact(7);
}

TEST_P(FaultTest, EagainStormIsRetriedAndAnEndlessOneGivesUp) {
  inj_->fail_errno = EAGAIN;
  inj_->fail_first_n = 200;  // a storm: the first 200 issues fail with EAGAIN
  std::vector<char> w(data_[1].size());
  test::fill_pattern(w.data(), w.size(), 4242);
  swap_->write(exts_[1], w.data(), w.size()).wait();
  std::vector<char> r(w.size());
  inj_->fail_first_n = 200;
  swap_->read(exts_[1], r.data(), r.size()).wait();
  EXPECT_EQ(r, w);
  EXPECT_GE(engine_->stats().retries, 400u);
  data_[1] = w;
  // EAGAIN forever: the request fails with an IoError after the retry limit.
  target(6);
  inj_->fail_kind = static_cast<int>(IoOpKind::kRead);
  inj_->fail_first_n = -1;
  std::vector<char> r6(data_[6].size());
  try {
    swap_->read(exts_[6], r6.data(), r6.size()).wait();
    FAIL();
  } catch (const IoError& e) {
    EXPECT_EQ(e.err(), EAGAIN);
    EXPECT_NE(std::string(e.what()).find("retries"), std::string::npos) << e.what();
  }
  expect_others_intact(-1);
}

INSTANTIATE_TEST_SUITE_P(AllEngines, FaultTest, ::testing::ValuesIn(test::all_engine_configs()),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace tiermem
