// Host budgets that the start check accepts always finish (issue 32):
//   1. a sweep: for `mini` and a 2-layer custom model (stage 3, offload nvme) the host budget
//      takes 16 values from the minimum the start check names to 4x it; each runs 3 steps and
//      exits 0; the minimum less one byte is refused at once with exit 2, and the message gives
//      the minimum in bytes. Again under a CPU hog (two busy children: both cores of a small
//      machine), since the failures this guards against depended on timing; and with 2 ranks
//      under mpirun (the minimum, +1 byte, and a few points between);
//   2. a pinned pool (pin_memory true in both offload sections, the typical DeepSpeed config)
//      pins what it uses, not its 1 GiB default budget: max RSS under 200 MiB;
//   3. the <nvme_path>/rank0 directory tiermem made is gone after the run.
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>

#include <cstdlib>
#include <regex>

#include "train_run.h"

namespace {
using namespace tiermem_train_test;
using TrainBudget = TrainBinaryTest;

// Two busy child processes while alive (both cores of the 2-core CI machines busy).
class CpuHog {
 public:
  explicit CpuHog(int n) {
    for (int i = 0; i < n; ++i) {
      const pid_t p = ::fork();
      if (p == 0) {
        volatile unsigned long x = 0;
        for (;;) x = x + 1;
      }
      if (p > 0) pids_.push_back(p);
    }
  }
  ~CpuHog() {
    for (pid_t p : pids_) {
      ::kill(p, SIGKILL);
      ::waitpid(p, nullptr, 0);
    }
  }

 private:
  std::vector<pid_t> pids_;
};

const std::string kModelMini = "--model mini";
const std::string kModelCustom = "--model custom --layers 2 --d-model 64";

std::string args(const std::string& model, std::uint64_t host_budget) {
  return model + " --seq-len 16 --batch 1 --steps 3 --eval-every 0 --json --offload nvme "
                 "--swap-dir swap --host-budget " + std::to_string(host_budget) + " --data ";
}

// The minimum the start check names, in bytes ("... this model needs 3194880 bytes" or
// "(3194880 bytes)"), from the refusal of a 4 KiB budget; 0 when not found.
std::uint64_t named_minimum(const std::string& err) {
  std::smatch m;
  static const std::regex re("below the [^(]*\\(([0-9]+) bytes\\) this model needs");
  if (!std::regex_search(err, m, re)) return 0;
  return std::stoull(m[1].str());
}

// The budgets of the sweep: `points` values from min to 4 x min, evenly spaced, both ends in.
std::vector<std::uint64_t> sweep(std::uint64_t min, int points) {
  std::vector<std::uint64_t> v;
  for (int i = 0; i < points; ++i) v.push_back(min + 3 * min * static_cast<std::uint64_t>(i) / (points - 1));
  return v;
}

class Sweep : public TrainBudget {
 protected:
  std::uint64_t minimum(const std::string& model, const std::string& prefix = "") {
    const RunResult r = run(args(model, 4096) + corpus(), prefix);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    const std::uint64_t min = named_minimum(r.err);
    EXPECT_GT(min, 4096u) << "the refusal should name the minimum in bytes: " << r.err;
    return min;
  }
  void refused(const std::string& model, std::uint64_t budget, const std::string& prefix = "") {
    const RunResult r = run(args(model, budget) + corpus(), prefix);
    EXPECT_EQ(r.exit_code, 2) << "budget " << budget << ": " << r.err;
    EXPECT_TRUE(r.steps.empty()) << "budget " << budget << " ran steps";
  }
  void completes(const std::string& model, std::uint64_t budget, const std::string& prefix = "") {
    const RunResult r = run(args(model, budget) + corpus(), prefix);
    EXPECT_EQ(r.exit_code, 0) << "budget " << budget << " bytes: " << r.err;
    if (r.exit_code == 0 && !r.summary.is_null()) {
      EXPECT_EQ(r.summary["steps"].get<int>(), 3) << "budget " << budget;
    }
  }
  void run_sweep(const std::string& model, int points, const std::string& prefix = "") {
    const std::uint64_t min = minimum(model, prefix);
    if (min == 0) return;
    refused(model, min - 1, prefix);
    completes(model, min + 1, prefix);
    for (std::uint64_t b : sweep(min, points)) completes(model, b, prefix);
  }
};

TEST_F(Sweep, MiniFromTheMinimumTo4x) { run_sweep(kModelMini, 16); }
TEST_F(Sweep, TwoLayerCustomFromTheMinimumTo4x) { run_sweep(kModelCustom, 16); }

// Under the hog, fewer points (the runs are ~3x slower): the minimum, +1 byte and 6 between.
TEST_F(Sweep, MiniUnderCpuHog) {
  CpuHog hog(2);
  run_sweep(kModelMini, 6);
}
TEST_F(Sweep, TwoLayerCustomUnderCpuHog) {
  CpuHog hog(2);
  run_sweep(kModelCustom, 6);
}

TEST_F(Sweep, MiniTwoRanks) {
  if (std::system("command -v mpirun >/dev/null 2>&1") != 0) GTEST_SKIP() << "no mpirun";
  // `env` runs the binary: run() puts OMP_NUM_THREADS=1 before it, which mpirun would take for
  // the executable.
  const std::string mpirun = "mpirun --allow-run-as-root --oversubscribe -np 2 -x OMP_NUM_THREADS=1 env";
  // An explicit device budget: the trainer's default one is below what 2 ranks' all-gathers need
  // at some of these host budgets (refused at start: a separate issue).
  run_sweep(kModelMini + " --device-budget 32MiB", 4, mpirun);
}

TEST_F(TrainBudget, PinnedPoolPinsWhatItUsesNotItsBudget) {
  std::ofstream(dir_ / "ds.json") << R"({
    "train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {
      "stage": 3,
      "offload_param": {"device": "nvme", "nvme_path": "swap", "pin_memory": true},
      "offload_optimizer": {"device": "nvme", "nvme_path": "swap", "pin_memory": true}
    }
  })";
  const RunResult r = run("--model mini --seq-len 16 --batch 1 --steps 3 --eval-every 0 --json --config ds.json "
                          "--data " + corpus());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  ASSERT_FALSE(r.summary.is_null()) << r.out;
  const auto rss = r.summary["max_rss_bytes"].get<std::uint64_t>();
  EXPECT_LT(rss, 200ull << 20) << "max RSS " << rss << " bytes with a pinned pool";
  EXPECT_FALSE(fs::exists(dir_ / "swap" / "rank0")) << "the rank directory tiermem made is left behind";
}

}  // namespace
