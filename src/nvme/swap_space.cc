// SwapSpace: per-directory locked, preallocated swap files; extents from an ExtentAllocator per
// file, striped across the files; reads and writes through the IoEngine; XXH3-64 per extent
// (tiermem.checksum), hashed and verified on the completion threads.
#include "tiermem/swap_space.h"

#include "nvme/made_dirs.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <optional>

#include "nvme/checksum.h"
#include "nvme/extent_allocator.h"
#include "nvme/hash_worker.h"
#include "tiermem/config.h"
#include "tiermem/dir_lock.h"
#include "tiermem/error.h"
#include "tiermem/log.h"

namespace tiermem {
namespace {

constexpr const char* kLockName = "tiermem.lock";
constexpr const char* kSwapPrefix = "tiermem-swap-";

std::uint64_t round_up(std::uint64_t x, std::uint64_t a) { return (x + a - 1) / a * a; }

std::uint64_t fs_free_bytes(const std::string& dir) {
  struct statvfs s {};
  if (statvfs(dir.c_str(), &s) != 0) return 0;
  return static_cast<std::uint64_t>(s.f_bavail) * s.f_frsize;
}

// Deletes swap files left by processes that died without cleaning up (we hold the lock).
void remove_stale_swap_files(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return;
  while (dirent* e = ::readdir(d)) {
    std::string name = e->d_name;
    if (name.rfind(kSwapPrefix, 0) == 0) {
      std::string p = dir + "/" + name;
      if (::unlink(p.c_str()) == 0) TM_LOG_INFO("NVME", "removed stale swap file {}", p);
    }
  }
  ::closedir(d);
}

}  // namespace

SwapSpaceOptions SwapSpaceOptions::from_config(const Config& c) {
  SwapSpaceOptions o;
  o.stripe_bytes = c.tiermem.stripe_bytes;
  o.initial_bytes_per_path = c.tiermem.swap_initial_bytes;
  o.max_bytes_per_path = c.tiermem.swap_max_bytes;
  o.checksum = c.tiermem.checksum;
  return o;
}

struct SwapSpace::PathState {
  std::string dir;
  std::string file_path;
  std::optional<DirLock> lock;  // held for the swap space's life (see swap_space.h)
  IoFile file;
  detail::ExtentAllocator alloc{0, 4096};
};

SwapSpace::SwapSpace(const Config& c, std::vector<std::string> d, IoEngine& e)
    : SwapSpace(SwapSpaceOptions::from_config(c), std::move(d), e) {}

SwapSpace::SwapSpace(const SwapSpaceOptions& options, std::vector<std::string> dirs,
                     IoEngine& engine)
    : options_(options), dirs_(std::move(dirs)), engine_(engine), hasher_(std::make_unique<detail::HashWorker>()) {
  if (dirs_.empty())
    throw ConfigError("zero_optimization.offload_param.nvme_path", "",
                      "SwapSpace needs at least one nvme_path directory");
  for (const auto& dir : dirs_) {
    struct stat st {};
    if (::stat(dir.c_str(), &st) != 0)
      throw IoError(dir, 0, 0, errno, "stat", "the nvme_path directory must exist");
    if (!S_ISDIR(st.st_mode)) throw IoError(dir, 0, 0, ENOTDIR, "stat", "nvme_path must be a directory");
    if (const std::string why = unsafe_directory_reason(dir); !why.empty())
      throw ConfigError("zero_optimization.offload_param.nvme_path", dir,
                        "swap directory '" + dir + "' is refused: " + why +
                            "; use a directory only you can write (e.g. mkdir -m 700)");
    std::uint64_t bs = std::max<std::uint64_t>(4096, static_cast<std::uint64_t>(st.st_blksize));
    if (bs <= 65536 && (bs & (bs - 1)) == 0) align_ = std::max(align_, bs);
  }
  if (options_.stripe_bytes == 0 || options_.stripe_bytes % align_ != 0)
    throw ConfigError("tiermem.stripe_bytes", std::to_string(options_.stripe_bytes),
                      "tiermem.stripe_bytes must be a positive multiple of " + std::to_string(align_) +
                          " (the swap directories' block size)");
  const std::uint64_t initial = round_up(std::max<std::uint64_t>(options_.initial_bytes_per_path, align_), align_);
  try {
    for (const auto& dir : dirs_) {
      auto ps = std::make_unique<PathState>();
      ps->dir = dir;
      ps->lock.emplace(dir + "/" + kLockName, "swap directory '" + dir + "'",
                       "give each process its own nvme_path directory", "NVME");
      paths_.push_back(std::move(ps));
      PathState& p = *paths_.back();
      remove_stale_swap_files(dir);
      p.file_path = dir + "/" + kSwapPrefix + std::to_string(::getpid()) + ".bin";
      p.file = engine_.open_file(p.file_path, /*create=*/true);
      std::uint64_t first = initial;
      try {
        engine_.allocate_space(p.file, 0, first);
      } catch (const OutOfMemoryError&) {
        // A small filesystem: start with one block and grow on demand (a real shortage is
        // reported by the allocation that cannot be met, with its size).
        first = align_;
        engine_.allocate_space(p.file, 0, first);
        TM_LOG_INFO("NVME", "{} has less than tiermem.swap_initial_bytes ({}) free: the swap file "
                    "starts at {} and grows as needed", dir, format_bytes(initial), format_bytes(first));
      }
      p.alloc = detail::ExtentAllocator(first, align_);
    }
  } catch (...) {
    for (auto& p : paths_) {
      if (p->file.valid()) {
        engine_.close_file(p->file);
        ::unlink(p->file_path.c_str());
      }
      p->lock.reset();
    }
    throw;
  }
  TM_LOG_DEBUG("NVME", "swap space over {} directories, {} each, block {} B, stripe {}", dirs_.size(),
               format_bytes(initial), align_, format_bytes(options_.stripe_bytes));
}

SwapSpace::~SwapSpace() {
  hasher_.reset();  // every verification posted has run (their requests completed before this)
  for (auto& p : paths_) {
    engine_.close_file(p->file);
    if (::unlink(p->file_path.c_str()) != 0)
      TM_LOG_WARN("NVME", "{}", errno_message("removing swap file " + p->file_path, errno));
    p->lock.reset();  // removes the lock file, releases the flock
  }
  for (const std::string& d : created_dirs_) detail::remove_if_unused(d);  // made_dirs.h
}

const std::string& SwapSpace::file_path(std::uint32_t path_index) const {
  return paths_.at(path_index)->file_path;
}

namespace {
// What growing `p` could still add (max or filesystem free space).
std::uint64_t growable(const std::string& dir, std::uint64_t cap, std::uint64_t max) {
  std::uint64_t fs = fs_free_bytes(dir);
  if (max == 0) return fs;
  return max > cap ? std::min(max - cap, fs) : 0;
}
}  // namespace

// Allocates `len` (aligned) bytes in path `i`, growing its file if needed. nullopt when the
// growth limit is reached; throws OutOfMemoryError when the filesystem is full. Requires mu_.
static std::optional<std::uint64_t> alloc_in(SwapSpace& self, detail::ExtentAllocator& a,
                                             IoEngine& engine, IoFile file, const std::string& dir,
                                             std::uint64_t len, std::uint64_t max, std::uint64_t align) {
  if (auto off = a.allocate(len)) return off;
  std::uint64_t cap = a.capacity_bytes();
  std::uint64_t need = len - a.free_tail_bytes();
  // Doubling while the file is small (few fallocate calls), then 1 GiB at a time: a swap file
  // never outgrows the state it holds by more than 1 GiB (doubling took a 64 GiB file for 47 GB
  // of state, space other users of the disk then lacked).
  constexpr std::uint64_t kMaxGrowStep = 1ull << 30;
  std::uint64_t want = round_up(cap + std::max(need, std::min(cap, kMaxGrowStep)), align);
  if (max != 0) want = std::min(want, max);
  if (want < cap + need) return std::nullopt;
  try {
    engine.allocate_space(file, cap, want - cap);
  } catch (const OutOfMemoryError&) {
    if (want == cap + need) throw;
    want = cap + need;  // doubling did not fit: try exactly what is needed
    engine.allocate_space(file, cap, want - cap);
  }
  a.grow(want);
  TM_LOG_DEBUG("NVME", "swap file in {} grown to {}", dir, format_bytes(want));
  (void)self;
  return a.allocate(len);
}

SwapExtent SwapSpace::allocate(std::uint64_t bytes) {
  if (bytes == 0) throw Error("SwapSpace::allocate: 0 bytes requested");
  std::lock_guard<std::mutex> lock(mu_);
  const std::uint64_t padded = round_up(bytes, align_);
  const std::uint32_t n = static_cast<std::uint32_t>(paths_.size());
  const std::uint64_t max = options_.max_bytes_per_path;
  auto available = [&] {
    std::uint64_t a = 0;
    for (auto& p : paths_) a += p->alloc.free_bytes() + growable(p->dir, p->alloc.capacity_bytes(), max);
    return a;
  };
  SwapExtent ext;
  ext.bytes = bytes;
  if (n == 1 || padded <= options_.stripe_bytes) {
    std::vector<std::uint32_t> order(n);
    std::iota(order.begin(), order.end(), 0u);
    std::stable_sort(order.begin(), order.end(), [&](std::uint32_t a, std::uint32_t b) {
      return paths_[a]->alloc.free_bytes() > paths_[b]->alloc.free_bytes();
    });
    std::string last_dir;
    for (std::uint32_t i : order) {
      PathState& p = *paths_[i];
      last_dir = p.dir;
      std::optional<std::uint64_t> off;
      try {
        off = alloc_in(*this, p.alloc, engine_, p.file, p.dir, padded, max, align_);
      } catch (const OutOfMemoryError& e) {
        if (i == order.back()) {
          throw OutOfMemoryError(Tier::kNvme, bytes, available(),
                                 "no space left to grow swap file " + p.file_path + " (" +
                                     format_bytes(p.alloc.capacity_bytes()) + " now) for " +
                                     format_bytes(padded) + ": " + e.detail());
        }
        continue;
      }
      if (off) {
        ext.pieces.push_back(SwapPiece{i, *off, padded});
        break;
      }
    }
    if (ext.pieces.empty())
      throw OutOfMemoryError(Tier::kNvme, bytes, available(),
                             "swap files reached tiermem.swap_max_bytes (" + format_bytes(max) +
                                 " per directory), last tried " + last_dir);
  } else {
    const std::uint64_t stripe = options_.stripe_bytes;
    const std::uint64_t units = (padded + stripe - 1) / stripe;
    const std::uint32_t first = next_first_path_++ % n;
    std::vector<std::uint64_t> share(n, 0), base(n, 0);
    for (std::uint64_t k = 0; k < units; ++k)
      share[(first + k) % n] += std::min(stripe, padded - k * stripe);
    std::vector<std::uint32_t> done;
    for (std::uint32_t i = 0; i < n; ++i) {
      if (share[i] == 0) continue;
      PathState& p = *paths_[i];
      std::optional<std::uint64_t> off;
      std::string why;
      try {
        off = alloc_in(*this, p.alloc, engine_, p.file, p.dir, share[i], max, align_);
        if (!off) why = "reached tiermem.swap_max_bytes (" + format_bytes(max) + ")";
      } catch (const OutOfMemoryError& e) {
        why = "cannot grow (" + e.detail() + ")";
      }
      if (!off) {
        for (std::uint32_t j : done) paths_[j]->alloc.free(base[j], share[j]);
        throw OutOfMemoryError(Tier::kNvme, bytes, available(),
                               "striped allocation needs " + format_bytes(share[i]) + " in " +
                                   p.dir + ", which " + why);
      }
      base[i] = *off;
      done.push_back(i);
    }
    for (std::uint64_t k = 0; k < units; ++k) {
      std::uint32_t i = static_cast<std::uint32_t>((first + k) % n);
      ext.pieces.push_back(
          SwapPiece{i, base[i] + (k / n) * stripe, std::min(stripe, padded - k * stripe)});
    }
  }
  ext.id = next_id_++;
  extents_.emplace(ext.id, Live{});
  return ext;
}

void SwapSpace::free(const SwapExtent& extent) {
  if (extent.empty()) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = extents_.find(extent.id);
  if (it == extents_.end())
    throw Error("SwapSpace::free: extent " + std::to_string(extent.id) +
                " is not live (freed twice, or from another SwapSpace)");
  for (const SwapPiece& p : extent.pieces) paths_.at(p.path_index)->alloc.free(p.offset, p.bytes);
  extents_.erase(it);
}

namespace {
std::vector<IoOp> make_ops(const SwapExtent& e, IoOpKind kind, char* buf, std::uint64_t bytes,
                           const std::vector<IoFile>& files) {
  std::vector<IoOp> ops;
  std::uint64_t pos = 0;
  for (const SwapPiece& p : e.pieces) {
    if (pos >= bytes) break;
    std::uint64_t n = std::min(p.bytes, bytes - pos);
    ops.push_back(IoOp{kind, files[p.path_index], p.offset, n, buf + pos});
    pos += n;
  }
  return ops;
}
// A read of `bytes` (the extent's pieces `ops` on `engine`'s files) hashed to `got`, not
// `expected`: reads it again into the same buffer with pread(2) on a fresh buffered descriptor
// (outside the engine: this runs on a completion thread, which must not wait for the engine) and
// hashes it again. Null when the re-read matches (a transient fault; one warning), else
// IoError::corrupt.
std::exception_ptr verify_after_reread(const IoEngine& engine, const std::vector<IoOp>& ops,
                                       std::uint64_t bytes, std::uint64_t got,
                                       std::uint64_t expected) {
  const std::string& path0 = engine.path(ops.front().file);
  const std::uint64_t off0 = ops.front().offset;
  for (std::size_t i = 0; i < ops.size(); ++i) {
    const std::string& path = engine.path(ops[i].file);
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0)
      return std::make_exception_ptr(IoError(path, ops[i].offset, ops[i].bytes, errno, "open",
                                             "re-reading after a checksum mismatch"));
    char* buf = static_cast<char*>(ops[i].buf);
    std::uint64_t done = 0;
    int err = 0;
    while (done < ops[i].bytes) {
      const ssize_t n = ::pread(fd, buf + done, ops[i].bytes - done,
                                static_cast<off_t>(ops[i].offset + done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        err = n < 0 ? errno : EIO;  // 0: the file ends inside the extent
        break;
      }
      done += static_cast<std::uint64_t>(n);
    }
    ::close(fd);
    if (err != 0)
      return std::make_exception_ptr(IoError(path, ops[i].offset + done, ops[i].bytes - done, err,
                                             "pread", "re-reading after a checksum mismatch"));
  }
  const std::uint64_t again = detail::extent_checksum(ops.front().buf, bytes);
  if (again == expected) {
    TM_LOG_WARN("NVME", "checksum mismatch reading {} at offset {} ({} bytes: xxh3 {:016x}, "
                "written {:016x}) was gone on a re-read: a transient fault, the data is intact",
                path0, off0, bytes, got, expected);
    return nullptr;
  }
  char msg[256];
  std::snprintf(msg, sizeof msg,
                "checksum mismatch (xxh3 %016llx read, %016llx on a re-read, %016llx written): the "
                "bytes on disk changed after tiermem wrote them (a failing drive or cable, or "
                "another process writing the swap file)",
                static_cast<unsigned long long>(got), static_cast<unsigned long long>(again),
                static_cast<unsigned long long>(expected));
  return std::make_exception_ptr(IoError::corrupt(path0, off0, bytes, msg));
}

}  // namespace

IoRequest SwapSpace::write(const SwapExtent& extent, const void* src, std::uint64_t bytes) {
  if (bytes > extent.bytes)
    throw Error("SwapSpace::write: " + std::to_string(bytes) + " bytes into an extent of " +
                std::to_string(extent.bytes));
  std::vector<IoFile> files;
  std::uint64_t write_no = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = extents_.find(extent.id);
    if (it == extents_.end())
      throw Error("SwapSpace::write: extent " + std::to_string(extent.id) + " is not live");
    // The old checksum no longer describes the extent; the new one is known when this write is.
    it->second.checksum_bytes = UINT64_MAX;
    write_no = ++it->second.writes;
    for (auto& p : paths_) files.push_back(p->file);
  }
  auto ops = make_ops(extent, IoOpKind::kWrite, static_cast<char*>(const_cast<void*>(src)), bytes, files);
  if (!options_.checksum || bytes == 0) return engine_.submit(ops);

  // Hashed here, on the calling thread, while the drive takes the bytes (`src` is the caller's
  // and unchanged until this request completes, swap_space.h Buffers): the bytes were usually
  // just written by whoever releases them, so they are still in cache, and the engine's
  // completion thread only reaps (hash_worker.h says why). The checksum is recorded by whichever
  // of the two ends last, before the request reports completion.
  struct Join {
    std::atomic<int> left{2};
    std::uint64_t hash = 0;
    std::exception_ptr err;
  };
  auto outer = std::make_shared<detail::IoRequestState>(1);
  auto join = std::make_shared<Join>();
  const std::uint64_t id = extent.id;
  auto finish = [this, outer, join, bytes, id, write_no] {
    if (!join->err) record_checksum(id, write_no, join->hash, bytes);
    outer->finish_one(join->err);
  };
  IoRequest inner = engine_.submit(ops);
  inner.on_complete([join, finish](std::exception_ptr err) {
    join->err = err;  // ordered before the other side's read by the acq_rel decrement
    if (join->left.fetch_sub(1, std::memory_order_acq_rel) == 1) finish();
  });
  join->hash = timed_checksum(src, bytes);
  if (join->left.fetch_sub(1, std::memory_order_acq_rel) == 1) finish();
  return IoRequest(outer);
}

std::uint64_t SwapSpace::timed_checksum(const void* data, std::uint64_t bytes) {
  const auto t0 = std::chrono::steady_clock::now();
  const std::uint64_t h = detail::extent_checksum(data, bytes);
  checksum_ns_.fetch_add(static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                             std::chrono::steady_clock::now() - t0).count()),
                         std::memory_order_relaxed);
  checksum_bytes_.fetch_add(bytes, std::memory_order_relaxed);
  return h;
}

void SwapSpace::record_checksum(std::uint64_t id, std::uint64_t write, std::uint64_t checksum,
                                std::uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = extents_.find(id);
  if (it == extents_.end() || it->second.writes != write) return;  // freed, or written again
  it->second.checksum = checksum;
  it->second.checksum_bytes = bytes;
}

IoRequest SwapSpace::read(const SwapExtent& extent, void* dst, std::uint64_t bytes) {
  if (bytes > extent.bytes)
    throw Error("SwapSpace::read: " + std::to_string(bytes) + " bytes from an extent of " +
                std::to_string(extent.bytes));
  std::vector<IoFile> files;
  Live live;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = extents_.find(extent.id);
    if (it == extents_.end())
      throw Error("SwapSpace::read: extent " + std::to_string(extent.id) + " is not live");
    live = it->second;
    for (auto& p : paths_) files.push_back(p->file);
  }
  auto ops = make_ops(extent, IoOpKind::kRead, static_cast<char*>(dst), bytes, files);
  if (!options_.checksum || live.checksum_bytes != bytes || bytes == 0) return engine_.submit(ops);

  auto outer = std::make_shared<detail::IoRequestState>(1);
  IoRequest inner = engine_.submit(ops);
  const std::uint64_t expected = live.checksum;
  // Verified on the hash worker, not on the completion thread (hash_worker.h). The engine
  // outlives every request (io_engine.h), so the re-read may use its file table; the worker is
  // this SwapSpace's, whose requests complete before it is destroyed (swap_space.h).
  inner.on_complete([this, outer, dst, bytes, expected, ops = std::move(ops)](std::exception_ptr err) mutable {
    if (err) {
      outer->finish_one(err);
      return;
    }
    hasher_->post([this, outer, dst, bytes, expected, ops = std::move(ops)] {
      std::exception_ptr e;
      const std::uint64_t got = timed_checksum(dst, bytes);
      if (got != expected) e = verify_after_reread(engine_, ops, bytes, got, expected);
      outer->finish_one(e);
    });
  });
  return IoRequest(outer);
}

SwapStats SwapSpace::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  SwapStats s;
  s.alignment_bytes = align_;
  s.extents = extents_.size();
  s.checksum_bytes = checksum_bytes_.load(std::memory_order_relaxed);
  s.checksum_ns = checksum_ns_.load(std::memory_order_relaxed);
  for (auto& p : paths_) {
    SwapStats::Path ps;
    ps.dir = p->dir;
    ps.file = p->file_path;
    ps.capacity_bytes = p->alloc.capacity_bytes();
    ps.free_bytes = p->alloc.free_bytes();
    ps.largest_free_bytes = p->alloc.largest_free_bytes();
    ps.free_runs = p->alloc.free_runs();
    s.capacity_bytes += ps.capacity_bytes;
    s.free_bytes += ps.free_bytes;
    s.largest_free_bytes = std::max(s.largest_free_bytes, ps.largest_free_bytes);
    s.free_runs += ps.free_runs;
    s.paths.push_back(std::move(ps));
  }
  s.used_bytes = s.capacity_bytes - s.free_bytes;
  return s;
}

std::vector<std::string> make_swap_dirs(const std::string& dir) { return detail::make_marked_dirs(dir, ""); }

void remove_swap_dir_if_unused(const std::string& dir) noexcept { detail::remove_if_unused(dir); }

std::uint64_t drive_free_bytes(const std::string& path) noexcept {
  std::error_code ec;
  std::filesystem::path probe = path.empty() ? "." : path;
  while (!probe.empty() && !std::filesystem::exists(probe, ec)) probe = probe.parent_path();
  return fs_free_bytes(probe.empty() ? "." : probe.string());
}

}  // namespace tiermem
