// tiermem/dir_lock.h — an exclusive, crash-safe lock on a directory: who owns a swap directory or
// a checkpoint directory, so two processes never write into the same one.
//
// The lock is an flock(2) on a lock file that holds the owner's pid. The kernel drops an flock
// when its process dies (crash, SIGKILL), so a lock file left behind by a dead process is taken
// over at once; that is logged once, with the old pid. A live owner makes the constructor throw
// an Error that names the directory, the owner's pid and what to do.
// flock locks are per open file description: two DirLocks on one file in one process conflict
// too. Not for NFS (flock there may be local-only).
#pragma once

#include <string>

namespace tiermem {

class DirLock {
 public:
  // Takes the lock at `lock_path` (created if missing; its directory must exist) and writes our
  // pid into it. `what` names the locked thing in messages ("swap directory '/nvme/x'"),
  // `advice` says what to do when it is in use ("give each process its own nvme_path").
  // Throws Error when another live process holds it, IoError when the file cannot be created,
  // locked or written. `log_tag` is the log tag of the stale-lock message ("NVME", "TRAIN").
  DirLock(std::string lock_path, std::string what, std::string advice,
          const char* log_tag = "CORE");
  // Removes the lock file and releases the lock. Never throws.
  ~DirLock();
  DirLock(const DirLock&) = delete;
  DirLock& operator=(const DirLock&) = delete;
  DirLock(DirLock&& o) noexcept;
  DirLock& operator=(DirLock&& o) noexcept;

  const std::string& path() const { return path_; }

 private:
  void release() noexcept;
  std::string path_;
  int fd_ = -1;
};

}  // namespace tiermem
