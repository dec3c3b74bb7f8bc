// tiermem/log.h — leveled logging with a subsystem tag, on spdlog, to stderr.
//
//   TM_LOG_INFO("NVME", "opened {} ({} rings)", path, n);   // -> "[info] [NVME] opened ..."
//
// Tags in use: CONFIG, NVME, HOST, GPU, PREFETCH, RUNTIME, COMM, ZERO, TRAIN, BENCH.
// The level comes from TIERMEM_LOG_LEVEL (trace|debug|info|warn|error|off, read once; default
// info) or set_log_level(). Output goes to stderr so that stdout stays clean for --json.
// Thread-safety: all functions are thread-safe.
// Said once: TM_LOG_WARN_ONCE(tag, cause, ...) logs the first time a cause is seen in the process;
// TM_LOG_WARN_ONCE_RANK0 also only on rank 0 (set_log_rank), for what every rank would repeat.
#pragma once

#include <string_view>

#include <spdlog/spdlog.h>

#include "tiermem/export.h"

namespace tiermem {

// The process-wide logger (created on first use).
TIERMEM_API spdlog::logger& logger();

// Sets the level by name; an unknown name is ignored with a warning.
TIERMEM_API void set_log_level(std::string_view level);

// Messages said once per cause: true the first time `cause` (a short stable key, e.g.
// "host-pool-unpinned") is passed in this process, false every time after. Thread-safe.
TIERMEM_API bool first_time(std::string_view cause);

// This process's rank in a job of several (0 alone). Set once by whoever learns it first (the
// program from its launcher's environment, or the communicator); messages whose text is the same
// on every rank (TM_LOG_WARN_ONCE_RANK0) are said by rank 0 only. Thread-safe.
TIERMEM_API void set_log_rank(int rank);
TIERMEM_API int log_rank();

}  // namespace tiermem

#define TM_LOG_(lvl, tag, fmt_, ...) ::tiermem::logger().lvl("[" tag "] " fmt_ __VA_OPT__(, ) __VA_ARGS__)
#define TM_LOG_TRACE(tag, fmt_, ...) TM_LOG_(trace, tag, fmt_ __VA_OPT__(, ) __VA_ARGS__)
#define TM_LOG_DEBUG(tag, fmt_, ...) TM_LOG_(debug, tag, fmt_ __VA_OPT__(, ) __VA_ARGS__)
#define TM_LOG_INFO(tag, fmt_, ...) TM_LOG_(info, tag, fmt_ __VA_OPT__(, ) __VA_ARGS__)
#define TM_LOG_WARN(tag, fmt_, ...) TM_LOG_(warn, tag, fmt_ __VA_OPT__(, ) __VA_ARGS__)
#define TM_LOG_ERROR(tag, fmt_, ...) TM_LOG_(error, tag, fmt_ __VA_OPT__(, ) __VA_ARGS__)

// Once per cause per process (see first_time); the arguments are not evaluated after the first.
#define TM_LOG_WARN_ONCE(tag, cause, fmt_, ...)                          \
  do {                                                                   \
    if (::tiermem::first_time(cause)) TM_LOG_WARN(tag, fmt_ __VA_OPT__(, ) __VA_ARGS__); \
  } while (0)
// Once per cause per job: only rank 0 says it (for a message every rank would say alike).
#define TM_LOG_WARN_ONCE_RANK0(tag, cause, fmt_, ...)                                        \
  do {                                                                                       \
    if (::tiermem::log_rank() == 0 && ::tiermem::first_time(cause))                          \
      TM_LOG_WARN(tag, fmt_ __VA_OPT__(, ) __VA_ARGS__);                                     \
  } while (0)
