// src/nvme/made_dirs.cc — see made_dirs.h.
#include "nvme/made_dirs.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "tiermem/error.h"
#include "tiermem/log.h"

namespace tiermem::detail {
namespace {

std::string marker_of(const std::string& dir) { return dir + "/" + kMadeMarker; }

bool has_marker(const std::string& dir) {
  struct stat st {};
  return ::lstat(marker_of(dir).c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

void put_marker(const std::string& dir) {
  const int fd = ::open(marker_of(dir).c_str(), O_CREAT | O_WRONLY | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd >= 0) ::close(fd);
}

// Entries of `dir` other than ".", ".." and the marker; -1 when it cannot be read.
int other_entries(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return -1;
  int n = 0;
  while (const dirent* e = ::readdir(d)) {
    if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0 &&
        std::strcmp(e->d_name, kMadeMarker) != 0) {
      ++n;
    }
  }
  ::closedir(d);
  return n;
}

}  // namespace

std::vector<std::string> make_marked_dirs(const std::string& dir, const std::string& leaf) {
  const std::filesystem::path target = std::filesystem::path(dir).lexically_normal();
  // The levels from the outermost to `dir`, then the leaf.
  std::vector<std::filesystem::path> levels;
  for (std::filesystem::path p = target; !p.empty() && p != p.root_path(); p = p.parent_path()) {
    levels.insert(levels.begin(), p);
    if (p == p.parent_path()) break;
  }
  constexpr int kAttempts = 16;  // each retry follows a removal by another engine that closed
  for (int attempt = 0;; ++attempt) {
    int err = 0;
    std::string failed;
    bool made_leaf = false;
    for (const std::filesystem::path& p : levels) {
      if (::mkdir(p.c_str(), 0700) == 0) {
        put_marker(p.string());
      } else if (errno != EEXIST) {
        err = errno;
        failed = p.string();
        break;
      }
    }
    if (err == 0 && !leaf.empty()) {
      const std::string l = (target / leaf).string();
      if (::mkdir(l.c_str(), 0700) == 0) {
        made_leaf = true;
      } else if (errno != EEXIST) {
        err = errno;
        failed = l;
      }
    }
    if (err == ENOENT && attempt + 1 < kAttempts) continue;  // a level was removed meanwhile
    if (err != 0) {
      const char* why = err == ENOTDIR  ? "a path on the way to the swap directory is a file, not a directory"
                        : err == EROFS  ? "the swap directory's file system is read-only"
                        : err == EACCES ? "no permission to make the swap directory there"
                                        : "cannot make the swap directory";
      throw IoError(failed, 0, 0, err, "mkdir",
                    std::string(why) + "; give the swap path a writable directory (the config's "
                                       "zero_optimization.offload_param / offload_optimizer nvme_path, NVMeAdamW's "
                                       "nvme_path, or tiermem-train --swap-dir)");
    }
    std::vector<std::string> out;
    // A leaf found in a directory tiermem made is tiermem's too: one a killed run left behind (its
    // stale lock and swap file reclaimed by this run) goes when this run is done.
    if (made_leaf || (!leaf.empty() && has_marker(target.string()))) out.push_back((target / leaf).string());
    for (auto it = levels.rbegin(); it != levels.rend(); ++it) {
      if (has_marker(it->string())) out.push_back(it->string());
    }
    return out;
  }
}

void remove_if_unused(const std::string& dir) noexcept {
  try {
    const bool marked = has_marker(dir);
    if (other_entries(dir) != 0) return;  // in use (or unreadable, or gone)
    if (marked && ::unlink(marker_of(dir).c_str()) != 0 && errno != ENOENT) return;
    if (::rmdir(dir.c_str()) == 0 || errno == ENOENT) return;
    // Another engine made its rank directory here after the check: the directory stays, and
    // stays tiermem's.
    if (marked) put_marker(dir);
    TM_LOG_DEBUG("NVME", "swap directory {} stays: {}", dir, std::strerror(errno));
  } catch (...) {
  }
}

}  // namespace tiermem::detail
