// tiermem-train under `mpirun -np 2` (ZeroEngine stage 3 over MPI, each rank its own swap dir
// <swap>/rank<r>) against one rank with the same global batch: the losses agree within a
// relative 1e-5 for 8 steps (the only differences are fp32 summation orders in the reduce-scatter
// and the loss all-reduce). Label "mpi".
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#ifndef TIERMEM_TRAIN_BIN
#error "TIERMEM_TRAIN_BIN must name the tiermem-train executable"
#endif

namespace {
namespace fs = std::filesystem;

std::vector<double> run_losses(const std::string& cmd, const fs::path& dir, std::string* err) {
  const std::string out = (dir / "out.txt").string();
  const int status = std::system(("cd " + dir.string() + " && " + cmd + " >" + out + " 2>" +
                                  (dir / "err.txt").string()).c_str());
  std::ifstream e(dir / "err.txt");
  std::stringstream es;
  es << e.rdbuf();
  *err = es.str();
  std::vector<double> losses;
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return losses;
  std::ifstream in(out);
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_discarded() && j.contains("step")) losses.push_back(j["loss"].get<double>());
  }
  return losses;
}

TEST(TrainMpi, TwoRanksMatchOneRankWithTheSameGlobalBatch) {
  if (std::system("command -v mpirun >/dev/null 2>&1") != 0) GTEST_SKIP() << "no mpirun";
  const fs::path dir = fs::temp_directory_path() / ("tiermem_train_mpi_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  {
    std::ofstream f(dir / "corpus.txt");
    for (int i = 0; i < 400; ++i) f << "the quick brown fox " << i * 7919 % 1000 << " jumps.\n";
  }
  const std::string common = std::string(TIERMEM_TRAIN_BIN) +
                             " --model tiny --seq-len 16 --steps 8 --eval-every 0 --json "
                             "--engine zero --offload nvme --data corpus.txt --seed 3 ";
  std::string err1, err2;
  const auto one = run_losses("OMP_NUM_THREADS=1 " + common + "--batch 4 --swap-dir swap1", dir, &err1);
  const auto two = run_losses(
      "mpirun --allow-run-as-root --oversubscribe -np 2 -x OMP_NUM_THREADS=1 " + common +
          "--batch 2 --swap-dir swap2",
      dir, &err2);
  fs::remove_all(dir);
  ASSERT_EQ(one.size(), 8u) << err1;
  ASSERT_EQ(two.size(), 8u) << err2;
  EXPECT_GT(one.front() - one.back(), 0.2) << "the loss should fall";
  for (std::size_t i = 0; i < one.size(); ++i) {
    EXPECT_NEAR(two[i], one[i], 1e-5 * std::abs(one[i])) << "step " << i + 1;
  }
}

}  // namespace
