// tiermem-train under `mpirun -np 2` and `-np 3` (ZeroEngine stage 3 over MPI, each rank its own
// swap dir <swap>/rank<r>) against one rank with the same global batch: the losses agree within a
// relative 1e-5 for 8 steps (the only differences are fp32 summation orders in the reduce-scatter
// and the loss all-reduce); a two-rank --save/--resume equals an uninterrupted two-rank run bit
// for bit; a checkpoint resumes at another world size (2 -> 3, 2 -> 1, 3 -> 2) within 1e-5 of a
// resume at the saved size, streaming the state. Label "mpi".
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#ifndef TIERMEM_TRAIN_BIN
#error "TIERMEM_TRAIN_BIN must name the tiermem-train executable"
#endif

namespace {
namespace fs = std::filesystem;

// Steps and losses of a run (--json lines with "step"), in order.
std::vector<std::pair<int, double>> run_step_losses(const std::string& cmd, const fs::path& dir,
                                                    std::string* err) {
  const std::string out = (dir / "out.txt").string();
  const int status = std::system(("cd " + dir.string() + " && " + cmd + " >" + out + " 2>" +
                                  (dir / "err.txt").string()).c_str());
  std::ifstream e(dir / "err.txt");
  std::stringstream es;
  es << e.rdbuf();
  *err = es.str();
  std::vector<std::pair<int, double>> steps;
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    *err = "exit status " + std::to_string(status) + ": " + cmd + "\n" + *err;
    return steps;
  }
  std::ifstream in(out);
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_discarded() && j.contains("step") && j.contains("loss")) {
      steps.emplace_back(j["step"].get<int>(), j["loss"].get<double>());
    }
  }
  return steps;
}

// The losses of a run's steps, in order (empty when it failed; then *err says why).
std::vector<double> run_losses(const std::string& cmd, const fs::path& dir, std::string* err) {
  std::vector<double> losses;
  for (const auto& [step, loss] : run_step_losses(cmd, dir, err)) losses.push_back(loss);
  return losses;
}

// A fresh test directory under /tmp holding corpus.txt (a small deterministic text).
fs::path make_dir_with_corpus(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / (name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::ofstream f(dir / "corpus.txt");
  for (int i = 0; i < 400; ++i) f << "the quick brown fox " << i * 7919 % 1000 << " jumps.\n";
  return dir;
}

// W ranks with micro-batch 2 each against one rank with micro-batch 2·W (the same global batch).
// W = 3 is the odd world size: every shard of every module is padded.
class TrainMpiWorld : public ::testing::TestWithParam<int> {};

TEST_P(TrainMpiWorld, RanksMatchOneRankWithTheSameGlobalBatch) {
  if (std::system("command -v mpirun >/dev/null 2>&1") != 0) GTEST_SKIP() << "no mpirun";
  const int world = GetParam();
  const fs::path dir = make_dir_with_corpus("tiermem_train_mpi_np" + std::to_string(world));
  const std::string common = std::string(TIERMEM_TRAIN_BIN) +
                             " --model tiny --seq-len 16 --steps 8 --eval-every 0 --json "
                             "--engine zero --offload nvme --data corpus.txt --seed 3 ";
  std::string err1, err2;
  const auto one = run_losses(
      "OMP_NUM_THREADS=1 " + common + "--batch " + std::to_string(2 * world) + " --swap-dir swap1",
      dir, &err1);
  const auto many = run_losses("mpirun --allow-run-as-root --oversubscribe -np " +
                                   std::to_string(world) + " -x OMP_NUM_THREADS=1 " + common +
                                   "--batch 2 --swap-dir fresh/swap2",  // created by racing ranks
                               dir, &err2);
  fs::remove_all(dir);
  ASSERT_EQ(one.size(), 8u) << err1;
  ASSERT_EQ(many.size(), 8u) << err2;
  EXPECT_GT(one.front() - one.back(), 0.2) << "the loss should fall";
  for (std::size_t i = 0; i < one.size(); ++i) {
    EXPECT_NEAR(many[i], one[i], 1e-5 * std::abs(one[i])) << "step " << i + 1;
  }
}

INSTANTIATE_TEST_SUITE_P(World, TrainMpiWorld, ::testing::Values(2, 3),
                         [](const auto& info) { return "np" + std::to_string(info.param); });

// Two ranks on the CPU twin of a GPU (SimDevice with sim_host_addressable false): every stage-3
// all-gather is staged through host memory into device memory the CPU cannot touch, and the CPU
// model reads each module through a copy down. The losses equal the two-rank run on the default
// SimDevice bit for bit, with params homed on the device (offload none) and on NVMe.
TEST(TrainMpi, TwoRanksOnANonAddressableDeviceEqualTheAddressableRun) {
  if (std::system("command -v mpirun >/dev/null 2>&1") != 0) GTEST_SKIP() << "no mpirun";
  const fs::path dir = make_dir_with_corpus("tiermem_train_mpi_opaque");
  // Both runs read a config: with two ranks, a run with --config (even {}) and one without differ
  // in the last bits of the clipping norm (seen, cause not traced; not this test's subject).
  std::ofstream(dir / "plain.json") << R"({"tiermem": {"sim_host_addressable": true}})";
  std::ofstream(dir / "opaque.json") << R"({"tiermem": {"sim_host_addressable": false}})";
  const std::string mpirun = "mpirun --allow-run-as-root --oversubscribe -np 2 -x OMP_NUM_THREADS=1 ";
  for (const char* offload : {"none", "nvme"}) {
    SCOPED_TRACE(offload);
    const std::string common = std::string(TIERMEM_TRAIN_BIN) +
                               " --model tiny --seq-len 16 --steps 4 --eval-every 0 --json --batch 2 "
                               "--engine zero --device sim --data corpus.txt --seed 3 --offload " +
                               offload + " ";
    std::string err1, err2;
    const auto plain = run_losses(mpirun + common + "--swap-dir swap-plain --config plain.json", dir, &err1);
    const auto opaque = run_losses(mpirun + common + "--swap-dir swap-opaque --config opaque.json", dir, &err2);
    ASSERT_EQ(plain.size(), 4u) << err1;
    ASSERT_EQ(opaque.size(), 4u) << err2;
    for (std::size_t i = 0; i < plain.size(); ++i) {
      EXPECT_EQ(opaque[i], plain[i]) << std::setprecision(17) << "step " << i + 1 << ": " << opaque[i] << " vs "
                                     << plain[i];
    }
  }
  fs::remove_all(dir);
}

// --engine zero checkpoints (each rank its own optimizer shard in ck/rank<r>/): two ranks
// stopped after step 4 with --save, then resumed with --resume, give losses for steps 5..8 equal,
// bit for bit, to an uninterrupted two-rank run (master weights, Adam moments, step count, data
// position and learning-rate schedule all restored). Stage 3, params and optimizer on NVMe.
TEST(TrainMpi, TwoRankCheckpointResumesBitForBit) {
  if (std::system("command -v mpirun >/dev/null 2>&1") != 0) GTEST_SKIP() << "no mpirun";
  const fs::path dir = make_dir_with_corpus("tiermem_train_mpi_ck");
  const std::string mpirun = "mpirun --allow-run-as-root --oversubscribe -np 2 -x OMP_NUM_THREADS=1 ";
  const std::string common = std::string(TIERMEM_TRAIN_BIN) +
                             " --model tiny --seq-len 16 --steps 8 --eval-every 0 --json "
                             "--engine zero --offload nvme --data corpus.txt --seed 5 --batch 2 ";
  std::string err_full, err_first, err_resumed;
  const auto full = run_step_losses(mpirun + common + "--swap-dir swap-full", dir, &err_full);
  const auto first =
      run_step_losses(mpirun + common + "--swap-dir swap-a --save ck --stop-at 4", dir, &err_first);
  const bool manifests = fs::exists(dir / "ck" / "rank0" / "manifest.json") &&
                         fs::exists(dir / "ck" / "rank1" / "manifest.json");
  nlohmann::json m1;
  if (manifests) {
    std::ifstream f(dir / "ck" / "rank1" / "manifest.json");
    m1 = nlohmann::json::parse(f, nullptr, false);
  }
  const auto resumed =
      run_step_losses(mpirun + common + "--swap-dir swap-b --resume ck", dir, &err_resumed);
  // Only rank 1's checkpoint damaged: rank 1 fails, and it must end the whole job (MPI_Abort),
  // not leave rank 0 waiting in a collective. `timeout` turns a hang into exit code 124.
  int damaged_rc = -1;
  std::string damaged_err;
  for (const auto& e : fs::directory_iterator(dir / "ck" / "rank1")) {
    if (e.path().filename().string().rfind("state-", 0) == 0) fs::resize_file(e.path(), 1000);
  }
  {
    const int status = std::system(("cd " + dir.string() + " && timeout 120 " + mpirun + common +
                                    "--swap-dir swap-c --resume ck >damaged.out 2>damaged.err")
                                       .c_str());
    damaged_rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    std::ifstream f(dir / "damaged.err");
    std::stringstream ss;
    ss << f.rdbuf();
    damaged_err = ss.str();
  }
  fs::remove_all(dir);
  EXPECT_NE(damaged_rc, 0) << damaged_err;
  EXPECT_NE(damaged_rc, 124) << "the job hung after rank 1 failed\n" << damaged_err;
  EXPECT_NE(damaged_err.find("rank 1: checkpoint"), std::string::npos) << damaged_err;
  EXPECT_NE(damaged_err.find("aborting all ranks"), std::string::npos) << damaged_err;

  ASSERT_EQ(full.size(), 8u) << err_full;
  ASSERT_EQ(first.size(), 4u) << err_first;
  ASSERT_TRUE(manifests) << "each rank writes ck/rank<r>/manifest.json\n" << err_first;
  ASSERT_EQ(resumed.size(), 4u) << err_resumed;
  // Rank 1's manifest is its own (rank 1 of 2) and holds its optimizer shard.
  ASSERT_TRUE(m1.is_object());
  EXPECT_EQ(m1.value("rank", -1), 1);
  EXPECT_EQ(m1.value("world_size", -1), 2);
  EXPECT_EQ(m1.value("step", -1), 4);
  std::vector<std::string> names;
  for (const auto& t : m1.at("tensors")) names.push_back(t.at("name").get<std::string>());
  for (const char* want : {"zero.master", "zero.exp_avg", "zero.exp_avg_sq", "zero.steps"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), want), names.end()) << want;
  }
  EXPECT_GT(full.front().second - full.back().second, 0.05) << "the loss should fall";
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(first[i].first, i + 1);
    EXPECT_EQ(first[i].second, full[i].second) << "step " << i + 1;  // same run until the stop
    EXPECT_EQ(resumed[i].first, i + 5);
    EXPECT_EQ(resumed[i].second, full[i + 4].second) << "step " << i + 5;  // bit for bit
  }
}

// Resume at another world size (issue 33): the ZeRO optimizer state is re-partitioned as it loads
// (include/tiermem/checkpoint_reshard.h). Saved by 2 ranks with --batch 3 after step 4, resumed by 3
// ranks with --batch 2 and by 1 rank with --batch 6 (the same global batch of 6 sequences, so the
// same data): steps 5..8 equal those of a resume at 2 ranks within 1e-5 relative (the state is the
// same numbers; only fp32 summation orders in the reduce-scatter and the loss all-reduce differ).
// Then saved by 3, resumed by 2 against a resume at 3. A resume at 2 ranks equals the
// uninterrupted run bit for bit (TwoRankCheckpointResumesBitForBit). A --batch that changes the
// global batch is refused, naming the --batch that keeps it.
TEST(TrainMpi, ResumeAtAnotherWorldSizeContinuesTheRun) {
  if (std::system("command -v mpirun >/dev/null 2>&1") != 0) GTEST_SKIP() << "no mpirun";
  const fs::path dir = make_dir_with_corpus("tiermem_train_mpi_reshard");
  const std::string bin = std::string(TIERMEM_TRAIN_BIN) +
                          " --model tiny --seq-len 16 --steps 8 --eval-every 0 --json "
                          "--engine zero --offload nvme --data corpus.txt --seed 5 ";
  auto at = [&](int np, const std::string& args) {
    return (np == 1 ? std::string("OMP_NUM_THREADS=1 ")
                    : "mpirun --allow-run-as-root --oversubscribe -np " + std::to_string(np) +
                          " -x OMP_NUM_THREADS=1 ") +
           bin + "--batch " + std::to_string(6 / np) + " " + args;
  };
  struct Run {
    std::vector<std::pair<int, double>> steps;
    std::string err;
  };
  auto run = [&](int np, const std::string& args) {
    Run r;
    r.steps = run_step_losses(at(np, args), dir, &r.err);
    return r;
  };
  const Run save2 = run(2, "--swap-dir s-save2 --save ck2 --stop-at 4");
  const Run ref2 = run(2, "--swap-dir s-ref2 --resume ck2");
  const Run to3 = run(3, "--swap-dir s-to3 --resume ck2");
  const Run to1 = run(1, "--swap-dir s-to1 --resume ck2");
  const Run save3 = run(3, "--swap-dir s-save3 --save ck3 --stop-at 4");
  const Run ref3 = run(3, "--swap-dir s-ref3 --resume ck3");
  const Run to2 = run(2, "--swap-dir s-to2 --resume ck3");
  std::string bad_err;
  const auto bad = run_step_losses("OMP_NUM_THREADS=1 " + bin + "--batch 5 --swap-dir s-bad --resume ck2", dir,
                                   &bad_err);
  fs::remove_all(dir);
  ASSERT_EQ(save2.steps.size(), 4u) << save2.err;
  ASSERT_EQ(save3.steps.size(), 4u) << save3.err;
  for (const auto& [ref, got, what] : {std::tuple{&ref2, &to3, "2 -> 3"}, std::tuple{&ref2, &to1, "2 -> 1"},
                                       std::tuple{&ref3, &to2, "3 -> 2"}}) {
    SCOPED_TRACE(what);
    ASSERT_EQ(ref->steps.size(), 4u) << ref->err;
    ASSERT_EQ(got->steps.size(), 4u) << got->err;
    EXPECT_NE(got->err.find("re-partitioning the optimizer state"), std::string::npos) << got->err;
    for (std::size_t i = 0; i < 4; ++i) {
      EXPECT_EQ(got->steps[i].first, static_cast<int>(i) + 5);
      EXPECT_NEAR(got->steps[i].second, ref->steps[i].second, 1e-5 * std::abs(ref->steps[i].second))
          << "step " << i + 5;
    }
  }
  EXPECT_TRUE(bad.empty());
  EXPECT_NE(bad_err.find("give --batch 6"), std::string::npos) << bad_err;
}

// The re-partitioning load streams (issue 33: max RSS during the reshard stays within the
// budgets). A model with 154 MiB of optimizer state (17 blocks, d_model 256: 13.5 M parameters)
// saved by 2 ranks and resumed by 1, the rank that must read every old file, at a 16 MiB host and
// 8 MiB device budget: its max RSS (getrusage, the summary's max_rss_bytes) stays within the
// accounted host peak plus train_memory_test's 128 MiB for code, libraries and the corpus, and
// below the size of the optimizer state itself (one copy of it in memory would exceed that).
// Measured: 84 MiB max RSS against 154 MiB of state.
TEST(TrainMpi, ResumeAtAnotherWorldSizeStreamsTheState) {
  if (std::system("command -v mpirun >/dev/null 2>&1") != 0) GTEST_SKIP() << "no mpirun";
  const fs::path dir = make_dir_with_corpus("tiermem_train_mpi_reshard_rss");
  const std::string bin = std::string(TIERMEM_TRAIN_BIN) +
                          " --model custom --layers 17 --d-model 256 --seq-len 16 --steps 2 --eval-every 0 "
                          "--json --engine zero --offload nvme --data corpus.txt --seed 5 --host-budget 16MiB "
                          "--device-budget 8MiB ";
  std::string err_save, err_resume;
  const auto saved = run_step_losses(
      "mpirun --allow-run-as-root --oversubscribe -np 2 -x OMP_NUM_THREADS=1 " + bin +
          "--batch 1 --swap-dir s-save --save ck --stop-at 1", dir, &err_save);
  const auto resumed = run_step_losses("OMP_NUM_THREADS=1 " + bin + "--batch 2 --swap-dir s-one --resume ck",
                                       dir, &err_resume);
  nlohmann::json summary;
  {
    std::ifstream in(dir / "out.txt");  // the last run's stdout: its summary line
    for (std::string line; std::getline(in, line);) {
      auto j = nlohmann::json::parse(line, nullptr, false);
      if (!j.is_discarded() && j.contains("summary")) summary = j["summary"];
    }
  }
  fs::remove_all(dir);
  ASSERT_EQ(saved.size(), 1u) << err_save;
  ASSERT_EQ(resumed.size(), 1u) << err_resume;
  EXPECT_NE(err_resume.find("re-partitioning the optimizer state saved over 2 ranks for 1"), std::string::npos)
      << err_resume;
  ASSERT_TRUE(summary.is_object());
  const auto max_rss = summary.at("max_rss_bytes").get<std::uint64_t>();
  const auto host_peak = summary.at("host_peak_bytes").get<std::uint64_t>();
  const auto state = summary.at("optimizer_bytes").get<std::uint64_t>();
  std::printf("2 -> 1 ranks: max RSS %.1f MiB, accounted host peak %.1f MiB, optimizer state %.1f MiB\n",
              max_rss / 1048576.0, host_peak / 1048576.0, state / 1048576.0);
  EXPECT_LE(summary.at("host_pool_peak_bytes").get<std::uint64_t>(), 16u << 20);
  EXPECT_LE(max_rss, host_peak + (128ull << 20));
  EXPECT_LT(max_rss, state);
}

// Messages said once per job: every rank would warn alike that its host pools are not
// page-locked and that a config key has no effect; rank 0 says each once (3 ranks, each with
// several pools, said the pool warning 12 times before).
TEST(TrainMpi, ThreeRanksSayEachWarningOnce) {
  if (std::system("command -v mpirun >/dev/null 2>&1") != 0) GTEST_SKIP() << "no mpirun";
  const fs::path dir = make_dir_with_corpus("tiermem_train_mpi_once");
  std::ofstream(dir / "inert.json") << R"({"zero_optimization": {"stage": 3,
      "offload_param": {"device": "nvme", "nvme_path": "swap", "pin_memory": false},
      "offload_optimizer": {"device": "nvme", "nvme_path": "swap", "pin_memory": false},
      "contiguous_gradients": true, "stage3_param_persistence_threshold": 0},
      "steps_per_print": 5, "gradient_clipping": "auto"})";
  std::string err;
  const auto steps = run_step_losses(
      "mpirun --allow-run-as-root --oversubscribe -np 3 -x OMP_NUM_THREADS=1 " +
          std::string(TIERMEM_TRAIN_BIN) +
          " --model tiny --seq-len 16 --batch 1 --steps 1 --eval-every 0 --json --data corpus.txt "
          "--swap-dir swap --config inert.json",
      dir, &err);
  fs::remove_all(dir);
  ASSERT_EQ(steps.size(), 1u) << err;
  auto count = [&err](const std::string& needle) {
    int n = 0;
    for (auto at = err.find(needle); at != std::string::npos; at = err.find(needle, at + 1)) ++n;
    return n;
  };
  EXPECT_EQ(count("page-locked"), 0) << err;  // no warning without pin_memory (PinnedHostPool)
  EXPECT_EQ(count("'zero_optimization.contiguous_gradients'"), 1) << err;
  EXPECT_EQ(count("'steps_per_print'"), 1) << err;
  EXPECT_EQ(count("\"auto\" resolved"), 1) << err;
  EXPECT_EQ(count("device: sim"), 1) << err;  // every rank's simulated device is alike
}

}  // namespace
