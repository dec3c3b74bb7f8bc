// tests/unit/train_run.h — runs the tiermem-train binary for the end-to-end tests: a fixture
// with a fresh directory holding a small deterministic corpus, run() with stdout/stderr captured
// and the --json lines parsed, and losses() of a run. Included by train_e2e_test.cc and
// train_memory_test.cc (each defines TIERMEM_TRAIN_BIN through CMake).
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#ifndef TIERMEM_TRAIN_BIN
#error "TIERMEM_TRAIN_BIN must name the tiermem-train executable"
#endif

namespace tiermem_train_test {
namespace fs = std::filesystem;
using nlohmann::json;

struct RunResult {
  int exit_code = -1;
  std::string out, err;
  std::vector<json> steps;  // {"step":..} lines
  json summary;             // the last line's "summary"
};

class TrainBinaryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("tiermem_train_e2e_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    // A small text corpus (byte-level), deterministic.
    std::string text;
    for (int i = 0; i < 400; ++i) {
      text += "the quick brown fox " + std::to_string(i * 7919 % 1000) +
              " jumps over the lazy dog.\n";
    }
    std::ofstream(dir_ / "corpus.txt") << text;
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Runs tiermem-train with `args` (cwd = the test dir); stdout and stderr captured.
  RunResult run(const std::string& args, const std::string& prefix = "") {
    const std::string out = (dir_ / "stdout.txt").string(), err = (dir_ / "stderr.txt").string();
    const std::string cmd = "cd " + dir_.string() + " && " + prefix + " OMP_NUM_THREADS=1 " +
                            TIERMEM_TRAIN_BIN + " " + args + " >" + out + " 2>" + err;
    const int status = std::system(cmd.c_str());
    RunResult r;
    r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    r.out = slurp(out);
    r.err = slurp(err);
    std::istringstream lines(r.out);
    std::string line;
    while (std::getline(lines, line)) {
      if (line.empty() || line[0] != '{') continue;
      json j = json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (j.is_discarded()) continue;
      if (j.contains("step")) r.steps.push_back(j);
      if (j.contains("summary")) r.summary = j["summary"];
    }
    return r;
  }
  static std::string slurp(const std::string& path) {
    std::ifstream in(path);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }
  std::string corpus() const { return (dir_ / "corpus.txt").string(); }

  fs::path dir_;
};

// Losses (as doubles, compared bitwise) of steps [first, last].
inline std::vector<double> losses(const RunResult& r, int first = 1, int last = 1 << 30) {
  std::vector<double> v;
  for (const json& s : r.steps) {
    const int t = s["step"].get<int>();
    if (t >= first && t <= last) v.push_back(s["loss"].get<double>());
  }
  return v;
}

}  // namespace tiermem_train_test
