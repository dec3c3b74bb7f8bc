// Crash loop (issue 8, label "crash"): tiermem-train is killed with SIGKILL again and again —
// at named points (the test-only TIERMEM_TEST_KILL_AT hook, src/train/kill_point.h: during
// swap-out, inside the optimizer step, at every stage of a checkpoint write) and after random
// delays — and resumed from its checkpoint each time until it finishes. Asserted:
//   * after every kill the last complete checkpoint loads and every tensor verifies (xxh64), and
//     it is never older than the one before the kill (a later crash never damages it);
//   * every loss printed by every run (before and after each resume point) equals the
//     uninterrupted run's loss of that step, bit for bit;
//   * the final checkpoint's tensors (parameters and Adam moments) have the same checksums as the
//     uninterrupted run's, and no temporary or stale state file is left behind;
//   * a stale swap directory (lock and swap files of the killed process) never blocks a resume.
// Seeded (TIERMEM_CRASH_SEED, default 20240611); TIERMEM_CRASH_ROUNDS sets the number of kills
// (default 150). About 15 s idle, up to a minute on two busy cores.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tiermem/checkpoint.h"

#ifndef TIERMEM_TRAIN_BIN
#error "TIERMEM_TRAIN_BIN must name the tiermem-train executable"
#endif

namespace {
namespace fs = std::filesystem;
using nlohmann::json;
using tiermem::CheckpointReader;

constexpr int kSteps = 40;

struct Outcome {
  bool killed = false;  // ended by SIGKILL
  int exit_code = -1;   // when it exited
  std::map<int, double> losses;
  std::string err;
};

std::string slurp(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

long env_long(const char* name, long dflt) {
  const char* v = std::getenv(name);
  return v && *v ? std::strtol(v, nullptr, 10) : dflt;
}

class CrashLoop : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("tiermem_crash_loop_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    std::string text;
    for (int i = 0; i < 300; ++i)
      text += "crash " + std::to_string(i * 7919 % 1000) + " and resume, bit for bit.\n";
    std::ofstream(dir_ / "corpus.txt") << text;
  }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(dir_);
  }

  std::vector<std::string> args(const std::string& save, const std::string& swap,
                                bool resume) const {
    std::vector<std::string> a = {TIERMEM_TRAIN_BIN,
                                  "--model",
                                  "tiny",
                                  "--seq-len",
                                  "16",
                                  "--batch",
                                  "2",
                                  "--eval-every",
                                  "0",
                                  "--json",
                                  "--seed",
                                  "11",
                                  "--steps",
                                  std::to_string(kSteps),
                                  "--data",
                                  (dir_ / "corpus.txt").string(),
                                  "--swap-dir",
                                  swap,
                                  "--host-budget",  // smaller than the state: it pages to NVMe
                                  "256KiB",
                                  "--save",
                                  save,
                                  "--save-every",
                                  "2"};
    if (resume) {
      a.push_back("--resume");
      a.push_back(save);
    }
    return a;
  }

  // Runs the trainer; kill_at = "" (none), "<phase>:<n>" (the hook) or delay_ms > 0 (the parent
  // sends SIGKILL after that long).
  Outcome run(const std::vector<std::string>& argv, const std::string& kill_at, int delay_ms) {
    const fs::path out = dir_ / "out.txt", err = dir_ / "err.txt";
    const pid_t pid = ::fork();
    if (pid == 0) {
      std::vector<char*> cargv;
      for (const auto& s : argv) cargv.push_back(const_cast<char*>(s.c_str()));
      cargv.push_back(nullptr);
      if (!kill_at.empty()) ::setenv("TIERMEM_TEST_KILL_AT", kill_at.c_str(), 1);
      ::setenv("OMP_NUM_THREADS", "1", 1);
      if (!std::freopen(out.c_str(), "w", stdout) || !std::freopen(err.c_str(), "w", stderr))
        ::_exit(127);
      ::execv(cargv[0], cargv.data());
      ::_exit(127);
    }
    int status = 0;
    if (delay_ms > 0) {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(delay_ms);
      while (std::chrono::steady_clock::now() < deadline) {
        if (::waitpid(pid, &status, WNOHANG) == pid) goto done;
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
      ::kill(pid, SIGKILL);
    }
    ::waitpid(pid, &status, 0);
  done:
    Outcome o;
    o.killed = WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
    o.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    o.err = slurp(err);
    std::istringstream lines(slurp(out));
    std::string line;
    while (std::getline(lines, line)) {
      json j = json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (j.is_object() && j.contains("step") && j.contains("loss"))
        o.losses[j["step"].get<int>()] = j["loss"].get<double>();
    }
    return o;
  }

  // Loads the checkpoint in `save` completely (every tensor read and checksum-verified).
  // Returns its step and fills name -> xxh64; -1 when there is none yet.
  static int verify_checkpoint(const fs::path& save, std::map<std::string, std::uint64_t>* sums) {
    if (!fs::exists(save / "rank0" / "manifest.json")) return -1;
    CheckpointReader r(save.string(), 0);
    std::vector<char> buf;
    for (const auto& t : r.tensors()) {
      buf.resize(t.bytes);
      r.read_tensor(t.name, buf.data(), t.bytes);  // throws on any mismatch
      if (sums) (*sums)[t.name] = t.xxh64;
    }
    return r.step();
  }

  fs::path dir_;
};

TEST_F(CrashLoop, KilledAnywhereResumesBitForBit) {
  const auto t_start = std::chrono::steady_clock::now();
  // 1. The uninterrupted reference.
  const fs::path ref = dir_ / "ref";
  Outcome want = run(args(ref.string(), (dir_ / "swap-ref").string(), false), "", 0);
  ASSERT_EQ(want.exit_code, 0) << want.err;
  ASSERT_EQ(want.losses.size(), static_cast<std::size_t>(kSteps));
  std::map<std::string, std::uint64_t> want_sums;
  ASSERT_EQ(verify_checkpoint(ref, &want_sums), kSteps);
  ASSERT_EQ(want_sums.size(), 5u);  // ZeroEngine: master, exp_avg, exp_avg_sq, partition, steps

  // 2. The crash loop. The named phases cycle so each is hit; n and the delays are random.
  const unsigned seed = static_cast<unsigned>(env_long("TIERMEM_CRASH_SEED", 20240611));
  const int rounds = static_cast<int>(env_long("TIERMEM_CRASH_ROUNDS", 150));
  std::mt19937 rng(seed);
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  struct PhaseSpec {
    const char* name;
    int max_n;  // passes per run to choose from
  };
  const PhaseSpec phases[] = {
      {"swap-out", 6}, {"optimizer", 16},    {"ckpt-tensor", 24}, {"ckpt-state", 2},
      {"delay", 0},    {"ckpt-manifest", 2}, {"step", 6},         {"ckpt-gc", 2},
  };
  const fs::path save = dir_ / "ckpt";
  const std::string swap = (dir_ / "swap").string();
  std::map<std::string, int> kills_by_phase;
  int kills = 0, last_step = -1, restarts = 0;
  std::map<int, double> got;  // step -> loss, from every run
  auto check_losses = [&](const Outcome& o, const std::string& what) {
    for (const auto& [step, loss] : o.losses) {
      ASSERT_TRUE(want.losses.count(step)) << what << ": step " << step;
      EXPECT_EQ(loss, want.losses.at(step))
          << what << ": loss of step " << step << " differs from the uninterrupted run's";
      got[step] = loss;
    }
  };
  bool finished = false;
  for (int round = 0; round < rounds && !finished; ++round) {
    const PhaseSpec& ph = phases[static_cast<std::size_t>(round) % std::size(phases)];
    std::string kill_at;
    int delay_ms = 0;
    if (std::string(ph.name) == "delay") {
      delay_ms = uniform(15, 300);
    } else {
      kill_at = std::string(ph.name) + ":" + std::to_string(uniform(1, ph.max_n));
    }
    const bool resume = last_step >= 0;
    const std::string what = "round " + std::to_string(round) + " (" +
                             (delay_ms ? "delay " + std::to_string(delay_ms) + " ms" : kill_at) +
                             (resume ? ", resumed from step " + std::to_string(last_step) : "") +
                             ")";
    Outcome o = run(args(save.string(), swap, resume), kill_at, delay_ms);
    SCOPED_TRACE(what);
    ASSERT_TRUE(o.killed || o.exit_code == 0) << "exit " << o.exit_code << ": " << o.err;
    check_losses(o, what);
    if (resume && !o.losses.empty()) {
      EXPECT_EQ(o.losses.begin()->first, last_step + 1) << "resumed at the wrong step";
    }
    int step = -2;
    std::map<std::string, std::uint64_t> sums;
    ASSERT_NO_THROW(step = verify_checkpoint(save, &sums)) << "checkpoint damaged after " << what;
    EXPECT_GE(step, last_step) << "the checkpoint went backwards after " << what;
    last_step = step;
    if (o.killed) {
      ++kills;
      ++kills_by_phase[delay_ms ? "delay" : ph.name];
    } else if (round + 1 < rounds) {
      // The kill point was past the end of the run: it finished. Check it, then start afresh.
      std::map<std::string, std::uint64_t> s;
      ASSERT_EQ(verify_checkpoint(save, &s), kSteps);
      EXPECT_EQ(s, want_sums) << "final state differs from the uninterrupted run's";
      ++restarts;
      fs::remove_all(save);
      last_step = -1;
    } else {
      finished = true;
    }
  }
  // 3. Finish without kills.
  if (!finished) {
    Outcome o = run(args(save.string(), swap, last_step >= 0), "", 0);
    ASSERT_EQ(o.exit_code, 0) << o.err;
    check_losses(o, "final run");
  }
  std::map<std::string, std::uint64_t> got_sums;
  ASSERT_EQ(verify_checkpoint(save, &got_sums), kSteps);
  EXPECT_EQ(got_sums, want_sums) << "final parameters / Adam state differ from the uninterrupted "
                                    "run's";
  // Every step after the first resume point was seen by some run... and the last ones by the last.
  EXPECT_EQ(got.rbegin()->first, kSteps);
  // Only the final checkpoint is left: the manifest and the one state file it names, no .tmp.
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(save / "rank0"))
    files.push_back(e.path().filename().string());
  std::sort(files.begin(), files.end());
  const std::string state = CheckpointReader(save.string(), 0).tensors().at(0).file;
  EXPECT_EQ(files, (std::vector<std::string>{"manifest.json", state}));

  // The named phases must really have been hit (a renamed phase would silently test nothing).
  for (const char* p : {"swap-out", "optimizer", "ckpt-tensor", "ckpt-state", "ckpt-manifest"})
    EXPECT_GE(kills_by_phase[p], 1) << "no kill landed at phase " << p;
  EXPECT_GE(kills, rounds / 2);
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  std::string by;
  for (const auto& [p, n] : kills_by_phase) by += " " + p + "=" + std::to_string(n);
  std::printf(
      "crash loop: seed %u, %d SIGKILLs survived (%s), %d runs finished early and "
      "restarted, %zu steps compared bit for bit, final checkpoint identical (%zu "
      "tensors), %.1f s\n",
      seed, kills, by.empty() ? "" : by.c_str() + 1, restarts, got.size(), got_sums.size(), secs);
  RecordProperty("kills", kills);
}

}  // namespace
