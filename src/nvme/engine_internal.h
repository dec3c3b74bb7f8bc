// Internals shared by the IoEngine backends (not installed): the piece machinery (splitting,
// bounce buffers, checking completions, retries) and the file / registered-buffer tables. A
// backend only issues pieces and reports each result to EngineBase::on_result.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <vector>

#include "nvme/device_limits.h"
#include "tiermem/io_engine.h"

namespace tiermem {

struct IoEngine::AtomicStats {
  std::atomic<std::uint64_t> bytes_read{0}, bytes_written{0}, read_requests{0},
      write_requests{0}, pieces{0}, fixed_buffer_pieces{0}, bounced_pieces{0}, short_transfers{0},
      retries{0}, errors{0};
};

namespace detail {

inline constexpr std::uint32_t kMaxFiles = 256;
inline constexpr int kMaxBufferSlots = 64;
inline constexpr int kMaxRetries = 1000;   // EINTR/EAGAIN per piece before giving up

struct FreeDeleter {
  void operator()(char* p) const noexcept;
};

// One block_size piece of a request, in flight or queued.
struct Piece {
  IoOpKind kind = IoOpKind::kRead;
  std::uint32_t file = 0;
  std::uint64_t offset = 0;      // file offset of byte 0 of the piece
  std::uint64_t user_bytes = 0;  // caller's bytes
  std::uint64_t io_bytes = 0;    // bytes to transfer (padded to 4096 when bounced)
  char* user_buf = nullptr;
  char* io_buf = nullptr;        // user_buf or bounce
  std::unique_ptr<char, FreeDeleter> bounce;
  std::uint64_t done = 0;        // bytes transferred so far
  int retries = 0;
  int fixed_index = -1;          // registered buffer slot, -1 = plain
  int ring = 0;
  std::shared_ptr<IoRequestState> state;
};

enum class Action { kDone, kResubmit };

class EngineBase : public IoEngine {
 public:
  explicit EngineBase(IoEngineOptions options);
  ~EngineBase() override;  // closes files still open (backends stop their threads first)
  IoFile open_file(const std::string& path, bool create) override;
  void close_file(IoFile file) override;
  const std::string& path(IoFile file) const override;
  std::uint64_t file_size(IoFile file) const override;
  void allocate_space(IoFile file, std::uint64_t offset, std::uint64_t bytes) override;
  bool register_buffers(void* base, std::uint64_t bytes,
                        std::uint64_t contiguous_bytes = kDirectAlignment) override;
  std::uint64_t piece_bytes(IoFile file, const void* buf, std::uint64_t bytes) const override;
  void unregister_buffers(void* base) override;
  IoRequest submit(std::span<const IoOp> ops) override;
  void submit_into(std::span<const IoOp> ops,
                   const std::shared_ptr<IoRequestState>& state) override;
  bool fixed_buffers_active() const noexcept override { return fixed_active_.load(); }

 protected:
  // Backend hooks.
  virtual void on_file_opened(std::uint32_t index, int fd) {}
  virtual void on_file_closed(std::uint32_t index) {}
  // Registers one slice in `slot` on every ring; false (and errno-ish reason) when impossible.
  virtual bool register_slot(int slot, void* base, std::uint64_t bytes, std::string* why) {
    *why = std::string(name()) + " engine has no registered buffers";
    return false;
  }
  virtual void unregister_slot(int slot) {}
  // Queues pieces for issue (takes ownership).
  virtual void enqueue(std::vector<Piece*>& pieces) = 0;

  // Consults the interceptor before (re)issuing `p`: returns 0 and the length to issue in *len,
  // or a positive errno with which to complete the piece without issuing it.
  int before_issue(const Piece& p, std::uint64_t* len);
  // Checks one result (bytes >= 0 or -errno). kResubmit: issue p again for the rest. kDone: the
  // piece was completed and deleted (its request finished/failed).
  Action on_result(Piece* p, std::int64_t res);

  int fd(std::uint32_t index) const { return files_[index].fd.load(std::memory_order_acquire); }
  int ring_count() const { return rings_; }

 private:
  void finish(Piece* p, std::exception_ptr err);
  int find_slot(const char* buf, std::uint64_t bytes) const;

  // The contiguity unit of the registered memory that holds [buf, buf + bytes), else 4096.
  std::uint64_t contiguity(const char* buf, std::uint64_t bytes) const;

  struct FileEntry {
    std::atomic<int> fd{-1};
    std::string path;
    BlockDeviceLimits limits;  // written before fd is published, read after
  };
  struct Contiguous {
    char* region;  // base of the register_buffers() call it came from
    char* base;
    std::uint64_t bytes;
    std::uint64_t unit;
  };
  std::vector<Contiguous> contiguous_;  // guarded by slots_mu_
  std::array<FileEntry, kMaxFiles> files_;
  std::mutex files_mu_;
  struct Slot {
    char* base = nullptr;
    std::uint64_t bytes = 0;
    char* region = nullptr;  // base of the register_buffers() call it came from
  };
  mutable std::shared_mutex slots_mu_;
  std::array<Slot, kMaxBufferSlots> slots_;
  std::atomic<bool> fixed_active_{false};
  std::atomic<bool> logged_register_failure_{false};
  std::atomic<std::uint64_t> next_ring_{0};
  int rings_ = 1;
};

std::unique_ptr<IoEngine> make_uring_engine(const IoEngineOptions& options);  // NotSupportedError
std::unique_ptr<IoEngine> make_posix_engine(const IoEngineOptions& options);

}  // namespace detail
}  // namespace tiermem
