// src/core/dir_lock.cc — see tiermem/dir_lock.h.
#include "tiermem/dir_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <utility>

#include "tiermem/error.h"
#include "tiermem/log.h"

namespace tiermem {

std::string unsafe_directory_reason(const std::string& dir) {
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) return "";
  const uid_t me = ::geteuid();
  if (st.st_uid != me && st.st_uid != 0)
    return "it is owned by uid " + std::to_string(st.st_uid) + ", not by you (uid " +
           std::to_string(me) + ")";
  if ((st.st_mode & S_IWOTH) != 0 && (st.st_mode & S_ISVTX) == 0) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    return std::string("it is world-writable (mode ") + mode + ") without the sticky bit";
  }
  return "";
}

DirLock::DirLock(std::string lock_path, std::string what, std::string advice, const char* log_tag)
    : path_(std::move(lock_path)) {
  for (int attempt = 0; attempt < 100; ++attempt) {
    // O_NOFOLLOW: a symlink planted at the lock's name (in a shared directory) would make us
    // truncate and write whatever file it points to.
    int fd = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0) {
      const int err = errno;
      throw IoError(path_, 0, 0, err, "open",
                    err == ELOOP ? "the lock file of the " + what +
                                       " is a symbolic link; tiermem does not follow it (remove it "
                                       "if it is yours)"
                                 : "cannot create the lock file of the " + what);
    }
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      char buf[32] = {};
      const ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
      ::close(fd);
      if (err == EWOULDBLOCK) {
        std::string pid = n > 0 ? std::string(buf, static_cast<std::size_t>(n)) : std::string("?");
        pid.erase(std::remove_if(pid.begin(), pid.end(), [](char c) { return c == '\n' || c == ' '; }),
                  pid.end());
        if (pid == std::to_string(::getpid())) {  // an engine of this process not closed yet
          throw Error(what + " is in use by another engine in this process (pid " + pid + ", lock file " + path_ +
                      "): close that one first (engine.close(); a dropped engine holds it until exit), or " +
                      advice);
        }
        throw Error(what + " is in use by process " + pid + " (lock file " + path_ + "); " + advice);
      }
      throw IoError(path_, 0, 0, err, "flock");
    }
    // The owner before us may have unlinked the file between our open and flock: retry then.
    struct stat a {}, b {};
    if (::fstat(fd, &a) == 0 && ::lstat(path_.c_str(), &b) == 0 && a.st_ino == b.st_ino &&
        a.st_dev == b.st_dev) {
      // A pid left in the file means its process ended without releasing (crash, SIGKILL): the
      // kernel dropped its flock, so the lock is ours; say so once.
      char old[32] = {};
      const ssize_t n = ::pread(fd, old, sizeof old - 1, 0);
      const long old_pid = n > 0 ? std::strtol(old, nullptr, 10) : 0;
      if (old_pid > 0 && old_pid != static_cast<long>(::getpid())) {
        const bool alive = ::kill(static_cast<pid_t>(old_pid), 0) == 0 || errno == EPERM;
        logger().info("[{}] reclaimed stale lock {} of the {}: {} process {}", log_tag, path_, what,
                      alive ? "no longer holding (pid reused?)" : "dead", old_pid);
      }
      const std::string pid = std::to_string(::getpid()) + "\n";
      if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, pid.data(), pid.size(), 0) < 0) {
        const int err = errno;
        ::close(fd);
        throw IoError(path_, 0, pid.size(), err, "write");
      }
      fd_ = fd;
      return;
    }
    ::close(fd);
  }
  throw Error("could not lock the " + what + " (its lock file " + path_ + " keeps changing)");
}

void DirLock::release() noexcept {
  if (fd_ >= 0) {
    ::unlink(path_.c_str());  // while still holding: a waiter retries on the new file
    ::close(fd_);             // releases the flock
    fd_ = -1;
  }
}

DirLock::~DirLock() { release(); }

DirLock::DirLock(DirLock&& o) noexcept : path_(std::move(o.path_)), fd_(o.fd_) { o.fd_ = -1; }

DirLock& DirLock::operator=(DirLock&& o) noexcept {
  if (this != &o) {
    release();
    path_ = std::move(o.path_);
    fd_ = o.fd_;
    o.fd_ = -1;
  }
  return *this;
}

}  // namespace tiermem
