// tiermem/dir_lock.h — an exclusive, crash-safe lock on a directory: who owns a swap directory or
// a checkpoint directory, so two processes never write into the same one.
//
// The lock is an flock(2) on a lock file that holds the owner's pid. The kernel drops an flock
// when its process dies (crash, SIGKILL), so a lock file left behind by a dead process is taken
// over at once; that is logged once, with the old pid. A live owner makes the constructor throw
// an Error that names the directory, the owner's pid and what to do.
// flock locks are per open file description: two DirLocks on one file in one process conflict
// too. Not for NFS (flock there may be local-only).
//
// Hostile directories: the lock file is opened with O_NOFOLLOW (a symlink planted at its name is
// refused with ELOOP, never followed) and created 0600; unsafe_directory_reason() says whether a
// directory is fit to hold a process's private files at all.
//
// Thread-safety: a DirLock is not shared between threads; unsafe_directory_reason is a pure
// query (one stat), callable from any thread.
#pragma once

#include <string>

#include "tiermem/export.h"

namespace tiermem {

// Why `dir` must not hold this process's swap or checkpoint files, or "" when it may: it is owned
// by another user (not this effective uid, and not root, whom everyone trusts anyway), or it is
// world-writable without the sticky bit (anyone could rename, replace or plant files there).
// Returns e.g. "it is owned by uid 4242, not by you (uid 1000)" or "it is world-writable (mode
// 0777) without the sticky bit". "" also when `dir` cannot be stat'ed (the caller's other checks
// name that). Symlinks are followed: the directory they lead to is judged.
TIERMEM_API std::string unsafe_directory_reason(const std::string& dir);

class TIERMEM_API DirLock {
 public:
  // Takes the lock at `lock_path` (created 0600 if missing; its directory must exist; a symlink
  // there is not followed: IoError ELOOP naming the path) and writes our pid into it. `what`
  // names the locked thing in messages ("swap directory '/nvme/x'"), `advice` says what to do
  // when it is in use ("give each process its own nvme_path").
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
