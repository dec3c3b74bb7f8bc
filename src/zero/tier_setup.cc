// src/zero/tier_setup.cc — see tier_setup.h.
#include "zero/tier_setup.h"

#include <sys/stat.h>
#include <sys/statvfs.h>

#include <cerrno>
#include <filesystem>
#include <fmt/format.h>
#include <map>

#include "nvme/made_dirs.h"
#include "tiermem/error.h"

namespace tiermem::detail {
namespace {

// <path>/rank<r> for each path; the swap directory, its missing parents and its rank directory
// are created 0700 when missing (only this user may read or plant files there). `created`: the
// directories removed with the swap files when nothing is left in them — the rank directory made
// here, and the directories on the way that tiermem made (this engine or another rank's), which
// the last engine to leave removes (src/nvme/made_dirs.h); a directory the user made stays.
std::vector<std::string> rank_dirs(const std::vector<std::string>& paths, int rank,
                                   std::vector<std::string>* created) {
  std::vector<std::string> out;
  for (const auto& p : paths) {
    const std::filesystem::path base = std::filesystem::path(p).lexically_normal();
    const std::string leaf = "rank" + std::to_string(rank);
    for (std::string& d : make_marked_dirs(base.string(), leaf)) created->push_back(std::move(d));
    out.push_back((base / leaf).string());
  }
  return out;
}

// Refuses a swap directory whose filesystem lacks room for `need` bytes (spread over `paths`).
void check_free_space(const std::vector<std::string>& paths, std::uint64_t need, const char* key) {
  if (need == 0 || paths.empty()) return;
  const std::uint64_t per_path = need / paths.size();
  std::map<unsigned long, std::pair<std::string, std::uint64_t>> by_fs;  // fsid -> (path, need)
  for (const auto& p : paths) {
    struct statvfs sv {};
    std::filesystem::path probe(p);
    while (!probe.empty() && !std::filesystem::exists(probe)) probe = probe.parent_path();
    if (probe.empty()) probe = ".";
    // The swap space reports its own errors; a pseudo filesystem (proc, sys: no blocks at all)
    // is one the directory cannot be made on, which making it says, not a lack of free space.
    if (statvfs(probe.c_str(), &sv) != 0 || sv.f_blocks == 0) continue;
    auto& e = by_fs[sv.f_fsid];
    e.first = p;
    e.second += per_path;
    const std::uint64_t free_bytes = static_cast<std::uint64_t>(sv.f_bavail) * sv.f_frsize;
    if (e.second > free_bytes) {
      throw ConfigError(key, p,
                        fmt::format("the NVMe state needs {} in '{}' but its filesystem has {} free; free "
                                    "space there, add nvme_path entries on other filesystems, or offload "
                                    "less (offload_param / offload_optimizer device cpu)",
                                    format_bytes(e.second), p, format_bytes(free_bytes)));
    }
  }
}

}  // namespace

SwapTier make_swap_tier(const Config& cfg, const ZeroPlan& plan, int rank) {
  const ZeroConfig& z = cfg.zero;
  SwapTier out;
  const bool nvme_param = plan.uses_device && plan.param_home == Tier::kNvme;
  const bool nvme_opt = plan.optimizer_home == Tier::kNvme;
  if (nvme_param || nvme_opt) {
    // DeepSpeed's meaning: parameters under offload_param.nvme_path, optimizer state (and swapped
    // gradients) under offload_optimizer.nvme_path; one swap space when they are the same.
    const auto& ppaths = z.offload_param.nvme_path.empty() ? z.offload_optimizer.nvme_path : z.offload_param.nvme_path;
    const auto& opaths = z.offload_optimizer.nvme_path.empty() ? z.offload_param.nvme_path : z.offload_optimizer.nvme_path;
    const bool same = !nvme_param || !nvme_opt || ppaths == opaths;
    // The key (or flag, OffloadConfig::nvme_path_from) that gave each path list.
    auto key = [&](bool optimizer) {
      const OffloadConfig& own = optimizer ? z.offload_optimizer : z.offload_param;
      const OffloadConfig& other = optimizer ? z.offload_param : z.offload_optimizer;
      const OffloadConfig& from = own.nvme_path.empty() ? other : own;
      if (!from.nvme_path_from.empty()) return from.nvme_path_from;
      return std::string(&from == &z.offload_optimizer ? "zero_optimization.offload_optimizer.nvme_path"
                                                       : "zero_optimization.offload_param.nvme_path");
    };
    if (same) {
      const auto& paths = nvme_opt ? opaths : ppaths;
      check_free_space(paths, plan.nvme_bytes, key(nvme_opt).c_str());
    } else {
      check_free_space(ppaths, plan.nvme_param_bytes, key(false).c_str());
      check_free_space(opaths, plan.nvme_optimizer_bytes, key(true).c_str());
    }
    out.io = make_io_engine(cfg);
    auto make_swap = [&](const std::vector<std::string>& paths) {
      std::vector<std::string> created;
      auto s = std::make_shared<SwapSpace>(cfg, rank_dirs(paths, rank, &created), *out.io);
      s->remove_when_done(std::move(created));
      return s;
    };
    if (same) {
      out.param_swap = out.optim_swap = make_swap(nvme_opt ? opaths : ppaths);
    } else {
      out.param_swap = make_swap(ppaths);
      out.optim_swap = make_swap(opaths);
    }
  }
  return out;
}

}  // namespace tiermem::detail
