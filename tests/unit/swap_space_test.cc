// SwapSpace: integrity of random extents (1 B .. 64 MiB) striped over two directories under every
// engine configuration; checksums (and a detected corruption); growth, the max, fragmentation
// stats; the per-directory lock within a process and across a fork; cleanup.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <filesystem>
#include <fcntl.h>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <memory>
#include <thread>
#include <sys/stat.h>

#include "unit/nvme_test_util.h"
#include "tiermem/error.h"
#include "tiermem/swap_space.h"

namespace tiermem {
namespace {

using test::AlignedBuf;
using test::TempDir;

SwapSpaceOptions small_options() {
  SwapSpaceOptions o;
  o.stripe_bytes = 256 << 10;
  o.initial_bytes_per_path = 1 << 20;
  o.checksum = true;
  return o;
}

class SwapSpaceTest : public ::testing::TestWithParam<test::EngineConfig> {
 protected:
  void SetUp() override {
    ASSERT_TRUE(a_.ok() && b_.ok());
    try {
      engine_ = make_io_engine(test::options_for(GetParam()));
    } catch (const NotSupportedError& e) {
      GTEST_SKIP() << "io_uring not available here: " << e.what();
    }
  }
  TempDir a_, b_;
  std::unique_ptr<IoEngine> engine_;
};

TEST_P(SwapSpaceTest, RandomExtentsOverTwoPathsReadBackExactly) {
  SwapSpace swap(small_options(), {a_.path(), b_.path()}, *engine_);
  std::mt19937_64 rng(7);
  std::vector<std::uint64_t> sizes = {64ull << 20, 5ull << 20 | 17};
  for (int i = 0; i < 200; ++i)
    sizes.push_back(static_cast<std::uint64_t>(std::exp(std::uniform_real_distribution<>(0, std::log(2 << 20))(rng))));
  struct Item {
    SwapExtent ext;
    std::vector<char> data;  // unaligned std::vector buffers: exercises the bounce path
  };
  std::vector<Item> items;
  std::vector<IoRequest> reqs;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    Item it{swap.allocate(sizes[i]), std::vector<char>(sizes[i])};
    test::fill_pattern(it.data.data(), it.data.size(), i + 100);
    items.push_back(std::move(it));
  }
  for (auto& it : items) reqs.push_back(swap.write(it.ext, it.data.data(), it.data.size()));
  wait_all(reqs);
  // Free every third extent and reuse the space with new data: the others must not change.
  for (std::size_t i = 0; i < items.size(); i += 3) {
    swap.free(items[i].ext);
    items[i].ext = swap.allocate(items[i].data.size());
    test::fill_pattern(items[i].data.data(), items[i].data.size(), i + 5000);
    swap.write(items[i].ext, items[i].data.data(), items[i].data.size()).wait();
  }
  // The big extent is striped over both paths.
  bool p0 = false, p1 = false;
  for (const auto& p : items[0].ext.pieces) (p.path_index == 0 ? p0 : p1) = true;
  EXPECT_TRUE(p0 && p1);
  reqs.clear();
  std::vector<std::vector<char>> back(items.size());
  for (std::size_t i = 0; i < items.size(); ++i) {
    back[i].assign(items[i].data.size(), 0);
    reqs.push_back(swap.read(items[i].ext, back[i].data(), back[i].size()));
  }
  wait_all(reqs);
  for (std::size_t i = 0; i < items.size(); ++i)
    ASSERT_TRUE(back[i] == items[i].data) << "extent " << i << " of " << sizes[i] << " bytes";
  SwapStats s = swap.stats();
  EXPECT_EQ(s.extents, items.size());
  EXPECT_EQ(s.paths.size(), 2u);
  EXPECT_EQ(s.capacity_bytes, s.used_bytes + s.free_bytes);
  EXPECT_GE(s.capacity_bytes, 64ull << 20);  // grew from 1 MiB per path
  for (auto& it : items) swap.free(it.ext);
  s = swap.stats();
  EXPECT_EQ(s.used_bytes, 0u);
  EXPECT_EQ(s.free_runs, 2u);  // fully coalesced: one run per file
  EXPECT_EQ(s.largest_free_bytes, std::max(s.paths[0].capacity_bytes, s.paths[1].capacity_bytes));
}

INSTANTIATE_TEST_SUITE_P(AllEngines, SwapSpaceTest, ::testing::ValuesIn(test::all_engine_configs()),
                         [](const auto& info) { return std::string(info.param.name); });

// Default settings (checksums on): a byte flipped on disk is seen on read, re-read once, then
// reported as corrupt data naming the file, the extent's offset and the hashes.
TEST(SwapSpace, ChecksumMismatchIsDetectedWithDefaultSettings) {
  TempDir d;
  auto engine = make_io_engine(IoEngineOptions{});
  SwapSpaceOptions o;  // defaults, but a small file
  o.initial_bytes_per_path = 1 << 20;
  ASSERT_TRUE(o.checksum) << "checksums must be on by default";
  SwapSpace swap(o, {d.path()}, *engine);
  SwapExtent keep = swap.allocate(10000), bad = swap.allocate(50000);
  std::vector<char> k(10000), x(50000), r(50000);
  test::fill_pattern(k.data(), k.size(), 1);
  test::fill_pattern(x.data(), x.size(), 2);
  swap.write(keep, k.data(), k.size()).wait();
  swap.write(bad, x.data(), x.size()).wait();
  // Corrupt one byte of `bad` behind the engine's back.
  int fd = ::open(swap.file_path(0).c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  char c = 0x5A;
  ASSERT_EQ(::pwrite(fd, &c, 1, static_cast<off_t>(bad.pieces[0].offset + 30000)), 1);
  ::close(fd);
  try {
    swap.read(bad, r.data(), r.size()).wait();
    FAIL() << "expected a checksum mismatch";
  } catch (const IoError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("checksum mismatch"), std::string::npos) << m;
    EXPECT_NE(m.find("on a re-read"), std::string::npos) << m;
    EXPECT_NE(m.find("written"), std::string::npos) << m;
    EXPECT_TRUE(e.corrupt_data()) << m;
    EXPECT_EQ(e.err(), 0);
    EXPECT_EQ(e.path(), swap.file_path(0));
    EXPECT_EQ(e.offset(), bad.pieces[0].offset);
  }
  std::vector<char> kr(10000);
  swap.read(keep, kr.data(), kr.size()).wait();  // the other extent still verifies
  EXPECT_EQ(kr, k);
  // Writing the extent again repairs it (the new bytes' hash replaces the old one).
  swap.write(bad, x.data(), x.size()).wait();
  swap.read(bad, r.data(), r.size()).wait();
  EXPECT_EQ(r, x);
}

// A fault that is gone when the extent is read again (here: the disk holds a flipped byte while
// the first part of the read is transferred and is repaired before the rest is) costs a re-read
// and a warning, not an error; the caller gets the right bytes.
TEST(SwapSpace, TransientMismatchIsForgivenByTheReRead) {
  struct FlipDuringFirstRead : IoInterceptor {
    std::string path;
    std::uint64_t lo = 0, hi = 0;  // the extent's bytes in the file
    std::uint64_t at = 0;          // file offset of the byte to flip
    std::atomic<int> reads{0};
    Decision before_io(IoOpKind kind, const std::string& p, std::uint64_t offset,
                       std::uint64_t bytes) override {
      Decision d;
      if (kind != IoOpKind::kRead || p != path || offset + bytes <= lo || offset >= hi) return d;
      const int n = reads++;
      if (n == 0) {  // first piece: corrupt the disk, and let only 4 KiB through
        flip();
        d.max_bytes = 4096;
      } else if (n == 1) {  // the rest of the short transfer: repair the disk
        flip();
      }
      return d;
    }
    void flip() const {
      const int fd = ::open(path.c_str(), O_RDWR);
      if (fd < 0) return;
      char b = 0;
      if (::pread(fd, &b, 1, static_cast<off_t>(at)) == 1) {
        b = static_cast<char>(b ^ 0x01);
        (void)!::pwrite(fd, &b, 1, static_cast<off_t>(at));
      }
      ::close(fd);
    }
  };
  TempDir d;
  auto flipper = std::make_shared<FlipDuringFirstRead>();
  IoEngineOptions io;
  io.kind = IoEngineKind::kPosix;
  io.o_direct = false;  // the flips go through the page cache the reads see
  io.interceptor = flipper;
  auto engine = make_io_engine(io);
  SwapSpaceOptions o;
  o.initial_bytes_per_path = 1 << 20;
  SwapSpace swap(o, {d.path()}, *engine);
  SwapExtent e = swap.allocate(32768);
  std::vector<char> x(32768), r(32768);
  test::fill_pattern(x.data(), x.size(), 3);
  swap.write(e, x.data(), x.size()).wait();
  flipper->path = swap.file_path(0);
  flipper->lo = e.pieces[0].offset;
  flipper->hi = e.pieces[0].offset + x.size();
  flipper->at = e.pieces[0].offset + 100;  // inside the first 4 KiB
  swap.read(e, r.data(), r.size()).wait();  // must not throw
  EXPECT_EQ(flipper->reads.load(), 2) << "the read was not split as the test intends";
  EXPECT_EQ(r, x);
}

// Checksums off (tiermem.checksum: false): the same flip is not noticed (the old behaviour,
// still there for whoever turns them off).
TEST(SwapSpace, ChecksumOffReadsWhatIsOnDisk) {
  TempDir d;
  auto engine = make_io_engine(IoEngineOptions{});
  SwapSpaceOptions o;
  o.initial_bytes_per_path = 1 << 20;
  o.checksum = false;
  SwapSpace swap(o, {d.path()}, *engine);
  SwapExtent e = swap.allocate(8192);
  AlignedBuf x(8192), r(8192);
  test::fill_pattern(x.data, x.size, 4);
  swap.write(e, x.data, x.size).wait();
  int fd = ::open(swap.file_path(0).c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  const char c = static_cast<char>(x.data[10] ^ 0x40);
  ASSERT_EQ(::pwrite(fd, &c, 1, static_cast<off_t>(e.pieces[0].offset + 10)), 1);
  ::close(fd);
  swap.read(e, r.data, r.size).wait();
  EXPECT_EQ(r.data[10], c);
}

// The hashes leave the engine's completion thread (src/nvme/hash_worker.h): a write is hashed on
// the calling thread, a read verified on the swap space's hash thread; both are counted in
// SwapStats::checksum_bytes / checksum_ns, and many reads in flight at once still each verify
// (and each catch a flipped byte) with their own result.
TEST(SwapSpace, ChecksumsRunOffTheCompletionThreadAndAreCounted) {
  TempDir d;
  auto engine = make_io_engine(IoEngineOptions{});
  SwapSpaceOptions o;
  o.initial_bytes_per_path = 8 << 20;
  SwapSpace swap(o, {d.path()}, *engine);
  constexpr int kExtents = 24;
  constexpr std::size_t kBytes = 256 << 10;
  std::vector<SwapExtent> ext;
  std::vector<std::unique_ptr<AlignedBuf>> src, dst;
  std::vector<IoRequest> reqs;
  for (int i = 0; i < kExtents; ++i) {
    ext.push_back(swap.allocate(kBytes));
    src.push_back(std::make_unique<AlignedBuf>(kBytes));
    dst.push_back(std::make_unique<AlignedBuf>(kBytes));
    test::fill_pattern(src.back()->data, kBytes, 100 + i);
    reqs.push_back(swap.write(ext.back(), src.back()->data, kBytes));
  }
  wait_all(reqs);
  EXPECT_EQ(swap.stats().checksum_bytes, kExtents * kBytes);
  // Flip one byte in every third extent on disk.
  const int fd = ::open(swap.file_path(0).c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  for (int i = 0; i < kExtents; i += 3) {
    const char c = static_cast<char>(src[static_cast<std::size_t>(i)]->data[777] ^ 0x10);
    ASSERT_EQ(::pwrite(fd, &c, 1, static_cast<off_t>(ext[static_cast<std::size_t>(i)].pieces[0].offset + 777)), 1);
  }
  ::fsync(fd);
  ::close(fd);
  reqs.clear();
  std::atomic<int> on_completion_thread{0};
  const auto me = std::this_thread::get_id();
  for (int i = 0; i < kExtents; ++i) {
    reqs.push_back(swap.read(ext[static_cast<std::size_t>(i)], dst[static_cast<std::size_t>(i)]->data, kBytes));
    reqs.back().on_complete([&, me](std::exception_ptr) {
      if (std::this_thread::get_id() != me) ++on_completion_thread;
    });
  }
  for (int i = 0; i < kExtents; ++i) {
    const IoRequest& r = reqs[static_cast<std::size_t>(i)];
    if (i % 3 == 0) {
      EXPECT_THROW(r.wait(), IoError) << "extent " << i;
    } else {
      EXPECT_NO_THROW(r.wait()) << "extent " << i;
      EXPECT_EQ(std::memcmp(dst[static_cast<std::size_t>(i)]->data, src[static_cast<std::size_t>(i)]->data, kBytes), 0);
    }
  }
  EXPECT_GT(on_completion_thread.load(), 0);  // reads completed on another thread than the caller's
  const SwapStats st = swap.stats();
  // Every read was hashed once, and each corrupt one once more after its re-read.
  EXPECT_EQ(st.checksum_bytes, 2 * kExtents * kBytes);
  EXPECT_GT(st.checksum_ns, 0u);
}

TEST(SwapSpace, MaxSizeGivesOutOfMemoryErrorAndFreeMakesRoom) {
  TempDir d;
  auto engine = make_io_engine(IoEngineOptions{});
  SwapSpaceOptions o = small_options();
  o.max_bytes_per_path = 4 << 20;
  SwapSpace swap(o, {d.path()}, *engine);
  SwapExtent a = swap.allocate(3 << 20);
  try {
    swap.allocate(2 << 20);
    FAIL() << "expected OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    EXPECT_EQ(e.tier(), Tier::kNvme);
    EXPECT_EQ(e.requested(), 2u << 20);
    EXPECT_EQ(e.available(), 1u << 20);
    EXPECT_NE(std::string(e.what()).find(d.path()), std::string::npos) << e.what();
  }
  swap.free(a);
  SwapExtent b = swap.allocate(4 << 20);
  EXPECT_EQ(swap.stats().capacity_bytes, 4u << 20);
  EXPECT_THROW(swap.free(a), Error);  // double free
  swap.free(b);
}

// Growth doubles while the file is small, then goes 1 GiB at a time: 2.25 GiB of extents in a
// file that started at 1 MiB leave it at most 1 GiB larger than what it holds (doubling alone
// would have made it 4 GiB). fallocate reserves the blocks without writing them.
TEST(SwapSpace, GrowthNeverOvershootsByMoreThanOneGiB) {
  TempDir d;
  auto engine = make_io_engine(IoEngineOptions{});
  SwapSpaceOptions o = small_options();
  o.stripe_bytes = 1ull << 30;
  SwapSpace swap(o, {d.path()}, *engine);
  std::vector<SwapExtent> held;
  std::uint64_t total = 0;
  try {
    for (int i = 0; i < 9; ++i) {
      held.push_back(swap.allocate(256ull << 20));
      total += 256ull << 20;
      const std::uint64_t cap = swap.stats().capacity_bytes;
      EXPECT_GE(cap, total);
      EXPECT_LE(cap, total + (1ull << 30)) << "after " << total << " bytes";
    }
  } catch (const OutOfMemoryError& e) {
    GTEST_SKIP() << "this filesystem has no 3.25 GiB to spare: " << e.what();
  }
  EXPECT_LT(swap.stats().capacity_bytes, 4ull << 30);
  for (const auto& x : held) swap.free(x);
}

TEST(SwapSpace, FragmentationStats) {
  TempDir d;
  auto engine = make_io_engine(IoEngineOptions{});
  SwapSpaceOptions o = small_options();
  o.initial_bytes_per_path = 16 * 4096;
  o.max_bytes_per_path = 16 * 4096;
  SwapSpace swap(o, {d.path()}, *engine);
  std::vector<SwapExtent> e;
  for (int i = 0; i < 16; ++i) e.push_back(swap.allocate(i % 2 ? 4096 : 1));  // 1 B pads to 4 KiB
  for (int i = 0; i < 16; i += 2) swap.free(e[i]);
  SwapStats s = swap.stats();
  EXPECT_EQ(s.free_bytes, 8u * 4096);
  EXPECT_EQ(s.largest_free_bytes, 4096u);
  EXPECT_EQ(s.free_runs, 8u);
  EXPECT_EQ(s.extents, 8u);
  EXPECT_THROW(swap.allocate(8192), OutOfMemoryError);  // free, but fragmented
}

TEST(SwapSpace, SecondUserOfADirectoryGetsAClearErrorAndFilesAreRemoved) {
  TempDir d;
  auto engine = make_io_engine(IoEngineOptions{});
  std::string file;
  {
    SwapSpace first(small_options(), {d.path()}, *engine);
    file = first.file_path(0);
    EXPECT_TRUE(std::filesystem::exists(file));
    try {
      SwapSpace second(small_options(), {d.path()}, *engine);
      FAIL() << "expected the directory lock to refuse";
    } catch (const Error& e) {
      std::string m = e.what();
      // The holder is this process: the message says so and what to do (not "another process").
      EXPECT_NE(m.find("in use by another engine in this process (pid " + std::to_string(::getpid())),
                std::string::npos) << m;
      EXPECT_NE(m.find("close that one first"), std::string::npos) << m;
      EXPECT_NE(m.find(d.path()), std::string::npos) << m;
    }
    EXPECT_TRUE(std::filesystem::exists(file));
  }
  EXPECT_FALSE(std::filesystem::exists(file));
  EXPECT_TRUE(std::filesystem::is_empty(d.path()));
  SwapSpace again(small_options(), {d.path()}, *engine);  // the lock was released
}

TEST(SwapSpace, ForkedProcessCannotShareTheDirectoryAndDataIsUnchanged) {
  TempDir d;
  auto engine = make_io_engine(IoEngineOptions{});
  SwapSpace swap(small_options(), {d.path()}, *engine);
  SwapExtent e = swap.allocate(3 << 20);
  std::vector<char> w(3 << 20), r(3 << 20);
  test::fill_pattern(w.data(), w.size(), 99);
  swap.write(e, w.data(), w.size()).wait();
  int pipefd[2];
  ASSERT_EQ(::pipe(pipefd), 0);
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {  // child: a fresh engine and SwapSpace on the same directory must fail
    ::close(pipefd[0]);
    std::string msg = "no error";
    int code = 1;
    try {
      IoEngineOptions po;
      po.kind = IoEngineKind::kPosix;
      auto e2 = make_io_engine(po);
      SwapSpace s2(small_options(), {d.path()}, *e2);
    } catch (const Error& err) {
      msg = err.what();
      code = 0;
    } catch (...) {
      msg = "unexpected exception";
    }
    ssize_t n = ::write(pipefd[1], msg.data(), msg.size());
    (void)n;
    ::_exit(code);
  }
  ::close(pipefd[1]);
  std::string msg;
  char buf[512];
  ssize_t n;
  while ((n = ::read(pipefd[0], buf, sizeof buf)) > 0) msg.append(buf, static_cast<std::size_t>(n));
  ::close(pipefd[0]);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << msg;
  EXPECT_NE(msg.find("in use by process " + std::to_string(::getpid())), std::string::npos) << msg;
  EXPECT_TRUE(std::filesystem::exists(swap.file_path(0)));
  swap.read(e, r.data(), r.size()).wait();
  EXPECT_EQ(r, w);
}

TEST(SwapSpace, StaleSwapFilesOfDeadProcessesAreRemoved) {
  TempDir d;
  std::string stale = d.path() + "/tiermem-swap-999999.bin";
  { std::FILE* f = std::fopen(stale.c_str(), "w"); ASSERT_NE(f, nullptr); std::fclose(f); }
  auto engine = make_io_engine(IoEngineOptions{});
  SwapSpace swap(small_options(), {d.path()}, *engine);
  EXPECT_FALSE(std::filesystem::exists(stale));
}

TEST(SwapSpace, BadStripeIsAConfigError) {
  TempDir d;
  auto engine = make_io_engine(IoEngineOptions{});
  SwapSpaceOptions o = small_options();
  o.stripe_bytes = 1000;
  try {
    SwapSpace s(o, {d.path()}, *engine);
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.key_path(), "tiermem.stripe_bytes");
  }
  EXPECT_THROW(SwapSpace(small_options(), {d.path() + "/missing"}, *engine), IoError);
}

}  // namespace
}  // namespace tiermem

namespace tiermem {
namespace {

// Writes `text` to a fresh file at `path`; returns its content read back later by slurp().
void put(const std::string& path, const std::string& text) {
  FILE* f = std::fopen(path.c_str(), "w");
  ASSERT_NE(f, nullptr) << path;
  std::fputs(text.c_str(), f);
  std::fclose(f);
}
std::string slurp(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// A symlink planted at <dir>/tiermem.lock (someone else's trap in a shared directory) is refused
// with ELOOP, and the file it points to keeps its contents (before: truncated, our pid written).
TEST(SwapSpace, SymlinkPlantedAsTheLockIsNotFollowed) {
  TempDir d, elsewhere;
  const std::string victim = elsewhere.path() + "/precious.txt";
  put(victim, "precious contents\n");
  const std::string lock = d.path() + "/tiermem.lock";
  ASSERT_EQ(::symlink(victim.c_str(), lock.c_str()), 0);
  auto engine = make_io_engine(IoEngineOptions{});
  try {
    SwapSpace swap(small_options(), {d.path()}, *engine);
    FAIL() << "a symlink lock file was accepted";
  } catch (const IoError& e) {
    EXPECT_EQ(e.err(), ELOOP) << e.what();
    EXPECT_EQ(e.path(), lock);
    EXPECT_NE(std::string(e.what()).find("symbolic link"), std::string::npos) << e.what();
  }
  EXPECT_EQ(slurp(victim), "precious contents\n");
  struct stat st {};
  ASSERT_EQ(::lstat(lock.c_str(), &st), 0);
  EXPECT_TRUE(S_ISLNK(st.st_mode)) << "the planted link itself is left for its owner";
}

// A symlink planted at the name our swap file will get is removed as a stale swap file (unlink
// does not follow it); the swap file is then created fresh (O_NOFOLLOW), the target untouched.
TEST(SwapSpace, SymlinkPlantedAsTheSwapFileIsNotFollowed) {
  TempDir d, elsewhere;
  const std::string victim = elsewhere.path() + "/precious.txt";
  put(victim, "precious contents\n");
  const std::string name = d.path() + "/tiermem-swap-" + std::to_string(::getpid()) + ".bin";
  ASSERT_EQ(::symlink(victim.c_str(), name.c_str()), 0);
  auto engine = make_io_engine(IoEngineOptions{});
  {
    SwapSpace swap(small_options(), {d.path()}, *engine);
    SwapExtent e = swap.allocate(4096);
    AlignedBuf x(4096);
    test::fill_pattern(x.data, x.size, 5);
    swap.write(e, x.data, x.size).wait();
    struct stat st {};
    ASSERT_EQ(::lstat(swap.file_path(0).c_str(), &st), 0);
    EXPECT_TRUE(S_ISREG(st.st_mode));
    EXPECT_EQ(st.st_mode & 0777, 0600u);
    swap.free(e);
  }
  EXPECT_EQ(slurp(victim), "precious contents\n");
  struct stat lst {};
  ASSERT_EQ(::lstat((d.path() + "/tiermem.lock").c_str(), &lst), -1) << "lock left behind";
}

// A directory anyone may write into without the sticky bit is refused (anyone could replace
// our files there); with the sticky bit (like /tmp) it is accepted.
TEST(SwapSpace, WorldWritableDirectoryWithoutStickyBitIsRefused) {
  TempDir d;
  ASSERT_EQ(::chmod(d.path().c_str(), 0777), 0);
  auto engine = make_io_engine(IoEngineOptions{});
  try {
    SwapSpace swap(small_options(), {d.path()}, *engine);
    FAIL() << "a world-writable directory was accepted";
  } catch (const ConfigError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("'" + d.path() + "'"), std::string::npos) << m;
    EXPECT_NE(m.find("world-writable (mode 0777) without the sticky bit"), std::string::npos) << m;
    EXPECT_EQ(e.value(), d.path());
  }
  ASSERT_EQ(::chmod(d.path().c_str(), 01777), 0);
  SwapSpace swap(small_options(), {d.path()}, *engine);
  EXPECT_EQ(swap.stats().paths.size(), 1u);
}

// A directory owned by another user is refused, naming it and its owner. Needs root (chown).
TEST(SwapSpace, DirectoryOwnedByAnotherUserIsRefused) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to chown a directory to another uid";
  TempDir d;
  ASSERT_EQ(::chown(d.path().c_str(), 4242, 4242), 0);
  auto engine = make_io_engine(IoEngineOptions{});
  try {
    SwapSpace swap(small_options(), {d.path()}, *engine);
    FAIL() << "a directory of uid 4242 was accepted";
  } catch (const ConfigError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("'" + d.path() + "'"), std::string::npos) << m;
    EXPECT_NE(m.find("owned by uid 4242, not by you (uid 0)"), std::string::npos) << m;
  }
  EXPECT_TRUE(std::filesystem::is_empty(d.path())) << "nothing may be created in it";
}

// A directory not made yet is looked up at its nearest existing ancestor (tiermem-bench profile
// printed "0 B free" for the --path it had made and removed again).
TEST(SwapSpace, DriveFreeBytesOfAPathNotMadeYetIsItsAncestorsDrives) {
  TempDir d;
  ASSERT_TRUE(d.ok());
  const std::uint64_t here = drive_free_bytes(d.path());
  const std::uint64_t below = drive_free_bytes(d.path() + "/not/made/yet");
  ASSERT_GT(here, 0u);
  // The same filesystem: equal but for what other processes wrote between the two calls.
  EXPECT_LT(std::llabs(static_cast<long long>(below) - static_cast<long long>(here)), static_cast<long long>(here / 20));
  EXPECT_FALSE(std::filesystem::exists(d.path() + "/not")) << "nothing is made";
}

}  // namespace
}  // namespace tiermem
