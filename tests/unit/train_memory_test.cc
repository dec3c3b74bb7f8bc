// Memory promises of tiermem-train over ZeroEngine (issue: one engine over all three tiers):
//   1. at fixed host and device budgets, models whose state differs ~16x train with NVMe offload
//      at the same max RSS (read from the OS by the trainer: getrusage), within 64 MiB;
//   2. the summary's peak host (pool + bounce chunks + engine buffers + gradient buffers +
//      activations + sim device) is within kRssSlack of that max RSS, and every peak is within
//      its budget;
//   3. a host budget below what the model needs is refused at start with exit 2 and one line
//      naming the key, the value and the minimum, before anything is written to the swap dir;
//   4. an NVMe directory on a filesystem too small for the state is refused the same way, naming
//      --swap-dir (the flag given) rather than a config key
//      (a loop-mounted 8 MiB ext4; skipped, loudly, without root and mount).
#include <sys/mount.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "unit/train_run.h"

namespace {
using namespace tiermem_train_test;
using TrainMemory = TrainBinaryTest;

// What max RSS may exceed the accounted peak host by: code and libraries (OpenBLAS, MPI, ...),
// thread stacks, the corpus and allocator slack. Measured 27-74 MiB on the runs in
// docs/benchmarks.md.
constexpr std::uint64_t kRssSlack = 128ull << 20;

TEST_F(TrainMemory, MaxRssIsFlatAcrossModelSizesAtFixedBudgets) {
  std::vector<std::uint64_t> rss, params;
  for (int layers : {1, 4, 17}) {
    SCOPED_TRACE("layers " + std::to_string(layers));
    const RunResult r = run("--model custom --layers " + std::to_string(layers) +
                            " --d-model 256 --seq-len 16 --batch 1 --steps 2 --eval-every 0 --json "
                            "--offload nvme --swap-dir swap --data " + corpus() +
                            " --host-budget 16MiB --device-budget 8MiB");
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const json& s = r.summary;
    ASSERT_FALSE(s.is_null()) << r.out;
    EXPECT_TRUE(std::isfinite(s["final_loss"].get<double>()));
    const auto max_rss = s["max_rss_bytes"].get<std::uint64_t>();
    const auto peak_host = s["host_peak_bytes"].get<std::uint64_t>();
    EXPECT_LE(s["device_peak_bytes"].get<std::uint64_t>(), s["device_budget_bytes"].get<std::uint64_t>());
    EXPECT_EQ(s["device_budget_bytes"].get<std::uint64_t>(), 8u << 20);
    EXPECT_LE(s["host_pool_peak_bytes"].get<std::uint64_t>(), 16u << 20);
    // One layer's state (8 B a parameter with one fp32 copy) fits the 16 MiB pool; more does not.
    if (layers > 1) {
      EXPECT_GT(s["nvme_bytes_written"].get<std::uint64_t>(), 0u);
    }
    EXPECT_LE(peak_host, max_rss + kRssSlack);
    EXPECT_LE(max_rss, peak_host + kRssSlack) << "max RSS " << max_rss << " vs accounted " << peak_host;
    rss.push_back(max_rss);
    params.push_back(s["param_count"].get<std::uint64_t>());
  }
  std::printf("max RSS at %llu / %llu / %llu parameters: %.1f / %.1f / %.1f MiB\n",
              static_cast<unsigned long long>(params[0]), static_cast<unsigned long long>(params[1]),
              static_cast<unsigned long long>(params[2]), rss[0] / 1048576.0, rss[1] / 1048576.0,
              rss[2] / 1048576.0);
  EXPECT_GE(params.back(), 15 * params.front());  // the state really grew ~16x
  const auto [lo, hi] = std::minmax_element(rss.begin(), rss.end());
  EXPECT_LT(*hi - *lo, 64u << 20) << "max RSS " << rss[0] << ", " << rss[1] << ", " << rss[2];
}

TEST_F(TrainMemory, HostBudgetBelowTheMinimumIsRefusedAtStart) {
  const RunResult r = run("--model tiny --seq-len 16 --steps 2 --offload nvme --swap-dir swap "
                          "--host-budget 8KiB --data " + corpus());
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("tiermem.host_budget_bytes"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("is below the"), std::string::npos) << r.err;
  EXPECT_EQ(r.out.find("step 1"), std::string::npos) << "no step may start";
  // Nothing was written: no swap file, no rank directory with files in it.
  std::size_t files = 0;
  if (fs::exists(dir_ / "swap")) {
    for (const auto& e : fs::recursive_directory_iterator(dir_ / "swap")) files += e.is_regular_file();
  }
  EXPECT_EQ(files, 0u);
}

TEST_F(TrainMemory, NvmeFilesystemTooSmallIsRefusedAtStart) {
  if (::geteuid() != 0) GTEST_SKIP() << "SKIPPED: needs root to loop-mount a small filesystem";
  const std::string img = (dir_ / "fs.img").string(), mnt = (dir_ / "mnt").string();
  fs::create_directories(mnt);
  const std::string make = "truncate -s 8M " + img + " && mkfs.ext4 -q -F " + img +
                           " >/dev/null 2>&1 && mount -o loop " + img + " " + mnt + " >/dev/null 2>&1";
  if (std::system(make.c_str()) != 0) GTEST_SKIP() << "SKIPPED: mkfs.ext4 or mount -o loop failed";
  // mini: 52 MB of parameters and Adam state on NVMe, against ~6 MiB free.
  const RunResult r = run("--model mini --steps 1 --offload nvme --swap-dir " + mnt + " --data " + corpus());
  ::umount2(mnt.c_str(), MNT_DETACH);
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("free"), std::string::npos) << r.err;
  // The directory came from --swap-dir: the error names that, not a config key never written.
  EXPECT_NE(r.err.find("--swap-dir"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("offload_optimizer.nvme_path"), std::string::npos) << r.err;
  EXPECT_EQ(r.out.find("step 1"), std::string::npos);
}

}  // namespace
