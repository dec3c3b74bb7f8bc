// Internals shared by the IoEngine backends (not installed).
#pragma once

#include <atomic>
#include <cstdint>

#include "tiermem/io_engine.h"

namespace tiermem {

struct IoEngine::AtomicStats {
  std::atomic<std::uint64_t> bytes_read{0}, bytes_written{0}, read_requests{0},
      write_requests{0}, pieces{0}, fixed_buffer_pieces{0}, bounced_pieces{0}, short_transfers{0},
      retries{0}, errors{0};
};

namespace detail {
std::unique_ptr<IoEngine> make_uring_engine(const IoEngineOptions& options);  // throws
std::unique_ptr<IoEngine> make_posix_engine(const IoEngineOptions& options);
}  // namespace detail

}  // namespace tiermem
