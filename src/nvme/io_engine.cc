// IoEngine: options, the factory (io_uring first, posix fallback), counters.
#include "tiermem/io_engine.h"

#include "nvme/engine_internal.h"
#include "tiermem/config.h"
#include "tiermem/error.h"
#include "tiermem/log.h"

namespace tiermem {

IoEngineOptions IoEngineOptions::from_config(const Config& config) {
  IoEngineOptions o;
  const auto& e = config.tiermem.io_engine;
  if (e == "auto" || e.empty()) o.kind = IoEngineKind::kAuto;
  else if (e == "uring" || e == "io_uring") o.kind = IoEngineKind::kUring;
  else if (e == "posix") o.kind = IoEngineKind::kPosix;
  else throw ConfigError("tiermem.io_engine", e, "tiermem.io_engine: '" + e + "' is not one of auto, uring, posix");
  o.block_size_bytes = config.aio.block_size_bytes;
  o.queue_depth = config.aio.queue_depth;
  o.rings = config.aio.intra_op_parallelism;
  o.single_submit = config.aio.single_submit;
  o.sqpoll = config.tiermem.sqpoll;
  o.fixed_buffers = config.tiermem.fixed_buffers;
  o.o_direct = config.tiermem.o_direct;
  return o;
}

IoStats IoEngine::stats() const {
  IoStats s;
  if (!stats_) return s;
  s.bytes_read = stats_->bytes_read.load();
  s.bytes_written = stats_->bytes_written.load();
  s.read_requests = stats_->read_requests.load();
  s.write_requests = stats_->write_requests.load();
  s.pieces = stats_->pieces.load();
  s.fixed_buffer_pieces = stats_->fixed_buffer_pieces.load();
  s.bounced_pieces = stats_->bounced_pieces.load();
  s.short_transfers = stats_->short_transfers.load();
  s.retries = stats_->retries.load();
  s.errors = stats_->errors.load();
  return s;
}

IoRequest IoEngine::submit_read(IoFile file, std::uint64_t offset, std::uint64_t bytes, void* buf) {
  IoOp op{IoOpKind::kRead, file, offset, bytes, buf};
  return submit(std::span<const IoOp>(&op, 1));
}

IoRequest IoEngine::submit_write(IoFile file, std::uint64_t offset, std::uint64_t bytes,
                                 const void* buf) {
  IoOp op{IoOpKind::kWrite, file, offset, bytes, const_cast<void*>(buf)};
  return submit(std::span<const IoOp>(&op, 1));
}

std::unique_ptr<IoEngine> make_io_engine(const IoEngineOptions& options) {
  if (options.kind == IoEngineKind::kPosix) return detail::make_posix_engine(options);
  try {
    return detail::make_uring_engine(options);
  } catch (const NotSupportedError& e) {
    if (options.kind == IoEngineKind::kUring) throw;
    TM_LOG_INFO("NVME", "io_uring unavailable, using the posix thread-pool engine: {}", e.what());
    return detail::make_posix_engine(options);
  }
}

std::unique_ptr<IoEngine> make_io_engine(const Config& config) {
  return make_io_engine(IoEngineOptions::from_config(config));
}

}  // namespace tiermem
