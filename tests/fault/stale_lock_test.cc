// Stale state after a crash (issue 8): a swap directory lock whose holder died (SIGKILL, no
// cleanup) is reclaimed with one log line and its swap file removed; a live holder still blocks
// with an error naming its pid. Both with real processes (fork).
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include "fault/fault_util.h"
#include "tiermem/error.h"
#include "tiermem/swap_space.h"

namespace tiermem {
namespace {

SwapSpaceOptions small() {
  SwapSpaceOptions so;
  so.initial_bytes_per_path = 1 << 20;
  return so;
}

IoEngineOptions posix() {  // the children make their own engine; keep it simple and thread-light
  IoEngineOptions o;
  o.kind = IoEngineKind::kPosix;
  o.o_direct = false;
  return o;
}

std::string read_file(const std::string& p) {
  std::ifstream f(p);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// Forks a child that takes the lock of `dir`, writes one byte to `ready`, then waits for a byte
// on `go` (or is killed). Returns its pid.
pid_t spawn_holder(const std::string& dir, int ready, int go) {
  pid_t pid = ::fork();
  if (pid == 0) {
    try {
      auto engine = make_io_engine(posix());
      SwapSpace swap(small(), {dir}, *engine);
      char c = 'r';
      if (::write(ready, &c, 1) != 1) ::_exit(3);
      if (::read(go, &c, 1) != 1) ::_exit(4);
    } catch (...) {
      ::_exit(2);
    }
    ::_exit(0);
  }
  return pid;
}

// A child holding the lock of a directory, and the pipes that talk to it (closed at the end).
struct Holder {
  pid_t pid = -1;
  int ready[2] = {-1, -1}, go[2] = {-1, -1};
  ~Holder() {
    for (int fd : {ready[0], ready[1], go[0], go[1]})
      if (fd >= 0) ::close(fd);
  }
};

// Forks the holder of `dir` (spawn_holder) and waits until it holds the lock. False on failure.
bool start_holder(const std::string& dir, Holder* h) {
  if (::pipe(h->ready) != 0 || ::pipe(h->go) != 0) return false;
  h->pid = spawn_holder(dir, h->ready[1], h->go[0]);
  char c = 0;
  return h->pid > 0 && ::read(h->ready[0], &c, 1) == 1;
}

TEST(StaleLock, DeadHolderIsReclaimedWithOneLogLine) {
  fault::TempDir dir("stale");
  ASSERT_TRUE(dir.ok());
  Holder holder;
  ASSERT_TRUE(start_holder(dir.path(), &holder));
  const pid_t pid = holder.pid;
  ASSERT_EQ(::kill(pid, SIGKILL), 0);  // a crash: no destructor, the lock file and swap file stay
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFSIGNALED(status));
  const std::string lock = dir.path() + "/tiermem.lock";
  const std::string stale_swap = dir.path() + "/tiermem-swap-" + std::to_string(pid) + ".bin";
  ASSERT_EQ(std::stoi(read_file(lock)), pid);
  ASSERT_TRUE(std::filesystem::exists(stale_swap));
  ASSERT_NE(::kill(pid, 0), 0);  // not alive

  auto engine = make_io_engine(posix());
  ::testing::internal::CaptureStderr();
  std::unique_ptr<SwapSpace> swap;
  try {
    swap = std::make_unique<SwapSpace>(small(), std::vector<std::string>{dir.path()}, *engine);
  } catch (const std::exception& e) {
    ::testing::internal::GetCapturedStderr();
    FAIL() << "the stale lock was not reclaimed: " << e.what();
  }
  const std::string log = ::testing::internal::GetCapturedStderr();
  std::size_t lines = 0, at = 0;
  while ((at = log.find("reclaimed stale lock", at)) != std::string::npos) {
    ++lines;
    ++at;
  }
  EXPECT_EQ(lines, 1u) << log;
  EXPECT_NE(log.find("of the swap directory"), std::string::npos) << log;
  EXPECT_NE(log.find("dead process " + std::to_string(pid)), std::string::npos) << log;
  EXPECT_NE(log.find(lock), std::string::npos) << log;
  EXPECT_FALSE(std::filesystem::exists(stale_swap));
  EXPECT_EQ(std::stoi(read_file(lock)), ::getpid());
  SwapExtent e = swap->allocate(8192);
  auto d = fault::make_bytes(1, 0, 8192);
  swap->write(e, d.data(), d.size()).wait();
  std::vector<std::byte> r(8192);
  swap->read(e, r.data(), r.size()).wait();
  EXPECT_EQ(r, d);
}

TEST(StaleLock, LiveHolderBlocksWithItsPid) {
  fault::TempDir dir("live");
  ASSERT_TRUE(dir.ok());
  Holder holder;
  ASSERT_TRUE(start_holder(dir.path(), &holder));
  const pid_t pid = holder.pid;
  auto engine = make_io_engine(posix());
  std::string what;
  try {
    SwapSpace swap(small(), {dir.path()}, *engine);
  } catch (const Error& e) {
    what = e.what();
  }
  EXPECT_NE(what.find("in use by process " + std::to_string(pid)), std::string::npos) << what;
  EXPECT_NE(what.find(dir.path()), std::string::npos) << what;
  // The holder's files are untouched by the failed attempt; it exits cleanly and removes them.
  EXPECT_TRUE(std::filesystem::exists(dir.path() + "/tiermem-swap-" + std::to_string(pid) + ".bin"));
  const char c = 'g';
  ASSERT_EQ(::write(holder.go[1], &c, 1), 1);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  SwapSpace after(small(), {dir.path()}, *engine);  // free now
  EXPECT_EQ(after.dirs().size(), 1u);
}

}  // namespace
}  // namespace tiermem
