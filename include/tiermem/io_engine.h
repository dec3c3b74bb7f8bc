// tiermem/io_engine.h — asynchronous file I/O for the NVMe tier: io_uring, or a pread/pwrite
// thread pool when a ring cannot be set up.
//
//   IoEngine& e = *make_io_engine(IoEngineOptions::from_config(cfg));
//   IoFile f = e.open_file("/mnt/nvme0/swap.bin", /*create=*/true);
//   e.register_buffers(pool_base, pool_bytes);          // optional; pinned pools
//   IoRequest r = e.submit_read(f, /*offset=*/0, /*bytes=*/64 << 20, buf);
//   ... overlap other work ...
//   r.wait();                                           // throws IoError on failure
//
// What a request does: a request of any size is split into pieces of `block_size_bytes` or
// less (piece_bytes: no larger than the file's block device takes in one request), spread
// round-robin over `rings` rings (DeepSpeed's aio.intra_op_parallelism); each ring keeps at most
// `queue_depth` pieces in flight and has its own completion thread. Every completion is checked:
// a short transfer is resubmitted for the rest, EINTR/EAGAIN are retried (up to 1000 times per
// piece; the posix engine backs off a little),
// any other failure completes that request's IoRequest with an IoError(path, offset, bytes,
// errno) naming the failing piece. Other requests are not affected.
//
// O_DIRECT alignment (files opened with o_direct = true, the default): `offset` must be a multiple
// of kDirectAlignment (4096) — otherwise submit_* throws IoError(EINVAL) at once. The buffer
// address and the length may be anything: a piece whose buffer or length is not 4096-aligned
// goes through an aligned bounce buffer (a copy; slower — the swap layer keeps both aligned).
// A write whose length is not a multiple of 4096 writes zeros after the data up to the next
// multiple (the file region [offset, round_up(offset + bytes, 4096)) is overwritten); a read
// of such length reads the padded block but copies only `bytes` into the caller's buffer.
// Buffered files (o_direct = false) have no alignment rules and no padding.
//
// Buffers: the caller owns every buffer. A read's destination and a write's source must stay
// valid and untouched until the request is complete (ready() is true / wait() returned /
// the on_complete callback ran). Destroying an IoRequest does not cancel the I/O.
//
// Thread-safety: an IoEngine is thread-safe — open_file, register_buffers, submit_* and stats may
// be called from any thread concurrently. An IoRequest handle is a cheap shared reference; all of
// its methods are thread-safe. The engine must outlive every request it returned and every file
// it opened is closed by close_file or by the engine's destructor, which first waits for all
// in-flight I/O.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "tiermem/export.h"

namespace tiermem {

struct Config;

// Every O_DIRECT offset is a multiple of this (bytes); buffers and lengths are padded to it.
inline constexpr std::uint64_t kDirectAlignment = 4096;

// A file opened by an IoEngine: a small index into the engine's table (and, with io_uring, its
// registered-file slot). Only meaningful for the engine that returned it.
struct TIERMEM_API IoFile {
  std::uint32_t index = UINT32_MAX;
  bool valid() const noexcept { return index != UINT32_MAX; }
  friend bool operator==(IoFile, IoFile) = default;
};

enum class IoOpKind : std::uint8_t { kRead, kWrite, kFallocate, kOpen };

// One operation of a batch: read `bytes` at `offset` of `file` into `buf`, or write them from it.
struct TIERMEM_API IoOp {
  IoOpKind kind = IoOpKind::kRead;
  IoFile file;
  std::uint64_t offset = 0;  // bytes from the start of the file
  std::uint64_t bytes = 0;
  void* buf = nullptr;       // read: destination; write: source (not modified)
};

// Fault injection for tests (tests/unit/nvme_fault_test.cc): the engines consult it before every
// piece they issue (including resubmissions of the rest of a short transfer and retries), before
// every fallocate and before every open (kOpen, offset 0, bytes 0: fail_errno makes open_file fail
// as if open(2) had returned that errno). It sees the path, the byte range and the kind.
class TIERMEM_API IoInterceptor {
 public:
  struct Decision {
    int fail_errno = 0;                  // != 0: do not issue; complete the piece with -fail_errno
    std::uint64_t max_bytes = UINT64_MAX;  // < bytes: issue only this many (a short transfer)
  };
  virtual ~IoInterceptor() = default;
  // Called from submitting and completion threads concurrently: must be thread-safe and fast.
  virtual Decision before_io(IoOpKind kind, const std::string& path, std::uint64_t offset,
                             std::uint64_t bytes) = 0;
};

enum class IoEngineKind : std::uint8_t { kAuto, kUring, kPosix };

// Settings of an IoEngine. from_config reads `aio` and `tiermem` (io_engine, o_direct, sqpoll,
// fixed_buffers); defaults match config.h's.
struct TIERMEM_API IoEngineOptions {
  IoEngineKind kind = IoEngineKind::kAuto;  // auto: io_uring, posix when the ring cannot be set up
  std::uint64_t block_size_bytes = 1ull << 20;  // piece size (aio.block_size); multiple of 4096
  int queue_depth = 32;                         // pieces in flight per ring (aio.queue_depth)
  int rings = 1;                                // aio.intra_op_parallelism; posix: worker groups
  bool sqpoll = false;                          // IORING_SETUP_SQPOLL (kernel submission thread)
  bool fixed_buffers = true;                    // use READ_FIXED/WRITE_FIXED on registered pools
  bool fixed_files = true;                      // register files with the rings
  bool o_direct = true;                         // open files with O_DIRECT
  bool single_submit = false;                   // aio.single_submit: one SQE per io_uring_enter
  // Size pieces to the file's block device (piece_bytes); false: always block_size_bytes.
  bool size_to_device = true;
  std::shared_ptr<IoInterceptor> interceptor;   // tests only; null in production

  // Throws ConfigError for an unknown tiermem.io_engine value.
  static IoEngineOptions from_config(const Config& config);
};

// Counters since the engine was made (monotonic; a snapshot, consistent per field).
struct TIERMEM_API IoStats {
  std::uint64_t bytes_read = 0;        // bytes delivered to callers' read buffers
  std::uint64_t bytes_written = 0;     // bytes taken from callers' write buffers
  std::uint64_t read_requests = 0;     // submit_read calls (+ read ops of batches)
  std::uint64_t write_requests = 0;
  std::uint64_t pieces = 0;            // pieces issued to the kernel (incl. retries)
  std::uint64_t fixed_buffer_pieces = 0;  // of which used a registered buffer
  std::uint64_t bounced_pieces = 0;    // went through an aligned bounce buffer
  std::uint64_t short_transfers = 0;   // resubmitted for the rest
  std::uint64_t retries = 0;           // EINTR/EAGAIN retries
  std::uint64_t errors = 0;            // pieces that failed (each fails its request)
};

namespace detail {
// Shared completion state behind IoRequest. Engines add `pending` parts and finish them; the first
// error wins. Public only so that layers (SwapSpace) can build derived requests.
class IoRequestState {
 public:
  using Callback = std::function<void(std::exception_ptr)>;
  explicit IoRequestState(std::uint64_t pending = 0) : pending_(pending) {}
  void add_pending(std::uint64_t n);
  // Marks one part done; `error` (may be null) is kept if it is the first. Runs callbacks when the
  // last part finishes (on the calling thread, without locks held).
  void finish_one(std::exception_ptr error = nullptr);
  void wait();  // blocks; rethrows the error
  bool wait_for(std::chrono::nanoseconds timeout);  // true when complete (does not throw)
  bool ready();
  std::exception_ptr error();  // null when fine or not complete
  void on_complete(Callback cb);

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::uint64_t pending_;
  std::exception_ptr error_;
  std::vector<Callback> callbacks_;
};
}  // namespace detail

// The handle of one submitted request (or batch). Copyable; copies share state.
class TIERMEM_API IoRequest {
 public:
  IoRequest() = default;  // invalid: ready() is true, wait() returns at once
  explicit IoRequest(std::shared_ptr<detail::IoRequestState> s) : state_(std::move(s)) {}

  // Blocks until every byte of the request is transferred (and, for SwapSpace reads with
  // checksums, verified); then the buffer may be reused. Rethrows the request's error (IoError,
  // or OutOfMemoryError for a failed fallocate) — every call rethrows it again.
  void wait() const;
  // True once complete (successfully or not). Never blocks, never throws.
  bool ready() const;
  // Waits at most `timeout`; true when complete. Does not throw; call wait() for the error.
  bool wait_for(std::chrono::nanoseconds timeout) const;
  // The error once complete (null when it succeeded or is still running).
  std::exception_ptr error() const;
  // Runs `cb(error)` exactly once when the request completes: at once on the calling thread if it
  // already has, else on the engine's completion thread. `cb` must be quick and must not throw
  // or block on other requests of the same engine.
  void on_complete(std::function<void(std::exception_ptr)> cb) const;
  bool valid() const noexcept { return state_ != nullptr; }

 private:
  std::shared_ptr<detail::IoRequestState> state_;
};

// Waits for all of `requests`, then rethrows the first error among them (in order).
TIERMEM_API void wait_all(std::span<const IoRequest> requests);

class TIERMEM_API IoEngine {
 public:
  virtual ~IoEngine() = default;
  IoEngine(const IoEngine&) = delete;
  IoEngine& operator=(const IoEngine&) = delete;

  // "uring" or "posix".
  virtual const char* name() const noexcept = 0;
  const IoEngineOptions& options() const noexcept { return options_; }

  // Opens (create = true: creates if missing, mode 0600) `path` read-write, with O_DIRECT when
  // options().o_direct, never through a symlink (O_NOFOLLOW: IoError ELOOP). Throws IoError with
  // the path and errno; when the filesystem rejects O_DIRECT (EINVAL, e.g. tmpfs) the message
  // says so and names the option `tiermem.o_direct: false`, which opens buffered instead.
  virtual IoFile open_file(const std::string& path, bool create) = 0;
  // Closes the file; waits for nothing — the caller must have completed its requests on it.
  virtual void close_file(IoFile file) = 0;
  virtual const std::string& path(IoFile file) const = 0;
  // Current size of the file in bytes (fstat).
  virtual std::uint64_t file_size(IoFile file) const = 0;
  // Preallocates [offset, offset + bytes) (fallocate mode 0, the size grows). Synchronous.
  // Throws OutOfMemoryError(Tier::kNvme, bytes, free bytes of the filesystem) on ENOSPC/EDQUOT,
  // IoError otherwise.
  virtual void allocate_space(IoFile file, std::uint64_t offset, std::uint64_t bytes) = 0;

  // Registers [base, base + bytes) (a pinned pool) so pieces inside it use fixed buffers
  // (io_uring READ_FIXED/WRITE_FIXED; no per-I/O page pinning). Returns true when registered.
  // Registration can fail (RLIMIT_MEMLOCK, old kernel, posix engine, fixed_buffers = false):
  // then it logs one line and returns false, and I/O on that memory still works with plain
  // buffers. The region must stay mapped until unregister_buffers(base) or the engine is gone.
  // Up to 64 regions; regions over 1 GiB are registered in 1 GiB slices.
  // contiguous_bytes: the memory is physically contiguous in naturally aligned units of this
  // many bytes (HostRegion::contiguous_bytes: 2 MiB for huge pages); the engine then sizes
  // pieces in it to the device's limits for that layout (see piece_bytes). Remembered whatever
  // the return value (also with fixed_buffers = false) until unregister_buffers(base): call that
  // before the memory is unmapped.
  virtual bool register_buffers(void* base, std::uint64_t bytes,
                                std::uint64_t contiguous_bytes = kDirectAlignment) = 0;
  // Forgets a region passed to register_buffers; no I/O on it may be in flight.
  virtual void unregister_buffers(void* base) = 0;

  // The piece size (bytes) an op on `file` with buffer [buf, buf + bytes) is split into:
  // aio.block_size (block_size_bytes), lowered so that the block layer does not split a piece —
  // at most the device's max_sectors_kb and, for the buffer's known physical contiguity (4 KiB
  // pages unless registered with contiguous_bytes), what fits in its max_segments — read from
  // sysfs when the file was opened (block_size_bytes alone when sysfs says nothing: tmpfs,
  // overlay, containers). A multiple of 4096 and of the logical block size. Thread-safe.
  virtual std::uint64_t piece_bytes(IoFile file, const void* buf, std::uint64_t bytes) const = 0;

  // Starts reading `bytes` at `offset` of `file` into `buf` (see the alignment rules at the top).
  // Returns at once (it may block briefly for backpressure only when more than
  // rings * queue_depth * 64 pieces are queued). Throws IoError(EINVAL) for an unaligned O_DIRECT
  // offset; every other failure arrives through the returned request.
  IoRequest submit_read(IoFile file, std::uint64_t offset, std::uint64_t bytes, void* buf);
  // Starts writing `bytes` from `buf` at `offset` of `file`. Same rules as submit_read.
  IoRequest submit_write(IoFile file, std::uint64_t offset, std::uint64_t bytes, const void* buf);
  // Submits several operations as one request: complete when all are, failed if any failed (the
  // first error is kept; the others still run to completion). kFallocate ops are not allowed.
  virtual IoRequest submit(std::span<const IoOp> ops) = 0;
  // Like submit, but adds the ops' parts to an existing state, which stays incomplete until they
  // are done; the caller holds a pending part of its own while calling (so the state cannot
  // complete early) and finishes it afterwards. For layers that combine requests.
  virtual void submit_into(std::span<const IoOp> ops,
                           const std::shared_ptr<detail::IoRequestState>& state) = 0;

  // True when a ring uses SQPOLL / at least one region is registered as fixed buffers.
  virtual bool sqpoll_active() const noexcept { return false; }
  virtual bool fixed_buffers_active() const noexcept { return false; }

  IoStats stats() const;

 protected:
  explicit IoEngine(IoEngineOptions options) : options_(std::move(options)) {}
  IoEngineOptions options_;
  struct AtomicStats;
  std::shared_ptr<AtomicStats> stats_;  // set by the backends
};

// Makes the engine options.kind asks for. kAuto tries io_uring and falls back to posix with one
// log line saying why (e.g. "io_uring_queue_init: Operation not permitted (errno 1)", seccomp);
// kUring throws NotSupportedError when the ring cannot be set up; SQPOLL that cannot be set up
// falls back to a normal ring with one log line.
TIERMEM_API std::unique_ptr<IoEngine> make_io_engine(const IoEngineOptions& options);
TIERMEM_API std::unique_ptr<IoEngine> make_io_engine(const Config& config);

}  // namespace tiermem
