// tiermem-bench nvme never harms a user's file (issue 14), as fio: an existing file's own size is
// the default --size; a read job never writes to it (a --size above its size is refused, exit 2,
// naming both sizes); the bench's own data file is created only in a directory and removed at
// exit unless --keep; a path that does not exist exits 2 with "does not exist", one it cannot
// write with "is not writable"; a signal mid-run reports what was measured. Every case
// checksums the user's file before and after. The subcommands' ranged options name a value that
// is no number, or not a whole one, as such (not "not in range").
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <tuple>

#ifndef TIERMEM_BENCH_BIN
#error "TIERMEM_BENCH_BIN must name the tiermem-bench executable"
#endif

namespace {
namespace fs = std::filesystem;

struct Result {
  int exit_code = -1;
  std::string out, err;
};

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// FNV-1a 64 of the file's bytes, and its size: what "unharmed" means.
struct Sum {
  std::uint64_t hash = 0;
  std::uintmax_t size = 0;
  bool operator==(const Sum&) const = default;
};
Sum checksum(const fs::path& p) {
  const std::string bytes = slurp(p);
  std::uint64_t h = 1469598103934665603ull;
  for (unsigned char c : bytes) h = (h ^ c) * 1099511628211ull;
  return {h, fs::file_size(p)};
}

class BenchCli : public ::testing::Test {
 protected:
  void SetUp() override {
    // Under the build tree (a disk filesystem, so O_DIRECT works), not /tmp (tmpfs on some hosts).
    dir_ = fs::current_path() / ("bench_cli_" + std::to_string(::getpid()) + "_" +
                                 ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_ / "d");
    std::mt19937_64 rng(14);
    std::string data(8u << 20, '\0');
    for (char& c : data) c = static_cast<char>(rng());
    std::ofstream(dir_ / "user.dat", std::ios::binary) << data;
    std::ofstream(dir_ / "empty.dat", std::ios::binary).flush();
  }
  void TearDown() override { fs::remove_all(dir_); }

  // tiermem-bench `args` run in dir_ (behind `wrapper`, e.g. "timeout -s TERM 2"); exit code -1
  // when a signal ended it.
  Result bench(const std::string& args, const std::string& wrapper = "") {
    const fs::path out = dir_ / "stdout.txt", err = dir_ / "stderr.txt";
    const std::string cmd = "cd " + dir_.string() + " && " + wrapper + " " + TIERMEM_BENCH_BIN + " " + args + " >" +
                            out.string() + " 2>" + err.string();
    const int status = std::system(cmd.c_str());
    Result r;
    r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    r.out = slurp(out);
    r.err = slurp(err);
    return r;
  }
  Result run(const std::string& args) { return bench("nvme --bs 64K --qd 4 --runtime 0.2 " + args); }

  fs::path dir_;
};

TEST_F(BenchCli, ReadJobsLeaveAUsersFileAsItWas) {
  const Sum before = checksum(dir_ / "user.dat");
  for (const char* rw : {"read", "randread"}) {
    SCOPED_TRACE(rw);
    Result r = run(std::string("--path user.dat --json --rw ") + rw);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    // The file's own size is the default --size: 8 MiB, not 1 GiB.
    EXPECT_NE(r.out.find("size=8.0 MiB"), std::string::npos) << r.out;
    EXPECT_TRUE(checksum(dir_ / "user.dat") == before);
  }
  EXPECT_FALSE(fs::exists(dir_ / "tiermem-bench-nvme.dat"));
}

TEST_F(BenchCli, ReadLargerThanTheFileIsRefusedNamingBothSizes) {
  const Sum before = checksum(dir_ / "user.dat");
  Result r = run("--path user.dat --rw read --size 16M");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("16777216"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("8388608"), std::string::npos) << r.err;
  EXPECT_TRUE(checksum(dir_ / "user.dat") == before);

  const Sum empty = checksum(dir_ / "empty.dat");
  r = run("--path empty.dat --rw read");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("0 bytes"), std::string::npos) << r.err;
  EXPECT_TRUE(checksum(dir_ / "empty.dat") == empty);  // not extended
  r = run("--path empty.dat --rw randwrite");
  EXPECT_EQ(r.exit_code, 2) << r.err;  // a write job into an empty file needs an explicit --size
  EXPECT_TRUE(checksum(dir_ / "empty.dat") == empty);
}

TEST_F(BenchCli, OwnFileOnlyInADirectoryAndRemovedUnlessKept) {
  Result r = run("--path d --rw read --size 1M");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_FALSE(fs::exists(dir_ / "d" / "tiermem-bench-nvme.dat")) << "left behind";
  r = run("--path d --rw write --size 1M --keep");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  ASSERT_TRUE(fs::exists(dir_ / "d" / "tiermem-bench-nvme.dat"));
  EXPECT_EQ(fs::file_size(dir_ / "d" / "tiermem-bench-nvme.dat"), 1u << 20);
  // A kept file is the bench's, but not this run's: a later run without --keep leaves it.
  r = run("--path d --rw read --size 1M");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(fs::exists(dir_ / "d" / "tiermem-bench-nvme.dat"));
}

// A --size the filesystem cannot hold is refused before anything is written (a helper's 100G
// write job into /dev/shm filled the machine's memory): exit 2, the sizes named, nothing left.
TEST_F(BenchCli, SizeBeyondTheFreeSpaceIsRefusedBeforeWriting) {
  const Sum before = checksum(dir_ / "user.dat");
  for (const char* args : {"--path d --rw write --size 1024T", "--path d --rw read --size 1024T",
                           "--path user.dat --rw write --size 1024T"}) {
    SCOPED_TRACE(args);
    Result r = run(args);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_NE(r.err.find("free"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("1125899906842624"), std::string::npos) << r.err;  // 1 PiB in bytes
    EXPECT_FALSE(fs::exists(dir_ / "d" / "tiermem-bench-nvme.dat")) << "left behind";
  }
  EXPECT_TRUE(checksum(dir_ / "user.dat") == before);
  EXPECT_EQ(fs::file_size(dir_ / "user.dat"), 8u << 20);
}

TEST_F(BenchCli, MissingPathExitsWith2SayingDoesNotExist) {
  for (const char* path : {"no_such_dir/x", "no_such_dir", "d/no_such_file"}) {
    SCOPED_TRACE(path);
    Result r = run(std::string("--path ") + path + " --rw read --size 1M");
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_NE(r.err.find("does not exist"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find(path), std::string::npos) << r.err;
  }
  EXPECT_FALSE(fs::exists(dir_ / "no_such_dir"));
  EXPECT_FALSE(fs::exists(dir_ / "d" / "no_such_file"));
  // The pipeline bench's --path is a directory too: a missing one is not created.
  const std::string cmd = "cd " + dir_.string() + " && " + TIERMEM_BENCH_BIN +
                          " pipeline --path no_such_dir >/dev/null 2>err.txt";
  const int status = std::system(cmd.c_str());
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 2) << slurp(dir_ / "err.txt");
  EXPECT_NE(slurp(dir_ / "err.txt").find("does not exist"), std::string::npos);
  EXPECT_FALSE(fs::exists(dir_ / "no_such_dir"));
  // The profile's --path is a directory it may make: a file there is refused, naming it, exit 2.
  const std::string profile = "cd " + dir_.string() + " && " + TIERMEM_BENCH_BIN +
                              " profile --path user.dat --size 8M --copy-size 1M --reps 1 >/dev/null 2>err.txt";
  const int ps = std::system(profile.c_str());
  EXPECT_TRUE(WIFEXITED(ps) && WEXITSTATUS(ps) == 2) << slurp(dir_ / "err.txt");
  EXPECT_NE(slurp(dir_ / "err.txt").find("--path = user.dat: is a file"), std::string::npos) << slurp(dir_ / "err.txt");
}

TEST_F(BenchCli, WriteJobWritesTheUsersFileWithinItsSize) {
  // fio semantics: a write job is asked to write; it stays within the file's size.
  Result r = run("--path user.dat --rw write");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(fs::file_size(dir_ / "user.dat"), 8u << 20);
  EXPECT_TRUE(fs::exists(dir_ / "user.dat"));  // never removed
}

TEST_F(BenchCli, ARangedOptionThatIsNoWholeNumberIsCalledThat) {
  for (const char* bad : {"gemm --reps abc", "gemm --rows 1.5", "prefetch --steps x", "profile --reps 2.5",
                          "nvme --qd 1.5", "nvme --jobs two", "gpt --reps abc", "gpt --seq 1.5", "h2d --reps x",
                          "pipeline --chunks 2.5", "checksum --reps abc", "adam --threads 1.5",
                          "zero-offload --reps abc"}) {
    SCOPED_TRACE(bad);
    const Result r = bench(bad);
    const std::string& err = r.err;
    EXPECT_GT(r.exit_code, 0) << err;
    const std::string value = std::string(bad).substr(std::string(bad).rfind(' ') + 1);
    EXPECT_NE(err.find("'" + value + "' is not a whole number"), std::string::npos) << err;
    EXPECT_EQ(err.find("not in range"), std::string::npos) << err;
  }
}

// A count below its range is refused before anything runs (h2d --reps -3 printed a table of zero
// GB/s); a rate that is no number, or none a run can have, says so.
TEST_F(BenchCli, OutOfRangeCountsAndRatesAreRefused) {
  struct Case {
    const char* args;
    const char* says;
  } cases[] = {{"h2d --reps -3", "--reps"}, {"gpt --batch 0", "--batch"}, {"pipeline --tensors 0", "--tensors"},
               {"prefetch --nvme-gbps x", "'x' is not a number"}, {"prefetch --nvme-gbps 0", "0 is outside [0.001, 10000]"},
               {"prefetch --device-budget-frac 2", "2 is outside [1e-06, 1]"}, {"adam --threads -1", "--threads"},
               // Sizes and counts the runs cannot use: a division by zero (h2d --min-size 0), a heap
               // overrun (adam --params 3), garbage tables (checksum --size 0, pipeline
               // --tensor-size 0, zero-offload --params 0), a clamp (gpt --seq), a run without end.
               {"h2d --min-size 0", "--min-size = 0: must be at least 4K"},
               {"h2d --min-size 2G --max-size 8K", "is below --min-size"},
               {"adam --params 3", "'3' is below the smallest count, 4096"},
               {"adam --params 1M,,2M", "'' is not a parameter count"},
               {"checksum --size 0", "--size = 0: must be at least 4K"},
               {"pipeline --tensor-size 0", "--tensor-size = 0: must be at least 4K"},
               {"zero-offload --params 0 --dir zo", "--params = 0: must be at least 64K"},
               {"zero-offload --sub-group 0 --dir zo", "--sub-group = 0"},
               {"gpt --model tiny --seq 100", "is above --model tiny's seq_len, 16"},
               {"nvme --path . --runtime 1e30", "--runtime 1e+30 must be in (0, 3600] seconds"},
               // Past what the option's type holds, and booleans that are neither (CLI11: "Could not convert").
               {"nvme --path . --qd 99999999999", "99999999999 is outside [1, 4096]"},
               {"zero-offload --pin maybe --dir zo", "'maybe' is not true or false"},
               {"pipeline --o-direct maybe", "'maybe' is not true or false"},
               // A device budget below the trace's largest tensor cannot run (it failed late, exit 1).
               {"prefetch --model gpt2-small --steps 2 --device-budget 10M", "is below the trace's largest tensor"},
               {"prefetch --model gpt2-small --steps 2 --device-budget-frac 0.25", "give at least 0.311"},
               {"profile --copy-size 100T", "--copy-size = 100T: must be at least 4KiB and at most 1GiB"},
               // Beyond the drive or memory: refused before the file is laid out (it failed late).
               {"pipeline --tensor-size 16G --tensors 1000", "--tensor-size = 16G: the run holds about four tensors"},
               {"profile --path pz/q --size 1000T", "--size = 1000T: is read back into a host buffer of that size"}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.args);
    const Result r = bench(c.args);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_NE(r.err.find(c.says), std::string::npos) << r.err;
    EXPECT_EQ(r.out, "") << "nothing ran";
  }
  EXPECT_FALSE(fs::exists(dir_ / "zo")) << "zero-offload made its --dir before refusing the run";
  EXPECT_FALSE(fs::exists(dir_ / "pz")) << "profile made its --path before refusing the run";
}

// Stopped by SIGTERM (timeout) mid-run, nvme still removes its own data file, as at a normal exit.
TEST_F(BenchCli, NvmeRemovesItsFileWhenStoppedBySigterm) {
  fs::create_directories(dir_ / "stop");
  const Result r = bench("nvme --path stop --rw read --bs 64K --size 8M --runtime 30", "timeout -s TERM 2");
  EXPECT_EQ(r.exit_code, 124) << "timeout ended it: " << r.err;
  EXPECT_FALSE(fs::exists(dir_ / "stop" / "tiermem-bench-nvme.dat")) << "left behind";
}

// Ctrl-C (SIGINT) or SIGTERM mid-run on a user's file (nothing to lay out first, so the signal
// lands in the timed run; a signal in the set-up still ends the process at once): the report of
// the time run, marked interrupted (JSON too, as the last line), then the process ends by the
// signal (130 / 143 in a shell); the file is as it was.
TEST_F(BenchCli, NvmeReportsWhatItMeasuredWhenInterrupted) {
  const Sum before = checksum(dir_ / "user.dat");
  for (const auto& [sig, name, code] : {std::tuple{"INT", "SIGINT", 130}, std::tuple{"TERM", "SIGTERM", 143}}) {
    SCOPED_TRACE(name);
    const Result r = bench("nvme --path user.dat --rw randread --bs 64K --runtime 30 --json",
                           std::string("timeout --preserve-status -s ") + sig + " 3");
    EXPECT_EQ(r.exit_code, code) << "ended by the signal: " << r.err;
    EXPECT_NE(r.out.find(std::string("interrupted by ") + name + " after "), std::string::npos) << r.out;
    EXPECT_NE(r.out.find(" of --runtime 30"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("  read: IOPS="), std::string::npos) << r.out;
    const std::string body = r.out.substr(0, r.out.find_last_not_of('\n') + 1);
    const std::string last = body.substr(body.rfind('\n') + 1);
    EXPECT_NE(last.find(std::string("\"interrupted\":\"") + name + "\""), std::string::npos) << last;
    EXPECT_EQ(last.find("\"bytes\":0,"), std::string::npos) << "nothing measured: " << last;
  }
  EXPECT_TRUE(checksum(dir_ / "user.dat") == before);
}

// A directory the bench cannot create its file in (/proc, /sys: "0 bytes free") is called not
// writable, with the system's reason, exit 2, before the free-space check.
TEST_F(BenchCli, NvmeOnADirectoryItCannotWriteSaysNotWritable) {
  for (const char* path : {"/proc", "/proc/self", "/sys/kernel"}) {
    SCOPED_TRACE(path);
    if (!fs::is_directory(path)) continue;
    const Result r = run(std::string("--path ") + path + " --size 64M");
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_NE(r.err.find(std::string("--path '") + path + "' is not writable: cannot create '"),
              std::string::npos)
        << r.err;
    EXPECT_EQ(r.err.find("free"), std::string::npos) << r.err;
    EXPECT_EQ(r.out, "") << "nothing ran";
  }
}

// The prefetch simulation runs at its defaults on every generated model: the default device budget
// holds the trace's largest tensor (gpt2-small's wte is more than a quarter of its bytes).
TEST_F(BenchCli, PrefetchRunsAtItsDefaults) {
  const Result r = bench("prefetch --model gpt2-small --steps 2");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("belady"), std::string::npos) << r.out;
}

// zero-offload leaves no directory it made: --dir's missing parents and io-alone go with the run.
TEST_F(BenchCli, ZeroOffloadRemovesTheDirectoriesItMade) {
  const Result r = bench("zero-offload --dir made/zo --params 64K --sub-group 16K --reps 1");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("zero-offload:"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(dir_ / "made")) << "left behind";
}

}  // namespace
