// tiermem/swap_space.h — the NVMe tier's storage: extents inside preallocated swap files, one file
// per swap directory (nvme_path), striped across the directories.
//
//   auto engine = make_io_engine(cfg);
//   SwapSpace swap(cfg, cfg.zero.offload_param.nvme_path, *engine);
//   SwapExtent e = swap.allocate(bytes);
//   swap.write(e, src, bytes).wait();      // IoError on failure
//   swap.read(e, dst, bytes).wait();       // IoError; corrupt_data() on a checksum mismatch
//   swap.free(e);
//
// Layout: each directory gets `tiermem-swap-<pid>.bin`, fallocate'd to swap_initial_bytes and
// grown on demand (doubling, at least by what is needed) up to swap_max_bytes per directory
// (0 = the free space of the filesystem). Every extent's pieces are aligned to the allocation
// unit (the largest of 4096 and the directories' logical block sizes) and padded to it. An extent
// of more than one stripe (tiermem.stripe_bytes) is striped round-robin over the directories in
// stripe units (ZeRO-Infinity's bandwidth-centric partitioning, on one node): logical byte x lives
// in stripe unit x / stripe_bytes, which is on directory (first + unit) % n. A smaller extent lives
// whole in the directory with the most free space.
//
// Integrity (tiermem.checksum, on by default): each write's XXH3-64 is computed on the calling
// thread while the drive takes the bytes (the source buffer is the caller's and untouched until
// completion, see Buffers; it was usually just written, so it is in cache) and recorded before
// the request reports completion; a read of what was last written is verified on the swap
// space's hash thread (src/nvme/hash_worker.h) before it reports completion. Neither runs on the
// engine's completion thread, which only reaps. A mismatch is re-read once with pread(2) (a transient fault on the bus or in
// a transfer is forgiven, with one warning); a second mismatch completes the read with
// IoError::corrupt (path and offset of the extent's first piece, both hashes). Only whole-extent
// reads of exactly the length last written are verified; a shorter read is not.
//
// Hostile directories: a directory owned by another user or world-writable without the sticky
// bit (unsafe_directory_reason, dir_lock.h) is refused with a ConfigError naming it and why; the
// lock and swap files are opened with O_NOFOLLOW and created 0600.
//
// Exclusivity: each directory is flock'ed (file `tiermem.lock`, holding the owner's pid) for the
// SwapSpace's lifetime; a second process (or a second SwapSpace in this one) on the same
// directory gets an Error naming the directory and the holder's pid. Stale swap files of dead
// processes in a directory are deleted once its lock is taken. The destructor waits for nothing
// (the caller completes its requests first), closes and deletes the swap files and the lock.
//
// Buffers: as IoEngine — the caller owns src/dst and keeps them valid until the request is
// complete. Aligned (4096) buffers avoid a bounce copy; any address and length work.
//
// Thread-safety: all methods are thread-safe. Reading or writing an extent concurrently with
// freeing it, or writing it from two threads at once, is the caller's race (the data is
// undefined, nothing else is harmed).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "tiermem/export.h"
#include "tiermem/io_engine.h"

namespace tiermem {

struct Config;
namespace detail {
class HashWorker;
}

// Settings of a SwapSpace; from_config reads the `tiermem` section.
struct TIERMEM_API SwapSpaceOptions {
  std::uint64_t stripe_bytes = 1ull << 20;         // tiermem.stripe_bytes; multiple of 4096
  std::uint64_t initial_bytes_per_path = 64ull << 20;  // tiermem.swap_initial_bytes
  std::uint64_t max_bytes_per_path = 0;            // tiermem.swap_max_bytes; 0 = fs free space
  bool checksum = true;                            // tiermem.checksum: XXH3-64 per extent
  static SwapSpaceOptions from_config(const Config& config);
};

// A contiguous run of one swap file.
struct TIERMEM_API SwapPiece {
  std::uint32_t path_index = 0;  // index into SwapSpace::dirs()
  std::uint64_t offset = 0;      // bytes into that directory's swap file (aligned)
  std::uint64_t bytes = 0;       // padded length (a multiple of the allocation unit)
};

// An allocated region of swap space: a value (copyable). `bytes` is what was asked for;
// `pieces` are in logical order (byte 0 of the extent is at pieces[0].offset), one per stripe
// unit, consecutive units on the same file merged.
struct TIERMEM_API SwapExtent {
  std::uint64_t id = 0;     // unique within the SwapSpace; 0 = empty extent
  std::uint64_t bytes = 0;  // requested size
  std::vector<SwapPiece> pieces;
  bool empty() const noexcept { return id == 0; }
};

// Fragmentation and usage, in bytes, summed over all directories (per-directory in `paths`).
struct TIERMEM_API SwapStats {
  struct Path {
    std::string dir;
    std::string file;
    std::uint64_t capacity_bytes = 0;  // current swap file size
    std::uint64_t free_bytes = 0;
    std::uint64_t largest_free_bytes = 0;  // largest contiguous free run
    std::uint64_t free_runs = 0;           // number of free runs (fragmentation)
  };
  std::uint64_t capacity_bytes = 0;
  std::uint64_t used_bytes = 0;        // allocated, padded
  std::uint64_t free_bytes = 0;
  std::uint64_t largest_free_bytes = 0;
  std::uint64_t free_runs = 0;
  std::uint64_t extents = 0;           // live extents
  std::uint64_t alignment_bytes = 0;   // allocation unit
  // tiermem.checksum's CPU cost so far: bytes hashed (writes and verified reads) and the
  // nanoseconds the hashing took, on whichever thread ran it.
  std::uint64_t checksum_bytes = 0;
  std::uint64_t checksum_ns = 0;
  std::vector<Path> paths;
};

class TIERMEM_API SwapSpace {
 public:
  // Takes each directory's lock, creates and preallocates its swap file. `dirs` must be
  // non-empty; each must exist (it is not created). Throws Error (lock held by another
  // process: names the pid), IoError (open/O_DIRECT — see IoEngine::open_file; ELOOP for a
  // symlink planted as the lock file), ConfigError (bad stripe size; a directory owned by another
  // user or world-writable without the sticky bit: names it and why), OutOfMemoryError (the
  // initial fallocate hit ENOSPC).
  // `engine` must outlive the SwapSpace.
  SwapSpace(const SwapSpaceOptions& options, std::vector<std::string> dirs, IoEngine& engine);
  SwapSpace(const Config& config, std::vector<std::string> dirs, IoEngine& engine);
  ~SwapSpace();
  SwapSpace(const SwapSpace&) = delete;
  SwapSpace& operator=(const SwapSpace&) = delete;

  // Reserves `bytes` (> 0), growing swap files when needed. Throws OutOfMemoryError(Tier::kNvme,
  // requested, available) naming the directory that could not grow (ENOSPC or the max reached).
  SwapExtent allocate(std::uint64_t bytes);
  // Returns the extent's space; an empty extent is ignored. Freeing an extent twice or one of
  // another SwapSpace throws Error. No I/O on it may be in flight.
  void free(const SwapExtent& extent);

  // Writes `bytes` (<= extent.bytes) from `src` to the start of the extent. With checksums, the
  // XXH3-64 of these bytes is computed on this thread after the write is submitted (so the call
  // returns once the bytes are hashed) and remembered for the extent before the request completes
  // (until then reads are not verified).
  IoRequest write(const SwapExtent& extent, const void* src, std::uint64_t bytes);
  // Reads the first `bytes` (<= extent.bytes) of the extent into `dst`. With checksums, when
  // `bytes` equals the length last written the data is verified on the hash thread; a
  // mismatch is re-read once (pread into `dst`), and a second one completes the request with
  // IoError::corrupt(path of the first piece, its offset, bytes, "checksum mismatch ...": the
  // hash read, the re-read's and the one written).
  IoRequest read(const SwapExtent& extent, void* dst, std::uint64_t bytes);

  const std::vector<std::string>& dirs() const noexcept { return dirs_; }
  // Path of the swap file in dirs()[path_index].
  const std::string& file_path(std::uint32_t path_index) const;
  std::uint64_t alignment_bytes() const noexcept { return align_; }
  IoEngine& engine() noexcept { return engine_; }
  SwapStats stats() const;
  // Directories the caller created for this swap space (innermost first): the destructor removes
  // each one that is then empty, or holds only tiermem's marker (src/nvme/made_dirs.h);
  // each that is empty once the swap files and locks are gone (rmdir; a non-empty one stays).
  void remove_when_done(std::vector<std::string> created_dirs) { created_dirs_ = std::move(created_dirs); }

 private:
  std::vector<std::string> created_dirs_;
  struct PathState;
  SwapSpaceOptions options_;
  std::vector<std::string> dirs_;
  IoEngine& engine_;
  std::uint64_t align_ = 4096;
  mutable std::mutex mu_;  // guards paths_' allocators, extents_, next_id_, first_path_
  std::vector<std::unique_ptr<PathState>> paths_;
  struct Live {
    std::uint64_t checksum = 0;
    std::uint64_t checksum_bytes = UINT64_MAX;  // length the checksum covers; MAX = none
    std::uint64_t writes = 0;  // writes started; a completing write records its hash only if last
  };
  // Completion of write number `write` of extent `id`: records `checksum` over `bytes`.
  void record_checksum(std::uint64_t id, std::uint64_t write, std::uint64_t checksum,
                       std::uint64_t bytes);
  std::unordered_map<std::uint64_t, Live> extents_;
  // XXH3-64 of `bytes` at `data`, counted in checksum_bytes_/checksum_ns_.
  std::uint64_t timed_checksum(const void* data, std::uint64_t bytes);
  std::atomic<std::uint64_t> checksum_bytes_{0}, checksum_ns_{0};
  std::unique_ptr<detail::HashWorker> hasher_;  // verifies reads (src/nvme/hash_worker.h)
  std::uint64_t next_id_ = 1;
  std::uint32_t next_first_path_ = 0;
};

// For a caller that makes its swap directories (the Python SwapSpace with make_dirs): makes `dir`
// and its missing parents, each marked as tiermem's (src/nvme/made_dirs.h), and returns the ones
// to hand to SwapSpace::remove_when_done, innermost first. Throws IoError (path, errno) when one
// cannot be made.
TIERMEM_API std::vector<std::string> make_swap_dirs(const std::string& dir);
// Removes a directory make_swap_dirs listed when nothing but tiermem's marker is left in it (a
// SwapSpace that failed to open). Never throws.
TIERMEM_API void remove_swap_dir_if_unused(const std::string& dir) noexcept;

// The free space, in bytes (statvfs f_bavail x f_frsize), of the filesystem that holds `path`, or
// that would hold it: a path not made yet is looked up at its nearest existing ancestor (a
// relative path at the working directory). 0 when even that cannot be read. Never throws.
TIERMEM_API std::uint64_t drive_free_bytes(const std::string& path) noexcept;

}  // namespace tiermem
