// The tier set-up's NVMe part (src/zero/tier_setup.h): which swap spaces a plan gets, where they
// live (rank directories, 0700, removed when made here), and a filesystem too small refused
// with the key that named it.
#include "zero/tier_setup.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "tiermem/error.h"

namespace tiermem::detail {
namespace {

namespace fs = std::filesystem;

struct TempDir {
  fs::path path = fs::temp_directory_path() / ("tiermem-tier-setup-" + std::to_string(getpid()));
  TempDir() {  // made by "the user": it stays whatever the engine makes inside
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
};

ZeroPlan nvme_plan(bool params_on_nvme, std::uint64_t nvme_bytes = 1 << 20) {
  ZeroPlan p;
  p.uses_device = params_on_nvme;
  p.param_home = params_on_nvme ? Tier::kNvme : Tier::kHost;
  p.optimizer_home = Tier::kNvme;
  p.nvme_bytes = nvme_bytes;
  p.nvme_param_bytes = params_on_nvme ? nvme_bytes / 2 : 0;
  p.nvme_optimizer_bytes = nvme_bytes - p.nvme_param_bytes;
  return p;
}

TEST(TierSetup, NothingOnNvmeMakesNothing) {
  Config cfg;
  ZeroPlan p;  // every home in host memory
  const SwapTier t = make_swap_tier(cfg, p, 0);
  EXPECT_EQ(t.io, nullptr);
  EXPECT_EQ(t.param_swap, nullptr);
  EXPECT_EQ(t.optim_swap, nullptr);
}

TEST(TierSetup, OneSpaceInTheRankDirectoryWhenThePathsAgree) {
  TempDir d;
  Config cfg;
  cfg.zero.offload_optimizer.nvme_path = {(d.path / "swap").string()};  // offload_param's is empty
  const fs::path rank_dir = d.path / "swap" / "rank3";
  {
    SwapTier t = make_swap_tier(cfg, nvme_plan(/*params_on_nvme=*/true), 3);
    ASSERT_NE(t.io, nullptr);
    ASSERT_NE(t.optim_swap, nullptr);
    EXPECT_EQ(t.param_swap, t.optim_swap);  // the same paths: one space
    ASSERT_EQ(t.optim_swap->dirs().size(), 1u);
    EXPECT_EQ(fs::path(t.optim_swap->dirs()[0]), rank_dir);
    struct stat sb {};
    ASSERT_EQ(::stat(rank_dir.c_str(), &sb), 0);
    EXPECT_EQ(sb.st_mode & 0777, 0700u);
    t.param_swap.reset();
    t.optim_swap.reset();  // before the io engine they use
  }
  EXPECT_FALSE(fs::exists(rank_dir)) << "made here: removed with the swap files";
  // <path> was made here too (marked, src/nvme/made_dirs.h): the last engine to leave removes it;
  // the directory above it, the user's, stays.
  EXPECT_FALSE(fs::exists(d.path / "swap"));
  EXPECT_TRUE(fs::exists(d.path));
}

TEST(TierSetup, TwoSpacesForTwoSections) {
  TempDir d;
  Config cfg;
  cfg.zero.offload_param.nvme_path = {(d.path / "p").string()};
  cfg.zero.offload_optimizer.nvme_path = {(d.path / "o").string()};
  SwapTier t = make_swap_tier(cfg, nvme_plan(true), 0);
  ASSERT_NE(t.param_swap, nullptr);
  ASSERT_NE(t.optim_swap, nullptr);
  EXPECT_NE(t.param_swap, t.optim_swap);
  EXPECT_EQ(fs::path(t.param_swap->dirs()[0]), d.path / "p" / "rank0");
  EXPECT_EQ(fs::path(t.optim_swap->dirs()[0]), d.path / "o" / "rank0");
  t.param_swap.reset();
  t.optim_swap.reset();
  // Only the optimizer on NVMe: the parameter section's paths are not used.
  SwapTier u = make_swap_tier(cfg, nvme_plan(false), 0);
  EXPECT_EQ(u.param_swap, u.optim_swap);
  EXPECT_EQ(fs::path(u.optim_swap->dirs()[0]), d.path / "o" / "rank0");
  u.param_swap.reset();
  u.optim_swap.reset();
}

TEST(TierSetup, AFilesystemWithoutRoomIsRefusedNamingTheKey) {
  TempDir d;
  Config cfg;
  cfg.zero.offload_optimizer.nvme_path = {(d.path / "swap").string()};
  try {
    make_swap_tier(cfg, nvme_plan(false, std::uint64_t{1} << 62), 0);  // 4 EiB
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.key_path(), "zero_optimization.offload_optimizer.nvme_path");
    EXPECT_NE(std::string(e.what()).find("free"), std::string::npos) << e.what();
  }
  cfg.zero.offload_optimizer.nvme_path_from = "--swap-dir";  // a program's flag set the path
  try {
    make_swap_tier(cfg, nvme_plan(false, std::uint64_t{1} << 62), 0);
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.key_path(), "--swap-dir");
  }
}

}  // namespace
}  // namespace tiermem::detail
