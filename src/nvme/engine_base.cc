// EngineBase: what every IoEngine backend shares — file table, registered-buffer slots, splitting
// requests into pieces, bounce buffers for unaligned O_DIRECT pieces, and checking every result.
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "nvme/engine_internal.h"
#include "tiermem/error.h"
#include "tiermem/log.h"

namespace tiermem::detail {
namespace {

constexpr std::uint64_t kSliceBytes = 1ull << 30;  // io_uring's limit per registered buffer

std::uint64_t round_up(std::uint64_t x, std::uint64_t a) { return (x + a - 1) / a * a; }

const char* op_name(IoOpKind k) {
  switch (k) {
    case IoOpKind::kRead: return "read";
    case IoOpKind::kWrite: return "write";
    case IoOpKind::kFallocate: return "fallocate";
    case IoOpKind::kOpen: return "open";
  }
  return "io";
}

std::uint64_t fs_free_bytes(int fd) {
  struct statvfs s {};
  if (fstatvfs(fd, &s) != 0) return 0;
  return static_cast<std::uint64_t>(s.f_bavail) * s.f_frsize;
}

}  // namespace

void FreeDeleter::operator()(char* p) const noexcept { std::free(p); }

EngineBase::EngineBase(IoEngineOptions options) : IoEngine(std::move(options)) {
  stats_ = std::make_shared<AtomicStats>();
  if (options_.block_size_bytes < kDirectAlignment || options_.block_size_bytes % kDirectAlignment)
    throw ConfigError("aio.block_size", std::to_string(options_.block_size_bytes),
                      "aio.block_size must be a positive multiple of 4096 bytes");
  if (options_.queue_depth < 1 || options_.queue_depth > 4096)
    throw ConfigError("aio.queue_depth", std::to_string(options_.queue_depth),
                      "aio.queue_depth must be in 1..4096");
  if (options_.rings < 1 || options_.rings > 64)
    throw ConfigError("aio.intra_op_parallelism", std::to_string(options_.rings),
                      "aio.intra_op_parallelism must be in 1..64");
  rings_ = options_.rings;
}

EngineBase::~EngineBase() {
  for (auto& f : files_) {
    int d = f.fd.exchange(-1);
    if (d >= 0) ::close(d);
  }
}

IoFile EngineBase::open_file(const std::string& path, bool create) {
  // O_NOFOLLOW: a symlink planted at a swap file's name is refused (ELOOP), never followed.
  int flags = O_RDWR | O_CLOEXEC | O_NOFOLLOW | (create ? O_CREAT : 0) |
              (options_.o_direct ? O_DIRECT : 0);
  int injected = options_.interceptor
                     ? options_.interceptor->before_io(IoOpKind::kOpen, path, 0, 0).fail_errno
                     : 0;
  int f = injected != 0 ? -1 : ::open(path.c_str(), flags, 0600);
  if (f < 0) {
    int err = injected != 0 ? injected : errno;
    if (err == EINVAL && options_.o_direct)
      throw IoError(path, 0, 0, err, "open",
                    "the filesystem does not support O_DIRECT (e.g. tmpfs); put the swap path on a "
                    "disk filesystem, or set \"tiermem.o_direct\": false to open it buffered "
                    "(through the page cache)");
    throw IoError(path, 0, 0, err, "open");
  }
  // The device's request limits, so that pieces are sized to what it takes unsplit.
  BlockDeviceLimits limits;
  struct stat st {};
  if (::fstat(f, &st) == 0) {
    limits = read_block_device_limits(S_ISBLK(st.st_mode) ? st.st_rdev : st.st_dev);
  }
  if (limits.known()) {
    TM_LOG_DEBUG("NVME", "{} is on {}: {} per request, {} segments of <= {}, {}-byte blocks", path,
                 limits.disk, format_bytes(limits.max_request_bytes), limits.max_segments,
                 format_bytes(limits.max_segment_bytes), limits.logical_block_bytes);
  } else {
    TM_LOG_DEBUG("NVME", "{}: no block-queue limits in sysfs; pieces are aio.block_size", path);
  }
  std::lock_guard<std::mutex> lock(files_mu_);
  for (std::uint32_t i = 0; i < kMaxFiles; ++i) {
    if (files_[i].fd.load() < 0) {
      files_[i].path = path;
      files_[i].limits = limits;
      files_[i].fd.store(f, std::memory_order_release);
      try {
        on_file_opened(i, f);
      } catch (...) {
        files_[i].fd.store(-1);
        ::close(f);
        throw;
      }
      return IoFile{i};
    }
  }
  ::close(f);
  throw IoError(path, 0, 0, EMFILE, "open",
                "the engine has " + std::to_string(kMaxFiles) + " files open already");
}

void EngineBase::close_file(IoFile file) {
  if (!file.valid() || file.index >= kMaxFiles) return;
  std::lock_guard<std::mutex> lock(files_mu_);
  int f = files_[file.index].fd.exchange(-1);
  if (f < 0) return;
  on_file_closed(file.index);
  ::close(f);
}

const std::string& EngineBase::path(IoFile file) const { return files_.at(file.index).path; }

std::uint64_t EngineBase::file_size(IoFile file) const {
  struct stat st {};
  if (fstat(fd(file.index), &st) != 0) throw IoError(path(file), 0, 0, errno, "fstat");
  return static_cast<std::uint64_t>(st.st_size);
}

void EngineBase::allocate_space(IoFile file, std::uint64_t offset, std::uint64_t bytes) {
  const std::string& p = path(file);
  int f = fd(file.index);
  int err = 0;
  if (options_.interceptor) {
    auto d = options_.interceptor->before_io(IoOpKind::kFallocate, p, offset, bytes);
    err = d.fail_errno;
  }
  if (err == 0) {
    int rc;
    do {
      rc = ::fallocate(f, 0, static_cast<off_t>(offset), static_cast<off_t>(bytes));
    } while (rc != 0 && errno == EINTR);
    err = rc == 0 ? 0 : errno;
    if (err == EOPNOTSUPP) {  // a filesystem without fallocate: extend sparsely
      err = ::ftruncate(f, static_cast<off_t>(offset + bytes)) == 0 ? 0 : errno;
    }
  }
  if (err == ENOSPC || err == EDQUOT) {
    throw OutOfMemoryError(Tier::kNvme, bytes, fs_free_bytes(f),
                           "fallocate of '" + p + "' at offset " + std::to_string(offset) + ": " +
                               std::strerror(err));
  }
  if (err != 0) throw IoError(p, offset, bytes, err, "fallocate");
}

bool EngineBase::register_buffers(void* base, std::uint64_t bytes, std::uint64_t contiguous_bytes) {
  if (bytes == 0) return false;
  char* b = static_cast<char*>(base);
  std::unique_lock<std::shared_mutex> lock(slots_mu_);
  if (contiguous_bytes > kDirectAlignment) {
    // Only whole aligned units count (a mapping's tail may be in small pages).
    const auto addr = reinterpret_cast<std::uintptr_t>(b);
    const std::uint64_t head = (contiguous_bytes - addr % contiguous_bytes) % contiguous_bytes;
    if (bytes > head) {
      const std::uint64_t whole = (bytes - head) / contiguous_bytes * contiguous_bytes;
      if (whole > 0) contiguous_.push_back({b, b + head, whole, contiguous_bytes});
    }
  }
  if (!options_.fixed_buffers) return false;
  std::vector<int> taken;
  std::string why;
  for (std::uint64_t off = 0; off < bytes; off += kSliceBytes) {
    std::uint64_t len = std::min(kSliceBytes, bytes - off);
    int slot = -1;
    for (int s = 0; s < kMaxBufferSlots; ++s) {
      bool used = slots_[s].base != nullptr;
      for (int t : taken) used = used || t == s;
      if (!used) {
        slot = s;
        break;
      }
    }
    if (slot < 0) {
      why = "all " + std::to_string(kMaxBufferSlots) + " registered-buffer slots are in use";
    } else if (register_slot(slot, b + off, len, &why)) {
      slots_[slot] = Slot{b + off, len, b};
      taken.push_back(slot);
      continue;
    }
    for (int t : taken) {
      unregister_slot(t);
      slots_[t] = Slot{};
    }
    if (!logged_register_failure_.exchange(true)) {
      TM_LOG_INFO("NVME",
                  "registering {} at {} as io_uring fixed buffers failed ({}); I/O on it uses plain "
                  "buffers (RLIMIT_MEMLOCK may be too low; logged once)",
                  format_bytes(bytes), base, why);
    }
    return false;
  }
  fixed_active_.store(true);
  return true;
}

void EngineBase::unregister_buffers(void* base) {
  std::unique_lock<std::shared_mutex> lock(slots_mu_);
  char* b = static_cast<char*>(base);
  std::erase_if(contiguous_, [&](const Contiguous& c) { return c.region == b; });
  bool any = false;
  for (int s = 0; s < kMaxBufferSlots; ++s) {
    if (slots_[s].base != nullptr && slots_[s].region == base) {
      unregister_slot(s);
      slots_[s] = Slot{};
    }
    any = any || slots_[s].base != nullptr;
  }
  fixed_active_.store(any);
}

int EngineBase::find_slot(const char* buf, std::uint64_t bytes) const {
  if (!fixed_active_.load(std::memory_order_relaxed)) return -1;
  std::shared_lock<std::shared_mutex> lock(slots_mu_);
  for (int s = 0; s < kMaxBufferSlots; ++s) {
    const Slot& sl = slots_[s];
    if (sl.base != nullptr && buf >= sl.base && buf + bytes <= sl.base + sl.bytes) return s;
  }
  return -1;
}

std::uint64_t EngineBase::contiguity(const char* buf, std::uint64_t bytes) const {
  std::shared_lock<std::shared_mutex> lock(slots_mu_);
  for (const Contiguous& c : contiguous_) {
    if (buf >= c.base && buf + bytes <= c.base + c.bytes) return c.unit;
  }
  return kDirectAlignment;
}

std::uint64_t EngineBase::piece_bytes(IoFile file, const void* buf, std::uint64_t bytes) const {
  const std::uint64_t bs = options_.block_size_bytes;
  if (!options_.size_to_device || !file.valid() || file.index >= kMaxFiles || fd(file.index) < 0)
    return bs;
  const auto* b = static_cast<const char*>(buf);
  const bool aligned = reinterpret_cast<std::uintptr_t>(b) % kDirectAlignment == 0;
  const std::uint64_t unit = aligned ? contiguity(b, bytes) : kDirectAlignment;
  return unsplit_piece_bytes(files_[file.index].limits, unit, bs);
}

IoRequest EngineBase::submit(std::span<const IoOp> ops) {
  auto state = std::make_shared<IoRequestState>(1);  // our guard part
  try {
    submit_into(ops, state);
  } catch (...) {
    state->finish_one(std::current_exception());
    throw;
  }
  state->finish_one();
  return IoRequest(state);
}

void EngineBase::submit_into(std::span<const IoOp> ops, const std::shared_ptr<IoRequestState>& state) {
  const bool direct = options_.o_direct;
  // Validate everything before issuing anything; size each op's pieces to its file's device.
  std::uint64_t npieces = 0;
  std::vector<std::uint64_t> piece_size(ops.size());
  for (std::size_t i = 0; i < ops.size(); ++i) {
    const IoOp& op = ops[i];
    if (op.kind == IoOpKind::kFallocate)
      throw Error("IoEngine::submit: kFallocate ops are not allowed; use allocate_space");
    if (!op.file.valid() || op.file.index >= kMaxFiles || fd(op.file.index) < 0)
      throw Error("IoEngine::submit: file handle " + std::to_string(op.file.index) + " is not open");
    if (direct && op.offset % kDirectAlignment != 0)
      throw IoError(path(op.file), op.offset, op.bytes, EINVAL, op_name(op.kind),
                    "O_DIRECT offsets must be multiples of 4096");
    if (op.bytes > 0 && op.buf == nullptr)
      throw IoError(path(op.file), op.offset, op.bytes, EINVAL, op_name(op.kind), "null buffer");
    piece_size[i] = piece_bytes(op.file, op.buf, op.bytes);
    npieces += (op.bytes + piece_size[i] - 1) / piece_size[i];
  }
  if (npieces == 0) return;
  state->add_pending(npieces);
  std::vector<Piece*> pieces;
  pieces.reserve(npieces);
  for (std::size_t i = 0; i < ops.size(); ++i) {
    const IoOp& op = ops[i];
    const std::uint64_t bs = piece_size[i];
    if (op.kind == IoOpKind::kRead) stats_->read_requests.fetch_add(1, std::memory_order_relaxed);
    else stats_->write_requests.fetch_add(1, std::memory_order_relaxed);
    for (std::uint64_t off = 0; off < op.bytes; off += bs) {
      auto* p = new Piece;
      p->kind = op.kind;
      p->file = op.file.index;
      p->offset = op.offset + off;
      p->user_bytes = std::min(bs, op.bytes - off);
      p->user_buf = static_cast<char*>(op.buf) + off;
      p->state = state;
      p->ring = static_cast<int>(next_ring_.fetch_add(1, std::memory_order_relaxed) % rings_);
      bool aligned = reinterpret_cast<std::uintptr_t>(p->user_buf) % kDirectAlignment == 0 &&
                     p->user_bytes % kDirectAlignment == 0;
      if (direct && !aligned) {
        p->io_bytes = round_up(p->user_bytes, kDirectAlignment);
        void* mem = nullptr;
        if (posix_memalign(&mem, kDirectAlignment, p->io_bytes) != 0) {
          delete p;
          for (Piece* q : pieces) delete q;
          for (std::uint64_t i = 0; i < npieces; ++i) state->finish_one();
          throw std::bad_alloc();
        }
        p->bounce.reset(static_cast<char*>(mem));
        p->io_buf = p->bounce.get();
        if (op.kind == IoOpKind::kWrite) {
          std::memcpy(p->io_buf, p->user_buf, p->user_bytes);
          std::memset(p->io_buf + p->user_bytes, 0, p->io_bytes - p->user_bytes);
        }
        stats_->bounced_pieces.fetch_add(1, std::memory_order_relaxed);
      } else {
        p->io_bytes = p->user_bytes;
        p->io_buf = p->user_buf;
        p->fixed_index = find_slot(p->io_buf, p->io_bytes);
      }
      pieces.push_back(p);
    }
  }
  enqueue(pieces);
}

int EngineBase::before_issue(const Piece& p, std::uint64_t* len) {
  *len = p.io_bytes - p.done;
  stats_->pieces.fetch_add(1, std::memory_order_relaxed);
  if (p.fixed_index >= 0) stats_->fixed_buffer_pieces.fetch_add(1, std::memory_order_relaxed);
  if (!options_.interceptor) return 0;
  auto d = options_.interceptor->before_io(p.kind, files_[p.file].path, p.offset + p.done, *len);
  if (d.fail_errno != 0) return d.fail_errno;
  if (d.max_bytes < *len) *len = d.max_bytes;
  return 0;
}

Action EngineBase::on_result(Piece* p, std::int64_t res) {
  const char* op = op_name(p->kind);
  if (res < 0) {
    int err = static_cast<int>(-res);
    if ((err == EINTR || err == EAGAIN) && p->retries < kMaxRetries) {
      ++p->retries;
      stats_->retries.fetch_add(1, std::memory_order_relaxed);
      return Action::kResubmit;
    }
    std::string detail;
    if (err == EAGAIN || err == EINTR)
      detail = "gave up after " + std::to_string(p->retries) + " retries";
    finish(p, std::make_exception_ptr(IoError(files_[p->file].path, p->offset + p->done,
                                              p->io_bytes - p->done, err, op, detail)));
    return Action::kDone;
  }
  if (res == 0 && p->done < p->io_bytes) {
    if (p->kind == IoOpKind::kRead && p->done >= p->user_bytes) {
      finish(p, nullptr);  // end of file inside the padding of the last block
      return Action::kDone;
    }
    finish(p, std::make_exception_ptr(IoError(
                  files_[p->file].path, p->offset + p->done, p->io_bytes - p->done, 0, op,
                  p->kind == IoOpKind::kRead ? "unexpected end of file" : "wrote 0 bytes")));
    return Action::kDone;
  }
  p->done += static_cast<std::uint64_t>(res);
  if (p->done < p->io_bytes) {
    stats_->short_transfers.fetch_add(1, std::memory_order_relaxed);
    return Action::kResubmit;
  }
  finish(p, nullptr);
  return Action::kDone;
}

void EngineBase::finish(Piece* p, std::exception_ptr err) {
  if (!err) {
    if (p->kind == IoOpKind::kRead) {
      if (p->bounce) std::memcpy(p->user_buf, p->io_buf, p->user_bytes);
      stats_->bytes_read.fetch_add(p->user_bytes, std::memory_order_relaxed);
    } else {
      stats_->bytes_written.fetch_add(p->user_bytes, std::memory_order_relaxed);
    }
  } else {
    stats_->errors.fetch_add(1, std::memory_order_relaxed);
  }
  auto state = std::move(p->state);
  delete p;
  state->finish_one(std::move(err));
}

}  // namespace tiermem::detail
